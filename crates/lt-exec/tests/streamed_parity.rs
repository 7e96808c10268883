//! Streamed execution is numerically the same as one full-graph backward, whatever the plan.
//!
//! Tolerance: relative to the largest entry of each gradient, 1e-5 (f32; streamed and full-graph
//! paths run the same kernels, differing only in how upstream gradients are summed).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use lt_core::ByteSize;
use lt_exec::executor::Executor;
use lt_exec::grads::HostGrads;
use lt_exec::plan::{Placement, Step};
use lt_exec::state::SharedModel;
use lt_model::host::HostModel;
use lt_model::model::{Batch, full_graph_grads};
use lt_model::weights::DeviceModel;
use lt_model::{CpuAutodiff, CpuBackend};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models").join(name)
}

fn batch(dir: &Path) -> Batch {
    Batch::read_jsonl(&dir.join("tokens.jsonl")).unwrap()
}

fn rel_to_max(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().map(|x| x.abs()).fold(0.0, f32::max).max(1e-12);
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / scale
}

fn plans(layers: usize) -> Vec<(&'static str, Step)> {
    let mut small_chunks = Step::every(layers, 2, Placement::Gpu);
    small_chunks.shape.loss_chunk_tokens = 3;
    vec![
        ("keep-all", Step::keep_all(layers)),
        ("recompute-all", Step::recompute_all(layers)),
        ("every-2/chunk-3", small_chunks),
        ("all-host", Step::all_in(layers, Placement::Host)),
    ]
}

#[test]
fn every_plan_matches_full_graph_for_every_family() {
    for name in ["qwen2-tied-gqa", "qwen2-untied-mqa", "qwen3-hd16-gqa", "qwen35-hybrid"] {
        let dir = fixture(name);
        let host = HostModel::load(&dir).unwrap();
        let b = batch(&dir);
        let model = DeviceModel::<CpuBackend>::from_host(&host, &Default::default());
        let (ref_loss, reference) = full_graph_grads::<CpuAutodiff>(&model, &b);
        for (pname, plan) in plans(host.config.num_layers()) {
            let mut ex = Executor::<CpuAutodiff>::new(plan, ByteSize::gib(1), Default::default(), None);
            let grads = Arc::new(HostGrads::zeros_like(&host));
            let shared = Arc::new(SharedModel::new(host.clone(), 0));
            let r = ex.micro_batch(&shared, &b, b.loss_tokens(), true, &grads, 0).unwrap();
            assert!(
                ((r.loss as f32 - ref_loss) / ref_loss).abs() < 1e-6,
                "{name}/{pname}: loss {} vs {ref_loss}",
                r.loss
            );
            let mut sq = 0.0f64;
            for (n, g) in grads.named(&host) {
                let want = &reference.iter().find(|(k, _)| *k == n).unwrap_or_else(|| panic!("{n}")).1;
                let e = rel_to_max(&g, want);
                assert!(e <= 1e-5, "{name}/{pname}: {n} rel err {e}");
                sq += g.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>();
            }
            let fused = r.grad_sq_sum.unwrap();
            assert!((fused - sq).abs() <= 1e-9 * sq.max(1.0), "{name}/{pname}: fused norm^2 {fused} vs {sq}");
        }
    }
}

