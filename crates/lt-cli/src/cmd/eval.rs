//! `lt eval`: exact-match accuracy of a model on a MetaMathQA-style dataset.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::tensor::backend::Backend;
use lt_data::{DatasetFile, DatasetFormat, PrepareOptions, prepare};
use lt_model::host::HostModel;
use lt_model::stream::Streamed;
use lt_model::weights::DeviceModel;

use lt_run::DeviceChoice;
use lt_run::evaluate::{encoder_for, evaluate};

/// Arguments of `lt eval`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Greedy-decodes an answer for every question, extracts the text after \
`The answer is:` and compares it with the reference: numerically for GSM-type records, as normalised \
strings for MATH-type ones. Prints accuracy per `type` and overall.")]
pub struct EvalArgs {
    /// Model folder (config.json, safetensors, tokenizer files).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Dataset: a JSON array or JSONL of MetaMathQA records (or Alpaca / messages with answers).
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// Force the dataset format instead of detecting it.
    #[arg(long, value_enum, default_value_t = DatasetFormat::Auto)]
    pub format: DatasetFormat,
    /// Evaluate at most N questions: a deterministic subset spread over the whole file (MetaMathQA is
    /// sorted by type), the same one `lt train --eval-limit N` scores.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Longest generation per question, in tokens.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Questions decoded together.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Longest prompt in tokens (longer prompts are cut and counted).
    #[arg(long, default_value_t = 2048)]
    pub seq_len: usize,
    /// Per-example predictions (JSONL); default: predictions.jsonl next to the model.
    #[arg(long, value_name = "FILE.jsonl")]
    pub predictions: Option<PathBuf>,
    /// Count and skip malformed records instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_records: bool,
    /// Print one JSON object as the last line.
    #[arg(long)]
    pub json: bool,
    /// Where to generate: the CPU, or the GPU (a binary built with `--features cuda`; the whole model is
    /// uploaded in the compute dtype, so it must fit in GPU memory, unless --stream).
    #[arg(long, value_enum, default_value_t = DeviceChoice::Cpu)]
    pub device: DeviceChoice,
    /// Keep the model in host memory and stream its decoder layers to the device one at a time, as
    /// training does: for a model larger than the GPU. Every decoding step uploads every layer once
    /// for the whole batch, so raise --batch-size (the decoding caches stay on the device).
    #[arg(long)]
    pub stream: bool,
}

fn generate_on<B: Backend>(
    host: &HostModel,
    encoder: &lt_data::ChatEncoder,
    examples: &[lt_data::EvalExample],
    args: &EvalArgs,
    progress: impl FnMut(usize),
    device: &B::Device,
) -> Result<(lt_data::Accuracy, Vec<lt_run::evaluate::Prediction>)> {
    let (tok, stop) = (encoder.tokenizer(), encoder.stop_token_id());
    if args.stream {
        let mut model = Streamed::<B, HostModel>::new(host, device);
        evaluate(&mut model, tok, stop, examples, args.max_new_tokens, args.batch_size, progress)
    } else {
        let model = DeviceModel::<B>::from_host(host, device);
        evaluate(&mut &model, tok, stop, examples, args.max_new_tokens, args.batch_size, progress)
    }
}

/// Run the command.
pub fn run(args: &EvalArgs) -> Result<()> {
    let host = HostModel::load(&args.model)?;
    let encoder = encoder_for(&args.model, host.config.vocab_size)?;
    let file = DatasetFile::open(&args.data, args.format)?;
    // Everything is evaluation data: eval_fraction 1 would hold out every group.
    let opts = PrepareOptions {
        seq_len: args.seq_len,
        eval_fraction: 1.0,
        skip_bad_records: args.skip_bad_records,
        max_eval_examples: args.limit,
        ..Default::default()
    };
    let data = prepare(&file, &encoder, &opts)?;
    let examples = data.eval_examples;
    anyhow::ensure!(!examples.is_empty(), "{}: no question with a reference answer", args.data.display());
    let pb = crate::progress::bar(examples.len() as u64, "eval");
    let score = |n: usize| pb.inc(n as u64);
    let (acc, preds) = match args.device {
        DeviceChoice::Cpu => {
            generate_on::<lt_model::CpuBackend>(&host, &encoder, &examples, args, score, &Default::default())?
        }
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda => {
            let device = lt_run::device::cuda()?;
            // A GPU out-of-memory or driver failure surfaces as a panic inside cubecl: report it as one line.
            crate::failure::catch_panics(|| {
                generate_on::<lt_model::CudaBackend>(&host, &encoder, &examples, args, score, &device)
                    .map_err(|e| crate::failure::Failure::from_error(&e))
            })
            .map_err(|e| anyhow::anyhow!("--device cuda: {e}"))?
        }
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => {
            let device = lt_run::device::wgpu()?;
            crate::failure::catch_panics(|| {
                generate_on::<lt_model::WgpuBackend>(&host, &encoder, &examples, args, score, &device)
                    .map_err(|e| crate::failure::Failure::from_error(&e))
            })
            .map_err(|e| anyhow::anyhow!("--device wgpu: {e}"))?
        }
        #[allow(unreachable_patterns)]
        d => return Err(lt_run::device::not_built(d)),
    };
    pb.finish_and_clear();
    let pred_path = args.predictions.clone().unwrap_or_else(|| args.model.join("predictions.jsonl"));
    let mut out = Vec::new();
    for p in &preds {
        serde_json::to_writer(&mut out, p)?;
        out.push(b'\n');
    }
    lt_run::fsutil::write_atomic(&pred_path, &out)?;
    println!("exact match: {}", acc.summary());
    println!("predictions: {}", pred_path.display());
    if args.json {
        let line = serde_json::json!({
            "accuracy": acc.rate(), "correct": acc.overall.correct, "total": acc.overall.total,
            "by_type": acc.by_type, "predictions": pred_path,
        });
        let mut stdout = std::io::stdout();
        writeln!(stdout, "{line}").context("writing to stdout")?;
    }
    Ok(())
}
