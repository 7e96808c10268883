//! Choosing the plan a run executes (the planner, a fixed policy or a plan file), and the executor
//! that runs it.

use std::path::Path;

use anyhow::{Context, Result};
use burn::tensor::backend::AutodiffBackend;
use lt_core::{ByteSize, ModelConfig};
use lt_exec::executor::Executor;
use lt_exec::plan::Step;

use crate::config::{Policy, RunSettings};

/// The plan the executor will run, and what the planner predicted for it (if it planned).
#[derive(Debug, Clone)]
pub struct ChosenPlan {
    /// The step the executor runs, whole: placements, micro-batching, loss chunk, optimizer mode.
    pub plan: Step,
    /// The hardware profile the plan is for (budgets overridden as the settings say); its
    /// `gpu_memory` is the device budget the executor enforces.
    pub hardware: lt_core::hardware::HardwareProfile,
    /// The planner's predicted step time (seconds), when a plan was solved, loaded or replayed.
    pub predicted_step_seconds: Option<f64>,
    /// The simulator's timeline of one step (auto policy only).
    pub predicted_trace: Option<lt_sched::sim::Trace>,
    /// One line describing the plan (printed at the start of a run).
    pub summary: String,
    /// The plan as saved in checkpoints' metadata.
    pub plan_json: serde_json::Value,
}

/// The plan a run with settings `s` executes on model `cfg`: the plan file when one is given, else
/// the policy's (the planner's solution for `auto`).
pub fn choose_plan(s: &RunSettings, cfg: &ModelConfig) -> Result<ChosenPlan> {
    let mut chosen = choose(s, cfg)?;
    let shape = &mut chosen.plan.shape;
    shape.micro_batch_size = shape.micro_batch_size.clamp(1, s.batch_size);
    shape.grad_accum_steps = s.batch_size.div_ceil(shape.micro_batch_size);
    // Each step arrives with its own optimizer mode (MegaTrain's serial, the plan file's, the one the
    // planner was asked for); `--serial-optimizer` makes any of them serial.
    if !s.overlap_optimizer {
        shape.optimizer_overlap = lt_sched::OptimizerOverlap::Serial;
    }
    Ok(chosen)
}

impl ChosenPlan {
    /// Rows per micro-batch (1..=batch size).
    pub fn micro_batch_size(&self) -> usize {
        self.plan.shape.micro_batch_size
    }

    /// Whether the host optimizer overlaps the next step's forward (else it runs after backward).
    pub fn overlap_optimizer(&self) -> bool {
        self.plan.shape.optimizer_overlap != lt_sched::OptimizerOverlap::Serial
    }
}

