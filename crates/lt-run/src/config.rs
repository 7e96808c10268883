//! The run configuration: [`RunConfig`] holds every key a run can be given (the TOML run file, the
//! `lt train` flags and the builder methods are the same set), [`RunSettings`] is that config
//! validated with every default filled in.
//!
//! Parsing is two-step (ripgrep's LowArgs -> HiArgs): flags and an optional TOML run file fill
//! [`RunConfig`]s, a flag overriding the file ([`RunConfig::over`]); [`RunSettings::resolve`]
//! validates them and fills defaults; only then is anything loaded.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use lt_core::ByteSize;
use lt_core::hardware::{BuiltinProfile, HardwareProfile};
use lt_exec::train::LrSchedule;
use lt_optim::AdamWConfig;
use lt_sched::hardware::HardwareSpec;
use serde::{Deserialize, Serialize};

use crate::device::DeviceChoice;

/// Activation policy: lt-sched's, the one policy type of the CLI and xtask.
pub use lt_sched::planner::Policy;

/// Optimizer state precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerChoice {
    /// fp32 moments (PyTorch AdamW semantics).
    Adamw,
    /// Block-wise 8-bit moments (about 2 bytes/param of state), bitsandbytes' dynamic maps: its
    /// `AdamW8bit` trajectory.
    Adamw8bit,
    /// Block-wise 8-bit moments, the f8 codes (small floats found by integer rounding): the same
    /// memory, a faster host update.
    #[value(name = "adamw8bit-f8")]
    #[serde(rename = "adamw8bit-f8")]
    Adamw8bitF8,
}

impl OptimizerChoice {
    /// What `lt train`, `lt plan` and `lt profile` use when `--optimizer` is not given.
    pub const DEFAULT: Self = OptimizerChoice::Adamw8bit;

    /// The name on the command line and in reports (`adamw8bit`).
    pub fn name(self) -> &'static str {
        match self {
            OptimizerChoice::Adamw => "adamw",
            OptimizerChoice::Adamw8bit => "adamw8bit",
            OptimizerChoice::Adamw8bitF8 => "adamw8bit-f8",
        }
    }

    /// What the state is, in a few words (the run's optimizer line).
    pub fn what(self) -> &'static str {
        match self {
            OptimizerChoice::Adamw => "fp32 moments",
            OptimizerChoice::Adamw8bit => "8-bit moments, bitsandbytes' dynamic maps",
            OptimizerChoice::Adamw8bitF8 => "8-bit moments, f8 codes",
        }
    }

    /// The optimizer this choice runs.
    pub fn kind(self) -> lt_optim::OptimizerKind {
        match self {
            OptimizerChoice::Adamw => lt_optim::OptimizerKind::AdamW,
            OptimizerChoice::Adamw8bit => lt_optim::OptimizerKind::adamw8bit(),
            OptimizerChoice::Adamw8bitF8 => lt_optim::OptimizerKind::adamw8bit_f8(),
        }
    }

    /// What the planner's host-memory model assumes for this choice.
    pub fn state(self) -> lt_sched::cost::OptimizerState {
        match self {
            OptimizerChoice::Adamw => lt_sched::cost::OptimizerState::Fp32,
            OptimizerChoice::Adamw8bit | OptimizerChoice::Adamw8bitF8 => lt_sched::cost::OptimizerState::Blockwise8bit,
        }
    }
}

/// When a run saves checkpoints before its last step (the last step is always saved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SaveEveryRepr", into = "SaveEveryRepr")]
pub enum SaveEvery {
    /// Every step while a save costs at most [`crate::checkpointing::AUTO_SAVE_BUDGET`] of the
    /// training time, else every N steps with N as small as that budget allows, from measured
    /// save and step times.
    Auto,
    /// Every N steps (at multiples of N); 0: only at the end.
    Steps(u64),
}

impl From<u64> for SaveEvery {
    fn from(n: u64) -> Self {
        SaveEvery::Steps(n)
    }
}