/// Two micro-batches of one row each accumulate to exactly the full-batch gradient (the anchor did
/// not divide by the number of micro-batches; here each token weighs 1/N over the whole step).
#[test]
fn gradient_accumulation_equals_full_batch() {
    let dir = fixture("qwen3-tied-mqa");
    let host = HostModel::load(&dir).unwrap();
    let b = batch(&dir);
    let model = DeviceModel::<CpuBackend>::from_host(&host, &Default::default());
    let (ref_loss, reference) = full_graph_grads::<CpuAutodiff>(&model, &b);
    let mut ex = Executor::<CpuAutodiff>::new(Step::recompute_all(2), ByteSize::gib(1), Default::default(), None);
    let grads = Arc::new(HostGrads::zeros_like(&host));
    let shared = Arc::new(SharedModel::new(host.clone(), 0));
    let denom = b.loss_tokens();
    let mut loss = 0.0;
    for r in 0..2 {
        let mb = Batch::new(vec![b.input_ids[r].clone()], vec![b.labels[r].clone()]);
        loss += ex.micro_batch(&shared, &mb, denom, r == 1, &grads, 0).unwrap().loss;
    }
    assert!(((loss as f32 - ref_loss) / ref_loss).abs() < 1e-6);
    for (n, g) in grads.named(&host) {
        let want = &reference.iter().find(|(k, _)| *k == n).unwrap().1;
        assert!(rel_to_max(&g, want) <= 1e-5, "{n}");
    }
}

#[test]
fn a_tiny_budget_fails_before_compute_with_the_minimum() {
    let dir = fixture("qwen3-tied-mqa");
    let host = HostModel::load(&dir).unwrap();
    let b = batch(&dir);
    let plan = Step::keep_all(2);
    let mut ex = Executor::<CpuAutodiff>::new(plan, ByteSize(1024), Default::default(), None);
    let need = ex.required_device_bytes(&host.config, 2, 10);
    let grads = Arc::new(HostGrads::zeros_like(&host));
    let shared = Arc::new(SharedModel::new(host.clone(), 0));
    let e = ex.micro_batch(&shared, &b, b.loss_tokens(), true, &grads, 0).unwrap_err().to_string();
    assert!(e.contains("too small") && e.contains(&lt_exec::budget::round_up(need)), "{e}");
    assert!(ex.trace().events().is_empty(), "nothing ran");
    // Exactly the reported minimum is enough.
    let mut ex = Executor::<CpuAutodiff>::new(Step::keep_all(2), ByteSize(need), Default::default(), None);
    ex.micro_batch(&shared, &b, b.loss_tokens(), true, &grads, 0).unwrap();
    // Recomputing needs less than keeping everything.
    let ex2 = Executor::<CpuAutodiff>::new(Step::recompute_all(2), ByteSize(need), Default::default(), None);
    assert!(ex2.required_device_bytes(&host.config, 2, 10) <= need);
}

/// The h2d stream uploads exactly what the plan lists ([`Step::uploads`]): the head once per
/// step, everything else per micro-batch, counted from the trace's transfer spans.
#[test]
fn uploads_per_step_are_what_the_plan_says() {
    use lt_exec::train::{LrSchedule, TrainOptions, Trainer};
    let dir = fixture("qwen35-hybrid");
    let host = HostModel::load(&dir).unwrap();
    let b = batch(&dir);
    let mbs: Vec<Batch> = (0..2).map(|r| Batch::new(vec![b.input_ids[r].clone()], vec![b.labels[r].clone()])).collect();
    let opts = TrainOptions {
        adamw: lt_optim::AdamWConfig::default(),
        optimizer: lt_optim::OptimizerKind::AdamW,
        warmup_steps: 0,
        schedule: LrSchedule::Constant,
        total_steps: 2,
        overlap_optimizer: true,
        threads: 1,
    };
    for (pname, plan) in plans(host.config.num_layers()) {
        let ex = Executor::<CpuAutodiff>::new(plan.clone(), ByteSize::gib(1), Default::default(), None);
        let mut tr = Trainer::new(Arc::new(SharedModel::new(host.clone(), 0)), ex, opts.clone(), None, 0).unwrap();
        for _ in 0..2 {
            let m = tr.step(&mbs).unwrap();
            let n = tr
                .trace()
                .events()
                .iter()
                .filter(|e| e.step == m.step && (["upload ", "reload ", "bind "].iter().any(|p| e.name.starts_with(p))))
                .count();
            assert_eq!(n, plan.uploads_per_step(mbs.len()), "{pname} step {}", m.step);
            assert!(n > 0);
        }
    }
}
