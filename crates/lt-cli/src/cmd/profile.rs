//! `lt profile`: measure this machine and write a hardware profile (TOML) that `--hardware FILE`
//! (`lt plan`, `lt train`, `lt bench train`) loads through lt-sched's `load_profile`.
//!
//! What is measured, and which profile field it fills:
//! - **Transfers** (`h2d_gb_per_s`, `d2h_gb_per_s`): on CUDA, uploads of a large fp32 tensor along the
//!   executor's own path (`lt_model::upload`: threaded conversion to the device dtype, pinned staging,
//!   copy) and downloads through Burn, best of several, device synchronised before the timer stops;
//!   uploads of native-dtype data from pageable and from pinned memory are reported beside them. On
//!   the CPU executor "transfers" are memory copies, so a `memcpy` of the same size stands in
//!   (labelled so).
//! - **GEMM** (`peak_tflops`): the best of several square matmuls (bf16 on CUDA, f32 on ndarray) is
//!   the *achievable* dense peak that the cost model scales.
//! - **Decoder layer** (`efficiency`): forward and per-layer backward of one real decoder layer on the
//!   backend, fitted so that lt-sched's cost model (its own FLOP accounting, materialised attention as
//!   the trainer runs it, the `gemm_half_efficiency_rows` knee) reproduces the measured layer time
//!   against the measured peak. This is the calibration `docs/architecture.md` asks for.
//! - **Linear-attention layer** (`linear_efficiency`): the same for one Gated DeltaNet layer (chunked
//!   delta rule), so that hybrid models (Qwen3.5/3.6) are calibrated too.
//! - **Disk** (`nvme_write_gb_per_s`, `nvme_read_gb_per_s`): lt-storage's spill store (io_uring, O_DIRECT
//!   where allowed, with its automatic fallbacks) writing then reading back a few large values.
//! - **Host optimizer** (`optimizer_gparams_per_s`): lt-optim's AdamW update (8-bit by default, as
//!   `lt train` runs) with all cores, on what the trainer hands it on this device: fp32 gradients on
//!   an f32 device; on CUDA bf16 gradients (decoder layers', as downloaded) and the bf16 upload copy
//!   written in the same pass.
//! - **Memory** (`host_memory`, and `gpu_memory` on CUDA when `nvidia-smi` answers).
//!
//! Every other field is copied from the base profile (`--base`), and the file says so field by field.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{Distribution, Tensor, TensorData};
use clap::ValueEnum;
use lt_core::ModelConfig;
use lt_core::hardware::{BuiltinProfile, HardwareProfile};
use lt_core::{ByteSize, HostCpu};
use lt_optim::{AdamW, AdamWConfig, Grad, StepOutcome, ThreadPool};
use lt_sched::cost::{CostOptions, ExecConfig, Instance};
use lt_storage::spill::{SpillBuf, SpillConfig, SpillStore, Ticket};

use crate::timing::{best, sync};
use lt_run::DeviceChoice;
use lt_run::OptimizerChoice;

/// Built-in profile the unmeasured fields come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BaseArg {
    /// NVIDIA H800 80 GB (the published machine).
    H800,
    /// NVIDIA H200 141 GB (the project's device machine).
    H200,
    /// NVIDIA RTX 3090 24 GB.
    Rtx3090,
    /// The CPU executor on the development box.
    Cpu,
}

impl BaseArg {
    fn builtin(self) -> BuiltinProfile {
        match self {
            BaseArg::H800 => BuiltinProfile::H800,
            BaseArg::H200 => BuiltinProfile::H200,
            BaseArg::Rtx3090 => BuiltinProfile::Rtx3090,
            BaseArg::Cpu => BuiltinProfile::Cpu,
        }
    }
}

/// A measurement that can be skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Part {
    /// Host-to-device and device-to-host bandwidth.
    Transfers,
    /// GEMM throughput.
    Gemm,
    /// Decoder-layer efficiency (needs the GEMM figure).
    Layer,
    /// Spill-store (NVMe) write and read bandwidth.
    Disk,
    /// Host optimizer throughput.
    Optimizer,
}

/// Arguments of `lt profile`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Examples:\n  lt profile --device cuda --out h200-measured.toml\n  \
lt profile --device cpu --out cpu.toml --quick\n  lt plan --model-config configs/models/qwen2.5-7b.json \
--hardware h200-measured.toml --batch-size 8 --seq-len 1024")]
pub struct ProfileArgs {
    /// Device to measure.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Where to write the hardware profile (TOML).
    #[arg(long, value_name = "FILE.toml")]
    pub out: PathBuf,
    /// Built-in profile the unmeasured fields are copied from [default: cpu for --device cpu, h200
    /// for --device cuda].
    #[arg(long, value_enum)]
    pub base: Option<BaseArg>,
    /// Name written into the profile [default: <base>-measured].
    #[arg(long)]
    pub name: Option<String>,
    /// Small sizes (seconds instead of about a minute): for tests and smoke runs; the figures are
    /// rougher.
    #[arg(long)]
    pub quick: bool,
    /// Measurements to skip (comma-separated); skipped fields keep the base profile's value.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub skip: Vec<Part>,
    /// Folder for the disk measurement (put it on the disk you will spill to) [default: the system
    /// temp dir].
    #[arg(long, value_name = "DIR")]
    pub spill_dir: Option<PathBuf>,
    /// Optimizer whose speed goes into `optimizer_gparams_per_s` (all three are measured).
    #[arg(long, value_enum, default_value_t = OptimizerChoice::DEFAULT)]
    pub optimizer: OptimizerChoice,
    /// Host optimizer threads [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object (measurements and the written profile) as the only stdout line; progress
    /// lines still go to stderr.
    #[arg(long)]
    pub json: bool,
}

/// Sizes of every measurement.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    transfer_bytes: usize,
    transfer_reps: usize,
    gemm_n: usize,
    gemm_reps: usize,
    disk_total: u64,
    disk_value: usize,
    optimizer_params: usize,
}

impl Sizes {
    fn new(device: DeviceChoice, quick: bool) -> Self {
        match (device, quick) {
            (DeviceChoice::Cuda, false) => Sizes {
                transfer_bytes: 256 << 20,
                transfer_reps: 5,
                gemm_n: 8192,
                gemm_reps: 10,
                disk_total: 1 << 30,
                disk_value: 64 << 20,
                optimizer_params: 32 << 20,
            },
            // wgpu adapters commonly cap one buffer below 256 MiB (wgpu's default binding limit is
            // 128 MiB; lavapipe refuses 256 MiB), so its transfers are timed at 64 MiB.
            (DeviceChoice::Wgpu, false) => Sizes {
                transfer_bytes: 64 << 20,
                transfer_reps: 5,
                gemm_n: 1024,
                gemm_reps: 3,
                disk_total: 1 << 30,
                disk_value: 64 << 20,
                optimizer_params: 32 << 20,
            },
            (DeviceChoice::Cpu, false) => Sizes {
                transfer_bytes: 256 << 20,
                transfer_reps: 5,
                gemm_n: 1024,
                gemm_reps: 3,
                disk_total: 1 << 30,
                disk_value: 64 << 20,
                optimizer_params: 32 << 20,
            },
            (DeviceChoice::Cuda, true) => Sizes {
                transfer_bytes: 64 << 20,
                transfer_reps: 3,
                gemm_n: 4096,
                gemm_reps: 3,
                disk_total: 64 << 20,
                disk_value: 16 << 20,
                optimizer_params: 4 << 20,
            },
            (DeviceChoice::Cpu | DeviceChoice::Wgpu, true) => Sizes {
                transfer_bytes: 16 << 20,
                transfer_reps: 3,
                gemm_n: 256,
                gemm_reps: 3,
                disk_total: 16 << 20,
                disk_value: 4 << 20,
                optimizer_params: 1 << 20,
            },
        }
    }
}

