//! Predicted rows: lt-sched's planner and simulator, called in-process the way `lt plan` calls them
//! (`PlanRequest::new(batch, seq)`: the planner chooses micro-batch, loss chunk and optimizer overlap,
//! with clipping on; MegaTrain is `planner::baseline`; the max batch is `planner::max_batch`).

use std::time::Instant;

use anyhow::{Context, Result};
use lt_core::ModelConfig;
use lt_core::hardware::HardwareProfile;
use lt_sched::SchedError;
use lt_sched::hardware::load_profile;
use lt_sched::planner::{self, PlanRequest, Policy};

use crate::bench_train::StepMetrics;
use crate::matrix::Matrix;
use crate::report::{MaxBatchRow, Source, Status, StepRow, gib_text};

/// A loaded model of the matrix.
pub struct LoadedModel {
    /// Name from the matrix.
    pub name: String,
    /// Its config.
    pub config: ModelConfig,
}

/// Load every model config of `m`.
///
/// # Errors
/// When a config does not parse.
pub fn load_models(m: &Matrix) -> Result<Vec<LoadedModel>> {
    m.file
        .models
        .iter()
        .zip(&m.model_paths)
        .map(|(e, p)| {
            let config = ModelConfig::from_path(p).with_context(|| format!("reading {}", p.display()))?;
            Ok(LoadedModel { name: e.name.clone(), config })
        })
        .collect()
}

/// The matrix's hardware profile.
///
/// # Errors
/// When the profile does not load or validate.
pub fn profile(m: &Matrix) -> Result<HardwareProfile> {
    load_profile(&m.hardware).with_context(|| format!("{}: field `hardware`", m.path.display()))
}

fn metrics_of(plan: &lt_sched::Plan) -> StepMetrics {
    let p = &plan.predicted;
    StepMetrics {
        step_seconds: p.step_seconds,
        tokens_per_s: Some(p.tokens_per_second),
        tflops_6pt: Some(p.tflops),
        tflops_full: Some(p.hardware_tflops),
        peak_device_bytes: Some(p.peak_gpu_bytes),
        peak_host_bytes: Some(p.peak_host_bytes),
        exposed_seconds: serde_json::to_value(p.exposed_seconds).ok(),
        predicted_step_seconds: Some(p.step_seconds),
        micro_batch_size: Some(plan.step.shape.micro_batch_size),
        grad_accum_steps: Some(plan.step.shape.grad_accum_steps),
    }
}

/// A short "needs X, profile has Y" for an infeasible request.
pub fn infeasible_reason(e: &SchedError) -> String {
    match e {
        SchedError::Infeasible { host_memory, min_host_memory: Some(h), .. } => {
            format!("needs {} host memory, profile has {}", gib_text(*h), gib_text(*host_memory))
        }
        SchedError::Infeasible { gpu_memory, min_gpu_memory: Some(g), .. } => {
            format!("needs {} GPU memory at micro-batch 1, profile has {}", gib_text(*g), gib_text(*gpu_memory))
        }
        other => other.to_string(),
    }
}

/// Why the fixed policy `which` fits no micro-batch of `req`: host memory when it fits with unbounded host
/// memory, else GPU memory.
fn fixed_reason(model: &ModelConfig, hw: &HardwareProfile, req: &PlanRequest, which: Policy) -> String {
    let mut big_host = hw.clone();
    big_host.host_memory.0 = 1 << 50;
    match planner::baseline(model, &big_host, req, which) {
        Ok(Some((plan, _))) => format!(
            "needs {} host memory, profile has {}",
            gib_text(plan.predicted.peak_host_bytes),
            gib_text(hw.host_memory.0)
        ),
        Ok(None) => {
            format!("policy {which} fits no micro-batch in {} GPU memory (even 1 sequence)", gib_text(hw.gpu_memory.0))
        }
        Err(e) => e.to_string(),
    }
}

/// One predicted step row.
pub fn step_row(model: &LoadedModel, hw: &HardwareProfile, batch: usize, seq: usize, policy: Policy) -> StepRow {
    let req = PlanRequest::new(batch, seq);
    let (status, reason, metrics) = match policy {
        Policy::Auto => match planner::plan(&model.config, hw, &req) {
            Ok(o) => (Status::Ok, None, Some(metrics_of(&o.plan))),
            Err(e @ SchedError::Infeasible { .. }) => (Status::Skipped, Some(infeasible_reason(&e)), None),
            Err(e) => (Status::Failed, Some(e.to_string()), None),
        },
        fixed => match planner::baseline(&model.config, hw, &req, fixed) {
            Ok(Some((plan, _))) => (Status::Ok, None, Some(metrics_of(&plan))),
            Ok(None) => (Status::Skipped, Some(fixed_reason(&model.config, hw, &req, fixed)), None),
            Err(e) => (Status::Failed, Some(e.to_string()), None),
        },
    };
    StepRow {
        model: model.name.clone(),
        params: model.config.total_params() as u64,
        batch_size: batch,
        seq_len: seq,
        policy,
        source: Source::Predicted,
        status,
        reason,
        metrics,
        speedup_vs_megatrain: None,
        lt_output: None,
    }
}

