//! The plan: what the executor runs, in a versioned JSON file.
//!
//! # Semantics (the executor's contract)
//! Boundaries are numbered `0..=L`: boundary `i` is the input of decoder layer `i`, boundary `L` the
//! input of the final norm and head. Each boundary is kept in a [`Tier`] or recomputed; boundaries `0`
//! and `L` are always kept on the GPU. In backward, for each segment between kept boundaries `s < e`
//! (top segment first), the executor reloads boundary `s` from its tier, re-runs the forward of layers
//! `s..=e-2` keeping their outputs (boundaries `s+1..e-1`) on the GPU, then runs the backward of layers
//! `e-1` down to `s`; each layer's backward starts with a graph-recording forward from its input.
//!
//! A step is `grad_accum_steps` micro-batches of `micro_batch_size` sequences, each with the same
//! placements; the loss runs in chunks of `loss_chunk_tokens` tokens; the host optimizer runs as
//! [`OptimizerOverlap`] says.

use std::path::Path;

use lt_core::ModelConfig;
use lt_core::config::{Family, LayerKind};
use lt_core::hardware::HardwareProfile;
use serde::{Deserialize, Serialize};

use crate::SchedError;
use crate::cost::{AttentionKernel, ExecConfig, OptimizerState};

/// The plan file version this build writes and reads.
pub const PLAN_VERSION: u32 = 1;

/// Where a kept boundary lives between forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// GPU memory.
    Gpu,
    /// Pinned host memory.
    Host,
    /// NVMe, through pinned staging buffers.
    Nvme,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Host, Tier::Nvme];

    /// Index in [`Tier::ALL`].
    pub fn index(self) -> usize {
        match self {
            Tier::Gpu => 0,
            Tier::Host => 1,
            Tier::Nvme => 2,
        }
    }
}

/// The placement of one boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Kept on the GPU.
    Gpu,
    /// Kept in pinned host memory.
    Host,
    /// Kept on NVMe.
    Nvme,
    /// Dropped after forward and recomputed in backward.
    Recompute,
}

impl Placement {
    /// The tier of a kept boundary, `None` when recomputed.
    pub fn tier(self) -> Option<Tier> {
        match self {
            Placement::Gpu => Some(Tier::Gpu),
            Placement::Host => Some(Tier::Host),
            Placement::Nvme => Some(Tier::Nvme),
            Placement::Recompute => None,
        }
    }

    /// Whether the boundary is kept in some tier.
    pub fn is_kept(self) -> bool {
        self != Placement::Recompute
    }

    /// Kept somewhere other than the GPU.
    pub fn is_offloaded(self) -> bool {
        matches!(self, Placement::Host | Placement::Nvme)
    }
}

impl From<Tier> for Placement {
    fn from(t: Tier) -> Self {
        match t {
            Tier::Gpu => Placement::Gpu,
            Tier::Host => Placement::Host,
            Tier::Nvme => Placement::Nvme,
        }
    }
}

/// When the host optimizer updates the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerOverlap {
    /// After the last micro-batch's backward, all layers, then the next step starts (MegaTrain).
    Serial,
    /// Layer `j` is updated as soon as its gradient of the last micro-batch arrives, during backward.
    /// The update happens before the global gradient norm is known, so this mode is exact only without
    /// global-norm clipping.
    OverlapBackward,
    /// After backward (global norm known), layers are updated in forward order while the next step's
    /// forward runs; layer `i`'s upload waits for its update.
    OverlapNextForward,
}

impl OptimizerOverlap {
    /// Every mode.
    pub const ALL: [OptimizerOverlap; 3] = [Self::Serial, Self::OverlapBackward, Self::OverlapNextForward];

    /// Whether the mode keeps exact global-norm gradient clipping.
    pub fn exact_with_clipping(self) -> bool {
        self != Self::OverlapBackward
    }
}

/// Per-stream times, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct StreamTimes {
    /// Host-to-device copies.
    pub h2d: f64,
    /// Device-to-host copies.
    pub d2h: f64,
    /// NVMe reads and writes.
    pub nvme: f64,
    /// Host optimizer.
    pub cpu: f64,
}

impl StreamTimes {
    /// Sum over streams.
    pub fn total(&self) -> f64 {
        self.h2d + self.d2h + self.nvme + self.cpu
    }
}

