//! `lt bench train`: streamed training throughput on a randomly initialised model (nothing to
//! download), with exactly the machinery `lt train` runs: [`lt_run::choose_plan`], the
//! [`Executor`] and the [`Trainer`].
//!
//! Every position of every row is a real, trained token (random ids), so the published formula
//! `6 x params x tokens / step` (shared/REFERENCE.md §1: params include the embedding, padding counted,
//! attention and recompute not) and the honest one coincide in their token count. The honest figure,
//! `tflops_full`, counts what this executor really computes: forward, the recompute the plan asks for,
//! the graph-recording forward of each per-layer backward, the backward and the head, with attention
//! scores materialised (`T x T`, as Burn's autodiff does) — lt-sched's `executed_flops_per_step`.
//!
//! Output: a human summary on stderr and, as the last stdout line, one JSON object. When the run
//! cannot fit (device budget, host memory, planner infeasible, CUDA out of memory) the last stdout
//! line is `{"error": ..., "kind": "device_memory" | "host_memory" | "infeasible"}` and the exit
//! code is 2; any other failure prints `{"error": ..., "kind": "error"}` and exits 1. Panics inside
//! the backend (cubecl reports out-of-memory by panicking) are caught and classified, never shown
//! as a crash.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use burn::tensor::backend::AutodiffBackend;
use lt_core::{ByteSize, HostCpu, ModelConfig};
use lt_exec::ExecError;
use lt_exec::plan::Placement;
use lt_exec::state::SharedModel;
use lt_exec::train::{LrSchedule, StepMetrics, TrainOptions, Trainer};
use lt_model::host::HostModel;
use lt_model::model::Batch;
use lt_sched::cost::{AttentionKernel, CostOptions, ExecConfig, Instance};

use lt_run::{ChosenPlan, DeviceChoice, OptimizerChoice, Policy, RunConfig, RunSettings, choose_plan, executor_for};

use crate::failure::{FailKind, Failure, catch_panics, fail};
use crate::procmem::{mem_available, vm_hwm, vm_rss};

/// Arguments of `lt bench train`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "The last stdout line is one JSON object (fields: model, params, policy, batch_size, seq_len, \
micro_batch_size, steps, warmup, device, step_seconds, step_seconds_all, tokens_per_s, tflops_6pt, tflops_full, \
peak_device_bytes, peak_device_source, peak_host_bytes, exposed_seconds, predicted_step_seconds, ...). \
Exit code 2 with {\"error\", \"kind\"} when the run does not fit (kind device_memory, host_memory or infeasible).\n\n\
Examples:\n  lt bench train --model-config configs/models/qwen2.5-7b.json --device cuda --hardware h200 \
--batch-size 8 --seq-len 1024\n  lt bench train --model-config tiny.json --batch-size 2 --seq-len 64 --steps 1 --json")]
pub struct BenchTrainArgs {
    /// The model's Hugging Face config.json (weights are randomly initialised; nothing is downloaded).
    #[arg(long, value_name = "CONFIG.json", required_unless_present = "model", conflicts_with = "model")]
    pub model_config: Option<PathBuf>,
    /// A model folder; only its config.json is read (weights are randomly initialised).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Sequences (rows) per optimizer step.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Tokens per row; every position is a trained token.
    #[arg(long, default_value_t = 1024)]
    pub seq_len: usize,
    /// Rows per micro-batch (gradient accumulation when smaller than --batch-size) [default: the plan's,
    /// or the whole batch for a fixed policy].
    #[arg(long)]
    pub micro_batch_size: Option<usize>,
    /// Activation policy: the planner (auto) or a fixed baseline.
    #[arg(long, value_enum, default_value = "auto")]
    pub policy: Policy,
    /// Timed optimizer steps.
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    /// Untimed warm-up steps run first (kernel compilation, first-touch page faults, allocator growth).
    #[arg(long, default_value_t = 1)]
    pub warmup: u64,
    /// Compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceChoice,
    #[command(flatten)]
    pub hw: lt_run::config::HardwareArgs,
    /// Optimizer state precision.
    #[arg(long, value_enum, default_value_t = OptimizerChoice::DEFAULT)]
    pub optimizer: OptimizerChoice,
    /// Host optimizer threads [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seed of the random weights and token ids.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Run the optimizer serially after backward instead of overlapping it with the next forward.
    #[arg(long)]
    pub serial_optimizer: bool,
    /// Folder for NVMe-placed activations [default: a fresh folder under the system temp dir, removed
    /// afterwards].
    #[arg(long, value_name = "DIR")]
    pub spill_dir: Option<PathBuf>,
    /// Write the Chrome trace (chrome://tracing, Perfetto) of the timed steps.
    #[arg(long, value_name = "FILE.json")]
    pub trace: Option<PathBuf>,
    /// Print only the JSON line on stdout (no human summary on stderr).
    #[arg(long)]
    pub json: bool,
}

