//! `lt train`: streamed fine-tuning, or the embedded demo when run without `--model`/`--data`.
//!
//! Settings are parsed in two steps (ripgrep's LowArgs -> HiArgs): flags and an optional TOML run
//! file fill [`RunFile`]-shaped options, a flag overriding the file; [`Settings::resolve`] validates
//! them and fills defaults; only then is anything loaded.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::AutodiffBackend;
use clap::ValueEnum;
use lt_core::{ByteSize, ModelConfig};
use lt_data::{BatchMode, Batcher, BatcherConfig, BatcherState, ChatEncoder, PrepareOptions, TrainBatch};
use lt_exec::executor::Executor;
use lt_exec::persist;
use lt_exec::plan::{ExecPlan, Placement};
use lt_exec::state::SharedModel;
use lt_exec::train::{LrSchedule, StepMetrics, TrainOptions, Trainer};
use lt_model::host::HostModel;
use lt_model::model::{Batch, PackInfo};
use lt_model::weights::DeviceModel;
use lt_optim::{AdamWConfig, OptimizerKind};
use lt_storage::checkpoint::{CheckpointStore, Retention, Verify};
use lt_storage::export::ExportDtype;

use crate::device::DeviceChoice;
use serde::{Deserialize, Serialize};

use crate::evaluate::{encoder_for, evaluate};

/// Activation policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// The planner (MILP) chooses per boundary: keep on GPU, host or NVMe, or recompute.
    Auto,
    /// A checkpoint every 4 layers kept on the GPU (the MegaTrain baseline).
    Megatrain,
    /// Keep every boundary on the GPU.
    KeepAll,
    /// Keep only the first and last boundary; recompute everything else.
    RecomputeAll,
}

/// Optimizer state precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerChoice {
    /// fp32 moments (PyTorch AdamW semantics).
    Adamw,
    /// Block-wise 8-bit moments (about 2 bytes/param of state).
    Adamw8bit,
}

impl OptimizerChoice {
    /// What the planner's host-memory model assumes for this choice.
    pub fn state(self) -> lt_sched::cost::OptimizerState {
        match self {
            OptimizerChoice::Adamw => lt_sched::cost::OptimizerState::Fp32,
            OptimizerChoice::Adamw8bit => lt_sched::cost::OptimizerState::Blockwise8bit,
        }
    }
}

/// Everything a run can be configured with; the TOML run file has the same keys.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize, clap::Args)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RunFile {
    /// Model folder (HF config.json + safetensors + tokenizer). Omit with --data for the demo.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Training data: MetaMathQA / Alpaca / ShareGPT / messages (JSON or JSONL), or pre-tokenized
    /// JSONL ({"input_ids": [...], "labels": [...]}).
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Optimizer steps [default: 100; demo 200].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Sequences (rows) per step [default: 8; demo 12].
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Rows per micro-batch (gradient accumulation when smaller than --batch-size) [default: the plan's].
    #[arg(long)]
    pub micro_batch_size: Option<usize>,
    /// Row length in tokens; longer examples are cut and counted [default: 1024; demo 256].
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Peak learning rate [default: 1e-5; demo 3e-3].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Decoupled weight decay [default: 0.01].
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Global-norm gradient clipping; 0 disables [default: 1.0].
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
    /// Linear warmup steps [default: 0; demo 20].
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// Use a cosine decay after warmup instead of a constant learning rate (the demo always does).
    #[arg(long)]
    #[serde(default)]
    pub cosine: bool,
    /// Optimizer state precision [default: adamw8bit].
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerChoice>,
    /// Keep file order instead of shuffling every epoch.
    #[arg(long)]
    #[serde(default)]
    pub no_shuffle: bool,
    /// Seed for shuffling and the split [default: 42].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Activation policy [default: auto].
    #[arg(long, value_enum)]
    pub policy: Option<Policy>,
    /// Execute this plan file (from `lt plan --out`) instead of planning.
    #[arg(long, value_name = "FILE")]
    pub plan: Option<PathBuf>,
    /// Device memory budget, e.g. 80GB, 24GiB [default: the hardware profile's].
    #[arg(long, value_name = "SIZE")]
    pub gpu_memory: Option<ByteSize>,
    /// Host memory budget for the planner [default: the hardware profile's].
    #[arg(long, value_name = "SIZE")]
    pub host_memory: Option<ByteSize>,
    /// Hardware profile for the planner: h800, rtx3090, h200, cpu, or a .toml file [default: cpu].
    #[arg(long, value_name = "NAME|FILE")]
    pub hardware: Option<String>,
    /// Metrics file (one JSON object per step) [default: OUT/metrics.jsonl].
    #[arg(long, value_name = "FILE.jsonl")]
    pub metrics: Option<PathBuf>,
    /// Output folder: checkpoints, metrics, trace and the exported model [default: ./lt-runs/<timestamp>].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Save a checkpoint every N steps (0: only at the end) [default: 0].
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Checkpoints to keep [default: 2].
    #[arg(long)]
    pub keep_checkpoints: Option<usize>,
    /// Continue from the newest valid checkpoint in --out.
    #[arg(long)]
    #[serde(default)]
    pub resume: bool,
    /// Compute device [default: cpu].
    #[arg(long, value_enum)]
    pub device: Option<DeviceChoice>,
    /// Evaluate exact match on the held-out split every N steps (0: only at the end).
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Fraction of question groups held out for evaluation [default: 0; demo 0.1].
    #[arg(long)]
    pub eval_fraction: Option<f64>,
    /// Held-out loss every N steps and at the end, on up to 128 held-out examples; 0 turns it off. It runs
    /// on the CPU backend, so keep it off for large models [default: off; demo steps/20].
    #[arg(long)]
    pub eval_loss_every: Option<u64>,
    /// Evaluate at most N held-out questions [default: 200].
    #[arg(long)]
    pub eval_limit: Option<usize>,
    /// Longest generated answer during evaluation [default: 256; demo 48].
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// Pad each example to its own row instead of packing several per row.
    #[arg(long)]
    #[serde(default)]
    pub no_packing: bool,
    /// Train on prompt tokens too (default: loss on responses only).
    #[arg(long)]
    #[serde(default)]
    pub train_on_prompt: bool,
    /// Count and skip malformed records instead of stopping.
    #[arg(long)]
    #[serde(default)]
    pub skip_bad_records: bool,
    /// Host optimizer threads [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Run the optimizer serially after backward instead of overlapping it with the next forward.
    #[arg(long)]
    #[serde(default)]
    pub serial_optimizer: bool,
    /// Folder for NVMe-placed activations (put it on the fastest local disk) [default: OUT/spill].
    #[arg(long, value_name = "DIR")]
    pub spill_dir: Option<PathBuf>,
    /// Dataset format [default: detected from the first record].
    #[arg(long, value_enum)]
    pub format: Option<lt_data::DatasetFormat>,
}

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
    pub opts: RunFile,
}

