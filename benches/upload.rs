//! Upload preparation on the host: the work between a layer's fp32 masters and the bytes the driver
//! copies to a bf16 device, which the executor's h2d thread does twice per layer per step.
//!
//! Run: `cargo bench -p benches --bench upload`
//! (`LT_UPLOAD_BENCH_CONFIG`, default `configs/models/qwen2.5-7b.json`: every tensor of its layer 0;
//! `LT_UPLOAD_BENCH_REPEATS` timed repeats, default 5; `LT_UPLOAD_BENCH_PCIE_GBS`, default 25).
//!
//! Prints, from the same run, the host time of each path for the whole layer, the ratio to the
//! previous path, and the ratio to the layer's PCIe time (its bf16 bytes at 25 GB/s: 18.6 ms for
//! Qwen2.5-7B). Each path runs the calls that the executor and cubecl-runtime 0.10.0 run, on this
//! machine's memory; only the pinned pool is not real (a CPU machine has no driver to pin with), so
//! the staging copy lands in a buffer reused across repeats, the best case for that copy:
//! - **before**: `host_data` (f32 -> bf16 on up to 8 threads, into fresh memory), `Backend::staging`
//!   (a blocking round trip to the runtime, not timed here, then `Bytes::copy_into` the pinned block
//!   on one thread), then
//!   upstream `do_create`'s `Bytes::from_bytes_vec(data.to_vec())` (one more single-threaded copy,
//!   into fresh pageable memory);
//! - **before, unpinned**: the same without staging (`LT_PINNED_UPLOADS=0`);
//! - **copy, upstream cubecl**: the optimizer-written bf16 copy shared into `TensorData`
//!   (`shared_bf16_data`), then upstream's `to_vec`;
//! - **copy, patched cubecl (now)**: the shared copy handed over as it is (patches/cubecl-runtime).
//!
//! The driver's own pageable-to-device copy follows in every case and is not host preparation.
//! The bf16 copy itself is written by the optimizer's update pass (`cargo bench -p benches --bench
//! optimizer` and `lt bench optimizer --write-copy bf16` time that), not here.
#![allow(missing_docs)]

use std::path::Path;
use std::sync::Arc;

use benches::{env_usize, median_secs};
use burn::tensor::{AllocationProperty, Bytes, DType, TensorData, bf16};
use lt_core::ModelConfig;
use lt_model::upload::{Bf16Copy, host_data, shared_bf16_data};

/// Upstream cubecl-runtime 0.10.0 `ComputeClient::do_create`: every buffer copied into a fresh `Vec`.
fn upstream_create(data: &TensorData) -> Bytes {
    Bytes::from_bytes_vec(data.bytes.to_vec())
}

/// The patched `do_create`: pinned buffers keep the copy, any other is handed over as it is.
fn patched_create(data: TensorData) -> Bytes {
    match data.bytes.property() {
        AllocationProperty::Pinned => Bytes::from_bytes_vec(data.bytes.to_vec()),
        _ => data.bytes,
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let config = std::env::var("LT_UPLOAD_BENCH_CONFIG")
        .map_or_else(|_| root.join("configs/models/qwen2.5-7b.json"), Into::into);
    let repeats = env_usize("LT_UPLOAD_BENCH_REPEATS", 5);
    let pcie_gbs = env_usize("LT_UPLOAD_BENCH_PCIE_GBS", 25) as f64;
    let text = match std::fs::read_to_string(&config) {
        Ok(t) => t,
        Err(e) => return eprintln!("{}: {e}", config.display()),
    };
    let cfg = match ModelConfig::from_json_str(&text) {
        Ok(c) => c,
        Err(e) => return eprintln!("{}: {e}", config.display()),
    };
    let specs = cfg.layer_params(0);
    let masters: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(k, s)| (0..s.numel()).map(|i| ((i * 7 + k) % 1000) as f32 * 1e-3 - 0.5).collect())
        .collect();
    let shapes: Vec<Vec<usize>> = specs.iter().map(|s| s.shape.clone()).collect();
    let copies: Vec<Bf16Copy> =
        masters.iter().map(|m| Arc::new(m.iter().map(|&x| bf16::from_f32(x)).collect())).collect();
    let params: usize = masters.iter().map(Vec::len).sum();
    let layer_bytes = params * 2;
    let pcie = layer_bytes as f64 / (pcie_gbs * 1e9);
    // The staging stand-in: one block per tensor, reused (a real pinned pool reuses its blocks too).
    let mut pinned: Vec<Bytes> = masters.iter().map(|m| Bytes::from_bytes_vec(vec![0u8; m.len() * 2])).collect();

    let before = median_secs(repeats, || {
        let mut n = 0;
        for ((m, shape), stage) in masters.iter().zip(&shapes).zip(pinned.iter_mut()) {
            let mut data = host_data(m, shape, DType::BF16);
            // `ComputeClient::staging`: copy into the pinned block, then swap it in.
            data.bytes.copy_into(stage);
            std::mem::swap(&mut data.bytes, stage);
            n += upstream_create(&data).len();
            // Dropping the data returns the block to the pool: here, to `pinned` for the next repeat.
            std::mem::swap(&mut data.bytes, stage);
        }
        n
    });
    let unpinned = median_secs(repeats, || {
        let mut n = 0;
        for (m, shape) in masters.iter().zip(&shapes) {
            n += upstream_create(&host_data(m, shape, DType::BF16)).len();
        }
        n
    });
    let shared = |create: fn(TensorData) -> Bytes| {
        median_secs(repeats, || {
            let mut n = 0;
            for (c, shape) in copies.iter().zip(&shapes) {
                let Some(data) = shared_bf16_data(c, shape) else { return 0 };
                n += create(data).len();
            }
            n
        })
    };
    let copy_upstream = shared(|d| upstream_create(&d));
    let copy_patched = shared(patched_create);

    let threads = std::thread::available_parallelism().map_or(1, |c| c.get()).min(lt_model::upload::PREP_THREADS);
    println!(
        "upload preparation of one {} layer ({} tensors, {:.1} M params, {:.1} MB in bf16), {} conversion \
         threads, median of {repeats}:",
        config.file_stem().map_or("model".into(), |s| s.to_string_lossy()),
        specs.len(),
        params as f64 / 1e6,
        layer_bytes as f64 / 1e6,
        threads,
    );
    println!("  host: {}", lt_core::HostCpu::detect());
    println!("  PCIe reference: {:.1} ms ({pcie_gbs} GB/s)", pcie * 1e3);
    let row = |name: &str, secs: f64, base: Option<f64>| {
        let vs = match base {
            None => "(baseline)".to_string(),
            Some(b) if b / secs.max(1e-12) > 1000.0 => "over 1000x faster than before".to_string(),
            Some(b) => format!("{:.1}x faster than before", b / secs),
        };
        println!("  {name:<34} {:>9.3} ms  {:>7.2}x PCIe time  {vs}", secs * 1e3, secs / pcie);
    };
    row("before: convert + staging + to_vec", before, None);
    row("before, unpinned: convert + to_vec", unpinned, Some(before));
    row("copy, upstream cubecl: to_vec", copy_upstream, Some(before));
    row("copy, patched cubecl (now)", copy_patched, Some(before));
    println!("  goal (host preparation <= PCIe time): {}", if copy_patched <= pcie { "met" } else { "not met" });
    drop(pinned.drain(..));
}