/// The decoder layer used for the efficiency fit: Qwen2.5-7B's shape on CUDA, a small Qwen2 layer on
/// the CPU (ndarray is about 1000x slower). One layer and a tiny vocabulary, so it builds in a moment.
/// Timed at a training length (1024 tokens on the CPU backends): the cost model has no term for the
/// elementwise passes over materialised attention scores, so a fit at 256 tokens under-predicted a
/// 1024-token step of a dense model by 2.6x on ndarray.
fn layer_config(device: DeviceChoice, quick: bool) -> Result<(ModelConfig, usize)> {
    let (h, inter, heads, kv, seq) = match (device, quick) {
        (DeviceChoice::Cuda, false) => (3584, 18944, 28, 4, 2048),
        (DeviceChoice::Cuda, true) => (3584, 18944, 28, 4, 512),
        (DeviceChoice::Cpu | DeviceChoice::Wgpu, false) => (512, 1536, 8, 2, 1024),
        (DeviceChoice::Cpu | DeviceChoice::Wgpu, true) => (128, 256, 2, 1, 32),
    };
    let json = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 256, "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": true, "max_position_embeddings": 32768,
    });
    Ok((ModelConfig::from_json_str(&json.to_string())?, seq))
}

/// The Gated DeltaNet layer used for the linear-attention fit: Qwen3.6-27B's linear-attention layer on
/// CUDA, a small one on the CPU backends.
fn linear_layer_config(device: DeviceChoice, quick: bool) -> Result<(ModelConfig, usize)> {
    let (h, inter, kh, vh, d, seq) = match (device, quick) {
        (DeviceChoice::Cuda, false) => (5120, 17408, 16, 48, 128, 2048),
        (DeviceChoice::Cuda, true) => (5120, 17408, 16, 48, 128, 512),
        (DeviceChoice::Cpu | DeviceChoice::Wgpu, false) => (512, 1536, 4, 8, 64, 1024),
        (DeviceChoice::Cpu | DeviceChoice::Wgpu, true) => (128, 256, 2, 2, 32, 64),
    };
    let json = serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": 1, "layer_types": ["linear_attention"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "linear_conv_kernel_dim": 4, "linear_key_head_dim": d,
        "linear_value_head_dim": d, "linear_num_key_heads": kh, "linear_num_value_heads": vh,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    });
    Ok((ModelConfig::from_json_str(&json.to_string())?, seq))
}

/// Everything measured (absent: skipped or not applicable).
#[derive(Debug, Default, Clone, serde::Serialize)]
struct Measured {
    h2d_gb_per_s: Option<f64>,
    d2h_gb_per_s: Option<f64>,
    /// CUDA: `Tensor::from_data` of native-dtype data in pageable memory (`h2d_gb_per_s` is the
    /// executor's whole path from fp32 masters).
    h2d_pageable_gb_per_s: Option<f64>,
    /// CUDA: the same from data already in pinned staging memory.
    h2d_pinned_gb_per_s: Option<f64>,
    /// Host bytes read and written per uploaded byte before the driver's own transfer, on the
    /// executor's upload path (counted from the path, not measured).
    host_bytes_per_uploaded_byte: Option<f64>,
    /// Whether the executor-path upload read a page-locked bf16 copy (absent on f32 devices).
    h2d_copy_pinned: Option<bool>,
    transfer_source: Option<String>,
    transfer_bytes: Option<usize>,
    gemm_tflops: Option<f64>,
    gemm_n: Option<usize>,
    gemm_dtype: Option<String>,
    layer_fwd_seconds: Option<f64>,
    layer_bwd_seconds: Option<f64>,
    layer_tokens: Option<usize>,
    layer_hidden: Option<usize>,
    layer_model_flops: Option<f64>,
    efficiency: Option<f64>,
    efficiency_clamped: bool,
    linear_layer_fwd_seconds: Option<f64>,
    linear_layer_bwd_seconds: Option<f64>,
    linear_layer_tokens: Option<usize>,
    linear_layer_hidden: Option<usize>,
    linear_efficiency: Option<f64>,
    linear_efficiency_clamped: bool,
    nvme_write_gb_per_s: Option<f64>,
    nvme_read_gb_per_s: Option<f64>,
    disk_engine: Option<String>,
    disk_o_direct: Option<bool>,
    disk_bytes: Option<u64>,
    adamw8bit_gparams_per_s: Option<f64>,
    adamw8bit_f8_gparams_per_s: Option<f64>,
    adamw_gparams_per_s: Option<f64>,
    optimizer_params: Option<usize>,
    optimizer_threads: Option<usize>,
    /// What the optimizer measurement read and wrote besides the masters and the state.
    optimizer_io: Option<&'static str>,
    host_memory_available: Option<u64>,
    gpu_memory_total: Option<u64>,
}

/// Run the command.
pub fn run(args: &ProfileArgs) -> Result<()> {
    let started = Instant::now();
    let base = default_base(args).builtin().profile();
    let sizes = Sizes::new(args.device, args.quick);
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map(usize::from).unwrap_or(1));
    if threads == 0 {
        bail!("--threads: must be > 0");
    }
    let skip = |p: Part| args.skip.contains(&p);
    // Progress lines always go to stderr (stdout carries only the summary or the JSON line), each
    // with the seconds since the start: on a fresh GPU the first layer compiles and autotunes its
    // kernels, and a run stopped by a timeout must still say where the time went.
    let say = |s: String| eprintln!("[{:6.1} s] {s}", started.elapsed().as_secs_f64());
    let mut m = measure_device(args, &sizes, &say)?;
    if !skip(Part::Disk) {
        measure_disk(args, &sizes, &mut m, &say)?;
    }
    if !skip(Part::Optimizer) {
        measure_optimizers(&sizes, threads, args.device == DeviceChoice::Cuda, &mut m, &say)?;
    }
    m.host_memory_available = crate::procmem::mem_available();
    if args.device == DeviceChoice::Cuda {
        m.gpu_memory_total = nvidia_smi_total_memory();
    }

    let name = args.name.clone().unwrap_or_else(|| format!("{}-measured", base.name));
    let (profile, text) = build_profile(&base, &name, args, &m)?;
    lt_run::fsutil::write_atomic(&args.out, text.as_bytes())?;
    print_summary(args, &base, &profile, &m, started);
    Ok(())
}