impl std::str::FromStr for SaveEvery {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "auto" => Ok(SaveEvery::Auto),
            t => t.parse().map(SaveEvery::Steps).map_err(|_| format!("`{s}`: expected a number of steps or `auto`")),
        }
    }
}

impl std::fmt::Display for SaveEvery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SaveEvery::Auto => f.write_str("auto"),
            SaveEvery::Steps(n) => write!(f, "{n}"),
        }
    }
}

/// The run file's spelling of [`SaveEvery`]: a number or `"auto"`.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum SaveEveryRepr {
    Steps(u64),
    Text(String),
}

impl TryFrom<SaveEveryRepr> for SaveEvery {
    type Error = String;

    fn try_from(r: SaveEveryRepr) -> std::result::Result<Self, String> {
        match r {
            SaveEveryRepr::Steps(n) => Ok(SaveEvery::Steps(n)),
            SaveEveryRepr::Text(t) => t.parse(),
        }
    }
}

impl From<SaveEvery> for SaveEveryRepr {
    fn from(s: SaveEvery) -> Self {
        match s {
            SaveEvery::Auto => SaveEveryRepr::Text("auto".into()),
            SaveEvery::Steps(n) => SaveEveryRepr::Steps(n),
        }
    }
}

/// Everything a run can be configured with; the TOML run file has the same keys.
// `deny_unknown_fields` does not work with `#[serde(flatten)]`: [`RunConfig::from_toml_file`]
// checks the keys itself.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize, clap::Args)]
#[serde(rename_all = "kebab-case")]
pub struct RunConfig {
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
    /// The hardware profile and memory budgets the plan is made for.
    #[command(flatten)]
    #[serde(flatten)]
    pub hw: HardwareArgs,
    /// Metrics file (one JSON object per step) [default: OUT/metrics.jsonl].
    #[arg(long, value_name = "FILE.jsonl")]
    pub metrics: Option<PathBuf>,
    /// Output folder: checkpoints, metrics, trace and the exported model [default: ./lt-runs/<timestamp>].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Checkpoints during training: every N steps, 0 for only at the end, or `auto`: every step
    /// while a save costs at most 5% of the training time, else as often as that allows (announced
    /// after the first save, with what a kill -9 would lose) [default: auto].
    #[arg(long, value_name = "N|auto")]
    pub save_every: Option<SaveEvery>,
    /// Checkpoints kept on disk, newest first; while saving, one more exists until the oldest is
    /// pruned (the disk check before training counts both) [default: 2].
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
    /// Held-out loss every N steps and at the end, on up to 128 held-out examples; 0 turns it off. Like
    /// exact match it runs on the training device, the layers streamed from the masters one at a time
    /// as in training (no copy of the model) [default: off; demo steps/20].
    #[arg(long)]
    pub eval_loss_every: Option<u64>,
    /// Evaluate at most N held-out questions [default: 200].
    #[arg(long)]
    pub eval_limit: Option<usize>,
    /// Held-out questions decoded together [default: 32]. Every decoding step streams each layer to the
    /// device once for the whole batch, so on a GPU a larger batch means fewer uploads (its decoding
    /// caches stay on the device).
    #[arg(long)]
    pub eval_batch_size: Option<usize>,
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

impl RunConfig {
    /// Read a TOML run file (kebab-case keys, the same as the flags). An unknown or mistyped key is
    /// a one-line error naming the file and the key.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let one_line = |e: toml::de::Error| {
            anyhow::anyhow!("{}: {}", path.display(), e.to_string().lines().collect::<Vec<_>>().join(" "))
        };
        let table: toml::Table = toml::from_str(&text).map_err(one_line)?;
        let known = Self::keys();
        if let Some(key) = table.keys().find(|k| !known.contains(k)) {
            bail!("{}: unknown field `{key}`, expected one of {}", path.display(), known.join(", "));
        }
        toml::from_str::<RunConfig>(&text).map_err(one_line)
    }

    /// Every key of a run file, in declaration order.
    pub fn keys() -> Vec<String> {
        // serde_json writes every field, `None` as null, flattened ones inline.
        match serde_json::to_value(RunConfig::default()) {
            Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }

    /// Sets the hardware profile (see [`HardwareArgs::hardware`]).
    #[must_use]
    pub fn hardware(mut self, spec: HardwareSpec) -> Self {
        self.hw.hardware = Some(spec);
        self
    }

    /// Sets the device memory budget (see [`HardwareArgs::gpu_memory`]).
    #[must_use]
    pub fn gpu_memory(mut self, budget: ByteSize) -> Self {
        self.hw.gpu_memory = Some(budget);
        self
    }

    /// Sets the host memory budget (see [`HardwareArgs::host_memory`]).
    #[must_use]
    pub fn host_memory(mut self, budget: ByteSize) -> Self {
        self.hw.host_memory = Some(budget);
        self
    }
}

