//! `lt bench train`: streamed training throughput on a randomly initialised model (nothing to
//! download), with exactly the machinery `lt train` runs: [`super::train::choose_plan`], the
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
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Result;
use burn::tensor::backend::AutodiffBackend;
use lt_core::{ByteSize, ModelConfig};
use lt_exec::ExecError;
use lt_exec::executor::Executor;
use lt_exec::plan::{ExecPlan, Placement};
use lt_exec::state::SharedModel;
use lt_exec::train::{LrSchedule, StepMetrics, TrainOptions, Trainer};
use lt_model::host::HostModel;
use lt_model::model::Batch;
use lt_optim::{OptimizerKind, Quant8Config};
use lt_sched::SchedError;
use lt_sched::cost::{AttentionKernel, CostOptions, ExecConfig, Instance};

use super::train::{OptimizerChoice, Policy, RunFile, Settings, choose_plan};
use crate::device::DeviceChoice;

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
    /// Planner hardware profile: h800, rtx3090, h200, cpu, or a .toml file (e.g. from `lt profile`)
    /// [default: cpu for --device cpu, h200 for --device cuda].
    #[arg(long, value_name = "NAME|FILE")]
    pub hardware: Option<String>,
    /// Device memory budget, e.g. 80GB, 24GiB [default: the hardware profile's].
    #[arg(long, value_name = "SIZE")]
    pub gpu_memory: Option<ByteSize>,
    /// Host memory the planner may use [default: the hardware profile's].
    #[arg(long, value_name = "SIZE")]
    pub host_memory: Option<ByteSize>,
    /// Optimizer state precision.
    #[arg(long, value_enum, default_value = "adamw8bit")]
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

/// Why a benchmark did not produce a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailKind {
    /// The device budget (or the real device) is too small.
    DeviceMemory,
    /// Host memory cannot hold the masters, gradients and optimizer state.
    HostMemory,
    /// The planner found no plan for another reason.
    Infeasible,
    /// Anything else (bad flags, unreadable files, a bug).
    Error,
}

impl FailKind {
    fn name(self) -> &'static str {
        match self {
            FailKind::DeviceMemory => "device_memory",
            FailKind::HostMemory => "host_memory",
            FailKind::Infeasible => "infeasible",
            FailKind::Error => "error",
        }
    }

    fn exit_code(self) -> i32 {
        if self == FailKind::Error { 1 } else { 2 }
    }
}

/// A classified failure.
#[derive(Debug)]
pub(crate) struct Failure {
    /// What kind of failure.
    pub(crate) kind: FailKind,
    /// One line saying what went wrong.
    pub(crate) message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Failure {
    fn new(kind: FailKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    /// Classify an error by the typed causes in its chain.
    pub(crate) fn from_error(e: &anyhow::Error) -> Self {
        let mut kind = FailKind::Error;
        for cause in e.chain() {
            if let Some(x) = cause.downcast_ref::<ExecError>()
                && matches!(x, ExecError::OutOfDeviceMemory { .. })
            {
                kind = FailKind::DeviceMemory;
                break;
            }
            if let Some(SchedError::Infeasible { gpu_memory, min_gpu_memory, min_host_memory, .. }) =
                cause.downcast_ref::<SchedError>()
            {
                kind = if min_host_memory.is_some() {
                    FailKind::HostMemory
                } else if min_gpu_memory.is_some_and(|m| m > *gpu_memory) {
                    FailKind::DeviceMemory
                } else {
                    FailKind::Infeasible
                };
                break;
            }
        }
        Self { kind, message: crate::error_line(e) }
    }
}

/// Whether a panic message is a device allocator running out of memory.
fn is_oom(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    ["out of memory", "out-of-memory", "outofmemory", "out_of_memory"].iter().any(|k| m.contains(k))
}

/// The first panic message seen while [`catch_panics`] runs (from any thread).
static PANIC_MESSAGE: Mutex<Option<String>> = Mutex::new(None);

/// Run `f`, turning a panic (on this thread, or one recorded from a worker thread that `f` then
/// reported as an error) into a classified [`Failure`]. Backends report device out-of-memory by
/// panicking; this is where that becomes `kind: device_memory` instead of a crash.
pub(crate) fn catch_panics<T>(f: impl FnOnce() -> Result<T, Failure>) -> Result<T, Failure> {
    if let Ok(mut m) = PANIC_MESSAGE.lock() {
        *m = None;
    }
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|info| {
        let text = info.payload_as_str().unwrap_or("(non-text panic payload)");
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        if let Ok(mut m) = PANIC_MESSAGE.lock()
            && m.is_none()
        {
            // One line, and short: cubecl's messages carry whole backtraces.
            let mut line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
            if line.len() > 400 {
                let cut = (0..=400).rev().find(|&i| line.is_char_boundary(i)).unwrap_or(0);
                line.truncate(cut);
                line.push_str(" ...");
            }
            *m = Some(format!("{line}{at}"));
        }
    }));
    let out = std::panic::catch_unwind(AssertUnwindSafe(f));
    std::panic::set_hook(previous);
    let recorded = PANIC_MESSAGE.lock().ok().and_then(|mut m| m.take());
    let oom = |p: &str| Failure::new(FailKind::DeviceMemory, format!("device out of memory: {p}"));
    match out {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => match recorded {
            None => Err(e),
            Some(p) if is_oom(&p) => Err(oom(&p)),
            Some(p) => Err(Failure::new(e.kind, format!("{} (a worker panicked: {p})", e.message))),
        },
        Err(_) => match recorded {
            Some(p) if is_oom(&p) => Err(oom(&p)),
            Some(p) => Err(Failure::new(FailKind::Error, format!("internal error (panic): {p}"))),
            None => Err(Failure::new(FailKind::Error, "internal error (a panic without a message)")),
        },
    }
}