/// One predicted max-batch row (largest batch in one micro-batch, as `lt plan --max-batch`).
pub fn max_batch_row(model: &LoadedModel, hw: &HardwareProfile, seq: usize, policy: Policy) -> MaxBatchRow {
    let req = PlanRequest::new(1, seq);
    let (status, reason, max_batch) = match planner::max_batch(&model.config, hw, &req, policy) {
        Ok(Some(b)) => (Status::Ok, None, Some(b)),
        Ok(None) => {
            let why = match policy {
                Policy::Auto => match planner::plan(&model.config, hw, &req) {
                    Err(e) => infeasible_reason(&e),
                    Ok(_) => "not even one sequence fits in one micro-batch".into(),
                },
                fixed => fixed_reason(&model.config, hw, &req, fixed),
            };
            (Status::Skipped, Some(why), None)
        }
        Err(e) => (Status::Failed, Some(e.to_string()), None),
    };
    MaxBatchRow {
        model: model.name.clone(),
        params: model.config.total_params() as u64,
        seq_len: seq,
        policy,
        source: Source::Predicted,
        status,
        reason,
        max_batch,
        probes: Vec::new(),
    }
}

/// Every predicted row of `m`, with progress on stderr.
///
/// # Errors
/// When a model or the profile does not load.
pub fn run(m: &Matrix) -> Result<(Vec<StepRow>, Vec<MaxBatchRow>)> {
    let hw = profile(m)?;
    let models = load_models(m)?;
    let f = &m.file;
    let mb_policies = f.max_batch.as_ref().map_or(&[][..], |x| &x.policies[..]);
    let total = models.len() * (f.batch_sizes.len() * f.policies.len() + mb_policies.len());
    let mut done = 0;
    let mut rows = Vec::new();
    let mut max_rows = Vec::new();
    for model in &models {
        for &b in &f.batch_sizes {
            for &p in &f.policies {
                done += 1;
                let t = Instant::now();
                eprint!("[{done}/{total}] predicting {} batch {b} x {} {p} ... ", model.name, f.seq_len);
                let row = step_row(model, &hw, b, f.seq_len, p);
                eprintln!("{} ({:.2} s)", progress_word(row.status, row.reason.as_deref()), t.elapsed().as_secs_f64());
                rows.push(row);
            }
        }
        for &p in mb_policies {
            done += 1;
            let t = Instant::now();
            eprint!("[{done}/{total}] predicting {} max batch at seq {} {p} ... ", model.name, f.seq_len);
            let row = max_batch_row(model, &hw, f.seq_len, p);
            let what =
                row.max_batch.map_or_else(|| progress_word(row.status, row.reason.as_deref()), |b| format!("{b}"));
            eprintln!("{what} ({:.2} s)", t.elapsed().as_secs_f64());
            max_rows.push(row);
        }
    }
    Ok((rows, max_rows))
}

fn progress_word(s: Status, reason: Option<&str>) -> String {
    match s {
        Status::Ok => "ok".into(),
        Status::Skipped => format!("skipped: {}", reason.unwrap_or("?")),
        Status::Failed => format!("failed: {}", reason.unwrap_or("?")),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;
    use lt_core::hardware::BuiltinProfile;
    use std::path::Path;

    fn model(name: &str) -> LoadedModel {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/models").join(format!("{name}.json"));
        LoadedModel { name: name.into(), config: ModelConfig::from_path(&p).unwrap() }
    }

    #[test]
    fn predicted_tflops_is_the_published_6pt_formula() {
        let m = model("qwen2.5-3b");
        let row = step_row(&m, &BuiltinProfile::H800.profile(), 4, 256, Policy::Auto);
        let x = row.metrics.unwrap();
        let tokens = 4.0 * 256.0;
        let want = 6.0 * row.params as f64 * tokens / x.step_seconds / 1e12;
        // Same formula, same inputs: equal to rounding.
        assert!((x.tflops_6pt.unwrap() / want - 1.0).abs() < 1e-12);
        assert!((x.tokens_per_s.unwrap() - tokens / x.step_seconds).abs() < 1e-6);
        assert_eq!(row.source, Source::Predicted);
    }

    #[test]
    fn model_too_big_for_host_memory_is_skipped_with_both_sizes() {
        // 14B at about 16 B/param does not fit the H200 machine's 120 GiB.
        let m = model("qwen2.5-14b");
        let hw = BuiltinProfile::H200.profile();
        for p in [Policy::Auto, Policy::Megatrain] {
            let row = step_row(&m, &hw, 8, 1024, p);
            assert_eq!(row.status, Status::Skipped, "{p}");
            let r = row.reason.unwrap();
            assert!(r.starts_with("needs ") && r.ends_with("host memory, profile has 120.0 GiB"), "{p}: {r}");
        }
    }
}
