//! Gradient landing on the host: the work between one layer's downloaded bf16 gradients and what the
//! optimizer reads, which the executor's d2h stream does once per layer per micro-batch, plus the
//! zeroing the optimizer does after each update.
//!
//! Run: `cargo bench -p benches --bench grad_landing`
//! (`LT_GRAD_BENCH_CONFIG`, default `configs/models/qwen2.5-7b.json`: every tensor of its layer 0;
//! `LT_GRAD_BENCH_REPEATS` timed repeats, default 5; `LT_GRAD_BENCH_THREADS`, default the executor's
//! d2h pool: a quarter of the cores, 1 to 4; `LT_GRAD_BENCH_PCIE_GBS`, default 25).
//!
//! Prints, from the same run, the host time per layer of each layout, their ratio, and the ratio to
//! the layer's gradient download at PCIe speed (its bf16 bytes at 25 GB/s: 18.6 ms for Qwen2.5-7B),
//! which the landing must keep up with:
//! - **fp32 buffers** (before; `LT_BF16_GRADS=0`): zero the fp32 buffer, then widen the bf16 gradient
//!   into it with the sum of squares (`accumulate_into`): 2 B read, 4 + 4 B written per parameter;
//! - **bf16 kept** (now, one micro-batch per step): `land_bf16` (copy with -0 as +0, and the sum of
//!   squares): 2 B read, 2 B written. The buffer is not cleared after an update: a landing overwrites
//!   every element (`lt_exec::grads::Bf16Landing`).
//!
//! A plain single-threaded copy of the same bytes is printed as the reference (the most a landing that
//! moves the data once can approach on this memory).
//!
//! Both give the optimizer the same values and the same sum (`lt_optim::grad` tests); the optimizer
//! then reads 2 instead of 4 bytes of gradient per parameter (`lt bench optimizer --grad-dtype`).
#![allow(missing_docs)]

use std::path::Path;

use benches::{env_usize, median_secs};
use lt_core::ModelConfig;
use lt_optim::grad::{accumulate_into, land_bf16};
use lt_optim::{Grad, ThreadPool, bf16};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let config =
        std::env::var("LT_GRAD_BENCH_CONFIG").map_or_else(|_| root.join("configs/models/qwen2.5-7b.json"), Into::into);
    let repeats = env_usize("LT_GRAD_BENCH_REPEATS", 5);
    let pcie_gbs = env_usize("LT_GRAD_BENCH_PCIE_GBS", 25) as f64;
    let d2h = std::thread::available_parallelism().map_or(1, |c| c.get() / 4).clamp(1, 4);
    let threads = env_usize("LT_GRAD_BENCH_THREADS", d2h);
    let cfg = match std::fs::read_to_string(&config)
        .map_err(|e| e.to_string())
        .and_then(|t| ModelConfig::from_json_str(&t).map_err(|e| e.to_string()))
    {
        Ok(c) => c,
        Err(e) => return eprintln!("{}: {e}", config.display()),
    };
    let pool = match ThreadPool::new(threads) {
        Ok(p) => p,
        Err(e) => return eprintln!("thread pool: {e}"),
    };
    let specs = cfg.layer_params(0);
    // Downloaded gradients: small values of both signs, some exact zeros.
    let downloads: Vec<Vec<bf16>> = specs
        .iter()
        .enumerate()
        .map(|(k, s)| (0..s.numel()).map(|i| bf16::from_f32(((i * 13 + k) % 2001) as f32 * 1e-6 - 1e-3)).collect())
        .collect();
    let params: usize = downloads.iter().map(Vec::len).sum();
    let pcie = 2.0 * params as f64 / (pcie_gbs * 1e9);
    let mut wide: Vec<Vec<f32>> = downloads.iter().map(|g| vec![0f32; g.len()]).collect();
    let mut kept: Vec<Vec<bf16>> = downloads.iter().map(|g| vec![bf16::ZERO; g.len()]).collect();

    let mut sums = (0.0, 0.0);
    let fp32 = median_secs(repeats, || {
        let mut sq = 0.0;
        for (g, dst) in downloads.iter().zip(wide.iter_mut()) {
            dst.fill(0.0);
            sq += accumulate_into(Grad::Bf16(g), dst, 1.0, &pool).unwrap_or(f64::NAN);
        }
        sums.0 = sq;
        sq
    });
    let bf16 = median_secs(repeats, || {
        let mut sq = 0.0;
        for (g, dst) in downloads.iter().zip(kept.iter_mut()) {
            sq += land_bf16(g, dst, &pool).unwrap_or(f64::NAN);
        }
        sums.1 = sq;
        sq
    });
    // The reference: a plain copy of the same bytes on one thread (`memcpy`), what a landing that
    // only moved the data would cost.
    let mut plain: Vec<Vec<bf16>> = downloads.iter().map(|g| vec![bf16::ZERO; g.len()]).collect();
    let memcpy = median_secs(repeats, || {
        for (g, dst) in downloads.iter().zip(plain.iter_mut()) {
            dst.copy_from_slice(g);
        }
        0.0
    });
    println!(
        "gradient landing of one {} layer ({} tensors, {:.1} M params, {:.1} MB of bf16 gradients), {threads} \
         threads (the executor's d2h pool here: {d2h}), median of {repeats}:",
        config.file_stem().map_or("model".into(), |s| s.to_string_lossy()),
        specs.len(),
        params as f64 / 1e6,
        2.0 * params as f64 / 1e6,
    );
    println!("  host: {}", lt_core::HostCpu::detect());
    println!("  PCIe reference: {:.1} ms ({pcie_gbs} GB/s, the download itself)", pcie * 1e3);
    for (name, secs, host_bytes) in [
        ("fp32 buffers (before): zero + widen", fp32, 10.0),
        ("bf16 kept (now): land", bf16, 4.0),
        ("reference: memcpy, 1 thread", memcpy, 4.0),
    ] {
        println!(
            "  {name:<36} {:>9.3} ms  {:>6.2}x PCIe time  {:>6.1} GB/s of host memory traffic",
            secs * 1e3,
            secs / pcie,
            host_bytes * params as f64 / secs / 1e9
        );
    }
    println!("  bf16 kept / fp32 buffers: {:.2}x the speed; bf16 kept / memcpy: {:.2}x", fp32 / bf16, memcpy / bf16);
    println!(
        "  host memory for these gradients: {:.1} MB fp32, {:.1} MB bf16",
        4.0 * params as f64 / 1e6,
        2.0 * params as f64 / 1e6
    );
    if sums.0.to_bits() != sums.1.to_bits() {
        println!("  WARNING: the two sums of squares differ ({} vs {})", sums.0, sums.1);
    }
}