fn choose(s: &RunSettings, cfg: &ModelConfig) -> Result<ChosenPlan> {
    let mut hw = s.hardware_profile()?;
    // Plan in the float the executor runs (an `--hardware h800` profile on `--device cpu` runs f32).
    hw.compute_dtype_bytes = s.device.float_bytes();
    let layers = cfg.num_layers();
    // Batch, seq, optimizer state and mode were taken from the file, or checked against it, when the
    // settings were resolved.
    if let (Some(path), Some(p)) = (&s.plan, &s.plan_file) {
        p.validate(cfg).with_context(|| format!("{}: plan does not fit this model", path.display()))?;
        let mut plan = p.step.clone();
        plan.shape.micro_batch_size = s.micro_batch_size.unwrap_or(p.step.shape.micro_batch_size);
        return Ok(ChosenPlan {
            plan,
            hardware: hw.clone(),
            predicted_step_seconds: Some(p.predicted.step_seconds),
            predicted_trace: None,
            summary: format!("plan file {}: predicted step {:.3} s", path.display(), p.predicted.step_seconds),
            plan_json: serde_json::to_value(p)?,
        });
    }
    Ok(match s.policy {
        Policy::KeepAll | Policy::RecomputeAll => {
            let mut plan = s.policy.step(layers).context("a fixed policy has a step")?;
            plan.shape.micro_batch_size = s.micro_batch_size.unwrap_or(s.batch_size);
            ChosenPlan {
                summary: format!("policy {}: kept boundaries {:?}", s.policy, plan.kept()),
                plan_json: serde_json::json!({"policy": s.policy.name(), "boundaries": plan.boundaries}),
                plan,
                hardware: hw.clone(),
                predicted_step_seconds: None,
                predicted_trace: None,
            }
        }
        Policy::Megatrain => megatrain(s, cfg, &hw)?,
        Policy::Auto => {
            let mut req = lt_sched::planner::PlanRequest::new(s.batch_size, s.seq_len);
            req.micro_batch_size = s.micro_batch_size;
            req.grad_clipping = s.adamw.max_grad_norm.is_some();
            // Plan the optimizer mode the executor runs: overlapped with the next forward, or serial.
            req.optimizer_overlap = Some(if s.overlap_optimizer {
                lt_sched::OptimizerOverlap::OverlapNextForward
            } else {
                lt_sched::OptimizerOverlap::Serial
            });
            req.trace = true;
            req.cost.optimizer = s.optimizer.state();
            // The executor's attention (lt_model::ops::sdpa) materialises the T x T scores on every
            // backend, so plan with that kernel's FLOPs and memory, not flash attention's.
            req.cost.attention = lt_sched::cost::AttentionKernel::Materialized;
            let out = lt_sched::planner::plan(cfg, &hw, &req)?;
            let p = &out.plan;
            let plan = p.step.clone();
            // Say when the device could hold more per micro-batch than this step asks for: on a
            // device, or on the CPU under an explicit --gpu-memory budget (the CPU profile's own is
            // the host's memory; nor for the demo, whose tiny model would fit thousands).
            let device_budget = s.device != crate::DeviceChoice::Cpu || s.hw.gpu_memory.is_some();
            let room = match s.model {
                Some(_) if device_budget => {
                    lt_sched::planner::max_batch(cfg, &hw, &req, Policy::Auto)?.filter(|m| *m > s.batch_size)
                }
                _ => None,
            };
            ChosenPlan {
                hardware: hw.clone(),
                predicted_step_seconds: Some(p.predicted.step_seconds),
                predicted_trace: Some(out.sim.trace.clone()),
                summary: format!(
                    "plan (auto, {} profile, solved in {:.0} ms): boundaries [{}] (G gpu, H host, N nvme, . recompute), \
micro-batch {} x {} accumulation, loss chunk {} tokens; predicted step {:.3} s, predicted peak device {}{}",
                    hw.name,
                    p.solver.solve_seconds * 1e3,
                    plan.tiers(),
                    p.step.shape.micro_batch_size,
                    p.step.shape.grad_accum_steps,
                    p.step.shape.loss_chunk_tokens,
                    p.predicted.step_seconds,
                    ByteSize(p.predicted.peak_gpu_bytes),
                    room.map_or(String::new(), |m| format!(
                        "; the device budget fits up to {m} sequences in one micro-batch (predicted), this step has {}: \
a larger --batch-size would use more of it",
                        s.batch_size
                    ))
                ),
                plan_json: serde_json::to_value(p)?,
                plan,
            }
        }
    })
}