macro_rules! merge {
    ($flags:expr, $file:expr, [$($opt:ident),*], [$($flag:ident),*]) => {{
        let (a, b) = ($flags, $file);
        RunFile {
            $( $opt: a.$opt.clone().or(b.$opt.clone()), )*
            $( $flag: a.$flag || b.$flag, )*
        }
    }};
}

/// Flags over file.
fn merge(flags: &RunFile, file: &RunFile) -> RunFile {
    merge!(
        flags,
        file,
        [
            model,
            data,
            steps,
            batch_size,
            micro_batch_size,
            seq_len,
            lr,
            weight_decay,
            max_grad_norm,
            warmup_steps,
            optimizer,
            seed,
            policy,
            plan,
            gpu_memory,
            host_memory,
            hardware,
            metrics,
            out,
            save_every,
            keep_checkpoints,
            device,
            eval_every,
            eval_loss_every,
            eval_fraction,
            eval_limit,
            max_new_tokens,
            threads,
            spill_dir,
            format
        ],
        [cosine, no_shuffle, resume, no_packing, train_on_prompt, skip_bad_records, serial_optimizer]
    )
}

/// Validated settings.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    /// `None` for the demo.
    pub model: Option<PathBuf>,
    /// `None` for the demo.
    pub data: Option<PathBuf>,
    /// Steps.
    pub steps: u64,
    /// Rows per step.
    pub batch_size: usize,
    /// Rows per micro-batch (None: from the plan).
    pub micro_batch_size: Option<usize>,
    /// Row length.
    pub seq_len: usize,
    /// Optimizer.
    #[serde(skip)]
    pub adamw: AdamWConfig,
    /// Optimizer kind.
    pub optimizer: OptimizerChoice,
    /// Warmup.
    pub warmup_steps: u64,
    /// Schedule.
    pub schedule: LrSchedule,
    /// Shuffle.
    pub shuffle: bool,
    /// Seed.
    pub seed: u64,
    /// Policy.
    pub policy: Policy,
    /// Plan file.
    pub plan: Option<PathBuf>,
    /// Device budget override.
    pub gpu_memory: Option<ByteSize>,
    /// Host budget override.
    pub host_memory: Option<ByteSize>,
    /// Hardware profile.
    pub hardware: String,
    /// Output folder.
    pub out: PathBuf,
    /// Metrics file.
    pub metrics: PathBuf,
    /// Checkpoint interval.
    pub save_every: u64,
    /// Checkpoints kept.
    pub keep_checkpoints: usize,
    /// Resume.
    pub resume: bool,
    /// Device.
    pub device: DeviceChoice,
    /// Eval interval.
    pub eval_every: u64,
    /// Eval-loss interval.
    pub eval_loss_every: u64,
    /// Held-out fraction.
    pub eval_fraction: f64,
    /// Eval questions.
    pub eval_limit: usize,
    /// Eval generation length.
    pub max_new_tokens: usize,
    /// Packing.
    pub packing: bool,
    /// Loss on prompts.
    pub train_on_prompt: bool,
    /// Skip bad records.
    pub skip_bad_records: bool,
    /// Optimizer threads.
    pub threads: usize,
    /// Overlap the optimizer.
    pub overlap_optimizer: bool,
    /// NVMe spill folder.
    pub spill_dir: PathBuf,
    /// Dataset format.
    pub format: lt_data::DatasetFormat,
}

