//! `lt logits`: whole-model logits for token sequences, the black-box parity entry point.

use std::path::PathBuf;

use anyhow::{Context, Result};
use lt_model::host::HostModel;
use lt_model::model::{Batch, forward_logits, to_vec};
use lt_model::weights::DeviceModel;

use lt_run::DeviceChoice;

/// Arguments of `lt logits`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  lt logits --model tools/fixtures/models/qwen3-tied-mqa \\\n    --tokens tools/fixtures/models/qwen3-tied-mqa/tokens.jsonl --out /tmp/logits.safetensors"
)]
pub struct LogitsArgs {
    /// Model folder: config.json plus model.safetensors (or sharded with model.safetensors.index.json).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// JSONL file, one {"input_ids": [...]} per line; all lines must have the same length.
    #[arg(long, value_name = "FILE.jsonl")]
    pub tokens: PathBuf,
    /// Output safetensors file holding one f32 tensor `logits` of shape [lines, length, vocab].
    /// Written atomically: on any error nothing is created or overwritten.
    #[arg(long, value_name = "FILE.safetensors")]
    pub out: PathBuf,
    /// Sequences per forward pass (bounds memory; does not change the result).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub rows_per_pass: u64,
    /// Backend: `cpu` (f32, the reference), `cuda` (bf16) or `wgpu` (f32) where built. The whole
    /// model is uploaded, so on a device it must fit.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceChoice,
}

/// Logits of every row of `batch`, `per_pass` rows per forward, as f32 in row-major order.
fn logits_on<B: burn::tensor::backend::Backend>(
    host: &HostModel,
    batch: &Batch,
    per_pass: usize,
    device: &B::Device,
    pb: &indicatif::ProgressBar,
) -> Vec<f32> {
    let model = DeviceModel::<B>::from_host(host, device);
    let mut out = Vec::new();
    for chunk in batch.input_ids.chunks(per_pass) {
        out.extend(to_vec(forward_logits(&model, chunk)));
        pb.inc(chunk.len() as u64);
    }
    out
}

/// Run the command.
pub fn run(args: &LogitsArgs) -> Result<()> {
    let host = HostModel::load(&args.model)?;
    let batch = Batch::read_jsonl(&args.tokens)?;
    let (b, t) = batch.validate(host.config.vocab_size, &args.tokens.display().to_string())?;
    let vocab = host.config.vocab_size;
    let pb = crate::progress::bar(b as u64, "logits");
    let per_pass = args.rows_per_pass as usize;
    let out = match args.device {
        DeviceChoice::Cpu => logits_on::<lt_model::CpuBackend>(&host, &batch, per_pass, &Default::default(), &pb),
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda => {
            logits_on::<lt_model::CudaBackend>(&host, &batch, per_pass, &lt_run::device::cuda()?, &pb)
        }
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => {
            logits_on::<lt_model::WgpuBackend>(&host, &batch, per_pass, &lt_run::device::wgpu()?, &pb)
        }
        #[allow(unreachable_patterns)]
        d => return Err(lt_run::device::not_built(d)),
    };
    pb.finish_and_clear();
    let bytes: Vec<u8> = out.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![b, t, vocab], &bytes)
        .context("building the logits tensor")?;
    let data = safetensors::serialize([("logits", view)], None).context("serialising logits")?;
    lt_run::fsutil::write_atomic(&args.out, &data)?;
    eprintln!("wrote logits [{b}, {t}, {vocab}] to {}", args.out.display());
    Ok(())
}