/// The base profile: `--base`, or the default for `--device` (cpu for the CPU and wgpu, h200 for
/// CUDA).
fn default_base(args: &ProfileArgs) -> BaseArg {
    args.base.unwrap_or(match args.device {
        DeviceChoice::Cpu | DeviceChoice::Wgpu => BaseArg::Cpu,
        DeviceChoice::Cuda => BaseArg::H200,
    })
}

/// Transfers, GEMM and the layer fits on the backend of `--device`, a backend panic turned into a
/// one-line error.
fn measure_device(args: &ProfileArgs, sizes: &Sizes, say: &dyn Fn(String)) -> Result<Measured> {
    // A backend panic (cubecl reports device errors by panicking) becomes a one-line error.
    let guarded = |f: &dyn Fn() -> Result<Measured>| {
        crate::failure::catch_panics(|| f().map_err(|e| crate::failure::Failure::from_error(&e)))
            .map_err(|e| anyhow::anyhow!("measuring the {} backend: {e}", device_name(args.device)))
    };
    let m = match args.device {
        DeviceChoice::Cpu => {
            guarded(&|| measure_backend::<lt_model::CpuAutodiff>(args, sizes, &Default::default(), "f32", say))?
        }
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda => {
            let device = lt_run::device::cuda()?;
            guarded(&|| measure_backend::<lt_model::CudaAutodiff>(args, sizes, &device, "bf16", say))?
        }
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => {
            let device = lt_run::device::wgpu()?;
            guarded(&|| measure_backend::<lt_model::WgpuAutodiff>(args, sizes, &device, "f32", say))?
        }
        #[allow(unreachable_patterns)]
        d => return Err(lt_run::device::not_built(d)),
    };
    Ok(m)
}

/// The spill-store bandwidth in `--spill-dir` (or the temp dir), recorded in `m` and reported.
fn measure_disk(args: &ProfileArgs, sizes: &Sizes, m: &mut Measured, say: &dyn Fn(String)) -> Result<()> {
    let dir = args.spill_dir.clone().unwrap_or_else(std::env::temp_dir);
    disk(&dir, sizes, m)?;
    say(format!(
        "disk ({} via {}, O_DIRECT {}): write {:.2} GB/s, read {:.2} GB/s",
        ByteSize(sizes.disk_total),
        m.disk_engine.as_deref().unwrap_or("?"),
        m.disk_o_direct.unwrap_or(false),
        m.nvme_write_gb_per_s.unwrap_or(0.0),
        m.nvme_read_gb_per_s.unwrap_or(0.0)
    ));
    Ok(())
}

/// The host optimizer throughput of the three AdamW variants, recorded in `m` and reported; `bf16` for a
/// bf16 device (see [`optimizer_speed`]).
fn measure_optimizers(sizes: &Sizes, threads: usize, bf16: bool, m: &mut Measured, say: &dyn Fn(String)) -> Result<()> {
    for kind in [OptimizerChoice::Adamw8bit, OptimizerChoice::Adamw8bitF8, OptimizerChoice::Adamw] {
        let g = Some(optimizer_speed(kind, sizes.optimizer_params, threads, bf16)?);
        match kind {
            OptimizerChoice::Adamw8bit => m.adamw8bit_gparams_per_s = g,
            OptimizerChoice::Adamw8bitF8 => m.adamw8bit_f8_gparams_per_s = g,
            OptimizerChoice::Adamw => m.adamw_gparams_per_s = g,
        }
    }
    m.optimizer_params = Some(sizes.optimizer_params);
    m.optimizer_threads = Some(threads);
    let io = if bf16 { "bf16 gradients, bf16 upload copy written" } else { "fp32 gradients" };
    m.optimizer_io = Some(io);
    say(format!(
        "host optimizer ({} params, {threads} threads, {io}): adamw8bit {:.3} Gparam/s, adamw8bit-f8 {:.3} \
         Gparam/s, adamw {:.3} Gparam/s",
        sizes.optimizer_params,
        m.adamw8bit_gparams_per_s.unwrap_or(0.0),
        m.adamw8bit_f8_gparams_per_s.unwrap_or(0.0),
        m.adamw_gparams_per_s.unwrap_or(0.0)
    ));
    Ok(())
}

/// The measured throughput of `kind`, if measured.
fn optimizer_measured(m: &Measured, kind: OptimizerChoice) -> Option<f64> {
    match kind {
        OptimizerChoice::Adamw8bit => m.adamw8bit_gparams_per_s,
        OptimizerChoice::Adamw8bitF8 => m.adamw8bit_f8_gparams_per_s,
        OptimizerChoice::Adamw => m.adamw_gparams_per_s,
    }
}

/// Prints the one-line summary of the written profile, or with `--json` the JSON line instead.
fn print_summary(
    args: &ProfileArgs,
    base: &HardwareProfile,
    profile: &HardwareProfile,
    m: &Measured,
    started: Instant,
) {
    // The optimizer speed (and the upload preparation) are host speeds: name the CPU with them.
    let host = HostCpu::detect();
    let summary = format!(
        "wrote {} (base {}, {:.1} s): h2d {:.2} GB/s, d2h {:.2} GB/s, peak {:.3} TFLOPS x efficiency {:.3}, nvme r/w \
{:.2}/{:.2} GB/s, optimizer {:.2} Gparam/s; host {}",
        args.out.display(),
        base.name,
        started.elapsed().as_secs_f64(),
        profile.h2d_gb_per_s,
        profile.d2h_gb_per_s,
        profile.peak_tflops,
        profile.efficiency,
        profile.nvme_read_gb_per_s,
        profile.nvme_write_gb_per_s,
        profile.optimizer_gparams_per_s,
        host
    );
    if !args.json {
        println!("{summary}");
    }
    if args.json {
        let j = serde_json::json!({
            "out": args.out,
            "device": device_name(args.device),
            "base": base.name,
            "quick": args.quick,
            "host_cpu": host,
            "seconds": started.elapsed().as_secs_f64(),
            "measured": m,
            "profile": profile,
        });
        println!("{j}");
    }
}

fn device_name(d: DeviceChoice) -> &'static str {
    d.name()
}