/// The hardware a plan is made for: `--hardware`, `--gpu-memory`, `--host-memory`, shared by every
/// command that plans (`lt train`, `lt plan`, `lt bench train`, `lt bench layer`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize, clap::Args)]
#[serde(rename_all = "kebab-case")]
pub struct HardwareArgs {
    /// Hardware profile for the planner: h800, rtx3090, h200, cpu, or a .toml file (from `lt profile`)
    /// [default: cpu; h200 for `lt bench` on cuda].
    #[arg(long, value_name = "NAME|FILE.toml")]
    pub hardware: Option<HardwareSpec>,
    /// Device memory budget, e.g. 80GB, 24GiB [default: the hardware profile's].
    #[arg(long, value_name = "SIZE")]
    pub gpu_memory: Option<ByteSize>,
    /// Host memory budget for the planner [default: the hardware profile's].
    #[arg(long, value_name = "SIZE")]
    pub host_memory: Option<ByteSize>,
}

impl HardwareArgs {
    /// These flags with every one left unset taken from `base`.
    pub fn over(&self, base: &HardwareArgs) -> HardwareArgs {
        HardwareArgs {
            hardware: self.hardware.clone().or_else(|| base.hardware.clone()),
            gpu_memory: self.gpu_memory.or(base.gpu_memory),
            host_memory: self.host_memory.or(base.host_memory),
        }
    }

    /// The profile `--hardware` names (`default` when not given), with the budgets replaced where
    /// the flags give them.
    pub fn profile(&self, default: BuiltinProfile) -> Result<HardwareProfile> {
        let spec = self.spec(default);
        let mut hw = lt_sched::hardware::load_profile(&spec)?;
        if let Some(g) = self.gpu_memory {
            hw.gpu_memory = g;
        }
        if let Some(h) = self.host_memory {
            hw.host_memory = h;
        }
        lt_sched::hardware::validate_profile(&hw).context("after --gpu-memory/--host-memory overrides")?;
        Ok(hw)
    }

    /// The profile `--hardware` names, `default` when not given.
    pub fn spec(&self, default: BuiltinProfile) -> HardwareSpec {
        self.hardware.clone().unwrap_or(HardwareSpec::Builtin(default))
    }
}

/// From one list of the config's keys: [`RunConfig::over`] (merging) and one builder method per key.
macro_rules! keys {
    (nested: [$($nested:ident),* $(,)?], into: [$($into:ident: $it:ty),* $(,)?], plain: [$($opt:ident: $t:ty),* $(,)?], switches: [$($flag:ident),* $(,)?] $(,)?) => {
        impl RunConfig {
            /// This config with every key it leaves unset taken from `base` (flags over a run file).
            pub fn over(&self, base: &RunConfig) -> RunConfig {
                RunConfig {
                    $( $nested: self.$nested.over(&base.$nested), )*
                    $( $into: self.$into.clone().or_else(|| base.$into.clone()), )*
                    $( $opt: self.$opt.or(base.$opt), )*
                    $( $flag: self.$flag || base.$flag, )*
                }
            }
            $(
                #[doc = concat!("Sets `", stringify!($into), "` (see the field).")]
                #[must_use]
                pub fn $into(mut self, value: impl Into<$it>) -> Self {
                    self.$into = Some(value.into());
                    self
                }
            )*
            $(
                #[doc = concat!("Sets `", stringify!($opt), "` (see the field).")]
                #[must_use]
                pub fn $opt(mut self, value: $t) -> Self {
                    self.$opt = Some(value);
                    self
                }
            )*
            $(
                #[doc = concat!("Sets the `", stringify!($flag), "` switch (see the field).")]
                #[must_use]
                pub fn $flag(mut self, on: bool) -> Self {
                    self.$flag = on;
                    self
                }
            )*
        }
    };
}