/// Print a failure as the last stdout line and exit with its code.
fn fail(f: &Failure) -> ! {
    eprintln!("error: {}", f.message);
    println!("{}", serde_json::json!({"error": f.message, "kind": f.kind.name()}));
    std::process::exit(f.kind.exit_code());
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

fn settings(args: &BenchTrainArgs) -> Result<Settings> {
    if args.steps == 0 {
        anyhow::bail!("--steps: must be > 0");
    }
    let hardware = args.hardware.clone().unwrap_or_else(|| {
        match args.device {
            // wgpu has no built-in profile: `lt profile --device wgpu` measures one.
            DeviceChoice::Cpu | DeviceChoice::Wgpu => "cpu",
            DeviceChoice::Cuda => "h200",
        }
        .into()
    });
    // Every field `choose_plan` and the trainer read is set here, so `resolve`'s demo defaults
    // (used because neither --model nor --data is given) never apply.
    let file = RunFile {
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
        gpu_memory: args.gpu_memory,
        host_memory: args.host_memory,
        hardware: Some(hardware),
        device: Some(args.device),
        threads: args.threads,
        serial_optimizer: args.serial_optimizer,
        spill_dir: args.spill_dir.clone(),
        ..RunFile::default()
    };
    Settings::resolve(&file)
}

/// Bytes of optimizer state `kind` allocates for a tensor of `n` elements (see lt-optim's
/// `TensorState::state_bytes`).
fn state_bytes(kind: OptimizerChoice, n: usize) -> u64 {
    let q = Quant8Config::default();
    let n = n as u64;
    match kind {
        OptimizerChoice::Adamw8bit if n >= q.min_8bit_numel as u64 => 2 * n + 8 * n.div_ceil(q.block_size as u64),
        _ => 8 * n,
    }
}

/// Host bytes the trainer allocates for `cfg`: fp32 masters (4 B/param), fp32 gradients (4),
/// optimizer state (about 2.03 B/param for adamw8bit — 8-bit codes for `m` and `v` plus one f32
/// absmax each per 256-element block, fp32 state below 4096 elements — and 8 for adamw), plus the
/// activations the plan keeps in host memory for one micro-batch (`act_elem_bytes` each). Transient
/// per-layer buffers of the streams (a few layers' worth) are not counted.
pub(crate) fn host_bytes_needed(
    cfg: &ModelConfig,
    optimizer: OptimizerChoice,
    host_boundaries: usize,
    micro: usize,
    seq: usize,
    act_elem_bytes: usize,
) -> u64 {
    let params = cfg.total_params() as u64;
    let mut state = 0u64;
    for p in cfg.outer_params() {
        state += state_bytes(optimizer, p.numel());
    }
    for i in 0..cfg.num_layers() {
        for p in cfg.layer_params(i) {
            state += state_bytes(optimizer, p.numel());
        }
    }
    let acts = (host_boundaries * micro * seq * cfg.hidden_size * act_elem_bytes) as u64;
    8 * params + state + acts
}

/// A `/proc` field in kB, as bytes.
fn proc_kb(file: &str, field: &str) -> Option<u64> {
    let f = std::fs::File::open(file).ok()?;
    for line in std::io::BufReader::new(f).lines() {
        let line = line.ok()?;
        if let Some(rest) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
            let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            return Some(kb * 1024);
        }
    }
    None
}