/// Transfers, GEMM and the layer fit on backend `B`.
fn measure_backend<B: AutodiffBackend>(
    args: &ProfileArgs,
    sizes: &Sizes,
    device: &<B::InnerBackend as BackendTypes>::Device,
    dtype: &str,
    say: &dyn Fn(String),
) -> Result<Measured> {
    let mut m = Measured::default();
    let skip = |p: Part| args.skip.contains(&p);
    if !skip(Part::Transfers) {
        measure_transfers::<B::InnerBackend>(args, sizes, device, &mut m, say)?;
    }
    if !skip(Part::Gemm) {
        let t = gemm_tflops::<B::InnerBackend>(device, sizes.gemm_n, sizes.gemm_reps)?;
        m.gemm_tflops = Some(t);
        m.gemm_n = Some(sizes.gemm_n);
        m.gemm_dtype = Some(dtype.into());
        say(format!("gemm {n}x{n}x{n} {dtype}: {t:.3} TFLOPS (best of {})", sizes.gemm_reps, n = sizes.gemm_n));
    }
    if !skip(Part::Layer) {
        measure_layers::<B>(args, device, dtype, &mut m, say)?;
    }
    Ok(m)
}

/// Host-to-device and device-to-host bandwidth on backend `B` (a `memcpy` stand-in on the CPU
/// executor), recorded in `m` and reported.
fn measure_transfers<B: Backend>(
    args: &ProfileArgs,
    sizes: &Sizes,
    device: &B::Device,
    m: &mut Measured,
    say: &dyn Fn(String),
) -> Result<()> {
    match args.device {
        DeviceChoice::Cpu => {
            let gbs = memcpy_gb_per_s(sizes.transfer_bytes, sizes.transfer_reps);
            m.h2d_gb_per_s = Some(gbs);
            m.d2h_gb_per_s = Some(gbs);
            m.transfer_source = Some("memcpy (the CPU executor's transfers are memory copies)".into());
            say(format!("transfers (memcpy stand-in, {}): {gbs:.2} GB/s", ByteSize(sizes.transfer_bytes as u64)));
        }
        DeviceChoice::Cuda | DeviceChoice::Wgpu => {
            let r = transfers::<B>(device, sizes.transfer_bytes, sizes.transfer_reps)?;
            m.h2d_gb_per_s = Some(r.h2d_executor);
            m.d2h_gb_per_s = Some(r.d2h);
            m.h2d_pageable_gb_per_s = Some(r.h2d_pageable);
            m.h2d_pinned_gb_per_s = Some(r.h2d_pinned);
            m.host_bytes_per_uploaded_byte = Some(r.host_touch);
            m.h2d_copy_pinned = r.copy_pinned;
            m.transfer_source = Some(
                "uploads: the executor's path (bf16 devices: the optimizer's bf16 copy, shared with the runtime; \
f32 devices: the fp32 master, one threaded copy); downloads: Burn into_data; device dtype, synchronised, \
best of several"
                    .into(),
            );
            say(format!(
                "transfers ({}): h2d as the executor uploads {:.2} GB/s{} (from pageable native data {:.2}, from \
cubecl's pinned staging {:.2}), d2h {:.2} GB/s; host bytes touched per uploaded byte before the driver: {:.1} \
(counted from the path)",
                ByteSize(sizes.transfer_bytes as u64),
                r.h2d_executor,
                match r.copy_pinned {
                    Some(true) => " from the page-locked bf16 copy",
                    Some(false) => " from the bf16 copy, pageable",
                    None => "",
                },
                r.h2d_pageable,
                r.h2d_pinned,
                r.d2h,
                r.host_touch
            ));
        }
    }
    m.transfer_bytes = Some(sizes.transfer_bytes);
    Ok(())
}

/// The decoder-layer and linear-attention-layer timings on backend `B` and, when the GEMM peak was
/// measured, their efficiency fits, recorded in `m` and reported.
fn measure_layers<B: AutodiffBackend>(
    args: &ProfileArgs,
    device: &<B::InnerBackend as BackendTypes>::Device,
    dtype: &str,
    m: &mut Measured,
    say: &dyn Fn(String),
) -> Result<()> {
    let (cfg, seq) = layer_config(args.device, args.quick)?;
    let (fwd, bwd) = layer_seconds::<B>(&cfg, seq, device)?;
    m.layer_fwd_seconds = Some(fwd);
    m.layer_bwd_seconds = Some(bwd);
    m.layer_tokens = Some(seq);
    m.layer_hidden = Some(cfg.hidden_size);
    say(format!(
        "decoder layer (hidden {}, {} tokens, {dtype}): forward {:.2} ms, backward (with its re-forward) {:.2} ms",
        cfg.hidden_size,
        seq,
        fwd * 1e3,
        bwd * 1e3
    ));
    if let Some(peak) = m.gemm_tflops {
        let (eff, flops, clamped) = fit_efficiency(&cfg, seq, fwd + bwd, peak, args)?;
        m.efficiency = Some(eff);
        m.layer_model_flops = Some(flops);
        m.efficiency_clamped = clamped;
        say(format!(
            "layer efficiency against the measured GEMM peak: {eff:.3}{}",
            if clamped { " (clamped)" } else { "" }
        ));
    } else {
        say("layer efficiency not fitted: the GEMM measurement was skipped".into());
    }
    // The linear-attention layer of hybrid models: its chunked delta rule runs many small
    // matmuls, so it gets its own efficiency.
    let (cfg, seq) = linear_layer_config(args.device, args.quick)?;
    let (fwd, bwd) = layer_seconds::<B>(&cfg, seq, device)?;
    m.linear_layer_fwd_seconds = Some(fwd);
    m.linear_layer_bwd_seconds = Some(bwd);
    m.linear_layer_tokens = Some(seq);
    m.linear_layer_hidden = Some(cfg.hidden_size);
    say(format!(
        "linear-attention layer (hidden {}, {} tokens, {dtype}): forward {:.2} ms, backward (with its re-forward) \
         {:.2} ms",
        cfg.hidden_size,
        seq,
        fwd * 1e3,
        bwd * 1e3
    ));
    if let Some(peak) = m.gemm_tflops {
        let (eff, _, clamped) = fit_efficiency(&cfg, seq, fwd + bwd, peak, args)?;
        m.linear_efficiency = Some(eff);
        m.linear_efficiency_clamped = clamped;
        say(format!(
            "linear-attention layer efficiency against the measured GEMM peak: {eff:.3}{}",
            if clamped { " (clamped)" } else { "" }
        ));
    }
    Ok(())
}