/// The model a plan was solved for (enough to check it against a config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanModel {
    /// Family.
    pub family: Family,
    /// Decoder layers.
    pub num_layers: usize,
    /// Width.
    pub hidden_size: usize,
    /// Vocabulary.
    pub vocab_size: usize,
    /// All parameters, embedding included.
    pub total_params: u64,
    /// Kind of each layer.
    pub layer_types: Vec<LayerKind>,
}

impl PlanModel {
    /// Describe `model`.
    pub fn of(model: &ModelConfig) -> Self {
        Self {
            family: model.family,
            num_layers: model.num_layers(),
            hidden_size: model.hidden_size,
            vocab_size: model.vocab_size,
            total_params: model.total_params() as u64,
            layer_types: model.layer_types.clone(),
        }
    }
}

/// The figures the cost model predicts for a plan. All are predictions, none is measured.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Predicted {
    /// Step time replayed by the simulator, seconds (predicted).
    pub step_seconds: f64,
    /// Step time by the MILP's window model (its objective plus constants), seconds (predicted).
    pub model_step_seconds: f64,
    /// Tokens per second (predicted).
    pub tokens_per_second: f64,
    /// `6 x params x tokens / step` (the published formula), TFLOPS (predicted).
    pub tflops: f64,
    /// FLOPs executed (attention, recompute and graph-recording forwards included) / step, TFLOPS
    /// (predicted).
    pub hardware_tflops: f64,
    /// Time the compute stream waits on each other stream per step, seconds (predicted).
    pub exposed_seconds: StreamTimes,
    /// Peak GPU bytes of the memory model (`window::gpu_peak`, the function lt-exec checks its budget
    /// with), predicted.
    pub peak_gpu_bytes: u64,
    /// Peak host bytes (predicted).
    pub peak_host_bytes: u64,
    /// Peak NVMe bytes (predicted).
    pub peak_nvme_bytes: u64,
}

/// How the plan was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolveMethod {
    /// The MILP, proved optimal within its gap.
    Milp,
    /// The MILP's best incumbent when its time limit ran out.
    MilpIncumbent,
    /// The exact dynamic program (MILP failed or timed out without an incumbent).
    Dp,
    /// The greedy fallback.
    Greedy,
    /// A fixed policy (baselines).
    Fixed,
}

/// Solver bookkeeping stored with the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SolverInfo {
    /// What produced the placements.
    pub method: SolveMethod,
    /// Wall time of the whole planning, seconds.
    pub solve_seconds: f64,
    /// The MILP's relative gap when it stopped, if it ran.
    pub mip_gap: Option<f64>,
    /// Warnings (fallbacks, validation notes).
    pub warnings: Vec<String>,
}

/// A plan for one model, machine, batch and sequence length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// File format version ([`PLAN_VERSION`]).
    pub version: u32,
    /// The model it was solved for.
    pub model: PlanModel,
    /// The machine it was solved for.
    pub hardware: HardwareProfile,
    /// Sequences per optimizer step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// The step the executor runs: placements, micro-batching, loss chunk, optimizer mode, attention
    /// (flattened: the file keeps one flat object).
    #[serde(flatten)]
    pub step: Step,
    /// Optimizer-state precision the host memory assumed.
    #[serde(default)]
    pub optimizer_state: OptimizerState,
    /// Predicted figures.
    pub predicted: Predicted,
    /// How it was solved.
    pub solver: SolverInfo,
}

impl Plan {
    /// The step shape of this plan.
    pub fn exec_config(&self) -> ExecConfig {
        self.step.shape
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.step.num_layers()
    }

    /// Segments `(s, e)` between consecutive kept boundaries, in forward order.
    pub fn segments(&self) -> Vec<(usize, usize)> {
        segments(&self.step.boundaries)
    }

    /// Check the plan's own rules and that it matches `model`.
    ///
    /// # Errors
    /// [`SchedError::PlanMismatch`] when the model differs, [`SchedError::InvalidPlan`] when a rule
    /// is broken.
    pub fn validate(&self, model: &ModelConfig) -> Result<(), SchedError> {
        let mismatch = |field, plan: String, model: String| Err(SchedError::PlanMismatch { field, plan, model });
        if self.model.num_layers != model.num_layers() {
            return mismatch("num_layers", self.model.num_layers.to_string(), model.num_layers().to_string());
        }
        if self.model.hidden_size != model.hidden_size {
            return mismatch("hidden_size", self.model.hidden_size.to_string(), model.hidden_size.to_string());
        }
        if self.model.vocab_size != model.vocab_size {
            return mismatch("vocab_size", self.model.vocab_size.to_string(), model.vocab_size.to_string());
        }
        if self.model.layer_types != model.layer_types {
            return mismatch(
                "layer_types",
                format!("{:?}", self.model.layer_types),
                format!("{:?}", model.layer_types),
            );
        }
        if self.model.total_params != model.total_params() as u64 {
            return mismatch("total_params", self.model.total_params.to_string(), model.total_params().to_string());
        }
        self.validate_rules()
    }