/// Run the command.
pub fn run(args: &BenchTrainArgs) -> Result<()> {
    match catch_panics(|| bench(args)) {
        Ok(report) => {
            if !args.json {
                eprint!("{}", human_summary(&report));
            }
            println!("{report}");
            Ok(())
        }
        Err(f) => fail(&f),
    }
}

/// The model's short name: the config file's stem, or the folder's name for `config.json`.
pub(crate) fn model_name(path: &Path) -> String {
    let p = if path.is_dir() || path.file_name().is_some_and(|n| n == "config.json") {
        if path.is_dir() { path } else { path.parent().unwrap_or(path) }
    } else {
        path
    };
    p.file_stem().map_or_else(|| p.display().to_string(), |s| s.to_string_lossy().into_owned())
}

fn settings(args: &BenchTrainArgs) -> Result<RunSettings> {
    if args.steps == 0 {
        anyhow::bail!("--steps: must be > 0");
    }
    let hw = lt_run::config::HardwareArgs {
        hardware: Some(args.hw.spec(lt_run::device::default_profile(args.device))),
        ..args.hw.clone()
    };
    // Every field `choose_plan` and the trainer read is set here, so `resolve`'s demo defaults
    // (used because neither --model nor --data is given) never apply.
    let file = RunConfig {
        steps: Some(args.warmup + args.steps),
        batch_size: Some(args.batch_size),
        micro_batch_size: args.micro_batch_size,
        seq_len: Some(args.seq_len),
        lr: Some(1e-5),
        weight_decay: Some(0.01),
        max_grad_norm: Some(1.0),
        warmup_steps: Some(0),
        optimizer: Some(args.optimizer),
        seed: Some(args.seed),
        policy: Some(args.policy),
        hw,
        device: Some(args.device),
        threads: args.threads,
        serial_optimizer: args.serial_optimizer,
        spill_dir: args.spill_dir.clone(),
        ..RunConfig::default()
    };
    RunSettings::resolve(&file)
}

/// Host bytes the run needs for `cfg`: what the trainer keeps for the parameters
/// ([`lt_sched::cost::host_param_bytes`]: fp32 masters, gradients, the optimizer's moments,
/// and on a bf16 device the bf16 upload copies; `dtype_bytes` is the device's element size), plus
/// the activations the plan keeps in host memory for one micro-batch (in the device dtype).
/// Transient per-layer buffers of the streams (a few layers' worth) are not counted.
pub(crate) fn host_bytes_needed(
    cfg: &ModelConfig,
    optimizer: OptimizerChoice,
    host_boundaries: usize,
    micro: usize,
    seq: usize,
    dtype_bytes: usize,
    grad_accum_steps: usize,
) -> u64 {
    let acts = (host_boundaries * micro * seq * cfg.hidden_size * dtype_bytes) as u64;
    lt_sched::cost::host_param_bytes(cfg, dtype_bytes, optimizer.state(), grad_accum_steps).total() + acts
}

/// What one benchmark run measured.
#[derive(Debug)]
struct Report {
    json: serde_json::Value,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.json)
    }
}