/// The MegaTrain baseline, defined once (lt-sched's `planner::baseline`, as REFERENCE.md §2 describes
/// MegaTrain): a GPU checkpoint every 4 layers, the optimizer serial after backward, 4,096-token loss
/// chunks, the largest micro-batch that fits. Predicted and measured rows run this same step. (The
/// prediction also counts the logits MegaTrain keeps alive until its final backward; the executor
/// frees each chunk's, so it measures that memory as lower.)
fn megatrain(s: &RunSettings, cfg: &ModelConfig, hw: &lt_core::hardware::HardwareProfile) -> Result<ChosenPlan> {
    let mut req = lt_sched::planner::PlanRequest::new(s.batch_size, s.seq_len);
    req.trace = true;
    req.cost.optimizer = s.optimizer.state();
    req.cost.attention = lt_sched::cost::AttentionKernel::Materialized;
    let Some((p, sim)) = lt_sched::planner::baseline(cfg, hw, &req, Policy::Megatrain)? else {
        anyhow::bail!(
            "policy megatrain: not even one sequence of {} tokens per micro-batch fits the {} device memory of the {} \
profile (predicted); try --gpu-memory or --policy auto",
            s.seq_len,
            hw.gpu_memory,
            hw.name
        );
    };
    // A micro-batch given on the command line is run as given; the prediction is for the baseline's.
    let micro_batch_size = s.micro_batch_size.unwrap_or(p.step.shape.micro_batch_size);
    let predicted = (micro_batch_size == p.step.shape.micro_batch_size).then_some(p.predicted.step_seconds);
    let mut plan = p.step.clone();
    plan.shape.micro_batch_size = micro_batch_size;
    Ok(ChosenPlan {
        plan,
        hardware: hw.clone(),
        summary: format!(
            "policy megatrain (a GPU checkpoint every {} layers, serial optimizer, {}-token loss chunks): micro-batch \
{} x {} accumulation{}",
            lt_sched::plan::MEGATRAIN_INTERVAL,
            p.step.shape.loss_chunk_tokens,
            micro_batch_size,
            s.batch_size / micro_batch_size.max(1),
            predicted.map(|t| format!("; predicted step {t:.3} s")).unwrap_or_default()
        ),
        plan_json: serde_json::to_value(&p)?,
        predicted_step_seconds: predicted,
        predicted_trace: predicted.map(|_| sim.trace),
    })
}

/// The plan needs more device memory than the budget allows (checked before anything is uploaded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetTooSmall {
    /// The device budget.
    pub budget: ByteSize,
    /// What the plan needs at its peak.
    pub needed: ByteSize,
    /// Rows per micro-batch.
    pub micro_batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
}

impl std::fmt::Display for BudgetTooSmall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device memory budget {} is too small for micro-batch {} x {} tokens with this plan: it needs at least {} \
(try --gpu-memory {} or a smaller --micro-batch-size)",
            self.budget,
            self.micro_batch_size,
            self.seq_len,
            self.needed,
            lt_exec::budget::round_up(self.needed.0)
        )
    }
}

impl std::error::Error for BudgetTooSmall {}

/// The executor for `chosen`: an NVMe spill store in `spill_dir` when the plan spills (sized for
/// every spilled boundary of one micro-batch), and the device budget checked against the plan's
/// peak. Returns the executor and, when a spill store was opened, one line describing it.
pub fn executor_for<B: AutodiffBackend>(
    chosen: &ChosenPlan,
    cfg: &ModelConfig,
    seq_len: usize,
    device: <B::InnerBackend as burn::tensor::backend::BackendTypes>::Device,
    spill_dir: &Path,
) -> Result<(Executor<B>, Option<String>)> {
    let micro = chosen.micro_batch_size();
    let capacity = lt_exec::executor::spill_capacity::<B::InnerBackend>(&chosen.plan, cfg, micro, seq_len);
    let (spill, note) = if capacity > 0 {
        let (store, note) = crate::spill::open(spill_dir, capacity)?;
        (Some(store), Some(note))
    } else {
        (None, None)
    };
    // The memory model counts for the plan's own profile (its reserved memory included), so the
    // executor refuses exactly what the planner would not plan.
    let executor = Executor::<B>::new(chosen.plan.clone(), chosen.hardware.gpu_memory, device, spill)
        .with_hardware(chosen.hardware.clone());
    let need = executor.required_device_bytes(cfg, micro, seq_len);
    if need > chosen.hardware.gpu_memory.0 {
        return Err(BudgetTooSmall {
            budget: chosen.hardware.gpu_memory,
            needed: ByteSize(need),
            micro_batch_size: micro,
            seq_len,
        }
        .into());
    }
    Ok((executor, note))
}