    /// Check the rules that do not need the model.
    ///
    /// # Errors
    /// [`SchedError::InvalidPlan`] naming the broken rule.
    pub fn validate_rules(&self) -> Result<(), SchedError> {
        let bad = |field, reason: String| Err(SchedError::InvalidPlan { field, reason });
        if self.version != PLAN_VERSION {
            return bad("version", format!("{} (expected {PLAN_VERSION})", self.version));
        }
        self.step.validate(self.model.num_layers)?;
        let shape = &self.step.shape;
        if shape.micro_batch_size * shape.grad_accum_steps != self.batch_size {
            return bad(
                "batch_size",
                format!(
                    "{} != micro_batch_size {} x grad_accum_steps {}",
                    self.batch_size, shape.micro_batch_size, shape.grad_accum_steps
                ),
            );
        }
        if self.seq_len == 0 {
            return bad("seq_len", "must be > 0".into());
        }
        Ok(())
    }

    /// Write the plan as pretty JSON.
    ///
    /// # Errors
    /// [`SchedError::Write`] when the file cannot be written.
    pub fn save(&self, path: &Path) -> Result<(), SchedError> {
        let name = path.display().to_string();
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| SchedError::Write { path: name.clone(), source: std::io::Error::other(e.to_string()) })?;
        std::fs::write(path, text + "\n").map_err(|source| SchedError::Write { path: name, source })
    }

    /// Read a plan file, checking its version first and then its rules.
    ///
    /// # Errors
    /// [`SchedError::Read`], [`SchedError::PlanJson`], [`SchedError::PlanVersion`] or
    /// [`SchedError::InvalidPlan`].
    pub fn load(path: &Path) -> Result<Self, SchedError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| SchedError::Read { path: name.clone(), source })?;
        Self::from_json_named(&text, &name)
    }

    /// Parse a plan from JSON text; `name` labels errors.
    ///
    /// # Errors
    /// As [`Plan::load`].
    pub fn from_json_named(text: &str, name: &str) -> Result<Self, SchedError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|source| SchedError::PlanJson { path: name.to_string(), source })?;
        let found = value.get("version").and_then(serde_json::Value::as_u64).unwrap_or(0);
        if found != PLAN_VERSION as u64 {
            return Err(SchedError::PlanVersion { path: name.to_string(), found, expected: PLAN_VERSION });
        }
        let plan: Plan =
            serde_json::from_value(value).map_err(|source| SchedError::PlanJson { path: name.to_string(), source })?;
        plan.validate_rules()?;
        Ok(plan)
    }
}

/// The step contract: what the planner produces, the simulator replays and lt-exec executes, whole.
///
/// Every fixed policy is a constructor of this one type ([`Step::keep_all`], [`Step::recompute_all`],
/// [`Step::megatrain`]); the planner's choice is [`Plan::step`]. The constructors use one sequence per
/// micro-batch, no accumulation, 1,024-token loss chunks, the optimizer overlapped with the next
/// forward and materialised attention (what lt-exec runs); set [`Step::shape`] to change them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// Micro-batching, loss chunk, optimizer mode, MegaTrain's retained logits.
    #[serde(flatten)]
    pub shape: ExecConfig,
    /// Attention kernel.
    #[serde(default)]
    pub attention: AttentionKernel,
    /// Placement of boundaries `0..=L`.
    pub boundaries: Vec<Placement>,
}

/// Loss chunk of [`Step`]'s constructors, tokens.
pub const DEFAULT_LOSS_CHUNK: usize = 1024;

/// MegaTrain's checkpoint interval, layers (shared/REFERENCE.md §2).
pub const MEGATRAIN_INTERVAL: usize = 4;

/// MegaTrain's loss chunk, tokens (its chunk size is not published; 4096 is one of ours).
pub const MEGATRAIN_LOSS_CHUNK: usize = 4096;