fn human_summary(r: &Report) -> String {
    let j = &r.json;
    let f = |k: &str| j.get(k).and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN);
    let s = |k: &str| j.get(k).map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string)).unwrap_or_default();
    let mut out = format!(
        "bench train: {} ({:.3}B params) {} on {}, batch {} x {} (micro-batch {} x {}), {} timed + {} warm-up steps\n",
        s("model"),
        f("params") / 1e9,
        s("policy"),
        s("device"),
        s("batch_size"),
        s("seq_len"),
        s("micro_batch_size"),
        s("grad_accum_steps"),
        s("steps"),
        s("warmup"),
    );
    if let Ok(host) = serde_json::from_value::<HostCpu>(j["host_cpu"].clone()) {
        out += &format!("  host: {host}\n");
    }
    out += &format!(
        "  measured: {:.3} s/step, {:.1} tokens/s, {:.3} TFLOPS (6*params*tokens), {:.3} TFLOPS (executed, attention and recompute counted)\n",
        f("step_seconds"),
        f("tokens_per_s"),
        f("tflops_6pt"),
        f("tflops_full")
    );
    if let Some(p) = j.get("predicted_step_seconds").and_then(serde_json::Value::as_f64) {
        out += &format!("  predicted: {p:.3} s/step ({})\n", s("predicted_source"));
    }
    let e = &j["exposed_seconds"];
    let g = |k: &str| e.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    out += &format!(
        "  measured exposure per step: h2d {:.3} s, d2h {:.3} s, nvme {:.3} s, optimizer {:.3} s\n",
        g("h2d"),
        g("d2h"),
        g("nvme"),
        g("optimizer")
    );
    out += &format!(
        "  peak device {} ({}), peak host {} (VmHWM; host tier predicted {}, of which the trainer's buffers {}), losses {}\n",
        ByteSize(f("peak_device_bytes").max(0.0) as u64),
        s("peak_device_source"),
        ByteSize(f("peak_host_bytes").max(0.0) as u64),
        ByteSize(f("host_estimate_bytes").max(0.0) as u64),
        ByteSize(
            serde_json::from_value::<lt_exec::train::HostBytes>(j["host_trainer_bytes"].clone())
                .map_or(0, |b| b.total())
        ),
        j["losses"]
    );
    out
}

fn bench(args: &BenchTrainArgs) -> Result<Report, Failure> {
    let err = |e: anyhow::Error| Failure::from_error(&e);
    let path = args
        .model_config
        .as_ref()
        .or(args.model.as_ref())
        .ok_or_else(|| Failure::new(FailKind::Error, "give --model-config FILE.json or --model DIR"))?;
    let cfg = ModelConfig::from_path(path).map_err(|e| err(e.into()))?;
    let s = settings(args).map_err(err)?;
    let chosen = choose_plan(&s, &cfg).map_err(err)?;
    let micro = chosen.micro_batch_size();
    if !args.json {
        eprintln!("{}", chosen.summary);
    }

    // Host memory first: the masters alone of a large model can exhaust the machine.
    let host_boundaries = chosen.plan.boundaries.iter().filter(|p| **p == Placement::Host).count();
    // Uploads and host-tier boundaries are in the device dtype: bf16 on CUDA (which adds the
    // optimizer-written upload copies), f32 on the CPU and wgpu backends.
    let dtype_bytes = match args.device {
        DeviceChoice::Cuda => 2,
        DeviceChoice::Cpu | DeviceChoice::Wgpu => 4,
    };
    let accum = chosen.plan.shape.grad_accum_steps;
    let need = host_bytes_needed(&cfg, s.optimizer, host_boundaries, micro, s.seq_len, dtype_bytes, accum);
    match mem_available() {
        Some(avail) if need > avail => {
            return Err(Failure::new(
                FailKind::HostMemory,
                format!(
                    "host memory: this run needs about {} (fp32 masters, gradients, {} state{}, host-tier \
activations) but only {} is available (MemAvailable)",
                    ByteSize(need),
                    s.optimizer.name(),
                    if dtype_bytes < 4 { ", bf16 upload copies" } else { "" },
                    ByteSize(avail)
                ),
            ));
        }
        Some(_) => {}
        None => eprintln!("warning: /proc/meminfo unreadable; host memory not checked up front"),
    }

    match s.device {
        DeviceChoice::Cpu => bench_on::<lt_model::CpuAutodiff>(args, &s, &cfg, &chosen, need, Default::default()),
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda => {
            let device = lt_run::device::cuda().map_err(|e| Failure::new(FailKind::Error, e.to_string()))?;
            bench_on::<lt_model::CudaAutodiff>(args, &s, &cfg, &chosen, need, device)
        }
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => {
            let device = lt_run::device::wgpu().map_err(|e| Failure::new(FailKind::Error, e.to_string()))?;
            bench_on::<lt_model::WgpuAutodiff>(args, &s, &cfg, &chosen, need, device)
        }
        #[allow(unreachable_patterns)]
        d => Err(Failure::new(FailKind::Error, lt_run::device::not_built(d).to_string())),
    }
}