/// Copy bandwidth of one thread, decimal GB/s (bytes copied per second).
fn memcpy_gb_per_s(bytes: usize, reps: usize) -> f64 {
    let src: Vec<u8> = (0..bytes).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
    let mut dst = vec![0u8; bytes];
    // First touch outside the timer.
    dst.copy_from_slice(&src);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        times.push(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best(&times) / 1e9
}

/// Measured transfer rates, in GB/s of data in the device dtype.
struct TransferRates {
    /// `Tensor::from_data` of native-dtype data in ordinary (pageable) host memory.
    h2d_pageable: f64,
    /// The same after `Backend::staging` moved the data into the backend's staging memory (pinned
    /// on CUDA); the staging copy itself is not timed.
    h2d_pinned: f64,
    /// The executor's whole upload path, what the planner should assume: on a bf16 device from the
    /// bf16 copy that the optimizer writes (shared with the runtime, nothing converted or copied by
    /// us), on an f32 device from the fp32 master (one threaded copy); staging only with
    /// `LT_PINNED_UPLOADS=1`.
    h2d_executor: f64,
    /// `into_data` of the uploaded tensor.
    d2h: f64,
    /// Whether the bf16 copy the executor's path uploads from was page-locked (CUDA:
    /// `cuMemHostRegister`; off with `LT_PIN_COPY=0`); `None` on f32 devices, which have no copy.
    copy_pinned: Option<bool>,
    /// Host bytes read and written per uploaded byte on the executor's path before the driver's own
    /// transfer, by construction of that path (see [`host_touch_per_uploaded_byte`]).
    host_touch: f64,
}

/// Host bytes read plus written per uploaded byte before the driver's own transfer, on the path the
/// executor takes for `dtype`. Counted from the path, not measured: from the optimizer's bf16 copy
/// nothing (the patched cubecl-runtime hands the shared buffer to the server); from an fp32 master, a
/// conversion (4 read + `elem` written per `elem` uploaded); pinned staging (`LT_PINNED_UPLOADS=1`)
/// adds a copy into the pinned pool and cubecl's copy of pinned data back into pageable memory (2
/// bytes each per byte).
fn host_touch_per_uploaded_byte(dtype: burn::tensor::DType) -> f64 {
    let staged = if lt_model::upload::pinned_uploads() { 4.0 } else { 0.0 };
    match dtype {
        burn::tensor::DType::BF16 => staged,
        d => (4.0 + d.size() as f64) / d.size() as f64 + staged,
    }
}

/// Upload and download bandwidth of `bytes` in the device dtype, three ways for uploads (see
/// [`TransferRates`]), best of `reps`, the device synchronised before each timer stops.
fn transfers<B: Backend>(device: &B::Device, bytes: usize, reps: usize) -> Result<TransferRates> {
    let elem = std::mem::size_of::<<B as BackendTypes>::FloatElem>().max(1);
    let n = bytes / elem;
    let host: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32) * 1e-3).collect();
    let native = TensorData::new(host.clone(), [n]).convert::<<B as BackendTypes>::FloatElem>();
    // A bf16 device uploads the optimizer's bf16 copy of the masters, made outside the timing as
    // the optimizer makes it outside the upload.
    let dtype = <<B as BackendTypes>::FloatElem as burn::tensor::Element>::dtype();
    let copy: Option<lt_model::upload::Bf16Copy> = (dtype == burn::tensor::DType::BF16).then(|| {
        std::sync::Arc::new(lt_model::upload::CopyBuf::new(
            host.iter().map(|&x| burn::tensor::bf16::from_f32(x)).collect(),
        ))
    });
    // Page-locked as the executor's copies are (CUDA), before any timing.
    let copy_pin = copy.as_ref().map(|c| c.pin());
    let shared = |c: &lt_model::upload::Bf16Copy| {
        lt_model::upload::shared_bf16_data(c, &[n]).ok_or_else(|| anyhow::anyhow!("bf16 copy of the wrong size"))
    };
    // Warm-up: context creation, allocator pages, kernels, the pinned pool.
    let t0: Tensor<B, 1> = Tensor::from_data(native.clone(), device);
    let _ = t0.clone().into_data();
    let _w: Tensor<B, 1> = lt_model::upload::upload(&host, &[n], device);
    sync::<B>(device)?;
    let (mut up, mut pinned, mut down, mut exec) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps.max(1) {
        let data = native.clone();
        let t = Instant::now();
        let x: Tensor<B, 1> = Tensor::from_data(data, device);
        sync::<B>(device)?;
        up.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let back = x.into_data();
        down.push(t.elapsed().as_secs_f64());
        std::hint::black_box(back);
        let mut data = native.clone();
        B::staging(std::iter::once(&mut data), device);
        let t = Instant::now();
        let z: Tensor<B, 1> = Tensor::from_data(data, device);
        sync::<B>(device)?;
        pinned.push(t.elapsed().as_secs_f64());
        drop(z);
        let t = Instant::now();
        let y: Tensor<B, 1> = match &copy {
            Some(c) => lt_model::upload::upload_data(shared(c)?, device),
            None => lt_model::upload::upload(&host, &[n], device),
        };
        sync::<B>(device)?;
        exec.push(t.elapsed().as_secs_f64());
        drop(y);
    }
    let gbs = |t: &[f64]| (n * elem) as f64 / best(t) / 1e9;
    Ok(TransferRates {
        h2d_pageable: gbs(&up),
        h2d_pinned: gbs(&pinned),
        h2d_executor: gbs(&exec),
        d2h: gbs(&down),
        host_touch: host_touch_per_uploaded_byte(dtype),
        copy_pinned: copy_pin.map(|p| p == lt_model::upload::PinState::Pinned),
    })
}

/// Best achieved TFLOPS of an `n^3` matmul.
fn gemm_tflops<B: Backend>(device: &B::Device, n: usize, reps: usize) -> Result<f64> {
    let a: Tensor<B, 2> = Tensor::random([n, n], Distribution::Default, device);
    let b: Tensor<B, 2> = Tensor::random([n, n], Distribution::Default, device);
    let _ = a.clone().matmul(b.clone());
    sync::<B>(device)?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let c = a.clone().matmul(b.clone());
        sync::<B>(device)?;
        times.push(t.elapsed().as_secs_f64());
        drop(c);
    }
    Ok(2.0 * (n as f64).powi(3) / best(&times) / 1e12)
}

/// Best forward and per-layer backward times of layer 0 of `cfg` over `seq` tokens.
fn layer_seconds<B: AutodiffBackend>(
    cfg: &ModelConfig,
    seq: usize,
    device: &<B::InnerBackend as BackendTypes>::Device,
) -> Result<(f64, f64)> {
    let t = crate::timing::layer_times::<B>(cfg, 0, 1, seq, lt_model::DeltaForm::Chunked, 1, 3, device)?;
    Ok((best(&t.fwd), best(&t.bwd)))
}

/// The step shape the efficiency fit models: one sequence, no accumulation, the loss in one chunk.
fn calibration_exec(seq: usize) -> ExecConfig {
    ExecConfig {
        micro_batch_size: 1,
        grad_accum_steps: 1,
        loss_chunk_tokens: seq,
        optimizer_overlap: lt_sched::OptimizerOverlap::Serial,
        retain_all_logits: false,
    }
}

/// The cost model options of the fit: materialised attention, what the trainer runs.
fn calibration_options() -> CostOptions {
    CostOptions { attention: lt_sched::cost::AttentionKernel::Materialized, ..Default::default() }
}

