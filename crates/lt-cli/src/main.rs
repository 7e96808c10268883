//! `lt`: the LazyTrain-rs command line.
//!
//! Each subcommand lives in `cmd/<name>.rs` as a clap `Args` struct plus a `run` function; this file
//! only dispatches. Errors print as one line (`error: <file>: <problem>`) and exit non-zero.

// `lt bench train`'s report is one `serde_json::json!` object with many keys.
#![recursion_limit = "256"]

use clap::{Parser, Subcommand};

mod cmd;
mod failure;
mod procmem;
mod progress;
mod timing;

/// LazyTrain-rs: fine-tune Qwen models larger than your GPU by streaming layers from host memory.
#[derive(Debug, Parser)]
#[command(name = "lt", version, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Fine-tune a model with layer streaming; with no arguments, train the built-in demo.
    Train(Box<cmd::train::TrainArgs>),
    /// Exact-match accuracy on a MetaMathQA-style dataset (greedy decoding).
    Eval(cmd::eval::EvalArgs),
    /// Compute logits of a model for token sequences (a parity-check entry point).
    Logits(cmd::logits::LogitsArgs),
    /// Plan activation placement for a model, batch and hardware, and predict step time.
    Plan(cmd::plan::PlanArgs),
    /// Micro-benchmarks of the subsystems.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Measure this machine (transfers, GEMM, a decoder layer, disk, host optimizer) and write a
    /// hardware profile for `--hardware FILE`.
    Profile(cmd::profile::ProfileArgs),
    /// Check the compute backend against the CPU reference on the tiny fixture models.
    Selftest(cmd::selftest::SelftestArgs),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Host optimizer update throughput (AdamW fp32 or 8-bit).
    Optimizer(cmd::bench_optimizer::BenchOptimizerArgs),
    /// Activation spill engine throughput (io_uring, pread, mmap).
    Spill(cmd::bench_spill::BenchSpillArgs),
    /// Streamed training throughput on a randomly initialised model (TFLOPS, tokens/s, memory).
    Train(Box<cmd::bench_train::BenchTrainArgs>),
    /// One decoder layer's forward and backward with random weights (default: Qwen3.6-27B's
    /// linear-attention layer at batch 1 x seq 1024), measured against the cost model's prediction.
    Layer(cmd::bench_layer::BenchLayerArgs),
}

fn main() {
    // Before any thread starts: the CPU backend's per-operation tensors are then reused instead of
    // mapped and unmapped every step (lt_core::hostmem::tune_malloc).
    lt_core::hostmem::tune_malloc();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Train(a) => cmd::train::run(a),
        Command::Eval(a) => cmd::eval::run(a),
        Command::Logits(a) => cmd::logits::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Bench(BenchCommand::Optimizer(a)) => cmd::bench_optimizer::run(a),
        Command::Bench(BenchCommand::Layer(a)) => cmd::bench_layer::run(a),
        Command::Bench(BenchCommand::Spill(a)) => cmd::bench_spill::run(a),
        Command::Bench(BenchCommand::Train(a)) => cmd::bench_train::run(a),
        Command::Profile(a) => cmd::profile::run(a),
        Command::Selftest(a) => cmd::selftest::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {}", error_line(&e));
        std::process::exit(1);
    }
}

/// An error and its causes on one line, outermost first. Library errors often print their source
/// already, so a cause whose text is already present is not repeated.
pub(crate) fn error_line(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !msg.contains(&text) {
            if !msg.is_empty() {
                msg.push_str(": ");
            }
            msg.push_str(&text);
        }
    }
    msg.replace('\n', " ")
}