/// Samples whole-GPU memory use with `nvidia-smi` (the allocator's own counters are not reachable
/// through Burn 0.21's backend API), keeping the maximum.
struct GpuMemorySampler {
    child: std::process::Child,
    reader: std::thread::JoinHandle<Option<u64>>,
}

impl GpuMemorySampler {
    /// Start sampling every `ms` milliseconds; `None` when nvidia-smi cannot be started.
    fn start(ms: u32) -> Option<Self> {
        let mut child = std::process::Command::new("nvidia-smi")
            .args(["--query-gpu=memory.used", "--format=csv,noheader,nounits", &format!("--loop-ms={ms}"), "--id=0"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()?;
        let stdout = child.stdout.take()?;
        let reader = std::thread::spawn(move || {
            let mut peak: Option<u64> = None;
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(mib) = line.trim().parse::<u64>() {
                    peak = Some(peak.unwrap_or(0).max(mib << 20));
                }
            }
            peak
        });
        Some(Self { child, reader })
    }

    /// Stop and return the largest sample, bytes.
    fn stop(mut self) -> Option<u64> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reader.join().ok().flatten()
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 }
}

/// Removes a folder this run created (the spill file inside is already unlinked).
struct TempDir(Option<PathBuf>);

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// What the timed loop measured.
struct Measured {
    /// The timed steps (warm-up excluded).
    timed: Vec<StepMetrics>,
    /// Every step's loss, warm-up included.
    losses: Vec<f64>,
    /// Device memory the runtime reserved over the executor's streams after every step.
    reserved: Vec<Option<u64>>,
    /// Host RSS after every step.
    rss: Vec<Option<u64>>,
    /// nvidia-smi's largest sample (CUDA only).
    sampled_peak: Option<u64>,
    /// Seconds to initialise the random weights.
    init_seconds: f64,
    /// What the trainer keeps for the parameters (allocated, by kind, after the last step).
    host_bytes: lt_exec::train::HostBytes,
}

fn bench_on<B: AutodiffBackend>(
    args: &BenchTrainArgs,
    s: &RunSettings,
    cfg: &ModelConfig,
    chosen: &ChosenPlan,
    host_need: u64,
    device: <B::InnerBackend as burn::tensor::backend::BackendTypes>::Device,
) -> Result<Report, Failure> {
    let err = |e: anyhow::Error| Failure::from_error(&e);
    // Spilled boundaries go to --spill-dir, or to a folder of this run's own, removed afterwards.
    let mut _cleanup = TempDir(None);
    let spill_dir = match &args.spill_dir {
        Some(d) => d.clone(),
        None => {
            let d = std::env::temp_dir().join(format!("lt-bench-spill-{}", std::process::id()));
            _cleanup = TempDir(Some(d.clone()));
            d
        }
    };
    let (executor, note) = executor_for::<B>(chosen, cfg, s.seq_len, device, &spill_dir).map_err(err)?;
    if let Some(note) = note.filter(|_| !args.json) {
        eprintln!("{note}");
    }
    let t_init = Instant::now();
    let host = HostModel::random_init(cfg.clone(), s.seed);
    let init_seconds = t_init.elapsed().as_secs_f64();
    if crate::progress::as_lines() {
        eprintln!("random weights: {init_seconds:.1} s");
    }
    let opts = TrainOptions {
        adamw: s.adamw,
        optimizer: s.optimizer.kind(),
        warmup_steps: 0,
        schedule: LrSchedule::Constant,
        total_steps: s.steps,
        overlap_optimizer: chosen.overlap_optimizer(),
        threads: s.threads,
    };
    let mut trainer =
        Trainer::new(Arc::new(SharedModel::new(host, 0)), executor, opts, None, 0).map_err(|e| err(e.into()))?;
    let measured = Measured { init_seconds, ..timed_steps(args, s, cfg, chosen.micro_batch_size(), &mut trainer)? };
    if let Some(path) = &args.trace {
        let first = args.warmup + 1;
        let total = args.warmup + args.steps;
        lt_run::fsutil::write_atomic(path, trainer.trace().chrome_json(first..=total).as_bytes()).map_err(err)?;
    }
    figures(args, s, cfg, chosen, host_need, &measured)
}