/// The efficiency that makes the cost model's layer time (forward plus backward, as
/// `lt_sched::cost` defines them) equal `measured` seconds at the measured `peak`. Returns the
/// efficiency, the cost model's FLOPs of that work, and whether it had to be clamped into (0, 1].
fn fit_efficiency(
    cfg: &ModelConfig,
    seq: usize,
    measured: f64,
    peak: f64,
    args: &ProfileArgs,
) -> Result<(f64, f64, bool)> {
    let base = default_base(args).builtin().profile();
    let mut hw = base;
    hw.peak_tflops = peak;
    hw.efficiency = 1.0;
    let ecfg = calibration_exec(seq);
    hw.linear_efficiency = None;
    let inst = Instance::from_model(cfg, &hw, seq, &ecfg, calibration_options())?;
    let l = inst.layers.first().context("no layer in the calibration instance")?;
    // With efficiency 1 the model predicts `fwd + bwd` seconds; efficiency scales it inversely.
    let at_full = l.fwd_seconds + l.bwd_seconds;
    let eff = at_full / measured.max(1e-12);
    let clamped = !(eff > 0.0 && eff <= 1.0);
    Ok((eff.clamp(1e-6, 1.0), 2.0 * l.fwd_flops + l.bwd_flops, clamped))
}

/// Write then read back `sizes.disk_total` bytes through a spill store in `dir`.
fn disk(dir: &Path, sizes: &Sizes, m: &mut Measured) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create the spill folder", dir.display()))?;
    let value = sizes.disk_value.min(sizes.disk_total as usize).max(4096);
    let n_values = sizes.disk_total.div_ceil(value as u64);
    let inflight = 2;
    let cfg = SpillConfig { pool_bytes: inflight * value, ..SpillConfig::new(dir, n_values * value as u64) };
    let store = SpillStore::open(cfg).with_context(|| format!("opening a spill store in {}", dir.display()))?;
    let report = store.report().clone();
    let mut free: Vec<SpillBuf> =
        (0..inflight).map(|_| store.alloc_buf(value)).collect::<Result<_, _>>().context("allocating buffers")?;
    for b in &mut free {
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
        }
    }
    let mut pending: VecDeque<Ticket<SpillBuf>> = VecDeque::new();
    let t = Instant::now();
    for k in 0..n_values {
        let buf = match free.pop() {
            Some(b) => b,
            None => pending.pop_front().context("no buffer in flight")?.wait().context("spill write")?,
        };
        pending.push_back(store.submit_put(k, buf).context("submitting a spill write")?);
    }
    while let Some(p) = pending.pop_front() {
        free.push(p.wait().context("spill write")?);
    }
    let write_s = t.elapsed().as_secs_f64();
    let mut pending: VecDeque<Ticket<SpillBuf>> = VecDeque::new();
    let t = Instant::now();
    for k in 0..n_values {
        if free.is_empty()
            && let Some(p) = pending.pop_front()
        {
            free.push(p.wait().context("spill read")?);
        }
        let buf = free.pop().context("no free buffer")?;
        pending.push_back(store.submit_get_into(k, buf).context("submitting a spill read")?);
    }
    while let Some(p) = pending.pop_front() {
        free.push(p.wait().context("spill read")?);
    }
    let read_s = t.elapsed().as_secs_f64();
    let bytes = (n_values * value as u64) as f64;
    m.nvme_write_gb_per_s = Some(bytes / write_s / 1e9);
    m.nvme_read_gb_per_s = Some(bytes / read_s / 1e9);
    m.disk_engine = Some(report.engine.name().to_string());
    m.disk_o_direct = Some(report.direct_io);
    m.disk_bytes = Some(n_values * value as u64);
    Ok(())
}

/// Median update throughput of `kind` over `n` parameters (one group, clipping active), Gparam/s, on
/// what the trainer hands the optimizer: fp32 gradients, or with `bf16` (a bf16 device) bf16
/// gradients, as a decoder layer's land without accumulation, and the bf16 upload copy written in
/// the same pass.
fn optimizer_speed(kind: OptimizerChoice, n: usize, threads: usize, bf16: bool) -> Result<f64> {
    let kind = kind.kind();
    let cfg = AdamWConfig { max_grad_norm: Some(1.0), ..Default::default() };
    let mut opt = AdamW::new(cfg, kind).context("creating the optimizer")?;
    opt.add_group("profile", &[("w", n)]).context("registering the parameter group")?;
    let pool = ThreadPool::new(threads).context("starting optimizer threads")?;
    let mut rng = lt_core::rng::SplitMix64::new(3);
    let mut params: Vec<f32> = (0..n).map(|_| (rng.next_f64() as f32 - 0.5) * 0.1).collect();
    let grads: Vec<f32> =
        (0..n).map(|i| (rng.next_f64() as f32 - 0.5) * 10f32.powi(-((i / 4096) as i32 % 4))).collect();
    let grads16: Vec<lt_optim::bf16> =
        if bf16 { grads.iter().map(|&g| lt_optim::bf16::from_f32(g)).collect() } else { Vec::new() };
    let grad = if bf16 { Grad::Bf16(&grads16) } else { Grad::F32(&grads) };
    let mut copy = if bf16 { vec![lt_optim::bf16::ZERO; n] } else { Vec::new() };
    let norm = lt_optim::grad::sum_squares(grad, &pool).sqrt();
    let mut times = Vec::new();
    for s in 0..4 {
        let t = Instant::now();
        let StepOutcome::Apply(ctx) = opt.begin_step(norm) else {
            bail!("profile gradient norm is not finite");
        };
        let group = &mut opt.groups_mut()[0];
        if bf16 {
            group.update_with_copies(&mut [&mut params], &mut [Some(&mut copy)], &[grad], &ctx, &pool)
        } else {
            group.update(&mut [&mut params], &[grad], &ctx, &pool)
        }
        .context("optimizer update")?;
        if s > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(n as f64 / times[times.len() / 2] / 1e9)
}

/// Total memory of GPU 0 from `nvidia-smi`, bytes.
fn nvidia_smi_total_memory() -> Option<u64> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=memory.total", "--format=csv,noheader,nounits", "--id=0"])
        .output()
        .ok()?;
    let mib: u64 = String::from_utf8_lossy(&out.stdout).trim().lines().next()?.trim().parse().ok()?;
    Some(mib << 20)
}

fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// The TOML lines of a profile being written, each field preceded by a comment saying where its
/// value comes from.
struct ProfileToml {
    lines: Vec<String>,
}

impl ProfileToml {
    /// Appends `# note` and then `key = value`.
    fn field(&mut self, key: &str, value: String, note: String) {
        self.lines.push(format!("# {note}"));
        self.lines.push(format!("{key} = {value}"));
    }
}

