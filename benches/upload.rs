//! Upload preparation on the host: one fp32 master tensor turned into the bytes a bf16 device
//! tensor is created from, the work the executor's h2d thread does twice per layer per step.
//!
//! Run: `cargo bench -p benches --bench upload`
//! (`LT_UPLOAD_BENCH_ELEMS` elements, default 67,895,296 = Qwen2.5-7B's `mlp.up_proj`, 3584 x 18944;
//! `LT_UPLOAD_BENCH_REPEATS` timed repeats, default 5).
//!
//! Prints, from the same run, Burn's own path (`TensorData::new(data.clone())` then
//! `convert_dtype(BF16)`, what `Tensor::from_data` does for a bf16 backend) against
//! `lt_model::upload::host_data` (one pass over up to 8 threads), each as GB/s of fp32 input, and
//! the ratio; plus a plain single-threaded copy of the fp32 input into fresh memory as the
//! memory-bound reference. Pinned staging (`Backend::staging`) is a CUDA-only step, measured by
//! `lt profile --device cuda`.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Instant;

use burn::tensor::{DType, TensorData};
use lt_model::upload::host_data;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Median seconds of `repeats` runs of `f`, after one warm-up run.
fn median_secs(repeats: usize, mut f: impl FnMut() -> usize) -> f64 {
    black_box(f());
    let mut t: Vec<f64> = (0..repeats.max(1))
        .map(|_| {
            let s = Instant::now();
            black_box(f());
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let n = env_usize("LT_UPLOAD_BENCH_ELEMS", 3584 * 18944);
    let repeats = env_usize("LT_UPLOAD_BENCH_REPEATS", 5);
    let x: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-3).collect();
    let shape = [n];
    let gbs = |secs: f64| n as f64 * 4.0 / secs / 1e9;

    let burn = median_secs(repeats, || TensorData::new(x.clone(), shape).convert_dtype(DType::BF16).as_bytes().len());
    let ours = median_secs(repeats, || host_data(&x, &shape, DType::BF16).as_bytes().len());
    let copy = median_secs(repeats, || x.clone().len());
    let threads = std::thread::available_parallelism().map_or(1, |c| c.get()).min(lt_model::upload::PREP_THREADS);
    println!("upload preparation, {n} fp32 elements -> bf16, {threads} conversion threads, median of {repeats}:");
    println!("  burn clone + convert_dtype   {:>7.3} s  {:>6.2} GB/s (baseline)", burn, gbs(burn));
    println!("  lt_model::upload::host_data  {:>7.3} s  {:>6.2} GB/s  {:.2}x baseline", ours, gbs(ours), burn / ours);
    println!("  plain fp32 copy (1 thread)   {:>7.3} s  {:>6.2} GB/s  {:.2}x baseline", copy, gbs(copy), burn / copy);
}