/// `MemAvailable` from /proc/meminfo (None where there is no /proc).
pub(crate) fn mem_available() -> Option<u64> {
    proc_kb("/proc/meminfo", "MemAvailable")
}

/// This process's peak resident set (`VmHWM` from /proc/self/status).
pub(crate) fn vm_hwm() -> Option<u64> {
    proc_kb("/proc/self/status", "VmHWM")
}

/// This process's resident set size now (VmRSS), bytes.
fn vm_rss() -> Option<u64> {
    proc_kb("/proc/self/status", "VmRSS")
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
        "  peak device {} ({}), peak host {} (VmHWM), losses {}\n",
        ByteSize(f("peak_device_bytes").max(0.0) as u64),
        s("peak_device_source"),
        ByteSize(f("peak_host_bytes").max(0.0) as u64),
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
    let micro = chosen.micro_batch_size.clamp(1, s.batch_size);
    if !args.json {
        eprintln!("{}", chosen.summary);
    }

    // Host memory first: the masters alone of a large model can exhaust the machine.
    let host_boundaries = chosen.plan.boundaries.iter().filter(|p| **p == Placement::Host).count();
    // Host-tier boundaries are kept in the device dtype: bf16 on CUDA, f32 on the CPU and wgpu backends.
    let act_elem_bytes = match args.device {
        DeviceChoice::Cuda => 2,
        DeviceChoice::Cpu | DeviceChoice::Wgpu => 4,
    };
    let need = host_bytes_needed(&cfg, s.optimizer, host_boundaries, micro, s.seq_len, act_elem_bytes);
    match mem_available() {
        Some(avail) if need > avail => {
            return Err(Failure::new(
                FailKind::HostMemory,
                format!(
                    "host memory: this run needs about {} (fp32 masters, fp32 gradients, {} state, host-tier \
activations) but only {} is available (MemAvailable)",
                    ByteSize(need),
                    optimizer_name(s.optimizer),
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
        DeviceChoice::Cuda => bench_on::<lt_model::CudaAutodiff>(args, &s, &cfg, &chosen, need, Default::default()),
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => {
            let device = crate::device::wgpu().map_err(|e| Failure::new(FailKind::Error, e.to_string()))?;
            bench_on::<lt_model::WgpuAutodiff>(args, &s, &cfg, &chosen, need, device)
        }
        #[allow(unreachable_patterns)]
        d => Err(Failure::new(FailKind::Error, crate::device::not_built(d).to_string())),
    }
}

fn optimizer_name(o: OptimizerChoice) -> &'static str {
    match o {
        OptimizerChoice::Adamw => "adamw",
        OptimizerChoice::Adamw8bit => "adamw8bit",
    }
}

fn policy_name(p: Policy) -> &'static str {
    match p {
        Policy::Auto => "auto",
        Policy::Megatrain => "megatrain",
        Policy::KeepAll => "keep-all",
        Policy::RecomputeAll => "recompute-all",
    }
}

fn to_sched(p: Placement) -> lt_sched::Placement {
    match p {
        Placement::Device => lt_sched::Placement::Gpu,
        Placement::Host => lt_sched::Placement::Host,
        Placement::Nvme => lt_sched::Placement::Nvme,
        Placement::Recompute => lt_sched::Placement::Recompute,
    }
}

/// The step shape the executor runs, as lt-sched's cost model sees it.
fn exec_config(plan: &ExecPlan, micro: usize, batch: usize, seq: usize, overlap: bool) -> ExecConfig {
    ExecConfig {
        micro_batch_size: micro,
        grad_accum_steps: batch.div_ceil(micro),
        loss_chunk_tokens: plan.loss_chunk_tokens.min(micro * seq).max(1),
        optimizer_overlap: if overlap {
            lt_sched::OptimizerOverlap::OverlapNextForward
        } else {
            lt_sched::OptimizerOverlap::Serial
        },
        retain_all_logits: false,
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

fn bench_on<B: AutodiffBackend>(
    args: &BenchTrainArgs,
    s: &Settings,
    cfg: &ModelConfig,
    chosen: &super::train::Chosen,
    host_need: u64,
    device: <B::InnerBackend as burn::tensor::backend::BackendTypes>::Device,
) -> Result<Report, Failure> {
    let err = |e: anyhow::Error| Failure::from_error(&e);
    let micro = chosen.micro_batch_size.clamp(1, s.batch_size);
    // Room for every spilled boundary of one micro-batch (as lt train).
    let capacity = lt_exec::executor::spill_capacity::<B::InnerBackend>(&chosen.plan, cfg, micro, s.seq_len);
    let mut _cleanup = TempDir(None);
    let spill = if capacity > 0 {
        let dir = match &args.spill_dir {
            Some(d) => d.clone(),
            None => {
                let d = std::env::temp_dir().join(format!("lt-bench-spill-{}", std::process::id()));
                _cleanup = TempDir(Some(d.clone()));
                d
            }
        };
        Some(crate::spill::open(&dir, capacity).map_err(err)?)
    } else {
        None
    };
    let executor = Executor::<B>::new(chosen.plan.clone(), chosen.budget, device, spill);
    let need = executor.required_device_bytes(cfg, micro, s.seq_len);
    if need > chosen.budget.0 {
        return Err(Failure::new(
            FailKind::DeviceMemory,
            format!(
                "device memory budget {} is too small for micro-batch {micro} x {} tokens with this plan: it needs at \
least {} (try --gpu-memory {} or a smaller --micro-batch-size)",
                chosen.budget,
                s.seq_len,
                ByteSize(need),
                lt_exec::budget::round_up(need)
            ),
        ));
    }

    let t_init = Instant::now();
    let host = HostModel::random_init(cfg.clone(), s.seed);
    let init_seconds = t_init.elapsed().as_secs_f64();
    let opts = TrainOptions {
        adamw: s.adamw,
        optimizer: match s.optimizer {
            OptimizerChoice::Adamw => OptimizerKind::AdamW,
            OptimizerChoice::Adamw8bit => OptimizerKind::adamw8bit(),
        },
        warmup_steps: 0,
        schedule: LrSchedule::Constant,
        total_steps: s.steps,
        overlap_optimizer: s.overlap_optimizer,
        threads: s.threads,
    };
    let mut trainer =
        Trainer::new(Arc::new(SharedModel::new(host, 0)), executor, opts, None, 0).map_err(|e| err(e.into()))?;

    let sampler = if s.device == DeviceChoice::Cuda { GpuMemorySampler::start(50) } else { None };
    let total = args.warmup + args.steps;
    let pb = crate::progress::bar(total, "bench train");
    let mut rng = lt_core::rng::SplitMix64::for_stream(s.seed, 0xBE7C);
    let vocab = cfg.vocab_size as u64;
    let mut timed: Vec<StepMetrics> = Vec::new();
    let mut losses = Vec::new();
    // After every step (warm-up included): device memory the runtime reserved over the executor's
    // streams, and host RSS. A leak shows as growth after step 2.
    let mut reserved: Vec<Option<u64>> = Vec::new();
    let mut rss: Vec<Option<u64>> = Vec::new();
    for k in 0..total {
        let rows: Vec<Vec<u32>> =
            (0..s.batch_size).map(|_| (0..s.seq_len).map(|_| rng.below(vocab) as u32).collect()).collect();
        let mbs: Vec<Batch> = rows.chunks(micro).map(|c| Batch::from_ids(c.to_vec())).collect();
        let m = trainer.step(&mbs).map_err(|e| err(e.into()))?;
        losses.push(m.loss);
        reserved.push(trainer.executor.device_reserved_bytes());
        rss.push(vm_rss());
        pb.set_position(k + 1);
        pb.set_message(format!("{} {:.3} s/step", if k < args.warmup { "warm-up" } else { "timed" }, m.step_seconds));
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) && !args.json {
            eprintln!(
                "step {} ({}): loss {:.4}, {:.3} s",
                m.step,
                if k < args.warmup { "warm-up" } else { "timed" },
                m.loss,
                m.step_seconds
            );
        }
        if k >= args.warmup {
            timed.push(m);
        }
    }
    trainer.flush().map_err(|e| err(e.into()))?;
    pb.finish_and_clear();
    let sampled_peak = sampler.and_then(GpuMemorySampler::stop);

    if let Some(path) = &args.trace {
        let first = args.warmup + 1;
        crate::fsutil::write_atomic(path, trainer.trace().chrome_json(first..=total).as_bytes()).map_err(err)?;
    }

    // --- figures ---
    let secs: Vec<f64> = timed.iter().map(|m| m.step_seconds).collect();
    let step_seconds = mean(&secs);
    let tokens = timed.first().map_or(s.batch_size * s.seq_len, |m| m.tokens);
    let params = cfg.total_params() as f64;
    let tflops_6pt = 6.0 * params * tokens as f64 / step_seconds / 1e12;
    let hw = {
        let spec: lt_sched::hardware::HardwareSpec = s.hardware.parse().map_err(|e: SchedError| err(e.into()))?;
        let mut hw = lt_sched::hardware::load_profile(&spec).map_err(|e| err(e.into()))?;
        if let Some(g) = s.gpu_memory {
            hw.gpu_memory = g;
        }
        if let Some(h) = s.host_memory {
            hw.host_memory = h;
        }
        hw
    };
    let ecfg = exec_config(&chosen.plan, micro, s.batch_size, s.seq_len, s.overlap_optimizer);
    let sched_boundaries: Vec<lt_sched::Placement> = chosen.plan.boundaries.iter().map(|p| to_sched(*p)).collect();
    let recomputed = lt_sched::plan::recomputed_layers(&sched_boundaries);
    let executed = Instance::from_model(
        cfg,
        &hw,
        s.seq_len,
        &ecfg,
        CostOptions { attention: AttentionKernel::Materialized, ..Default::default() },
    )
    .map(|inst| inst.executed_flops_per_step(&recomputed))
    .map_err(|e| err(e.into()))?;
    let tflops_full = executed / step_seconds / 1e12;
    let (predicted, predicted_source) = match chosen.predicted_step_seconds {
        Some(p) => (Some(p), "planner (lt-sched simulator replay of the solved plan)".to_string()),
        None => {
            // A fixed policy: replay exactly the executed shape in the planner's simulator.
            let inst = Instance::from_model(
                cfg,
                &hw,
                s.seq_len,
                &ecfg,
                CostOptions { optimizer: s.optimizer.state(), ..CostOptions::default() },
            )
            .map_err(|e| err(e.into()))?;
            let sim = lt_sched::simulate(&inst, &sched_boundaries, ecfg.optimizer_overlap, false);
            (Some(sim.step_seconds), format!("lt-sched simulator replay of the fixed plan on the {} profile", hw.name))
        }
    };
    let budget_peak = timed.iter().map(|m| m.peak_device_bytes).max().unwrap_or(0);
    let (peak_device, peak_source) = match (s.device, sampled_peak) {
        (DeviceChoice::Cuda, Some(p)) => {
            (p, "nvidia-smi memory.used sampled every 50 ms (whole GPU: CUDA context and allocator pools)")
        }
        (DeviceChoice::Cuda, None) => (budget_peak, "budget-accounting (nvidia-smi unavailable)"),
        (DeviceChoice::Cpu | DeviceChoice::Wgpu, _) => (budget_peak, "budget-accounting"),
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
    let plan_str: String = chosen
        .plan
        .boundaries
        .iter()
        .map(|p| match p {
            Placement::Device => 'G',
            Placement::Host => 'H',
            Placement::Nvme => 'N',
            Placement::Recompute => '.',
        })
        .collect();
    let json = serde_json::json!({
        "model": model_name(args.model_config.as_ref().or(args.model.as_ref()).map_or(Path::new("model"), |p| p.as_path())),
        "params": cfg.total_params(),
        "layers": cfg.num_layers(),
        "policy": policy_name(s.policy),
        "plan": plan_str,
        "batch_size": s.batch_size,
        "seq_len": s.seq_len,
        "micro_batch_size": micro,
        "grad_accum_steps": ecfg.grad_accum_steps,
        "loss_chunk_tokens": ecfg.loss_chunk_tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": device_name,
        "compute_dtype": dtype,
        "hardware": hw.name,
        "optimizer": optimizer_name(s.optimizer),
        "threads": s.threads,
        "overlap_optimizer": s.overlap_optimizer,
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
        "device_budget_bytes": chosen.budget.0,
        "peak_host_bytes": vm_hwm(),
        "peak_host_source": "VmHWM",
        "peak_host_rss_bytes": vm_hwm(),
        "host_rss_bytes_per_step": rss,
        "device_reserved_bytes_per_step": reserved,
        "device_reserved_bytes_step2": reserved.get(1).copied().flatten(),
        "device_reserved_bytes_last": reserved.last().copied().flatten(),
        "device_reserved_source": "cubecl memory_usage().bytes_reserved summed over the executor's streams (null on the CPU backend)",
        "host_estimate_bytes": host_need,
        "exposed_seconds": exposed,
        "predicted_step_seconds": predicted,
        "predicted_source": predicted_source,
        "losses": losses,
        "init_seconds": init_seconds,
        "trace": args.trace,
    });
    Ok(Report { json })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn host_estimate_counts_masters_grads_and_8bit_state() {
        let json = r#"{"model_type":"qwen3","vocab_size":1000,"hidden_size":64,"intermediate_size":128,
          "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
          "rms_norm_eps":1e-6,"rope_theta":1e6,"tie_word_embeddings":true}"#;
        let cfg = ModelConfig::from_json_str(json).unwrap();
        let p = cfg.total_params() as u64;
        let eight = host_bytes_needed(&cfg, OptimizerChoice::Adamw8bit, 0, 1, 8, 4);
        let fp32 = host_bytes_needed(&cfg, OptimizerChoice::Adamw, 0, 1, 8, 4);
        assert_eq!(fp32, 16 * p, "4 master + 4 grad + 8 state");
        assert!(eight < fp32 && eight > 8 * p, "{eight} vs {p} params");
        assert_eq!(host_bytes_needed(&cfg, OptimizerChoice::Adamw, 2, 1, 8, 4), 16 * p + 2 * 8 * 64 * 4);
        assert_eq!(host_bytes_needed(&cfg, OptimizerChoice::Adamw, 2, 1, 8, 2), 16 * p + 2 * 8 * 64 * 2);
    }

    #[test]
    fn oom_panics_are_device_memory_failures() {
        let r: Result<(), Failure> = catch_panics(|| panic!("CUDA_ERROR_OUT_OF_MEMORY while allocating"));
        assert_eq!(r.unwrap_err().kind, FailKind::DeviceMemory);
        // cubecl's launch error, with its multi-line backtrace folded into one line.
        let r: Result<(), Failure> = catch_panics(|| {
            panic!("An out-of-memory error happened during launch\nCaused by:\n  x\nBacktrace\n{}", "y\n".repeat(500))
        });
        let f = r.unwrap_err();
        assert_eq!(f.kind, FailKind::DeviceMemory);
        assert!(!f.message.contains('\n') && f.message.len() < 600, "{}", f.message);
        let r: Result<(), Failure> = catch_panics(|| panic!("index out of bounds"));
        assert_eq!(r.unwrap_err().kind, FailKind::Error);
        assert_eq!(catch_panics(|| Ok::<_, Failure>(3)).unwrap(), 3);
    }

    #[test]
    fn model_names_come_from_the_file_stem_or_folder() {
        assert_eq!(model_name(Path::new("configs/models/qwen2.5-7b.json")), "qwen2.5-7b");
        assert_eq!(model_name(Path::new("x/Qwen3-8B/config.json")), "Qwen3-8B");
    }
}