/// The profile and its TOML text, each field preceded by a comment saying where its value comes from.
/// The text is parsed back through lt-sched's loader before it is returned, so a written file always
/// loads.
fn build_profile(
    base: &HardwareProfile,
    name: &str,
    args: &ProfileArgs,
    m: &Measured,
) -> Result<(HardwareProfile, String)> {
    let from_base = format!("from the built-in `{}` profile (not measured)", base.name);
    let mut p = base.clone();
    p.name = name.to_string();
    let device = device_name(args.device);
    p.description = format!(
        "measured by `lt profile --device {device}{}`; unmeasured fields from `{}`",
        if args.quick { " --quick" } else { "" },
        base.name
    );
    let mut out = ProfileToml {
        lines: vec![
            "# Hardware profile written by `lt profile`. Load it with `--hardware FILE` (lt plan, lt train, lt bench train)."
                .to_string(),
            "# Each field says whether it was measured on this machine or copied from the base profile.".to_string(),
            String::new(),
            format!("name = {}", toml_str(&p.name)),
            format!("description = {}", toml_str(&p.description)),
        ],
    };
    memory_fields(&mut p, &mut out, args, m, &from_base);
    bandwidth_fields(&mut p, &mut out, m, &from_base);
    compute_fields(&mut p, &mut out, base, m, &from_base);
    linear_efficiency_field(&mut p, &mut out, m, &from_base);
    optimizer_field(&mut p, &mut out, args, m, &from_base);
    out.field("gpu_reserved", p.gpu_reserved.0.to_string(), format!("{from_base}: {}", p.gpu_reserved));
    out.field("gemm_half_efficiency_rows", format!("{:?}", p.gemm_half_efficiency_rows), from_base.clone());
    let dtype_bytes: u32 = match args.device {
        DeviceChoice::Cpu | DeviceChoice::Wgpu => 4,
        DeviceChoice::Cuda => 2,
    };
    p.compute_dtype_bytes = dtype_bytes;
    out.field(
        "compute_dtype_bytes",
        dtype_bytes.to_string(),
        format!("the executor's device dtype on --device {device} ({})", if dtype_bytes == 4 { "f32" } else { "bf16" }),
    );
    let text = out.lines.join("\n") + "\n";
    let parsed = lt_sched::hardware::profile_from_toml(&text, &args.out.display().to_string())
        .context("the measured profile does not validate (a measurement went wrong)")?;
    Ok((parsed, text))
}

/// `gpu_memory` (measured total on CUDA when nvidia-smi answers), `host_memory` (what is available
/// now) and `nvme_capacity` (from the base).
fn memory_fields(p: &mut HardwareProfile, out: &mut ProfileToml, args: &ProfileArgs, m: &Measured, from_base: &str) {
    // GPU memory: measured total on CUDA when nvidia-smi answers.
    if let Some(total) = m.gpu_memory_total {
        p.gpu_memory = ByteSize(total);
        out.field("gpu_memory", total.to_string(), format!("measured: nvidia-smi memory.total ({})", ByteSize(total)));
    } else {
        out.field("gpu_memory", p.gpu_memory.0.to_string(), format!("{from_base}: {}", p.gpu_memory));
    }
    // Host memory: what is available now; on the CPU executor the device budget lives in host memory too.
    if let Some(avail) = m.host_memory_available {
        let usable = match args.device {
            DeviceChoice::Cpu => avail.saturating_sub(p.gpu_memory.0).max(1 << 30),
            DeviceChoice::Cuda | DeviceChoice::Wgpu => avail,
        };
        p.host_memory = ByteSize(usable);
        let how = match args.device {
            DeviceChoice::Cpu => "MemAvailable less gpu_memory (the CPU executor's device budget is host memory)",
            DeviceChoice::Cuda | DeviceChoice::Wgpu => "MemAvailable",
        };
        out.field("host_memory", usable.to_string(), format!("measured: {how} ({})", ByteSize(usable)));
    } else {
        out.field("host_memory", p.host_memory.0.to_string(), format!("{from_base}: {}", p.host_memory));
    }
    out.field("nvme_capacity", p.nvme_capacity.0.to_string(), format!("{from_base}: {}", p.nvme_capacity));
}

/// The transfer (`h2d_gb_per_s`, `d2h_gb_per_s`) and disk (`nvme_read_gb_per_s`,
/// `nvme_write_gb_per_s`) bandwidths.
fn bandwidth_fields(p: &mut HardwareProfile, out: &mut ProfileToml, m: &Measured, from_base: &str) {
    let source = m.transfer_source.clone().unwrap_or_default();
    for (key, measured, slot) in [
        ("h2d_gb_per_s", m.h2d_gb_per_s, &mut p.h2d_gb_per_s as &mut f64),
        ("d2h_gb_per_s", m.d2h_gb_per_s, &mut p.d2h_gb_per_s),
    ] {
        match measured {
            Some(v) => {
                *slot = v;
                let extra = match (key, m.h2d_pageable_gb_per_s, m.h2d_pinned_gb_per_s) {
                    ("h2d_gb_per_s", Some(pg), Some(pn)) => {
                        format!("; native data from pageable memory {pg:.3} GB/s, from pinned {pn:.3} GB/s")
                    }
                    _ => String::new(),
                };
                out.field(key, format!("{v:?}"), format!("measured: {source}{extra}"));
            }
            None => out.field(key, format!("{:?}", *slot), from_base.to_string()),
        }
    }
    for (key, measured, slot) in [
        ("nvme_read_gb_per_s", m.nvme_read_gb_per_s, &mut p.nvme_read_gb_per_s as &mut f64),
        ("nvme_write_gb_per_s", m.nvme_write_gb_per_s, &mut p.nvme_write_gb_per_s),
    ] {
        match measured {
            Some(v) => {
                *slot = v;
                out.field(
                    key,
                    format!("{v:?}"),
                    format!(
                        "measured: lt-storage spill store ({}, O_DIRECT {}), {} written then read back",
                        m.disk_engine.as_deref().unwrap_or("?"),
                        m.disk_o_direct.unwrap_or(false),
                        ByteSize(m.disk_bytes.unwrap_or(0))
                    ),
                );
            }
            None => out.field(key, format!("{:?}", *slot), from_base.to_string()),
        }
    }
}

/// `peak_tflops` (the measured GEMM peak) and `efficiency` (the decoder-layer fit, or the base's
/// layer FLOP rate over the measured peak).
fn compute_fields(
    p: &mut HardwareProfile,
    out: &mut ProfileToml,
    base: &HardwareProfile,
    m: &Measured,
    from_base: &str,
) {
    match m.gemm_tflops {
        Some(t) => {
            p.peak_tflops = t;
            out.field(
                "peak_tflops",
                format!("{t:?}"),
                format!(
                    "measured: best {n}x{n}x{n} {} matmul through Burn (the achievable dense peak; the datasheet figure \
of `{}` is {})",
                    m.gemm_dtype.as_deref().unwrap_or("?"),
                    base.name,
                    base.peak_tflops,
                    n = m.gemm_n.unwrap_or(0)
                ),
            );
        }
        None => out.field("peak_tflops", format!("{:?}", p.peak_tflops), from_base.to_string()),
    }
    match m.efficiency {
        Some(e) => {
            p.efficiency = e;
            out.field(
                "efficiency",
                format!("{e:?}"),
                format!(
                    "measured: one decoder layer (hidden {}, {} tokens) forward {:.3} ms + backward {:.3} ms; efficiency \
fitted to that time at the measured peak{}",
                    m.layer_hidden.unwrap_or(0),
                    m.layer_tokens.unwrap_or(0),
                    m.layer_fwd_seconds.unwrap_or(0.0) * 1e3,
                    m.layer_bwd_seconds.unwrap_or(0.0) * 1e3,
                    if m.efficiency_clamped { " (clamped into (0, 1])" } else { "" }
                ),
            );
        }
        None if m.gemm_tflops.is_some() => {
            // The base efficiency is relative to the base's datasheet peak; keep the base's layer-level
            // FLOP rate rather than pairing it with the measured GEMM peak.
            let e = (base.efficiency * base.peak_tflops / p.peak_tflops).clamp(1e-6, 1.0);
            p.efficiency = e;
            out.field(
                "efficiency",
                format!("{e:?}"),
                format!(
                    "derived: the base profile's layer FLOP rate ({} x {}) over the measured peak",
                    base.efficiency, base.peak_tflops
                ),
            );
        }
        None => out.field("efficiency", format!("{:?}", p.efficiency), from_base.to_string()),
    }
}

