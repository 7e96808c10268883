//! Planner solve time versus layer count.
//!
//! Run: `cargo bench -p benches --bench planner`
//!
//! For synthetic Qwen2-shaped models of 8 to 128 layers (hidden 4096, MLP 11008, batch 24 x 1024 on
//! the RTX 3090 profile, where GPU memory binds and the plan mixes GPU, host and recompute), it times:
//! - `dp`: the exact dynamic program on one step shape;
//! - `milp-cold`: the MILP on the same formulation without a warm start;
//! - `milp-warm`: the MILP warm-started from the DP (what `lt plan` runs);
//! - `plan`: the whole planner (all step shapes, MILP, simulator replay).
//!
//! After the criterion groups it prints, per layer count, the MILP-to-DP time ratio measured in the
//! same run (the MILP is the planner, the DP its exact cross-check).

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use lt_core::ModelConfig;
use lt_core::hardware::BuiltinProfile;
use lt_sched::cost::{CostOptions, ExecConfig, Instance};
use lt_sched::milp::{self, MilpOptions};
use lt_sched::planner::{DEFAULT_MAX_SEGMENT_LEN, PlanRequest, plan};
use lt_sched::window::Formulation;
use lt_sched::{OptimizerOverlap, dp};

const LAYERS: [usize; 5] = [8, 24, 48, 96, 128];
const BATCH: usize = 24;
const SEQ: usize = 1024;

fn model(layers: usize) -> ModelConfig {
    let json = format!(
        r#"{{"model_type":"qwen2","vocab_size":152064,"hidden_size":4096,"intermediate_size":11008,
        "num_hidden_layers":{layers},"num_attention_heads":32,"num_key_value_heads":8,"rms_norm_eps":1e-6,
        "rope_theta":1e6,"tie_word_embeddings":false}}"#
    );
    // The JSON above is a valid qwen2 config for every layer count: a failure is a bug here.
    #[allow(clippy::expect_used)]
    ModelConfig::from_json_str(&json).expect("synthetic config parses")
}

fn formulation(layers: usize) -> Formulation {
    let m = model(layers);
    let mut hw = BuiltinProfile::Rtx3090.profile();
    // Room for the fp32 state of the largest model, so only GPU memory binds.
    hw.host_memory.0 = 4 << 40;
    let cfg = ExecConfig {
        micro_batch_size: BATCH,
        grad_accum_steps: 1,
        loss_chunk_tokens: 4096,
        optimizer_overlap: OptimizerOverlap::OverlapNextForward,
        retain_all_logits: false,
    };
    #[allow(clippy::expect_used)]
    let inst = Instance::from_model(&m, &hw, SEQ, &cfg, CostOptions::default()).expect("valid shape");
    Formulation::new(&inst, cfg.optimizer_overlap, DEFAULT_MAX_SEGMENT_LEN)
}

fn bench(c: &mut Criterion) {
    let opts = MilpOptions { time_limit: Duration::from_secs(10), ..MilpOptions::default() };
    let mut g = c.benchmark_group("planner");
    g.sample_size(10);
    for l in LAYERS {
        let f = formulation(l);
        g.bench_with_input(BenchmarkId::new("dp", l), &f, |b, f| b.iter(|| dp::solve(black_box(f))));
        g.bench_with_input(BenchmarkId::new("milp-cold", l), &f, |b, f| {
            b.iter(|| milp::solve(black_box(f), None, &opts))
        });
        let warm = dp::solve(&f).map(|d| d.placements);
        g.bench_with_input(BenchmarkId::new("milp-warm", l), &f, |b, f| {
            b.iter(|| milp::solve(black_box(f), warm.as_deref(), &opts))
        });
        let m = model(l);
        let mut hw = BuiltinProfile::Rtx3090.profile();
        hw.host_memory.0 = 4 << 40;
        let req = PlanRequest::new(BATCH, SEQ);
        g.bench_with_input(BenchmarkId::new("plan", l), &m, |b, m| b.iter(|| plan(black_box(m), &hw, &req)));
    }
    g.finish();

    println!("\nMILP (warm, as lt plan runs it) / DP solve-time ratio, same run, host {}:", lt_core::HostCpu::detect());
    for l in LAYERS {
        let f = formulation(l);
        let reps = 20;
        let t = Instant::now();
        let mut warm = None;
        for _ in 0..reps {
            warm = dp::solve(black_box(&f)).map(|d| d.placements);
        }
        let dp_s = t.elapsed().as_secs_f64() / reps as f64;
        let t = Instant::now();
        for _ in 0..reps {
            let _ = black_box(milp::solve(&f, warm.as_deref(), &opts));
        }
        let milp_s = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "  L = {l:>3}: dp {:>8.3} ms, milp {:>8.3} ms, ratio {:>6.1}x",
            dp_s * 1e3,
            milp_s * 1e3,
            milp_s / dp_s
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
