//! One optimizer step over a large tensor, timed: a quick release-mode harness for kernel work
//! (the criterion bench in `benches/optimizer.rs` is the reference benchmark).
//!
//! Run: `cargo run -p lt-optim --release --example step_timing -- [PARAMS] [THREADS] [STEPS]`
//! (defaults 64Mi parameters, 2 threads, 7 timed steps after one warm-up step). The kernel family
//! follows `LT_OPTIM_SIMD`, the optimizers `KINDS` (default `adamw8bit,adamw`). Prints one line per
//! (optimizer, gradient dtype) with the median and the best step time in Gparam/s.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use lt_optim::{AdamW, AdamWConfig, Grad, OptimizerKind, StepOutcome, ThreadPool, bf16};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numeric argument")).collect();
    let n = args.first().copied().unwrap_or(64 << 20);
    let threads = args.get(1).copied().unwrap_or(2);
    let steps = args.get(2).copied().unwrap_or(7);
    let kinds = std::env::var("KINDS").unwrap_or_else(|_| "adamw8bit,adamw".into());
    let kinds: Vec<&str> = kinds.split(',').collect();

    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let mut params: Vec<f32> = (0..n).map(|_| 0.05 * next()).collect();
    let g32: Vec<f32> = (0..n).map(|i| next() * 10f32.powi(-((i / 4096) as i32 % 4))).collect();
    let g16: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
    let pool = ThreadPool::new(threads).unwrap();

    for kind in kinds {
        for dtype in ["f32", "bf16"] {
            let k = if kind == "adamw" { OptimizerKind::AdamW } else { OptimizerKind::adamw8bit() };
            let mut opt = AdamW::new(AdamWConfig { max_grad_norm: Some(1.0), ..Default::default() }, k).unwrap();
            opt.add_group("bench", &[("w", n)]).unwrap();
            let grad = if dtype == "f32" { Grad::F32(&g32) } else { Grad::Bf16(&g16) };
            let mut times: Vec<f64> = (0..=steps)
                .map(|_| {
                    let t0 = Instant::now();
                    let StepOutcome::Apply(ctx) = opt.begin_step(3.0) else { panic!("skipped") };
                    opt.groups_mut()[0].update(&mut [&mut params], &[grad], &ctx, &pool).unwrap();
                    t0.elapsed().as_secs_f64()
                })
                .skip(1)
                .collect();
            times.sort_by(f64::total_cmp);
            let med = times[times.len() / 2];
            println!(
                "{kind:10} {dtype:4} {threads}t  median {:.3} Gparam/s, best {:.3} Gparam/s  ({:.3} ms)",
                n as f64 / med / 1e9,
                n as f64 / times[0] / 1e9,
                med * 1e3,
            );
        }
    }
    std::hint::black_box(&params);
}
