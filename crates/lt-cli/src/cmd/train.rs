//! `lt train`: streamed fine-tuning, or the embedded demo when run without `--model`/`--data`.
//!
//! The run itself is lt-run's [`Run`]; this command reads the flags and the optional TOML run file
//! (a flag overriding the file), and draws progress bars and the summary.

use std::path::PathBuf;

use anyhow::Result;
use indicatif::ProgressBar;
use lt_run::{Event, Observer, Run, RunConfig, RunReport};

/// Arguments of `lt train`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Without --model and --data, trains the embedded demo: a small Qwen3-architecture model \
from scratch on a built-in synthetic MetaMathQA-style arithmetic dataset, on the CPU, and reports held-out \
exact match.\n\nExamples:\n  lt train\n  lt train --model Qwen2.5-7B --data MetaMathQA-395K.json --device cuda \
--hardware h800 --batch-size 64 --seq-len 1024 --steps 3841 --out runs/q7b --save-every 200\n  lt train --config run.toml --resume")]
pub struct TrainArgs {
    /// TOML run file with the same keys as the flags (kebab-case); flags override it.
    #[arg(long, value_name = "FILE.toml")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub opts: RunConfig,
}

/// Run the command.
pub fn run(args: &TrainArgs) -> Result<()> {
    let config = match &args.config {
        Some(path) => args.opts.over(&RunConfig::from_toml_file(path)?),
        None => args.opts.clone(),
    };
    let run = Run::builder(config).observer(Console::default()).build()?;
    let report = run.execute()?;
    print_summary(&report);
    Ok(())
}

/// Progress bars on a terminal, and a line every 50 steps otherwise (CI logs, pipes).
#[derive(Default)]
struct Console {
    train: Option<ProgressBar>,
    eval: Option<ProgressBar>,
}

impl Observer for Console {
    fn event(&mut self, event: &Event<'_>) -> Result<()> {
        match event {
            Event::Data { summary } => eprintln!("data: {summary}"),
            Event::Planned { plan } => eprintln!("{}", plan.summary),
            Event::Note(line) => eprintln!("{line}"),
            Event::Warning(line) => eprintln!("warning: {line}"),
            Event::Training { first_step, total_steps } => {
                let pb = crate::progress::bar(*total_steps, "train");
                pb.set_position(*first_step);
                self.train = Some(pb);
            }
            Event::Step { metrics: m, tokens_per_second, .. } => {
                if let Some(pb) = &self.train {
                    pb.set_position(m.step);
                    pb.set_message(format!("train loss {:.4} | {tokens_per_second:.0} tok/s", m.loss));
                }
                if crate::progress::as_lines() && (m.step % 50 == 0 || m.step == 1) {
                    eprintln!(
                        "step {} loss {:.4} grad_norm {:.3} lr {:.2e} {:.3} s/step",
                        m.step, m.loss, m.grad_norm, m.lr, m.step_seconds
                    );
                }
            }
            Event::Saving { step, bytes } => {
                if let Some(pb) = &self.train {
                    pb.set_message(format!("saving the checkpoint of step {step} ({})", lt_core::ByteSize(*bytes)));
                }
            }
            Event::EvalStarted { label, total } => self.eval = Some(crate::progress::bar(*total as u64, label)),
            Event::EvalProgress { done } => {
                if let Some(pb) = &self.eval {
                    pb.inc(*done as u64);
                }
            }
            Event::ExactMatch { step, accuracy, is_final } => {
                if let Some(pb) = self.eval.take() {
                    pb.finish_and_clear();
                }
                if !is_final {
                    eprintln!("step {step}: held-out exact match {}", accuracy.summary());
                }
            }
            Event::Finished { .. } => {
                if let Some(pb) = self.train.take() {
                    pb.finish_and_clear();
                }
            }
            _ => {}
        }
        Ok(())
    }
}

fn print_summary(r: &RunReport) {
    println!("trained {} steps in {:.1} s; outputs in {}", r.steps, r.seconds, r.out.display());
    if let Some(m) = &r.last_step {
        println!(
            "last step: loss {:.4}, {:.3} s measured{}; measured exposure: h2d {:.3} s, d2h {:.3} s, nvme {:.3} s, optimizer {:.3} s",
            m.loss,
            m.step_seconds,
            r.predicted_step_seconds.map(|p| format!(" vs {p:.3} s predicted")).unwrap_or_default(),
            m.timing.exposed.h2d,
            m.timing.exposed.d2h,
            m.timing.exposed.nvme,
            m.timing.exposed.optimizer
        );
    }
    if let Some(acc) = &r.exact_match {
        println!("held-out exact match: {}", acc.summary());
    }
    println!("model: {}  metrics: {}  trace: {}", r.model_dir.display(), r.metrics.display(), r.trace.display());
    let pictures: Vec<String> = r.files.iter().map(|p| p.display().to_string()).collect();
    println!("pictures: {}", pictures.join("  "));
}