/// Warm-up and timed steps on random token ids.
fn timed_steps<B: AutodiffBackend>(
    args: &BenchTrainArgs,
    s: &RunSettings,
    cfg: &ModelConfig,
    micro: usize,
    trainer: &mut Trainer<B>,
) -> Result<Measured, Failure> {
    let err = |e: ExecError| Failure::from_error(&e.into());
    let sampler = if s.device == DeviceChoice::Cuda { GpuMemorySampler::start(50) } else { None };
    let total = args.warmup + args.steps;
    let pb = crate::progress::bar(total, "bench train");
    let mut rng = lt_core::rng::SplitMix64::for_stream(s.seed, 0xBE7C);
    let vocab = cfg.vocab_size as u64;
    let mut m = Measured {
        timed: Vec::new(),
        losses: Vec::new(),
        reserved: Vec::new(),
        rss: Vec::new(),
        sampled_peak: None,
        init_seconds: 0.0,
        host_bytes: Default::default(),
    };
    for k in 0..total {
        let rows: Vec<Vec<u32>> =
            (0..s.batch_size).map(|_| (0..s.seq_len).map(|_| rng.below(vocab) as u32).collect()).collect();
        let mbs: Vec<Batch> = rows.chunks(micro).map(|c| Batch::from_ids(c.to_vec())).collect();
        let step = trainer.step(&mbs).map_err(err)?;
        m.losses.push(step.loss);
        // After every step (warm-up included): device memory the runtime reserved over the
        // executor's streams, and host RSS. A leak shows as growth after step 2.
        m.reserved.push(trainer.executor.device_reserved_bytes());
        m.rss.push(vm_rss());
        let phase = if k < args.warmup { "warm-up" } else { "timed" };
        pb.set_position(k + 1);
        pb.set_message(format!("{phase} {:.3} s/step", step.step_seconds));
        // A line per step where the bar is hidden (JSON mode too: the report is stdout's last line),
        // so that a run stopped by a timeout still says how far it got: the first step on a fresh
        // GPU compiles every kernel.
        if crate::progress::as_lines() {
            eprintln!("step {} ({phase}): loss {:.4}, {:.3} s", step.step, step.loss, step.step_seconds);
        }
        if k >= args.warmup {
            m.timed.push(step);
        }
    }
    trainer.flush().map_err(err)?;
    pb.finish_and_clear();
    m.sampled_peak = sampler.and_then(GpuMemorySampler::stop);
    // After the steps: a bf16 gradient buffer widens to fp32 at a step's second micro-batch.
    m.host_bytes = trainer.host_bytes();
    Ok(m)
}

/// What the cost model says about the executed step: its FLOPs and the predicted step time.
struct CostFigures {
    hardware: String,
    ecfg: ExecConfig,
    executed_flops: f64,
    predicted: Option<f64>,
    predicted_source: String,
}

fn cost_figures(s: &RunSettings, cfg: &ModelConfig, chosen: &ChosenPlan) -> Result<CostFigures, Failure> {
    let err = |e: anyhow::Error| Failure::from_error(&e);
    let hw = &chosen.hardware;
    // The step the executor runs; it frees each loss chunk's logits, whatever the policy.
    let ecfg = ExecConfig { retain_all_logits: false, ..chosen.plan.shape };
    let recomputed = lt_sched::plan::recomputed_layers(&chosen.plan.boundaries);
    let executed = Instance::from_model(
        cfg,
        hw,
        s.seq_len,
        &ecfg,
        CostOptions { attention: AttentionKernel::Materialized, ..Default::default() },
    )
    .map(|inst| inst.executed_flops_per_step(&recomputed))
    .map_err(|e| err(e.into()))?;
    let (predicted, predicted_source) = match chosen.predicted_step_seconds {
        Some(p) if s.policy == Policy::Megatrain => {
            (Some(p), "lt-sched's MegaTrain baseline (planner::baseline), simulator replay".to_string())
        }
        Some(p) => (Some(p), "planner (lt-sched simulator replay of the solved plan)".to_string()),
        None => {
            // A fixed policy: replay exactly the executed shape in the planner's simulator.
            let inst = Instance::from_model(
                cfg,
                hw,
                s.seq_len,
                &ecfg,
                CostOptions { optimizer: s.optimizer.state(), ..CostOptions::default() },
            )
            .map_err(|e| err(e.into()))?;
            let sim = lt_sched::simulate(&inst, &chosen.plan.boundaries, ecfg.optimizer_overlap, false);
            (Some(sim.step_seconds), format!("lt-sched simulator replay of the fixed plan on the {} profile", hw.name))
        }
    };
    Ok(CostFigures { hardware: hw.name.clone(), ecfg, executed_flops: executed, predicted, predicted_source })
}

