//! `lt bench layer`: one decoder layer's forward and backward with random weights from a public
//! config, on any backend; the layer benchmark `tools/bench_layer_vs_torch.sh` sets against
//! transformers' layer in the same run.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use lt_core::{HostCpu, LayerKind, ModelConfig};
use lt_model::DeltaForm;
use lt_sched::cost::{CostOptions, ExecConfig, Instance};

use lt_run::device::{DeviceChoice, default_profile};
use lt_sched::hardware::HardwareSpec;

/// Which layer of the config to time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LayerChoice {
    /// The first linear-attention (Gated DeltaNet) layer.
    Linear,
    /// The first full-attention layer.
    Full,
}

/// Form of the gated delta rule (linear-attention layers only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FormChoice {
    /// Chunks of 64 tokens in WY form (what training runs).
    Chunked,
    /// One state update per token (the reference).
    Recurrent,
}

/// Arguments of `lt bench layer`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Examples:\n  lt bench layer\n  lt bench layer --layer full --json\n  \
lt bench layer --model-config configs/models/qwen2.5-7b.json --layer full --device cuda --batch-size 4")]
pub struct BenchLayerArgs {
    /// Hugging Face config.json of the model whose layer to time (random weights, seed 7).
    #[arg(long, value_name = "FILE", default_value = "configs/models/qwen3.6-27b.json")]
    pub model_config: PathBuf,
    /// The layer: the config's first linear-attention or first full-attention layer [default:
    /// linear when the config has one].
    #[arg(long, value_enum)]
    pub layer: Option<LayerChoice>,
    /// Sequences per batch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub seq_len: u64,
    /// Gated delta rule form of a linear-attention layer.
    #[arg(long, value_enum, default_value = "chunked")]
    pub delta_form: FormChoice,
    /// Timed rounds (the reported time is their median).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: u64,
    /// Untimed rounds first (kernel compilation, autotune, page faults).
    #[arg(long, default_value_t = 1)]
    pub warmup: u64,
    /// Backend.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Hardware profile for the cost model's predicted times (built-in name or TOML file)
    /// [default: cpu on cpu and wgpu, h200 on cuda].
    #[arg(long, value_name = "NAME|FILE")]
    pub hardware: Option<HardwareSpec>,
    /// Print one JSON object as the last stdout line.
    #[arg(long)]
    pub json: bool,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Run the command.
pub fn run(args: &BenchLayerArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.model_config)
        .with_context(|| format!("{}: cannot read", args.model_config.display()))?;
    let cfg = ModelConfig::from_json_str(&text).with_context(|| args.model_config.display().to_string())?;
    let want = match args.layer {
        Some(LayerChoice::Linear) => LayerKind::LinearAttention,
        Some(LayerChoice::Full) => LayerKind::FullAttention,
        None if cfg.layer_types.contains(&LayerKind::LinearAttention) => LayerKind::LinearAttention,
        None => LayerKind::FullAttention,
    };
    let Some(index) = cfg.layer_types.iter().position(|k| *k == want) else {
        bail!("{}: the model has no {want:?} layer", args.model_config.display());
    };
    let form = match args.delta_form {
        FormChoice::Chunked => DeltaForm::Chunked,
        FormChoice::Recurrent => DeltaForm::Recurrent,
    };
    let (b, t) = (args.batch_size as usize, args.seq_len as usize);
    let (w, r) = (args.warmup as usize, args.steps as usize);
    let times = match args.device {
        DeviceChoice::Cpu => {
            crate::timing::layer_times::<lt_model::CpuAutodiff>(&cfg, index, b, t, form, w, r, &Default::default())?
        }
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda => {
            let device = lt_run::device::cuda()?;
            crate::timing::layer_times::<lt_model::CudaAutodiff>(&cfg, index, b, t, form, w, r, &device)?
        }
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => {
            let device = lt_run::device::wgpu()?;
            crate::timing::layer_times::<lt_model::WgpuAutodiff>(&cfg, index, b, t, form, w, r, &device)?
        }
        #[allow(unreachable_patterns)]
        d => return Err(lt_run::device::not_built(d)),
    };
    report(args, &cfg, index, want, form, &times)
}

