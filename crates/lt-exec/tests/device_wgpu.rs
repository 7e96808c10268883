//! The streamed trainer on a device runtime: burn-wgpu (lavapipe in CI, any Vulkan/Metal GPU
//! elsewhere), against the CPU reference and PyTorch. Run with
//!
//! ```sh
//! cargo test -p lt-exec --features wgpu --test device_wgpu
//! ```
//!
//! These are the checks that ndarray cannot make: tensors made on one thread and used on another,
//! memory pools per stream, asynchronous execution. Tolerances:
//! - wgpu vs ndarray, same plan: 1e-5 relative on every step's loss. Both run f32; only the kernels'
//!   summation order differs (seen: below 1e-6 on these fixtures), and a race (a kernel reading a
//!   buffer that an upload has already overwritten) moves the loss by 1e-2 (the issue's probe: 4.95
//!   to 5.05 against 5.004).
//! - wgpu vs PyTorch: 1e-4 relative per step, the CPU train-parity bar (`train_parity.rs`).
#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::backend::{AutodiffBackend, BackendTypes};
use lt_core::ByteSize;
use lt_exec::executor::{ActivationSpill, Executor};
use lt_exec::plan::{Placement, Step};
use lt_exec::state::SharedModel;
use lt_exec::train::{LrSchedule, TrainOptions, Trainer};
use lt_model::host::HostModel;
use lt_model::model::Batch;
use lt_model::{CpuAutodiff, WgpuAutodiff};
use lt_optim::{AdamWConfig, OptimizerKind};

type Dev<B> = <<B as AutodiffBackend>::InnerBackend as BackendTypes>::Device;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures")
}

type WgpuDevice = <lt_model::WgpuBackend as BackendTypes>::Device;

/// The wgpu device, or a one-line failure that says how to install an adapter (never a skip).
fn wgpu() -> WgpuDevice {
    lt_model::device::wgpu_device().unwrap_or_else(|e| panic!("{e}"))
}

fn options() -> TrainOptions {
    TrainOptions {
        adamw: AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: Some(1.0),
        },
        optimizer: OptimizerKind::AdamW,
        warmup_steps: 0,
        schedule: LrSchedule::Constant,
        total_steps: 4,
        overlap_optimizer: true,
        threads: 2,
    }
}

fn plans(cfg: &lt_core::ModelConfig, rows: usize, seq: usize) -> Vec<(&'static str, Step)> {
    let layers = cfg.num_layers();
    vec![
        ("keep-all", Step::keep_all(layers)),
        ("recompute-all", Step::recompute_all(layers)),
        ("megatrain", Step::every(layers, 4, Placement::Gpu)),
        ("all-host", Step::all_in(layers, Placement::Host)),
        ("all-nvme", Step::all_in(layers, Placement::Nvme)),
        ("auto", auto_plan(cfg, rows, seq)),
    ]
}

/// The planner's plan on the CPU profile with a budget tight enough that it must offload or recompute:
/// the roomy plan's predicted peak, or the smallest memory the planner accepts if that is more.
fn auto_plan(cfg: &lt_core::ModelConfig, batch: usize, seq: usize) -> Step {
    let mut hw = lt_core::hardware::BuiltinProfile::Cpu.profile();
    let req = lt_sched::planner::PlanRequest::new(batch, seq);
    let roomy = lt_sched::planner::plan(cfg, &hw, &req).unwrap();
    hw.gpu_memory = ByteSize(roomy.plan.predicted.peak_gpu_bytes);
    let tight = match lt_sched::planner::plan(cfg, &hw, &req) {
        Err(lt_sched::SchedError::Infeasible { min_gpu_memory: Some(min), .. }) => {
            hw.gpu_memory = ByteSize(min);
            lt_sched::planner::plan(cfg, &hw, &req)
        }
        r => r,
    };
    tight.unwrap().plan.step
}

/// A trainer on backend `B` with a spill store when the plan needs one (the tempdir lives as long).
fn trainer<B: AutodiffBackend>(
    host: &HostModel,
    plan: Step,
    device: Dev<B>,
) -> (Trainer<B>, Option<tempfile::TempDir>) {
    let (spill, dir): (Option<Arc<dyn ActivationSpill>>, _) = if plan.boundaries.contains(&Placement::Nvme) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = lt_storage::spill::SpillConfig::new(dir.path(), 64 << 20);
        (Some(Arc::new(lt_storage::spill::SpillStore::open(cfg).unwrap())), Some(dir))
    } else {
        (None, None)
    };
    let ex = Executor::<B>::new(plan, ByteSize::gib(1), device, spill);
    (Trainer::new(Arc::new(SharedModel::new(host.clone(), 0)), ex, options(), None, 0).unwrap(), dir)
}

fn losses<B: AutodiffBackend>(host: &HostModel, plan: Step, device: Dev<B>, mbs: &[Batch], steps: usize) -> Vec<f64> {
    let (mut tr, _dir) = trainer::<B>(host, plan, device);
    (0..steps).map(|_| tr.step(mbs).unwrap().loss).collect()
}

/// The issue's probe: `qwen3-tied-mqa`, 4 micro-batches of one 32-token row.
fn probe_batches(vocab: usize) -> Vec<Batch> {
    (0..4u32)
        .map(|r| {
            let ids: Vec<u32> = (0..32u32).map(|i| (i * 7 + r * 13 + 1) % vocab as u32).collect();
            Batch::from_ids(vec![ids])
        })
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / b).abs()
}