impl Settings {
    /// Validate and fill defaults (demo defaults when neither --model nor --data is given).
    pub fn resolve(o: &RunFile) -> Result<Self> {
        let demo = match (&o.model, &o.data) {
            (None, None) => true,
            (Some(_), Some(_)) => false,
            (Some(_), None) => bail!("--model needs --data (or omit both for the built-in demo)"),
            (None, Some(_)) => bail!("--data needs --model (or omit both for the built-in demo)"),
        };
        fn d<T>(demo: bool, demo_v: T, v: T) -> T {
            if demo { demo_v } else { v }
        }
        let steps = o.steps.unwrap_or(d(demo, 200, 100));
        let batch_size = o.batch_size.unwrap_or(d(demo, 12, 8));
        let seq_len = o.seq_len.unwrap_or(d(demo, 256, 1024));
        let lr = o.lr.unwrap_or(if demo { 3e-3 } else { 1e-5 });
        let max_grad_norm = o.max_grad_norm.unwrap_or(1.0);
        let eval_fraction = o.eval_fraction.unwrap_or(if demo { 0.1 } else { 0.0 });
        let bad = |field: &str, why: &str| anyhow::anyhow!("--{field}: {why}");
        if steps == 0 {
            return Err(bad("steps", "must be > 0"));
        }
        if batch_size == 0 {
            return Err(bad("batch-size", "must be > 0"));
        }
        if seq_len < 2 {
            return Err(bad("seq-len", "must be >= 2"));
        }
        if let Some(m) = o.micro_batch_size
            && (m == 0 || !batch_size.is_multiple_of(m))
        {
            return Err(bad("micro-batch-size", "must divide --batch-size"));
        }
        if !(0.0..1.0).contains(&eval_fraction) {
            return Err(bad("eval-fraction", "must be in [0, 1)"));
        }
        let adamw = AdamWConfig {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: o.weight_decay.unwrap_or(0.01),
            max_grad_norm: (max_grad_norm > 0.0).then_some(max_grad_norm),
        };
        adamw.validate()?;
        let out = match &o.out {
            Some(p) => p.clone(),
            None => PathBuf::from("lt-runs").join(timestamp()),
        };
        let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(1);
        Ok(Self {
            model: o.model.clone(),
            data: o.data.clone(),
            steps,
            batch_size,
            micro_batch_size: o.micro_batch_size,
            seq_len,
            adamw,
            optimizer: o.optimizer.unwrap_or(OptimizerChoice::Adamw8bit),
            warmup_steps: o.warmup_steps.unwrap_or(d(demo, 20, 0)),
            schedule: if o.cosine || demo { LrSchedule::Cosine } else { LrSchedule::Constant },
            shuffle: !o.no_shuffle,
            seed: o.seed.unwrap_or(42),
            policy: o.policy.unwrap_or(Policy::Auto),
            plan: o.plan.clone(),
            gpu_memory: o.gpu_memory,
            host_memory: o.host_memory,
            hardware: o.hardware.clone().unwrap_or_else(|| "cpu".into()),
            metrics: o.metrics.clone().unwrap_or_else(|| out.join("metrics.jsonl")),
            out: out.clone(),
            save_every: o.save_every.unwrap_or(0),
            keep_checkpoints: o.keep_checkpoints.unwrap_or(2).max(1),
            resume: o.resume,
            device: o.device.unwrap_or(DeviceChoice::Cpu),
            eval_every: o.eval_every.unwrap_or(0),
            eval_loss_every: o.eval_loss_every.unwrap_or(if demo { (steps / 20).max(1) } else { 0 }),
            eval_fraction,
            eval_limit: o.eval_limit.unwrap_or(200),
            max_new_tokens: o.max_new_tokens.unwrap_or(d(demo, 48, 256)),
            packing: !o.no_packing,
            train_on_prompt: o.train_on_prompt,
            skip_bad_records: o.skip_bad_records,
            threads: o.threads.unwrap_or(cores).max(1),
            overlap_optimizer: !o.serial_optimizer,
            spill_dir: o.spill_dir.clone().unwrap_or_else(|| out.join("spill")),
            format: o.format.unwrap_or(lt_data::DatasetFormat::Auto),
        })
    }
}

fn timestamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    // UTC civil time from the Unix epoch (Howard Hinnant's days-from-civil inverse).
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Run the command.
pub fn run(args: &TrainArgs) -> Result<()> {
    let file = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?;
            toml::from_str::<RunFile>(&text).map_err(|e| {
                anyhow::anyhow!("{}: {}", p.display(), e.to_string().lines().collect::<Vec<_>>().join(" "))
            })?
        }
        None => RunFile::default(),
    };
    let settings = Settings::resolve(&merge(&args.opts, &file))?;
    match settings.device {
        DeviceChoice::Cpu => run_on::<lt_model::CpuAutodiff>(&settings, Default::default()),
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda => run_on::<lt_model::CudaAutodiff>(&settings, Default::default()),
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => run_on::<lt_model::WgpuAutodiff>(&settings, crate::device::wgpu()?),
        #[allow(unreachable_patterns)]
        d => Err(crate::device::not_built(d)),
    }
}