fn report(
    args: &BenchLayerArgs,
    cfg: &ModelConfig,
    index: usize,
    kind: LayerKind,
    form: DeltaForm,
    times: &crate::timing::LayerTimes,
) -> Result<()> {
    let (fwd, bwd) = (median(&times.fwd), median(&times.bwd));
    let (b, t) = (args.batch_size as usize, args.seq_len as usize);
    // FLOPs are the cost model's count for this layer (materialised attention, as trained); its
    // times are predictions on the chosen profile.
    let spec = args.hardware.clone().unwrap_or(HardwareSpec::Builtin(default_profile(args.device)));
    let hw = lt_sched::hardware::load_profile(&spec)?;
    let exec = ExecConfig {
        micro_batch_size: b,
        grad_accum_steps: 1,
        loss_chunk_tokens: b * t,
        optimizer_overlap: lt_sched::OptimizerOverlap::Serial,
        retain_all_logits: false,
    };
    let opts = CostOptions { attention: lt_sched::cost::AttentionKernel::Materialized, ..Default::default() };
    let inst = Instance::from_model(cfg, &hw, t, &exec, opts)?;
    let lc = &inst.layers[index];
    // The backward op re-runs the forward to record the graph, then back-propagates.
    let flops_bwd_op = lc.fwd_flops + lc.bwd_flops;
    let kind_name = match kind {
        LayerKind::LinearAttention => "linear_attention",
        LayerKind::FullAttention => "full_attention",
    };
    let form_name = if kind == LayerKind::LinearAttention { format!("{form:?}").to_lowercase() } else { "-".into() };
    println!(
        "{} layer {index} ({kind_name}, delta rule {form_name}), batch {b} x seq {t}, {} params, {} (median of {}):",
        args.model_config.display(),
        lc.params,
        args.device.name(),
        times.fwd.len()
    );
    // On the CPU these are host speeds, which hold for this CPU only.
    let host = HostCpu::detect();
    if args.device == DeviceChoice::Cpu {
        println!("  host: {host}");
    }
    println!(
        "  forward                {fwd:>9.4} s  {:>8.3} TFLOPS   predicted {:.4} s ({})",
        lc.fwd_flops / fwd / 1e12,
        lc.fwd_seconds,
        hw.name
    );
    println!(
        "  backward op (fwd+bwd)  {bwd:>9.4} s  {:>8.3} TFLOPS   predicted {:.4} s ({})",
        flops_bwd_op / bwd / 1e12,
        lc.bwd_seconds,
        hw.name
    );
    if args.json {
        let j = serde_json::json!({
            "model_config": args.model_config,
            "layer": index,
            "layer_type": kind_name,
            "delta_form": form_name,
            "params": lc.params,
            "batch_size": b,
            "seq_len": t,
            "device": args.device.name(),
            "compute_dtype": args.device.dtype(),
            "host_cpu": host,
            "threads": std::thread::available_parallelism().map_or(1, usize::from),
            "fwd_seconds": fwd,
            "fwd_bwd_seconds": bwd,
            "fwd_seconds_all": times.fwd,
            "fwd_bwd_seconds_all": times.bwd,
            "fwd_flops": lc.fwd_flops,
            "fwd_bwd_flops": flops_bwd_op,
            "flops_source": "lt-sched cost model count (materialized attention)",
            "tflops_fwd_bwd": flops_bwd_op / bwd / 1e12,
            "predicted_fwd_seconds": lc.fwd_seconds,
            "predicted_fwd_bwd_seconds": lc.bwd_seconds,
            "predicted_hardware": hw.name,
        });
        println!("{j}");
    }
    Ok(())
}
