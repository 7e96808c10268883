//! Host optimizer update throughput: `adamw` (fp32 state) and `adamw8bit` (block-wise 8-bit state),
//! each with f32 and bf16 gradients, one step = `begin_step` + one group update with clipping on,
//! plus the fused bf16 -> f32 gradient copy with its sum of squares (the "fast clipping" pass), and
//! the 8-bit update with bf16 gradients that also writes the bf16 upload copy of the weights
//! (`update_with_copy`).
//!
//! Run: `cargo bench -p benches --bench optimizer`
//! (`LT_OPTIM_BENCH_PARAMS` parameters, default 16777216; `LT_OPTIM_BENCH_THREADS` threads, default 2).
//!
//! After the criterion groups it prints, from the same run, the 8-bit-to-fp32 step-time ratio per
//! gradient dtype. For the comparison with PyTorch's fused AdamW and bitsandbytes' AdamW8bit use
//! `tools/bench_optimizer_vs_torch.sh`, which drives `lt bench optimizer` and the Python baselines.
#![allow(missing_docs)] // `criterion_group!` generates an undocumented public function

use std::hint::black_box;
use std::time::{Duration, Instant};

use benches::env_usize;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use lt_optim::{AdamW, AdamWConfig, Grad, OptimizerKind, StepOutcome, ThreadPool, bf16};

struct Setup {
    params: Vec<f32>,
    g32: Vec<f32>,
    g16: Vec<bf16>,
    pool: ThreadPool,
}

fn setup(n: usize, threads: usize) -> Setup {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let params = (0..n).map(|_| 0.05 * next()).collect();
    let g32: Vec<f32> = (0..n).map(|i| next() * 10f32.powi(-((i / 4096) as i32 % 4))).collect();
    let g16 = g32.iter().map(|&x| bf16::from_f32(x)).collect();
    let pool = match ThreadPool::new(threads) {
        Ok(p) => p,
        Err(e) => panic!("starting {threads} threads: {e}"),
    };
    Setup { params, g32, g16, pool }
}

fn optimizer(kind: OptimizerKind, n: usize) -> AdamW {
    let mut opt = match AdamW::new(AdamWConfig { max_grad_norm: Some(1.0), ..Default::default() }, kind) {
        Ok(o) => o,
        Err(e) => panic!("{e}"),
    };
    if let Err(e) = opt.add_group("bench", &[("w", n)]) {
        panic!("{e}");
    }
    opt
}

fn step(opt: &mut AdamW, params: &mut [f32], grad: Grad<'_>, pool: &ThreadPool) {
    let StepOutcome::Apply(ctx) = opt.begin_step(3.0) else { panic!("finite norm skipped") };
    if let Err(e) = opt.groups_mut()[0].update(&mut [params], &[grad], &ctx, pool) {
        panic!("{e}");
    }
}

/// Makes one optimizer kind.
type MakeKind = fn() -> OptimizerKind;

const KINDS: [(&str, MakeKind); 2] = [("adamw", || OptimizerKind::AdamW), ("adamw8bit", OptimizerKind::adamw8bit)];

fn bench_update(c: &mut Criterion) {
    let n = env_usize("LT_OPTIM_BENCH_PARAMS", 1 << 24);
    let threads = env_usize("LT_OPTIM_BENCH_THREADS", 2);
    let mut s = setup(n, threads);
    let mut g = c.benchmark_group("optimizer_step");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    for (name, kind) in KINDS {
        for dtype in ["f32", "bf16"] {
            let mut opt = optimizer(kind(), n);
            g.bench_function(BenchmarkId::new(name, format!("{dtype}/{n}/{threads}t")), |b| {
                b.iter(|| {
                    let grad = if dtype == "f32" { Grad::F32(&s.g32) } else { Grad::Bf16(&s.g16) };
                    step(&mut opt, &mut s.params, grad, &s.pool);
                    black_box(&s.params);
                })
            });
        }
    }
    let mut copy = vec![bf16::ZERO; n];
    let mut opt = optimizer(OptimizerKind::adamw8bit(), n);
    g.bench_function(BenchmarkId::new("adamw8bit+bf16copy", format!("bf16/{n}/{threads}t")), |b| {
        b.iter(|| {
            let StepOutcome::Apply(ctx) = opt.begin_step(3.0) else { panic!("finite norm skipped") };
            let r = opt.groups_mut()[0].update_with_copy(
                &mut [&mut s.params],
                &mut [&mut copy],
                &[Grad::Bf16(&s.g16)],
                &ctx,
                &s.pool,
            );
            if let Err(e) = r {
                panic!("{e}");
            }
            black_box(&copy);
        })
    });
    g.finish();

    let mut g = c.benchmark_group("grad_copy_sumsq");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(2));
    let mut dst = vec![0f32; n];
    g.bench_function(BenchmarkId::new("bf16_to_f32", format!("{n}/{threads}t")), |b| {
        b.iter(|| match lt_optim::grad::copy_into(Grad::Bf16(&s.g16), &mut dst, 1.0, &s.pool) {
            Ok(v) => black_box(v),
            Err(e) => panic!("{e}"),
        })
    });
    g.finish();

    // Same-run ratio of step times, median of 7 steps each.
    let median_step = |kind: OptimizerKind, grad: Grad<'_>, params: &mut Vec<f32>, pool: &ThreadPool| {
        let mut opt = optimizer(kind, n);
        step(&mut opt, params, grad, pool);
        let mut t: Vec<f64> = (0..7)
            .map(|_| {
                let t0 = Instant::now();
                step(&mut opt, params, grad, pool);
                t0.elapsed().as_secs_f64()
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[3]
    };
    eprintln!(
        "\nsame-run step times, {n} params, {threads} threads, 8-bit kernel {} (median of 7), host {}:",
        lt_optim::q8_kernel_name(),
        lt_core::HostCpu::detect()
    );
    for dtype in ["f32", "bf16"] {
        let grad = if dtype == "f32" { Grad::F32(&s.g32) } else { Grad::Bf16(&s.g16) };
        let fp32 = median_step(OptimizerKind::AdamW, grad, &mut s.params, &s.pool);
        let q8 = median_step(OptimizerKind::adamw8bit(), grad, &mut s.params, &s.pool);
        eprintln!(
            "  {dtype} grads: adamw {:.2} Gparam/s, adamw8bit {:.2} Gparam/s, 8-bit/fp32 speed ratio {:.2}",
            n as f64 / fp32 / 1e9,
            n as f64 / q8 / 1e9,
            fp32 / q8
        );
    }
}

criterion_group!(benches, bench_update);
criterion_main!(benches);