/// Stands in for a tokenizer when a model folder has none and the data is already tokenized: it
/// only knows the vocabulary size (for range checks) and refuses text.
#[derive(Debug)]
struct IdsOnly {
    vocab: usize,
}

impl lt_data::Tokenizer for IdsOnly {
    fn encode(&self, _text: &str) -> lt_data::error::Result<Vec<u32>> {
        Err(lt_data::DataError::Tokenize { reason: "the model folder has no tokenizer.json".into() })
    }
    fn decode(&self, _ids: &[u32], _skip: bool) -> lt_data::error::Result<String> {
        Err(lt_data::DataError::Tokenize { reason: "the model folder has no tokenizer.json".into() })
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn token_to_id(&self, _token: &str) -> Option<u32> {
        None
    }
    fn eos_id(&self) -> Option<u32> {
        None
    }
    fn pad_id(&self) -> Option<u32> {
        None
    }
}

/// The plan the executor will run, and what the planner predicted for it (if it planned).
pub(crate) struct Chosen {
    pub(crate) plan: ExecPlan,
    pub(crate) micro_batch_size: usize,
    pub(crate) budget: ByteSize,
    pub(crate) predicted_step_seconds: Option<f64>,
    /// The simulator's timeline of one step (auto policy only).
    pub(crate) predicted_trace: Option<lt_sched::sim::Trace>,
    pub(crate) summary: String,
    pub(crate) plan_json: serde_json::Value,
}

pub(crate) fn choose_plan(s: &Settings, cfg: &ModelConfig) -> Result<Chosen> {
    let spec: lt_sched::hardware::HardwareSpec = s.hardware.parse()?;
    let mut hw = lt_sched::hardware::load_profile(&spec)?;
    if let Some(g) = s.gpu_memory {
        hw.gpu_memory = g;
    }
    if let Some(h) = s.host_memory {
        hw.host_memory = h;
    }
    let budget = hw.gpu_memory;
    let layers = cfg.num_layers();
    let fixed = |plan: ExecPlan, name: &str| Chosen {
        micro_batch_size: s.micro_batch_size.unwrap_or(s.batch_size),
        summary: format!("policy {name}: kept boundaries {:?}", plan.kept()),
        plan_json: serde_json::json!({"policy": name, "boundaries": plan.boundaries}),
        plan,
        budget,
        predicted_step_seconds: None,
        predicted_trace: None,
    };
    if let Some(path) = &s.plan {
        let p = lt_sched::plan::Plan::load(path)?;
        p.validate(cfg).with_context(|| format!("{}: plan does not fit this model", path.display()))?;
        anyhow::ensure!(
            p.batch_size == s.batch_size && p.seq_len == s.seq_len,
            "{}: plan was solved for batch {} x seq {}, but this run uses batch {} x seq {}",
            path.display(),
            p.batch_size,
            p.seq_len,
            s.batch_size,
            s.seq_len
        );
        return Ok(Chosen {
            plan: ExecPlan::from_sched(&p),
            micro_batch_size: s.micro_batch_size.unwrap_or(p.micro_batch_size),
            budget,
            predicted_step_seconds: Some(p.predicted.step_seconds),
            predicted_trace: None,
            summary: format!("plan file {}: predicted step {:.3} s", path.display(), p.predicted.step_seconds),
            plan_json: serde_json::to_value(&p)?,
        });
    }
    Ok(match s.policy {
        Policy::KeepAll => fixed(ExecPlan::keep_all(layers), "keep-all"),
        Policy::RecomputeAll => fixed(ExecPlan::recompute_all(layers), "recompute-all"),
        Policy::Megatrain => fixed(ExecPlan::every(layers, 4, Placement::Device), "megatrain"),
        Policy::Auto => {
            let mut req = lt_sched::planner::PlanRequest::new(s.batch_size, s.seq_len);
            req.micro_batch_size = s.micro_batch_size;
            req.grad_clipping = s.adamw.max_grad_norm.is_some();
            req.trace = true;
            req.cost.optimizer = s.optimizer.state();
            // The executor's attention (lt_model::ops::sdpa) materialises the T x T scores on every
            // backend, so plan with that kernel's FLOPs and memory, not flash attention's.
            req.cost.attention = lt_sched::cost::AttentionKernel::Materialized;
            let out = lt_sched::planner::plan(cfg, &hw, &req)?;
            let p = &out.plan;
            let tiers: Vec<&str> = p
                .boundaries
                .iter()
                .map(|b| match b {
                    lt_sched::plan::Placement::Gpu => "G",
                    lt_sched::plan::Placement::Host => "H",
                    lt_sched::plan::Placement::Nvme => "N",
                    lt_sched::plan::Placement::Recompute => ".",
                })
                .collect();
            Chosen {
                plan: ExecPlan::from_sched(p),
                micro_batch_size: p.micro_batch_size,
                budget,
                predicted_step_seconds: Some(p.predicted.step_seconds),
                predicted_trace: Some(out.sim.trace.clone()),
                summary: format!(
                    "plan (auto, {} profile, solved in {:.0} ms): boundaries [{}] (G gpu, H host, N nvme, . recompute), \
micro-batch {} x {} accumulation, loss chunk {} tokens; predicted step {:.3} s, predicted peak device {}",
                    hw.name,
                    p.solver.solve_seconds * 1e3,
                    tiers.join(""),
                    p.micro_batch_size,
                    p.grad_accum_steps,
                    p.loss_chunk_tokens,
                    p.predicted.step_seconds,
                    ByteSize(p.predicted.peak_gpu_bytes)
                ),
                plan_json: serde_json::to_value(p)?,
            }
        }
    })
}

/// A small Qwen3-architecture model, randomly initialised as Hugging Face would (see `HostModel::random_init`).
fn demo_model(vocab: usize, seed: u64) -> Result<(HostModel, serde_json::Value)> {
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "max_position_embeddings": 512, "tie_word_embeddings": true, "attention_bias": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "torch_dtype": "float32",
    });
    let cfg = ModelConfig::from_json_str(&config.to_string())?;
    let host = HostModel::random_init(cfg, seed);
    Ok((host, config))
}