impl Step {
    /// A step over `boundaries` with the default shape (see [`Step`]).
    pub fn new(boundaries: Vec<Placement>) -> Self {
        Self {
            shape: ExecConfig {
                micro_batch_size: 1,
                grad_accum_steps: 1,
                loss_chunk_tokens: DEFAULT_LOSS_CHUNK,
                optimizer_overlap: OptimizerOverlap::OverlapNextForward,
                retain_all_logits: false,
            },
            attention: AttentionKernel::Materialized,
            boundaries,
        }
    }

    /// Keep every boundary on the GPU.
    pub fn keep_all(layers: usize) -> Self {
        Self::new(vec![Placement::Gpu; layers + 1])
    }

    /// Keep only boundaries 0 and L; recompute everything in between.
    pub fn recompute_all(layers: usize) -> Self {
        Self::every(layers, layers.max(1) + 1, Placement::Gpu)
    }

    /// A checkpoint every `k` layers kept in `tier` (0 and L always on the GPU), the rest recomputed.
    pub fn every(layers: usize, k: usize, tier: Placement) -> Self {
        let k = k.max(1);
        let boundaries = (0..=layers)
            .map(|i| {
                if i == 0 || i == layers {
                    Placement::Gpu
                } else if i % k == 0 {
                    tier
                } else {
                    Placement::Recompute
                }
            })
            .collect();
        Self::new(boundaries)
    }

    /// Every interior boundary in `tier` (e.g. all on NVMe).
    pub fn all_in(layers: usize, tier: Placement) -> Self {
        Self::every(layers, 1, tier)
    }

    /// MegaTrain as published: a GPU checkpoint every [`MEGATRAIN_INTERVAL`] layers, the optimizer
    /// serial after backward, [`MEGATRAIN_LOSS_CHUNK`]-token loss chunks whose logits are all kept until
    /// one final backward.
    pub fn megatrain(layers: usize) -> Self {
        let mut s = Self::every(layers, MEGATRAIN_INTERVAL, Placement::Gpu);
        s.shape.optimizer_overlap = OptimizerOverlap::Serial;
        s.shape.loss_chunk_tokens = MEGATRAIN_LOSS_CHUNK;
        s.shape.retain_all_logits = true;
        s
    }

    /// The same step with `micro_batch_size` sequences per micro-batch and `grad_accum_steps`
    /// micro-batches.
    pub fn with_micro_batches(mut self, micro_batch_size: usize, grad_accum_steps: usize) -> Self {
        self.shape.micro_batch_size = micro_batch_size;
        self.shape.grad_accum_steps = grad_accum_steps;
        self
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.boundaries.len().saturating_sub(1)
    }

    /// Check the step's own rules for a model of `layers` layers.
    ///
    /// # Errors
    /// [`SchedError::InvalidPlan`] naming the broken rule.
    pub fn validate(&self, layers: usize) -> Result<(), SchedError> {
        let bad = |field, reason: &str| Err(SchedError::InvalidPlan { field, reason: reason.into() });
        check_boundaries(&self.boundaries, layers)?;
        if self.shape.micro_batch_size == 0 || self.shape.grad_accum_steps == 0 {
            return bad("micro_batch_size", "micro_batch_size and grad_accum_steps must be > 0");
        }
        if self.shape.loss_chunk_tokens == 0 {
            return bad("loss_chunk_tokens", "must be > 0");
        }
        Ok(())
    }

    /// One letter per boundary: `G` GPU, `H` host, `N` NVMe, `.` recomputed.
    pub fn tiers(&self) -> String {
        self.boundaries
            .iter()
            .map(|p| match p {
                Placement::Gpu => 'G',
                Placement::Host => 'H',
                Placement::Nvme => 'N',
                Placement::Recompute => '.',
            })
            .collect()
    }

    /// Kept boundaries in order (always includes 0 and L).
    pub fn kept(&self) -> Vec<usize> {
        self.boundaries.iter().enumerate().filter(|(_, p)| p.is_kept()).map(|(i, _)| i).collect()
    }

    /// Segments `(s, e)` between consecutive kept boundaries, top segment first (backward order).
    pub fn segments_backward(&self) -> Vec<(usize, usize)> {
        let mut s = segments(&self.boundaries);
        s.reverse();
        s
    }