/// The report's JSON object.
fn figures(
    args: &BenchTrainArgs,
    s: &RunSettings,
    cfg: &ModelConfig,
    chosen: &ChosenPlan,
    host_need: u64,
    m: &Measured,
) -> Result<Report, Failure> {
    let CostFigures { hardware, ecfg, executed_flops: executed, predicted, predicted_source } =
        cost_figures(s, cfg, chosen)?;
    let micro = chosen.micro_batch_size();
    let timed = &m.timed;
    let secs: Vec<f64> = timed.iter().map(|m| m.step_seconds).collect();
    let step_seconds = mean(&secs);
    let tokens = timed.first().map_or(s.batch_size * s.seq_len, |m| m.tokens);
    let params = cfg.total_params() as f64;
    let tflops_6pt = 6.0 * params * tokens as f64 / step_seconds / 1e12;
    let tflops_full = executed / step_seconds / 1e12;
    let budget_peak = timed.iter().map(|m| m.peak_device_bytes).max().unwrap_or(0);
    let (peak_device, peak_source) = match (s.device, m.sampled_peak) {
        (DeviceChoice::Cuda, Some(p)) => {
            (p, "nvidia-smi memory.used sampled every 50 ms (whole GPU: CUDA context and allocator pools)")
        }
        (DeviceChoice::Cuda, None) => (budget_peak, "predicted: lt-sched memory model (nvidia-smi unavailable)"),
        (DeviceChoice::Cpu | DeviceChoice::Wgpu, _) => (budget_peak, "predicted: lt-sched memory model"),
    };
    let exposed_mean = |f: fn(&lt_exec::trace::PerStream) -> f64| {
        mean(&timed.iter().map(|m| f(&m.timing.exposed)).collect::<Vec<_>>())
    };
    let exposed = serde_json::json!({
        "h2d": exposed_mean(|p| p.h2d),
        "d2h": exposed_mean(|p| p.d2h),
        "nvme": exposed_mean(|p| p.nvme),
        "optimizer": exposed_mean(|p| p.optimizer),
    });
    let (device_name, dtype) = (s.device.name(), s.device.dtype());
    let json = serde_json::json!({
        "model": model_name(args.model_config.as_ref().or(args.model.as_ref()).map_or(Path::new("model"), |p| p.as_path())),
        "params": cfg.total_params(),
        "layers": cfg.num_layers(),
        "policy": s.policy.name(),
        "plan": chosen.plan.tiers(),
        "batch_size": s.batch_size,
        "seq_len": s.seq_len,
        "micro_batch_size": micro,
        "grad_accum_steps": ecfg.grad_accum_steps,
        "loss_chunk_tokens": ecfg.loss_chunk_tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": device_name,
        "compute_dtype": dtype,
        // The host runs the optimizer (and, on the CPU backend, everything): its speeds hold for
        // this CPU only.
        "host_cpu": HostCpu::detect(),
        "hardware": hardware,
        "optimizer": s.optimizer.name(),
        "threads": s.threads,
        "overlap_optimizer": chosen.overlap_optimizer(),
        "step_seconds": step_seconds,
        "step_seconds_all": secs,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens as f64 / step_seconds,
        "tflops_6pt": tflops_6pt,
        "tflops_full": tflops_full,
        "flops_full_per_step": executed,
        "flops_full_attention": "materialized",
        "peak_device_bytes": peak_device,
        "peak_device_source": peak_source,
        "peak_device_budget_bytes": budget_peak,
        "device_budget_bytes": chosen.hardware.gpu_memory.0,
        "peak_host_bytes": vm_hwm(),
        "peak_host_source": "VmHWM",
        "peak_host_rss_bytes": vm_hwm(),
        "host_rss_bytes_per_step": m.rss,
        "device_reserved_bytes_per_step": m.reserved,
        "device_reserved_bytes_step2": m.reserved.get(1).copied().flatten(),
        "device_reserved_bytes_last": m.reserved.last().copied().flatten(),
        "device_reserved_source": "cubecl memory_usage().bytes_reserved summed over the executor's streams (null on the CPU backend)",
        "host_estimate_bytes": host_need,
        "host_estimate_source": "predicted: lt-sched host_param_bytes plus host-tier activations",
        "host_trainer_bytes": m.host_bytes,
        "exposed_seconds": exposed,
        "predicted_step_seconds": predicted,
        "predicted_source": predicted_source,
        "losses": m.losses,
        "init_seconds": m.init_seconds,
        "trace": args.trace,
    });
    Ok(Report { json })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn host_estimate_counts_masters_grads_state_copies_and_host_activations() {
        let json = r#"{"model_type":"qwen3","vocab_size":1000,"hidden_size":64,"intermediate_size":128,
          "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
          "rms_norm_eps":1e-6,"rope_theta":1e6,"tie_word_embeddings":true}"#;
        let cfg = ModelConfig::from_json_str(json).unwrap();
        let p = cfg.total_params() as u64;
        let layers: u64 = (0..cfg.num_layers()).map(|i| cfg.layer_numel(i) as u64).sum();
        let eight = host_bytes_needed(&cfg, OptimizerChoice::Adamw8bit, 0, 1, 8, 4, 1);
        let fp32 = host_bytes_needed(&cfg, OptimizerChoice::Adamw, 0, 1, 8, 4, 1);
        assert_eq!(fp32, 16 * p, "4 master + 4 grad + 8 state, no copy on an f32 device");
        assert_eq!(host_bytes_needed(&cfg, OptimizerChoice::Adamw, 0, 1, 8, 4, 3), 16 * p, "accumulation is free");
        assert!(eight < fp32 && eight > 8 * p, "{eight} vs {p} params");
        // A bf16 device adds the upload copy of every tensor (tied: the embedding is uploaded), and
        // without accumulation keeps the decoder layers' gradients in bf16.
        assert_eq!(host_bytes_needed(&cfg, OptimizerChoice::Adamw, 0, 1, 8, 2, 3), 18 * p);
        assert_eq!(host_bytes_needed(&cfg, OptimizerChoice::Adamw, 0, 1, 8, 2, 1), 18 * p - 2 * layers);
        assert_eq!(host_bytes_needed(&cfg, OptimizerChoice::Adamw, 2, 1, 8, 4, 1), 16 * p + 2 * 8 * 64 * 4);
        assert_eq!(
            host_bytes_needed(&cfg, OptimizerChoice::Adamw, 2, 1, 8, 2, 1),
            18 * p - 2 * layers + 2 * 8 * 64 * 2
        );
    }

    #[test]
    fn model_names_come_from_the_file_stem_or_folder() {
        assert_eq!(model_name(Path::new("configs/models/qwen2.5-7b.json")), "qwen2.5-7b");
        assert_eq!(model_name(Path::new("x/Qwen3-8B/config.json")), "Qwen3-8B");
    }

    #[test]
    fn the_human_summary_names_the_host_cpu() {
        let cpu = HostCpu::from_cpuinfo(
            "vendor_id : AuthenticAMD\ncpu family : 25\nmodel : 1\nmodel name : AMD EPYC\n",
            2,
            vec!["avx2".into()],
        );
        let report = Report { json: serde_json::json!({ "host_cpu": cpu, "step_seconds": 1.0 }) };
        let text = human_summary(&report);
        let line = "  host: AMD EPYC (AuthenticAMD family 25 model 1), 2 logical CPUs, SIMD avx2";
        assert!(text.lines().any(|l| l == line), "{text}");
        // A report without one (an older JSON) just has no host line.
        assert!(!human_summary(&Report { json: serde_json::json!({}) }).contains("host:"));
    }
}