/// `linear_efficiency`: the Gated DeltaNet layer fit, else the base's value when it has one (the
/// field is left out otherwise).
fn linear_efficiency_field(p: &mut HardwareProfile, out: &mut ProfileToml, m: &Measured, from_base: &str) {
    match m.linear_efficiency {
        Some(e) => {
            p.linear_efficiency = Some(e);
            out.field(
                "linear_efficiency",
                format!("{e:?}"),
                format!(
                    "measured: one Gated DeltaNet layer (hidden {}, {} tokens, chunked delta rule) forward {:.3} ms + \
                     backward {:.3} ms, fitted like efficiency{}",
                    m.linear_layer_hidden.unwrap_or(0),
                    m.linear_layer_tokens.unwrap_or(0),
                    m.linear_layer_fwd_seconds.unwrap_or(0.0) * 1e3,
                    m.linear_layer_bwd_seconds.unwrap_or(0.0) * 1e3,
                    if m.linear_efficiency_clamped { " (clamped into (0, 1])" } else { "" }
                ),
            );
        }
        None => {
            if let Some(e) = p.linear_efficiency {
                out.field("linear_efficiency", format!("{e:?}"), from_base.to_string());
            }
        }
    }
}

/// `optimizer_gparams_per_s`: the measured throughput of the `--optimizer` variant.
fn optimizer_field(p: &mut HardwareProfile, out: &mut ProfileToml, args: &ProfileArgs, m: &Measured, from_base: &str) {
    let opt = optimizer_measured(m, args.optimizer);
    match opt {
        Some(g) => {
            p.optimizer_gparams_per_s = g;
            out.field(
                "optimizer_gparams_per_s",
                format!("{g:?}"),
                format!(
                    "measured: lt-optim {} update, {} params, {} threads, {} (adamw8bit {:.3}, adamw8bit-f8 {:.3}, \
                     adamw {:.3} Gparam/s)",
                    args.optimizer.name(),
                    m.optimizer_params.unwrap_or(0),
                    m.optimizer_threads.unwrap_or(0),
                    m.optimizer_io.unwrap_or("fp32 gradients"),
                    m.adamw8bit_gparams_per_s.unwrap_or(0.0),
                    m.adamw8bit_f8_gparams_per_s.unwrap_or(0.0),
                    m.adamw_gparams_per_s.unwrap_or(0.0)
                ),
            );
        }
        None => out.field("optimizer_gparams_per_s", format!("{:?}", p.optimizer_gparams_per_s), from_base.to_string()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    fn args(device: DeviceChoice) -> ProfileArgs {
        ProfileArgs {
            device,
            out: PathBuf::from("x.toml"),
            base: None,
            name: None,
            quick: true,
            skip: vec![],
            spill_dir: None,
            optimizer: OptimizerChoice::Adamw8bit,
            threads: None,
            json: false,
        }
    }

    #[test]
    fn the_optimizer_is_timed_on_what_the_trainer_hands_it() {
        // Both layouts run, for both optimizers, and give a throughput (the bf16 one writes the
        // upload copy too, so it is no faster here by construction; the figure is what matters).
        for kind in [OptimizerChoice::Adamw8bit, OptimizerChoice::Adamw] {
            for bf16 in [false, true] {
                let g = optimizer_speed(kind, 1 << 16, 2, bf16).unwrap();
                assert!(g.is_finite() && g > 0.0, "{kind:?} bf16={bf16}: {g}");
            }
        }
    }

    #[test]
    fn unmeasured_fields_keep_the_base_and_the_text_round_trips() {
        let base = BuiltinProfile::H200.profile();
        let m = Measured { h2d_gb_per_s: Some(41.5), gemm_tflops: Some(700.0), ..Default::default() };
        let (p, text) = build_profile(&base, "mine", &args(DeviceChoice::Cuda), &m).unwrap();
        assert_eq!(p.h2d_gb_per_s, 41.5);
        assert_eq!(p.d2h_gb_per_s, base.d2h_gb_per_s);
        assert_eq!(p.peak_tflops, 700.0);
        // Efficiency keeps the base's layer FLOP rate when no layer was measured: 0.285 x 989 / 700.
        assert!((p.efficiency * 700.0 - base.efficiency * base.peak_tflops).abs() < 1e-9);
        assert!(text.contains("# measured:") && text.contains("not measured"), "{text}");
        assert_eq!(lt_sched::hardware::profile_from_toml(&text, "x.toml").unwrap(), p);
    }

    #[test]
    fn efficiency_fit_reproduces_the_measured_layer_time() {
        let (cfg, seq) = layer_config(DeviceChoice::Cpu, true).unwrap();
        let (lcfg, lseq) = linear_layer_config(DeviceChoice::Cpu, true).unwrap();
        let a = args(DeviceChoice::Cpu);
        let (eff, _, clamped) = fit_efficiency(&cfg, seq, 0.5, 0.05, &a).unwrap();
        let (leff, _, lclamped) = fit_efficiency(&lcfg, lseq, 0.3, 0.05, &a).unwrap();
        assert!(!clamped && !lclamped);
        // Re-predict with the fitted efficiencies: each layer takes its measured time (1e-9 relative:
        // the same arithmetic in the other direction), and the linear one uses linear_efficiency.
        let mut hw = BuiltinProfile::Cpu.profile();
        hw.peak_tflops = 0.05;
        hw.efficiency = eff;
        hw.linear_efficiency = Some(leff);
        for (c, s, want) in [(&cfg, seq, 0.5), (&lcfg, lseq, 0.3)] {
            let inst = Instance::from_model(c, &hw, s, &calibration_exec(s), calibration_options()).unwrap();
            let t = inst.layers[0].fwd_seconds + inst.layers[0].bwd_seconds;
            assert!((t / want - 1.0).abs() < 1e-9, "{t} vs {want}");
        }
    }
}