fn to_micro_batches(b: &TrainBatch, micro: usize) -> Vec<Batch> {
    let rows = b.rows();
    let micro = micro.clamp(1, rows.max(1));
    (0..rows)
        .step_by(micro)
        .map(|start| {
            let end = (start + micro).min(rows);
            Batch {
                input_ids: b.input_ids[start..end].to_vec(),
                labels: b.labels[start..end].to_vec(),
                packing: Some(PackInfo {
                    positions: b.position_ids[start..end].to_vec(),
                    segments: b.segment_ids[start..end].to_vec(),
                }),
            }
        })
        .collect()
}

/// Keep only metrics lines of steps <= `step` (a resumed run rewrites what came after its checkpoint).
fn truncate_metrics(path: &Path, step: u64) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
                .is_some_and(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    crate::fsutil::write_atomic(path, kept.as_bytes())
}

fn run_on<B: AutodiffBackend>(
    s: &Settings,
    device: <B::InnerBackend as burn::tensor::backend::BackendTypes>::Device,
) -> Result<()>
where
    <B::InnerBackend as burn::tensor::backend::BackendTypes>::Device: Default,
{
    let started = Instant::now();
    std::fs::create_dir_all(&s.out).with_context(|| format!("{}: cannot create the output folder", s.out.display()))?;
    // --- model and tokenizer ---
    let data_file = match &s.data {
        Some(path) => Some(lt_data::DatasetFile::open(path, s.format)?),
        None => None,
    };
    let pretokenized = data_file.as_ref().is_some_and(|f| f.format() == lt_data::DatasetFormat::Tokens);
    // The demo's records come first: its tokenizer's vocabulary is built from them.
    let demo_records = match &s.data {
        Some(_) => None,
        None => Some(lt_data::synth::generate(&lt_data::SynthConfig::default())?),
    };
    let demo_tokenizer = demo_records.as_ref().map(|records| {
        lt_data::word_tokenizer::build(records.iter().flat_map(|r| [r.query.as_str(), r.response.as_str()]))
    });
    let (host, encoder, source_dir, config_json): (HostModel, ChatEncoder, Option<&Path>, Option<serde_json::Value>) =
        match (&s.model, &demo_tokenizer) {
            (Some(dir), _) => {
                let host = HostModel::load(dir)?;
                let encoder = match encoder_for(dir) {
                    Ok(e) => e,
                    // Pre-tokenized data needs no tokenizer: ids are only range-checked.
                    Err(_) if pretokenized => ChatEncoder::new(
                        Arc::new(IdsOnly { vocab: host.config.vocab_size }),
                        lt_data::ByteTokenizer::chat_template(),
                    ),
                    Err(e) => return Err(e),
                };
                (host, encoder, Some(dir.as_path()), None)
            }
            (None, Some(files)) => {
                let (tok, template) = files.load()?;
                let (host, cfg) = demo_model(tok.vocab_size(), s.seed)?;
                (host, ChatEncoder::new(tok, template), None, Some(cfg))
            }
            (None, None) => bail!("--model is required with --data"),
        };
    let encoder = encoder.with_train_on_prompt(s.train_on_prompt);
    let cfg = host.config.clone();
    // --- data ---
    let popts = PrepareOptions {
        seq_len: s.seq_len,
        eval_fraction: s.eval_fraction,
        split_seed: s.seed,
        skip_bad_records: s.skip_bad_records,
        max_eval_examples: Some(s.eval_limit),
        ..Default::default()
    };
    let (prepared, eval_records) = match (&data_file, demo_records) {
        (Some(file), _) => (lt_data::prepare(file, &encoder, &popts)?, None),
        (None, Some(records)) => {
            let src = lt_data::MemorySource::from_records("built-in synthetic arithmetic", &records);
            (lt_data::prepare(&src, &encoder, &popts)?, Some(records))
        }
        (None, None) => bail!("--data is required with --model"),
    };
    eprintln!("data: {}", prepared.report.summary());
    anyhow::ensure!(!prepared.train.is_empty(), "no training examples left after preparing the data");
    if let Some(records) = &eval_records {
        // The evaluated held-out questions (the --eval-limit subset) as a file, so `lt eval --data eval.json`
        // reproduces the final score question for question.
        let split = lt_data::GroupSplit::new(s.eval_fraction, s.seed)?;
        let asked: std::collections::HashSet<(&str, &str)> =
            prepared.eval_examples.iter().map(|e| (e.query.as_str(), e.kind.as_str())).collect();
        let held: Vec<lt_data::MetaMathRecord> = records
            .iter()
            .filter(|r| split.side(&r.original_question) == lt_data::Side::Eval)
            .filter(|r| asked.contains(&(r.query.as_str(), r.kind.as_str())))
            .cloned()
            .collect();
        crate::fsutil::write_atomic(&s.out.join("eval.json"), lt_data::synth::to_json_array(&held).as_bytes())?;
    }
    // --- plan ---
    let chosen = choose_plan(s, &cfg)?;
    eprintln!("{}", chosen.summary);
    let micro = chosen.micro_batch_size.clamp(1, s.batch_size);
    // Room for every spilled boundary of one micro-batch.
    let capacity = lt_exec::executor::spill_capacity::<B::InnerBackend>(&chosen.plan, &cfg, micro, s.seq_len);
    let spill = if capacity > 0 { Some(crate::spill::open(&s.spill_dir, capacity)?) } else { None };
    let executor = Executor::<B>::new(chosen.plan.clone(), chosen.budget, device, spill);
    let need = executor.required_device_bytes(&cfg, micro, s.seq_len);
    if need > chosen.budget.0 {
        bail!(
            "device memory budget {} is too small for micro-batch {micro} x {} tokens with this plan: it needs at least {} \
(try --gpu-memory {} or a smaller --micro-batch-size)",
            chosen.budget,
            s.seq_len,
            ByteSize(need),
            lt_exec::budget::round_up(need)
        );
    }
    // --- resume ---
    let store = CheckpointStore::new(
        s.out.join("checkpoints"),
        Retention::KeepLast(s.keep_checkpoints.try_into().unwrap_or(std::num::NonZeroUsize::MIN)),
    );
    let mut host = host;
    let mut optim = None;
    let mut completed = 0u64;
    let mut batcher_state: Option<BatcherState> = None;
    if s.resume {
        let found = store.find_latest(Verify::Full)?;
        for sk in &found.skipped {
            eprintln!("warning: skipping checkpoint {}: {}", sk.path.display(), sk.error);
        }
        match found.checkpoint {
            Some(ck) => {
                optim = Some(persist::load_checkpoint(&ck, &mut host)?);
                completed = ck.step();
                batcher_state = ck.meta().get("batcher").cloned().map(serde_json::from_value).transpose()?;
                truncate_metrics(&s.metrics, completed)?;
                eprintln!("resumed from {} (step {completed})", ck.path().display());
            }
            None => eprintln!("--resume: no checkpoint in {}; starting from step 0", store.root().display()),
        }
    } else if s.metrics.exists() {
        truncate_metrics(&s.metrics, 0)?;
    }
    let bcfg = BatcherConfig {
        batch_size: s.batch_size,
        seq_len: s.seq_len,
        mode: if s.packing { BatchMode::Pack } else { BatchMode::PadMax },
        seed: s.seed,
        shuffle: s.shuffle,
        pad_id: encoder.tokenizer().pad_id().unwrap_or(0),
    };
    let train_data = Arc::new(prepared.train);
    let mut batcher = match batcher_state {
        Some(st) => Batcher::restore(train_data, bcfg, st)?,
        None => Batcher::new(train_data, bcfg)?,
    };
    let opts = TrainOptions {
        adamw: s.adamw,
        optimizer: match s.optimizer {
            OptimizerChoice::Adamw => OptimizerKind::AdamW,
            OptimizerChoice::Adamw8bit => OptimizerKind::adamw8bit(),
        },
        warmup_steps: s.warmup_steps,
        schedule: s.schedule,
        total_steps: s.steps,
        overlap_optimizer: s.overlap_optimizer,
        threads: s.threads,
    };
    let model = Arc::new(SharedModel::new(host, completed));
    let mut trainer = Trainer::new(model, executor, opts, optim, completed)?;
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&s.metrics)
        .with_context(|| format!("{}: cannot open", s.metrics.display()))?;
    let save = |trainer: &mut Trainer<B>, batcher: &Batcher| -> Result<()> {
        trainer.flush()?;
        let snap = trainer.model.snapshot();
        let meta = serde_json::json!({"batcher": batcher.state(), "plan": chosen.plan_json, "settings": s});
        let c = persist::save_checkpoint(&store, trainer.completed(), &snap, &trainer.optimizer(), meta)?;
        for e in &c.prune_errors {
            eprintln!("warning: pruning old checkpoints: {e}");
        }
        Ok(())
    };
    // Held-out scoring runs on one CPU copy of the current weights per evaluation point.
    let eval_now = |dm: &DeviceModel<lt_model::CpuBackend>, label: &str| -> Result<lt_data::Accuracy> {
        let pb = crate::progress::bar(prepared.eval_examples.len() as u64, label);
        let (acc, _) = evaluate(
            dm,
            encoder.tokenizer(),
            encoder.stop_token_id(),
            &prepared.eval_examples,
            s.max_new_tokens,
            32,
            |n| pb.inc(n as u64),
        )?;
        pb.finish_and_clear();
        Ok(acc)
    };
    // Held-out loss on a fixed subset: each example its own right-padded row (causal attention never
    // sees the padding), the mean over the shifted non-ignored tokens as in training.
    let eval_rows: Vec<(Vec<u32>, Vec<i64>)> = (0..prepared.eval.len().min(128))
        .filter_map(|i| {
            let ids = prepared.eval.ids(i)?.to_vec();
            let mut labels = Vec::new();
            prepared.eval.extend_labels(i, &mut labels);
            Some((ids, labels))
        })
        .collect();
    let log_eval_loss =
        |dm: &DeviceModel<lt_model::CpuBackend>, metrics: &mut std::fs::File, step: u64| -> Result<()> {
            let (mut sum, mut count) = (0.0f64, 0usize);
            for rows in eval_rows.chunks(32) {
                let len = rows.iter().map(|(ids, _)| ids.len()).max().unwrap_or(0);
                let pad = encoder.tokenizer().pad_id().unwrap_or(0);
                let ids: Vec<Vec<u32>> = rows.iter().map(|(ids, _)| padded(ids, len, pad)).collect();
                let labels: Vec<Vec<i64>> = rows.iter().map(|(_, l)| padded(l, len, lt_data::IGNORE_INDEX)).collect();
                let n = lt_model::model::loss_token_count(&labels);
                if n == 0 {
                    continue;
                }
                let logits = lt_model::model::forward_logits(dm, &ids);
                let loss = lt_model::model::to_vec(lt_model::model::causal_lm_loss(logits, &labels));
                sum += f64::from(loss.first().copied().unwrap_or(f32::NAN)) * n as f64;
                count += n;
            }
            if count > 0 {
                writeln!(metrics, "{}", serde_json::json!({"step": step, "eval_loss": sum / count as f64}))
                    .with_context(|| format!("{}: write failed", s.metrics.display()))?;
            }
            Ok(())
        };
    let cpu_copy = |host: &HostModel| DeviceModel::<lt_model::CpuBackend>::from_host(host, &Default::default());
    let loss_wanted = s.eval_loss_every > 0 && !eval_rows.is_empty();
    let em_wanted = !prepared.eval_examples.is_empty();

    let pb = crate::progress::bar(s.steps, "train");
    pb.set_position(completed);
    let mut last: Option<StepMetrics> = None;
    let mut tokens_done = 0usize;
    let loop_start = Instant::now();
    while trainer.completed() < s.steps {
        let batch = batcher.next_batch();
        let mbs = to_micro_batches(&batch, micro);
        let m = trainer.step(&mbs)?;
        tokens_done += m.tokens;
        let mut line = serde_json::to_value(&m)?;
        if let Some(obj) = line.as_object_mut() {
            obj.insert("exposed_seconds".into(), serde_json::to_value(&m.timing.exposed)?);
            obj.insert("epoch".into(), batcher.epoch().into());
        }
        writeln!(metrics, "{line}").with_context(|| format!("{}: write failed", s.metrics.display()))?;
        metrics.flush().ok();
        pb.set_position(m.step);
        pb.set_message(format!(
            "train loss {:.4} | {:.0} tok/s",
            m.loss,
            tokens_done as f64 / loop_start.elapsed().as_secs_f64().max(1e-9)
        ));
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) && (m.step % 50 == 0 || m.step == 1) {
            eprintln!(
                "step {} loss {:.4} grad_norm {:.3} lr {:.2e} {:.3} s/step",
                m.step, m.loss, m.grad_norm, m.lr, m.step_seconds
            );
        }
        if s.save_every > 0 && m.step % s.save_every == 0 && m.step < s.steps {
            save(&mut trainer, &batcher)?;
        }
        let loss_now = loss_wanted && m.step % s.eval_loss_every == 0 && m.step < s.steps;
        let em_now = em_wanted && s.eval_every > 0 && m.step % s.eval_every == 0 && m.step < s.steps;
        if loss_now || em_now {
            trainer.flush()?;
            let dm = cpu_copy(&trainer.model.snapshot());
            if loss_now {
                log_eval_loss(&dm, &mut metrics, m.step)?;
            }
            if em_now {
                let acc = eval_now(&dm, "eval")?;
                let line = serde_json::json!({"step": m.step, "eval_exact_match": acc.rate(), "eval": acc});
                writeln!(metrics, "{line}").ok();
                eprintln!("step {}: held-out exact match {}", m.step, acc.summary());
            }
        }
        last = Some(m);
    }
    pb.finish_and_clear();
    save(&mut trainer, &batcher)?;
    // --- outputs ---
    let snap = trainer.model.snapshot();
    let model_dir = s.out.join("model");
    persist::export_model(&snap, &model_dir, source_dir, config_json.clone(), ExportDtype::F32)?;
    if let Some(files) = &demo_tokenizer {
        files.write_to(&model_dir)?;
    }
    let trace_path = s.out.join("trace.json");
    let last_step = trainer.completed();
    crate::fsutil::write_atomic(
        &trace_path,
        trainer.trace().chrome_json(last_step.saturating_sub(1)..=last_step).as_bytes(),
    )?;
    // `snap` was taken after the final save flushed the optimizer: score that copy.
    let dm = (loss_wanted || em_wanted).then(|| cpu_copy(&snap));
    if let Some(dm) = dm.as_ref().filter(|_| loss_wanted) {
        log_eval_loss(dm, &mut metrics, last_step)?;
    }
    let final_acc = match dm.as_ref().filter(|_| em_wanted) {
        Some(dm) => Some(eval_now(dm, "final eval")?),
        None => None,
    };
    if let Some(acc) = &final_acc {
        let line = serde_json::json!({"step": last_step, "eval_exact_match": acc.rate(), "eval": acc, "final": true});
        writeln!(metrics, "{line}").ok();
    }
    println!("trained {last_step} steps in {:.1} s; outputs in {}", started.elapsed().as_secs_f64(), s.out.display());
    if let Some(m) = &last {
        println!(
            "last step: loss {:.4}, {:.3} s measured{}; measured exposure: h2d {:.3} s, d2h {:.3} s, nvme {:.3} s, optimizer {:.3} s",
            m.loss,
            m.step_seconds,
            chosen.predicted_step_seconds.map(|p| format!(" vs {p:.3} s predicted")).unwrap_or_default(),
            m.timing.exposed.h2d,
            m.timing.exposed.d2h,
            m.timing.exposed.nvme,
            m.timing.exposed.optimizer
        );
    }
    if let Some(acc) = &final_acc {
        println!("held-out exact match: {}", acc.summary());
    }
    metrics.flush().ok();
    let pictures = write_pictures(s, &chosen, trainer.trace(), last_step)?;
    println!("model: {}  metrics: {}  trace: {}", model_dir.display(), s.metrics.display(), trace_path.display());
    println!("pictures: {pictures}");
    Ok(())
}