    /// The h2d stream's transfers for one micro-batch, in the order compute consumes them:
    /// the embedded tokens (gathered from the host embedding, so the embedding matrix never goes to the
    /// device), the forward layers, the head (final norm and output projection) when `with_head`,
    /// i.e. on the step's first micro-batch, while the last forward layer computes, and then per
    /// backward segment the segment's start boundary if it lives off the GPU, the recompute layers
    /// and the backward layers. The executor runs exactly this list; the simulator replays it.
    pub fn uploads(&self, with_head: bool) -> Vec<Upload> {
        let layers = self.num_layers();
        let mut out = vec![Upload::Embed];
        out.extend((0..layers).map(Upload::Layer));
        if with_head {
            out.push(Upload::Head);
        }
        for (s, e) in self.segments_backward() {
            if self.boundaries[s].is_offloaded() {
                out.push(Upload::Boundary(s));
            }
            out.extend((s..e.saturating_sub(1)).map(Upload::Layer));
            out.extend((s..e).rev().map(Upload::Layer));
        }
        out
    }

    /// Host-to-device transfers of one step of `micro_batches` micro-batches: the head once, the rest
    /// per micro-batch (see [`Step::uploads`]).
    pub fn uploads_per_step(&self, micro_batches: usize) -> usize {
        if micro_batches == 0 {
            return 0;
        }
        self.uploads(true).len() + (micro_batches - 1) * self.uploads(false).len()
    }
}

/// One host-to-device transfer of the h2d stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upload {
    /// The micro-batch's embedded tokens, `[B, T, hidden]` (boundary 0).
    Embed,
    /// Decoder layer `i`'s weights.
    Layer(usize),
    /// Final norm and output projection (the embedding matrix when tied).
    Head,
    /// Offloaded boundary `s` coming back for its backward segment.
    Boundary(usize),
}

impl std::fmt::Display for Upload {
    /// The name of the transfer's span in the trace.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Upload::Embed => write!(f, "upload embed"),
            Upload::Layer(i) => write!(f, "upload L{i}"),
            Upload::Head => write!(f, "upload head"),
            Upload::Boundary(s) => write!(f, "reload B{s}"),
        }
    }
}

/// Check `boundaries` for a model of `layers` layers: `L + 1` entries, 0 and L on the GPU.
///
/// # Errors
/// [`SchedError::InvalidPlan`].
pub fn check_boundaries(boundaries: &[Placement], layers: usize) -> Result<(), SchedError> {
    if layers == 0 || boundaries.len() != layers + 1 {
        return Err(SchedError::InvalidPlan {
            field: "boundaries",
            reason: format!("{} entries for a {layers}-layer model (need {})", boundaries.len(), layers + 1),
        });
    }
    if boundaries[0] != Placement::Gpu || boundaries[layers] != Placement::Gpu {
        return Err(SchedError::InvalidPlan {
            field: "boundaries",
            reason: "boundaries 0 and L must be kept on the GPU".into(),
        });
    }
    Ok(())
}

/// Segments `(s, e)` between consecutive kept boundaries, in forward order.
pub fn segments(boundaries: &[Placement]) -> Vec<(usize, usize)> {
    let kept: Vec<usize> = boundaries.iter().enumerate().filter(|(_, p)| p.is_kept()).map(|(i, _)| i).collect();
    kept.windows(2).map(|w| (w[0], w[1])).collect()
}

