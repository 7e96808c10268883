//! Spill engine throughput: one 64 MiB activation written and read back per iteration, for each
//! engine, against a same-run baseline that does what `dd bs=4M oflag=direct` / `iflag=direct`
//! does: synchronous O_DIRECT writes and reads of 4 MiB blocks on one thread, same directory.
//! After the criterion group, a ratio table (median of 7 iterations each) goes to stderr.
//!
//! Run: `cargo bench -p benches --bench spill`
//! (spill directory: `$LT_SPILL_BENCH_DIR`, default the system temp dir; needs ~200 MiB free).
//! The mmap engine measures the page cache, not the disk, so its ratio is not a disk figure.
//! For the CLI-vs-dd comparison use `tools/bench_spill_vs_dd.sh`, which drives `lt bench spill`.
#![allow(missing_docs)] // `criterion_group!` generates an undocumented public function

use std::fs::File;
use std::hint::black_box;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use lt_storage::spill::{EngineChoice, SpillBuf, SpillConfig, SpillStore};

const VALUE: usize = 64 << 20;
const BLOCK: usize = 4 << 20;

#[cfg(target_arch = "x86_64")]
const O_DIRECT: i32 = 0o40000;
#[cfg(target_arch = "aarch64")]
const O_DIRECT: i32 = 0o200000;

fn bench_dir() -> PathBuf {
    std::env::var_os("LT_SPILL_BENCH_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir)
}

/// The dd baseline: one thread, synchronous 4 MiB O_DIRECT transfers from an aligned buffer.
struct DdLike {
    file: File,
    buf: SpillBuf,
}

impl DdLike {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn open(dir: &Path) -> Option<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(O_DIRECT)
            .open(dir.join("dd-like.bin"))
            .ok()?;
        let mut buf = SpillBuf::zeroed(VALUE).ok()?;
        for (i, x) in buf.iter_mut().enumerate() {
            *x = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
        }
        Some(Self { file, buf })
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    fn open(_dir: &Path) -> Option<Self> {
        None
    }

    fn put_get(&mut self) -> bool {
        for (i, chunk) in self.buf.chunks(BLOCK).enumerate() {
            if self.file.write_all_at(chunk, (i * BLOCK) as u64).is_err() {
                return false;
            }
        }
        for (i, chunk) in self.buf.chunks_mut(BLOCK).enumerate() {
            if self.file.read_exact_at(chunk, (i * BLOCK) as u64).is_err() {
                return false;
            }
        }
        true
    }
}

/// One engine with a written and a read buffer.
struct Engine {
    name: &'static str,
    store: SpillStore,
    slots: Option<(SpillBuf, SpillBuf)>,
}

impl Engine {
    fn open(dir: &Path, name: &'static str, engine: EngineChoice) -> Option<Self> {
        let cfg = SpillConfig { engine, pool_bytes: 2 * VALUE, ..SpillConfig::new(dir, 2 * VALUE as u64) };
        let store = match SpillStore::open(cfg) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{name}: skipped: {e}");
                return None;
            }
        };
        let r = store.report();
        eprintln!(
            "{name}: engine {} o_direct {} registered {} {:?}",
            r.engine, r.direct_io, r.registered_buffers, r.fallbacks
        );
        let mut w = store.alloc_buf(VALUE).ok()?;
        for (i, x) in w.iter_mut().enumerate() {
            *x = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
        }
        let r = store.alloc_buf(VALUE).ok()?;
        Some(Self { name, store, slots: Some((w, r)) })
    }

    fn put_get(&mut self) -> bool {
        let Some((w, r)) = self.slots.take() else { return false };
        let w = self.store.submit_put(1, w).and_then(|t| t.wait());
        let r = self.store.submit_get_into(1, r).and_then(|t| t.wait());
        match (w, r) {
            (Ok(w), Ok(r)) => {
                let same = w[..] == r[..];
                self.slots = Some((w, r));
                same
            }
            _ => false,
        }
    }
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Time one put+get, or `None` if it failed or read back wrong data.
fn timed(f: impl FnOnce() -> bool) -> Option<f64> {
    let t0 = Instant::now();
    f().then(|| t0.elapsed().as_secs_f64())
}

fn spill(c: &mut Criterion) {
    let base = bench_dir();
    let dir = match tempfile::tempdir_in(&base) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("spill bench skipped: cannot create a directory in {}: {e}", base.display());
            return;
        }
    };
    let mut dd = DdLike::open(dir.path());
    let mut engines: Vec<Engine> =
        [("io_uring", EngineChoice::IoUring), ("pread", EngineChoice::Pread), ("mmap", EngineChoice::Mmap)]
            .into_iter()
            .filter_map(|(n, e)| Engine::open(dir.path(), n, e))
            .collect();

    let mut g = c.benchmark_group("spill_64MiB_put_get");
    g.throughput(Throughput::Bytes(2 * VALUE as u64));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(5));
    if let Some(dd) = dd.as_mut() {
        g.bench_function("dd_like_o_direct_4MiB", |b| b.iter(|| black_box(dd.put_get())));
    }
    for e in &mut engines {
        let name = e.name;
        g.bench_function(name, |b| b.iter(|| black_box(e.put_get())));
    }
    g.finish();

    // Same-run ratios, so the claim is a ratio and not an absolute figure from a noisy machine.
    // Rounds interleave the baseline and the engines so that load drifts hit all of them alike.
    let Some(dd) = dd.as_mut() else {
        eprintln!("no O_DIRECT baseline on this file system; ratios skipped");
        return;
    };
    let mut base = Vec::new();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); engines.len()];
    let mut broken = vec![false; engines.len()];
    for _ in 0..9 {
        base.extend(timed(|| dd.put_get()));
        for (i, e) in engines.iter_mut().enumerate() {
            match timed(|| e.put_get()) {
                Some(t) => times[i].push(t),
                None => broken[i] = true,
            }
        }
    }
    if base.is_empty() {
        eprintln!("the O_DIRECT baseline failed; ratios skipped");
        return;
    }
    let base_s = median(base);
    let gib_s = |s: f64| 2.0 * VALUE as f64 / s / f64::from(1u32 << 30);
    eprintln!("\nhost: {}", lt_core::HostCpu::detect());
    eprintln!("{:<24} {:>10} {:>8}   (median of 9 interleaved rounds)", "put+get 64 MiB", "GiB/s", "x dd");
    eprintln!("{:<24} {:>10.2} {:>8.2}", "dd_like_o_direct_4MiB", gib_s(base_s), 1.0);
    for ((e, t), broken) in engines.iter().zip(times).zip(broken) {
        if broken || t.is_empty() {
            eprintln!("{:<24} failed or read back wrong data", e.name);
        } else {
            let s = median(t);
            eprintln!("{:<24} {:>10.2} {:>8.2}", e.name, gib_s(s), base_s / s);
        }
    }
}

criterion_group!(benches, spill);
criterion_main!(benches);