keys! {
    nested: [hw],
    into: [model: PathBuf, data: PathBuf, plan: PathBuf, metrics: PathBuf, out: PathBuf, spill_dir: PathBuf,
        save_every: SaveEvery],
    plain: [steps: u64, batch_size: usize, micro_batch_size: usize, seq_len: usize, lr: f64, weight_decay: f64,
        max_grad_norm: f64, warmup_steps: u64, optimizer: OptimizerChoice, seed: u64, policy: Policy,
        keep_checkpoints: usize,
        device: DeviceChoice, eval_every: u64, eval_loss_every: u64, eval_fraction: f64, eval_limit: usize,
        eval_batch_size: usize, max_new_tokens: usize, threads: usize, format: lt_data::DatasetFormat],
    switches: [cosine, no_shuffle, resume, no_packing, train_on_prompt, skip_bad_records, serial_optimizer],
}

/// Validated settings.
#[derive(Debug, Clone, Serialize)]
pub struct RunSettings {
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
    /// The plan file's contents, read and checked against the flags once, here.
    #[serde(skip)]
    pub plan_file: Option<lt_sched::plan::Plan>,
    /// Hardware profile and budget overrides.
    pub hw: HardwareArgs,
    /// Output folder.
    pub out: PathBuf,
    /// Metrics file.
    pub metrics: PathBuf,
    /// When to save checkpoints during training.
    pub save_every: SaveEvery,
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
    /// Held-out questions decoded together.
    pub eval_batch_size: usize,
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

impl RunSettings {
    /// One line saying which optimizer runs and how: `optimizer adamw8bit (8-bit moments, ...), lr ...`.
    pub fn optimizer_line(&self) -> String {
        let a = &self.adamw;
        let schedule = match self.schedule {
            LrSchedule::Constant => "constant",
            LrSchedule::Cosine => "cosine decay",
        };
        let warmup = match self.warmup_steps {
            0 => "no warmup".to_string(),
            n => format!("{n} warmup steps"),
        };
        format!(
            "optimizer {} ({}): lr {:.2e}, {schedule}, {warmup}, weight decay {}, {}",
            self.optimizer.name(),
            self.optimizer.what(),
            a.lr,
            a.weight_decay,
            a.max_grad_norm.map_or("no clipping".to_string(), |n| format!("clipped to global norm {n}"))
        )
    }

    /// The planner's hardware profile: the named one (or the `.toml` file), with the device and host
    /// budgets replaced where the settings give them.
    pub fn hardware_profile(&self) -> Result<HardwareProfile> {
        self.hw.profile(BuiltinProfile::Cpu)
    }