/// Every plan, several micro-batches, 10 runs each: every step's loss equals ndarray's to 1e-5.
/// Before the fix this gave a different step-1 loss on every run (the h2d thread's uploads raced
/// compute's kernels through the wgpu runtime's per-stream memory pools).
#[test]
fn streamed_training_on_wgpu_is_deterministic_and_matches_ndarray() {
    let device = wgpu();
    let host = HostModel::load(&root().join("models/qwen3-tied-mqa")).unwrap();
    let mbs = probe_batches(host.config.vocab_size);
    for (pname, plan) in plans(&host.config, 1, 32) {
        let want = losses::<CpuAutodiff>(&host, plan.clone(), Default::default(), &mbs, 3);
        for run in 0..10 {
            let got = losses::<WgpuAutodiff>(&host, plan.clone(), device.clone(), &mbs, 3);
            for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                let e = rel(*g, *w);
                assert!(e <= 1e-5, "{pname} run {run} step {}: wgpu loss {g} vs ndarray {w} (rel {e:e})", s + 1);
            }
        }
        eprintln!("{pname}: 10/10 runs match ndarray {want:?}");
    }
}

fn load_batch(path: &Path) -> Batch {
    let text = std::fs::read_to_string(path).unwrap();
    let (mut ids, mut labels) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        ids.push(v["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect());
        labels.push(v["labels"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect());
    }
    Batch::new(ids, labels)
}

/// Every family x every plan, two micro-batches, 4 steps: the losses follow PyTorch's (the fixtures
/// of `train_parity.rs`) to 1e-4 and ndarray's to 1e-5.
#[test]
fn every_family_and_plan_follows_pytorch_on_wgpu() {
    let device = wgpu();
    for name in ["qwen2-tied-gqa", "qwen2-untied-mqa", "qwen3-hd16-gqa", "qwen3-tied-mqa", "qwen35-hybrid"] {
        let host = HostModel::load(&root().join("models").join(name)).unwrap();
        let batch = load_batch(&root().join("train").join(name).join("train.jsonl"));
        let exp: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(root().join("train").join(name).join("expected.json")).unwrap(),
        )
        .unwrap();
        let torch: Vec<f64> = exp["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect();
        let mbs: Vec<Batch> = (0..2)
            .map(|k| Batch::new(batch.input_ids[k * 2..k * 2 + 2].to_vec(), batch.labels[k * 2..k * 2 + 2].to_vec()))
            .collect();
        let seq = batch.input_ids[0].len();
        for (pname, plan) in plans(&host.config, 2, seq) {
            let cpu = losses::<CpuAutodiff>(&host, plan.clone(), Default::default(), &mbs, torch.len());
            let got = losses::<WgpuAutodiff>(&host, plan, device.clone(), &mbs, torch.len());
            for (s, g) in got.iter().enumerate() {
                let (et, ec) = (rel(*g, torch[s]), rel(*g, cpu[s]));
                eprintln!(
                    "{name}/{pname} step {}: wgpu {g:.7} torch {:.7} (rel {et:.1e}) ndarray rel {ec:.1e}",
                    s + 1,
                    torch[s]
                );
                assert!(et <= 1e-4, "{name}/{pname} step {}: wgpu {g} vs torch {} (rel {et:e})", s + 1, torch[s]);
                assert!(ec <= 1e-5, "{name}/{pname} step {}: wgpu {g} vs ndarray {} (rel {ec:e})", s + 1, cpu[s]);
            }
        }
    }
}

/// A long run keeps its streams and its memory: 24 micro-batches (6 steps of 4). The executor's
/// reserved device memory after the last step equals that after step 2, no stream appears after
/// step 1, and the wgpu runtime as a whole (every stream it holds, dead threads' included) reserves
/// no more after the last step than after step 2.
#[test]
fn a_long_run_creates_no_streams_and_reserves_no_more_memory() {
    let device = wgpu();
    let host = HostModel::load(&root().join("models/qwen3-tied-mqa")).unwrap();
    let mbs = probe_batches(host.config.vocab_size);
    let (mut tr, _dir) =
        trainer::<WgpuAutodiff>(&host, Step::all_in(host.config.num_layers(), Placement::Host), device.clone());
    let (mut streams1, mut step2, mut total2) = (Vec::new(), 0, 0);
    for step in 1..=6 {
        let t0 = std::time::Instant::now();
        let m = tr.step(&mbs).unwrap();
        tr.flush().unwrap();
        // Every transfer the plan lists, the head once per step (in the shared-stream mode compute binds
        // what h2d prepared: one "bind" per transfer).
        let binds = tr.trace().events().iter().filter(|e| e.step == m.step && e.name.starts_with("bind ")).count();
        assert_eq!(binds, tr.executor.plan().uploads_per_step(mbs.len()), "step {step}");
        eprintln!("step {step}: {:.2} s ({:.2} s in step)", t0.elapsed().as_secs_f64(), m.step_seconds);
        let reserved = tr.executor.device_reserved_bytes().unwrap();
        let total = lt_model::device::wgpu_total_reserved_bytes(&device);
        eprintln!(
            "step {step}: executor reserved {reserved} B, runtime total {total} B, streams {:?}",
            tr.executor.streams_used()
        );
        match step {
            1 => streams1 = tr.executor.streams_used(),
            2 => (step2, total2) = (reserved, total),
            _ => {}
        }
        assert_eq!(tr.executor.streams_used(), streams1, "step {step}: a new stream appeared");
    }
    assert_eq!(tr.executor.device_reserved_bytes().unwrap(), step2, "executor reserved memory grew after step 2");
    let total = lt_model::device::wgpu_total_reserved_bytes(&device);
    assert!(total <= total2, "the runtime reserved {total} B after the last step, {total2} B after step 2");
}