/// Which layers a plan re-runs in a recompute pass: layers `s..=e-2` of every segment.
pub fn recomputed_layers(boundaries: &[Placement]) -> Vec<bool> {
    let layers = boundaries.len().saturating_sub(1);
    let mut r = vec![false; layers];
    for (s, e) in segments(boundaries) {
        for x in r.iter_mut().take(e.saturating_sub(1)).skip(s) {
            *x = true;
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use lt_core::hardware::BuiltinProfile;

    fn tiny_model(layers: usize) -> ModelConfig {
        let j = serde_json::json!({
            "model_type": "qwen2", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": true});
        ModelConfig::from_json_str(&j.to_string()).unwrap()
    }

    fn plan_for(model: &ModelConfig) -> Plan {
        let l = model.num_layers();
        let mut boundaries = vec![Placement::Recompute; l + 1];
        boundaries[0] = Placement::Gpu;
        boundaries[2] = Placement::Host;
        boundaries[l] = Placement::Gpu;
        Plan {
            version: PLAN_VERSION,
            model: PlanModel::of(model),
            hardware: BuiltinProfile::Cpu.profile(),
            batch_size: 4,
            seq_len: 16,
            step: Step {
                shape: ExecConfig {
                    micro_batch_size: 2,
                    grad_accum_steps: 2,
                    loss_chunk_tokens: 8,
                    optimizer_overlap: OptimizerOverlap::OverlapNextForward,
                    retain_all_logits: false,
                },
                attention: AttentionKernel::Flash,
                boundaries,
            },
            optimizer_state: OptimizerState::Fp32,
            predicted: Predicted::default(),
            solver: SolverInfo { method: SolveMethod::Milp, solve_seconds: 0.0, mip_gap: None, warnings: vec![] },
        }
    }

    #[test]
    fn save_load_round_trip() {
        let m = tiny_model(5);
        let p = plan_for(&m);
        let dir = std::env::temp_dir().join(format!("lt-sched-plan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("plan.json");
        p.save(&path).unwrap();
        let q = Plan::load(&path).unwrap();
        assert_eq!(p, q);
        q.validate(&m).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"version\": 1"));
        assert!(text.contains("\"host\""));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn wrong_version_is_refused_before_fields() {
        let m = tiny_model(3);
        let mut v = serde_json::to_value(plan_for(&m)).unwrap();
        v["version"] = 2.into();
        v.as_object_mut().unwrap().remove("boundaries");
        let e = Plan::from_json_named(&v.to_string(), "p.json").unwrap_err().to_string();
        assert_eq!(e, "p.json: plan version 2 is not supported (this build reads version 1)");
    }

    #[test]
    fn plan_for_another_model_is_refused() {
        let p = plan_for(&tiny_model(5));
        let e = p.validate(&tiny_model(6)).unwrap_err().to_string();
        assert!(e.contains("num_layers: the plan has 5, the model has 6"), "{e}");
    }

    #[test]
    fn boundary_rules_are_checked() {
        let m = tiny_model(4);
        let mut p = plan_for(&m);
        p.step.boundaries[4] = Placement::Host;
        assert!(p.validate(&m).unwrap_err().to_string().contains("boundaries 0 and L"));
        let mut p = plan_for(&m);
        p.step.shape.grad_accum_steps = 3;
        assert!(p.validate(&m).unwrap_err().to_string().contains("batch_size"));
    }

    #[test]
    fn segments_and_recomputed_layers() {
        use Placement::*;
        let b = [Gpu, Recompute, Recompute, Host, Gpu, Recompute, Gpu];
        assert_eq!(segments(&b), vec![(0, 3), (3, 4), (4, 6)]);
        // Segment (0, 3) re-runs layers 0 and 1; (4, 6) re-runs layer 4.
        assert_eq!(recomputed_layers(&b), vec![true, true, false, false, true, false]);
    }

    #[test]
    fn megatrain_every_four_and_segments() {
        let p = Step::megatrain(10);
        assert_eq!(p.kept(), vec![0, 4, 8, 10]);
        assert_eq!(p.segments_backward(), vec![(8, 10), (4, 8), (0, 4)]);
        assert_eq!(p.shape.optimizer_overlap, OptimizerOverlap::Serial);
        assert_eq!(p.shape.loss_chunk_tokens, MEGATRAIN_LOSS_CHUNK);
        p.validate(10).unwrap();
        assert!(p.validate(9).is_err());
        assert_eq!(Step::recompute_all(4).tiers(), "G...G");
        assert_eq!(Step::keep_all(2).tiers(), "GGG");
        assert_eq!(Step::all_in(3, Placement::Nvme).tiers(), "GNNG");
    }

    /// Forward layers, the head once, then per segment: its off-GPU start, recompute, backward.
    #[test]
    fn upload_schedule_follows_the_segments() {
        use Upload::*;
        // Boundaries [gpu, recompute, host, recompute, gpu]: segments (2, 4) then (0, 2).
        let p = Step::every(4, 2, Placement::Host);
        assert_eq!(p.segments_backward(), vec![(2, 4), (0, 2)]);
        let want = [
            Embed,
            Layer(0),
            Layer(1),
            Layer(2),
            Layer(3),
            Head,
            Boundary(2),
            Layer(2),
            Layer(3),
            Layer(2),
            Layer(0),
            Layer(1),
            Layer(0),
        ];
        assert_eq!(p.uploads(true), want);
        let later: Vec<Upload> = want.iter().copied().filter(|u| *u != Head).collect();
        assert_eq!(p.uploads(false), later);
        assert_eq!(p.uploads_per_step(3), 13 + 2 * 12);
        assert_eq!(p.uploads_per_step(0), 0);
    }

    #[test]
    fn step_ends_must_be_on_the_gpu() {
        let mut p = Step::keep_all(3);
        p.boundaries[3] = Placement::Host;
        assert!(p.validate(3).is_err());
    }
}