    /// Validate and fill defaults (demo defaults when neither --model nor --data is given).
    pub fn resolve(o: &RunConfig) -> Result<Self> {
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
        // A plan file fixes the step it was solved for: what the flags leave unset comes from it,
        // and a flag that contradicts it is an error.
        let from_plan = match &o.plan {
            Some(path) => Some(PlanFileStep::read(path, o)?),
            None => None,
        };
        let batch_size = o.batch_size.or(from_plan.as_ref().map(|p| p.batch_size)).unwrap_or(d(demo, 12, 8));
        let seq_len = o.seq_len.or(from_plan.as_ref().map(|p| p.seq_len)).unwrap_or(d(demo, 256, 1024));
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
        if o.eval_batch_size == Some(0) {
            return Err(bad("eval-batch-size", "must be > 0"));
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
            optimizer: o.optimizer.or(from_plan.as_ref().map(|p| p.optimizer)).unwrap_or(OptimizerChoice::DEFAULT),
            warmup_steps: o.warmup_steps.unwrap_or(d(demo, 20, 0)),
            schedule: if o.cosine || demo { LrSchedule::Cosine } else { LrSchedule::Constant },
            shuffle: !o.no_shuffle,
            seed: o.seed.unwrap_or(42),
            policy: o.policy.unwrap_or(Policy::Auto),
            plan: o.plan.clone(),
            plan_file: from_plan.as_ref().map(|p| p.plan.clone()),
            hw: HardwareArgs { hardware: Some(o.hw.spec(BuiltinProfile::Cpu)), ..o.hw.clone() },
            metrics: o.metrics.clone().unwrap_or_else(|| out.join("metrics.jsonl")),
            out: out.clone(),
            save_every: o.save_every.unwrap_or(SaveEvery::Auto),
            keep_checkpoints: o.keep_checkpoints.unwrap_or(2).max(1),
            resume: o.resume,
            device: o.device.unwrap_or(DeviceChoice::Cpu),
            eval_every: o.eval_every.unwrap_or(0),
            eval_loss_every: o.eval_loss_every.unwrap_or(if demo { (steps / 20).max(1) } else { 0 }),
            eval_fraction,
            eval_limit: o.eval_limit.unwrap_or(200),
            eval_batch_size: o.eval_batch_size.unwrap_or(32),
            max_new_tokens: o.max_new_tokens.unwrap_or(d(demo, 48, 256)),
            packing: !o.no_packing,
            train_on_prompt: o.train_on_prompt,
            skip_bad_records: o.skip_bad_records,
            threads: o.threads.unwrap_or(cores).max(1),
            overlap_optimizer: from_plan.as_ref().map_or(!o.serial_optimizer, |p| p.overlap_optimizer),
            spill_dir: o.spill_dir.clone().unwrap_or_else(|| out.join("spill")),
            format: o.format.unwrap_or(lt_data::DatasetFormat::Auto),
        })
    }
}

/// What a plan file (`lt plan --out`) fixes about the step, checked against the flags and against
/// what the executor implements.
struct PlanFileStep {
    plan: lt_sched::plan::Plan,
    batch_size: usize,
    seq_len: usize,
    optimizer: OptimizerChoice,
    overlap_optimizer: bool,
}