fn padded<T: Copy>(v: &[T], len: usize, fill: T) -> Vec<T> {
    let mut out = v.to_vec();
    out.resize(len, fill);
    out
}

/// `loss.png` from the metrics file (so a resumed run plots its whole history) and `timeline.svg` of the
/// last step, predicted (when the planner ran) above measured. Returns the paths written.
fn write_pictures(s: &Settings, chosen: &Chosen, trace: &lt_exec::trace::Trace, step: u64) -> Result<String> {
    use crate::plot::{Panel, Series, Span};
    let text = std::fs::read_to_string(&s.metrics).unwrap_or_default();
    let (mut train, mut eval) = (Vec::new(), Vec::new());
    for v in text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()) {
        let Some(x) = v.get("step").and_then(serde_json::Value::as_f64) else { continue };
        if let Some(y) = v.get("loss").and_then(serde_json::Value::as_f64) {
            train.push((x, y));
        }
        if let Some(y) = v.get("eval_loss").and_then(serde_json::Value::as_f64) {
            eval.push((x, y));
        }
    }
    let mut series = vec![Series { label: "train loss".into(), color: [31, 119, 180], points: train, dots: false }];
    if !eval.is_empty() {
        series.push(Series { label: "eval loss".into(), color: [214, 39, 40], points: eval, dots: true });
    }
    let loss_png = s.out.join("loss.png");
    crate::fsutil::write_atomic(&loss_png, &crate::plot::line_chart_png("loss", "step", "loss (log)", &series))?;

    let lanes = ["compute", "h2d", "d2h", "nvme", "optimizer"];
    let events: Vec<_> = trace.events().into_iter().filter(|e| e.step == step).collect();
    let t0 = events.iter().map(|e| e.start_us).fold(f64::INFINITY, f64::min);
    let measured: Vec<Span> = events
        .iter()
        .map(|e| Span {
            lane: lt_exec::trace::Stream::ALL.iter().position(|x| *x == e.stream).unwrap_or(0),
            start: (e.start_us - t0) / 1e6,
            dur: e.dur_us / 1e6,
            name: e.name.clone(),
            wait: e.waited_on.is_some(),
        })
        .collect();
    let measured_step = measured.iter().map(|x| x.start + x.dur).fold(0.0f64, f64::max);
    let mut panels = Vec::new();
    if let Some(pred) = &chosen.predicted_trace {
        let spans: Vec<Span> = pred
            .trace_events
            .iter()
            .filter(|e| e.ph == "X")
            .filter_map(|e| {
                Some(Span {
                    lane: e.tid as usize,
                    start: e.ts? / 1e6,
                    dur: e.dur? / 1e6,
                    name: e.name.clone(),
                    wait: false,
                })
            })
            .collect();
        panels.push(Panel {
            title: format!(
                "predicted (simulator, {} profile): step {:.1} ms",
                s.hardware,
                chosen.predicted_step_seconds.unwrap_or(0.0) * 1e3
            ),
            spans,
        });
    }
    panels.push(Panel {
        title: format!("measured: step {:.1} ms (red: compute waiting on a transfer = exposed)", measured_step * 1e3),
        spans: measured,
    });
    let svg = crate::plot::timeline_svg(&format!("step {step}: per-stream timeline"), &lanes, &panels);
    let timeline = s.out.join("timeline.svg");
    crate::fsutil::write_atomic(&timeline, svg.as_bytes())?;
    Ok(format!("{}  {}", loss_png.display(), timeline.display()))
}