impl PlanFileStep {
    fn read(path: &Path, o: &RunConfig) -> Result<Self> {
        use lt_sched::cost::{AttentionKernel, OptimizerState};
        let p = lt_sched::plan::Plan::load(path)?;
        let file = path.display();
        if p.step.attention != AttentionKernel::Materialized {
            bail!(
                "{file}: attention: the plan was solved for flash attention, but the executor materialises the \
scores; re-plan with `lt plan --attention materialized`"
            );
        }
        let overlap_optimizer = match p.step.shape.optimizer_overlap {
            lt_sched::OptimizerOverlap::OverlapNextForward => true,
            lt_sched::OptimizerOverlap::Serial => false,
            lt_sched::OptimizerOverlap::OverlapBackward => bail!(
                "{file}: optimizer_overlap: `backward` is not what the executor runs (it overlaps the optimizer \
with the next forward, or runs it serially); re-plan with `lt plan --optimizer-overlap next-forward` or `serial`"
            ),
        };
        if o.serial_optimizer && overlap_optimizer {
            bail!(
                "{file}: optimizer_overlap: the plan overlaps the optimizer with the next forward, but --serial-optimizer asks for serial"
            );
        }
        // The plan fixes the state's size, not the 8-bit format: both formats take the same bytes.
        if let Some(given) = o.optimizer.filter(|g| g.state() != p.optimizer_state) {
            let planned = match p.optimizer_state {
                OptimizerState::Fp32 => "fp32",
                OptimizerState::Blockwise8bit => "8-bit",
            };
            bail!(
                "{file}: optimizer_state: the plan was solved for {planned} optimizer state, but --optimizer is {}",
                given.name()
            );
        }
        let optimizer = match p.optimizer_state {
            OptimizerState::Fp32 => OptimizerChoice::Adamw,
            OptimizerState::Blockwise8bit => OptimizerChoice::DEFAULT,
        };
        for (field, flag, given, planned) in
            [("batch_size", "--batch-size", o.batch_size, p.batch_size), ("seq_len", "--seq-len", o.seq_len, p.seq_len)]
        {
            if let Some(g) = given.filter(|g| *g != planned) {
                bail!("{file}: {field}: the plan was solved for {planned}, but {flag} is {g}");
            }
        }
        Ok(Self { batch_size: p.batch_size, seq_len: p.seq_len, optimizer, overlap_optimizer, plan: p })
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file_key_by_key() {
        let file = RunConfig::default().steps(5).lr(1e-3).cosine(true).gpu_memory(ByteSize::mib(8));
        let flags = RunConfig::default().steps(7).hardware(HardwareSpec::Builtin(BuiltinProfile::H800));
        let merged = flags.over(&file);
        assert_eq!(merged.steps, Some(7), "the flag wins");
        assert_eq!(merged.lr, Some(1e-3), "the file fills what the flags leave unset");
        assert!(merged.cosine);
        assert_eq!(merged.hw.gpu_memory, Some(ByteSize::mib(8)));
        assert_eq!(merged.hw.hardware, Some(HardwareSpec::Builtin(BuiltinProfile::H800)));
    }

    #[test]
    fn run_files_parse_and_unknown_or_mistyped_keys_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(&path, "steps = 3\nbatch-size = 2\nhardware = \"h800\"\ngpu-memory = \"24GiB\"\n").unwrap();
        let c = RunConfig::from_toml_file(&path).unwrap();
        assert_eq!((c.steps, c.batch_size), (Some(3), Some(2)));
        assert_eq!(c.hw.hardware, Some(HardwareSpec::Builtin(BuiltinProfile::H800)));
        assert_eq!(c.hw.gpu_memory, Some(ByteSize::gib(24)));

        std::fs::write(&path, "stpes = 3\n").unwrap();
        let e = RunConfig::from_toml_file(&path).unwrap_err().to_string();
        assert!(e.contains("run.toml") && e.contains("`stpes`") && !e.contains('\n'), "{e}");
        std::fs::write(&path, "steps = \"many\"\n").unwrap();
        let e = format!("{:#}", RunConfig::from_toml_file(&path).unwrap_err());
        assert!(e.contains("run.toml") && e.contains("steps") && !e.contains('\n'), "{e}");
        std::fs::write(&path, "hardware = \"tpu\"\n").unwrap();
        let e = format!("{:#}", RunConfig::from_toml_file(&path).unwrap_err());
        assert!(e.contains("run.toml") && e.contains("tpu"), "{e}");

        // `save-every`: a number of steps or "auto".
        for (text, want) in [("save-every = 50\n", SaveEvery::Steps(50)), ("save-every = \"auto\"\n", SaveEvery::Auto)]
        {
            std::fs::write(&path, text).unwrap();
            assert_eq!(RunConfig::from_toml_file(&path).unwrap().save_every, Some(want), "{text}");
        }
        std::fs::write(&path, "save-every = \"often\"\n").unwrap();
        let e = format!("{:#}", RunConfig::from_toml_file(&path).unwrap_err());
        assert!(e.contains("run.toml") && e.contains("often") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn every_key_is_a_run_file_key_and_the_defaults_resolve() {
        let keys = RunConfig::keys();
        for k in ["model", "steps", "batch-size", "hardware", "gpu-memory", "host-memory", "serial-optimizer"] {
            assert!(keys.iter().any(|x| x == k), "{k} in {keys:?}");
        }
        let s = RunSettings::resolve(&RunConfig::default()).unwrap();
        assert_eq!((s.steps, s.batch_size, s.seq_len), (200, 12, 256), "the demo's defaults");
        assert_eq!(s.hw.hardware, Some(HardwareSpec::Builtin(BuiltinProfile::Cpu)));
        assert_eq!(s.save_every, SaveEvery::Auto);
        let e = RunSettings::resolve(&RunConfig::default().batch_size(4).micro_batch_size(3)).unwrap_err();
        assert!(e.to_string().contains("--micro-batch-size"), "{e}");
    }
}
