//! `lt bench spill`: write N MiB through a spill engine and read it back, timing both.
//!
//! The workload is the executor's: values of `--value-mib` (an activation) written from and read
//! into the store's registered, huge-page-aligned buffers, `--inflight` values outstanding, each
//! cut into `--request-kib` requests with `--queue-depth` in flight. io_uring and pread use
//! `O_DIRECT`, so the read-back comes from the disk, not the page cache; the mmap engine measures
//! page-cache (memory) speed by design. Every 4 KiB block carries a (key, block) tag that is
//! checked on read-back, so a fast but wrong engine fails instead of scoring.
//!
//! The last line of output is JSON (`engine`, `write_mib_s`, `read_mib_s`, request size, queue
//! depth, `o_direct`, `registered_buffers`, ...); `--json` prints only that line.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use lt_storage::spill::{EngineChoice, EngineKind, SpillBuf, SpillConfig, SpillReport, SpillStore, Ticket};

/// Spill engine to benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpillEngineArg {
    /// io_uring with O_DIRECT and registered buffers (falls back to pread if refused).
    #[value(name = "io_uring")]
    IoUring,
    /// pread/pwrite on a thread pool, O_DIRECT.
    Pread,
    /// Shared memory map (page-cache / tmpfs tier).
    Mmap,
}

/// Arguments of `lt bench spill`.
#[derive(Debug, clap::Args)]
pub struct BenchSpillArgs {
    /// Directory for the spill file (on the disk you will spill to). The file is unlinked at once.
    #[arg(long)]
    pub dir: PathBuf,
    /// MiB to write and then read back.
    #[arg(long, default_value_t = 1024)]
    pub size_mib: u64,
    /// Engine.
    #[arg(long, value_enum, default_value = "io_uring")]
    pub engine: SpillEngineArg,
    /// Size of one I/O request, KiB (multiple of 4).
    #[arg(long, default_value_t = 4096)]
    pub request_kib: usize,
    /// Requests in flight.
    #[arg(long, default_value_t = 8)]
    pub queue_depth: usize,
    /// Size of one spilled value (an activation), MiB.
    #[arg(long, default_value_t = 64)]
    pub value_mib: usize,
    /// Values in flight (each has its own buffer).
    #[arg(long, default_value_t = 2)]
    pub inflight: usize,
    /// Do not register buffers with io_uring.
    #[arg(long)]
    pub no_register: bool,
    /// Do not use O_DIRECT (buffered I/O: the read-back then measures the page cache).
    #[arg(long)]
    pub buffered: bool,
    /// Print only the JSON line.
    #[arg(long)]
    pub json: bool,
}

const TAG_BLOCK: usize = 4096;

/// Stamp every 4 KiB block of `buf` with `(key, block)`.
fn stamp(buf: &mut [u8], key: u64) {
    for (i, block) in buf.chunks_mut(TAG_BLOCK).enumerate() {
        if block.len() >= 16 {
            block[..8].copy_from_slice(&key.to_le_bytes());
            block[8..16].copy_from_slice(&(i as u64).to_le_bytes());
        }
    }
}

/// Number of blocks whose tag is not `(key, block)`.
fn check(buf: &[u8], key: u64) -> usize {
    buf.chunks(TAG_BLOCK)
        .enumerate()
        .filter(|(i, b)| b.len() >= 16 && (b[..8] != key.to_le_bytes() || b[8..16] != (*i as u64).to_le_bytes()))
        .count()
}

fn progress(total: u64, quiet: bool) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(total);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg:6} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// Run the command.
pub fn run(args: &BenchSpillArgs) -> anyhow::Result<()> {
    if args.size_mib == 0 || args.value_mib == 0 || args.inflight == 0 {
        bail!("--size-mib, --value-mib and --inflight must be positive");
    }
    if args.request_kib == 0 || !args.request_kib.is_multiple_of(4) {
        bail!("--request-kib must be a positive multiple of 4 (got {})", args.request_kib);
    }
    let total = args.size_mib << 20;
    let value = (args.value_mib << 20).min(total as usize);
    let n_values = total.div_ceil(value as u64);

    let cfg = spill_config(args, value, n_values);
    let t_setup = Instant::now();
    let store = SpillStore::open(cfg).with_context(|| format!("opening a spill store in {}", args.dir.display()))?;
    let setup_s = t_setup.elapsed().as_secs_f64();
    let report = store.report().clone();
    if !args.json {
        announce(args, &report);
    }

    let mut free: Vec<SpillBuf> =
        (0..args.inflight).map(|_| store.alloc_buf(value)).collect::<Result<_, _>>().context("allocating buffers")?;
    // Non-zero filler so compression or zero-detection anywhere below cannot flatter the figures.
    for b in &mut free {
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
        }
    }

    let write_s = write_phase(&store, &mut free, total, value, args.json)?;
    let (read_s, bad_blocks) = read_phase(&store, &mut free, total, n_values, args.json)?;
    if bad_blocks > 0 {
        bail!("read-back verification failed: {bad_blocks} blocks of 4 KiB carry the wrong tag");
    }
    print_results(args, &report, total, value, Seconds { setup: setup_s, write: write_s, read: read_s });
    Ok(())
}

/// The spill store configuration the flags ask for, sized for `n_values` values of `value` bytes.
fn spill_config(args: &BenchSpillArgs, value: usize, n_values: u64) -> SpillConfig {
    SpillConfig {
        engine: match args.engine {
            SpillEngineArg::IoUring => EngineChoice::IoUring,
            SpillEngineArg::Pread => EngineChoice::Pread,
            SpillEngineArg::Mmap => EngineChoice::Mmap,
        },
        request_size: args.request_kib << 10,
        queue_depth: args.queue_depth,
        direct_io: !args.buffered,
        register_buffers: !args.no_register,
        pool_bytes: args.inflight * value,
        ..SpillConfig::new(&args.dir, n_values * value as u64)
    }
}

/// Prints (to stderr) what the store actually opened with, and its fallbacks.
fn announce(args: &BenchSpillArgs, report: &SpillReport) {
    eprintln!(
        "spill bench: {} MiB via {} (requested {:?}), {} KiB requests, queue depth {}, O_DIRECT {}, registered buffers {}",
        args.size_mib,
        report.engine,
        args.engine,
        args.request_kib,
        report.queue_depth,
        report.direct_io,
        report.registered_buffers
    );
    for f in &report.fallbacks {
        eprintln!("note: {f}");
    }
}

/// Writes `total` bytes as tagged values of `value` bytes through the buffers in `free` (all back
/// in `free` afterwards); returns the seconds taken.
fn write_phase(
    store: &SpillStore,
    free: &mut Vec<SpillBuf>,
    total: u64,
    value: usize,
    quiet: bool,
) -> anyhow::Result<f64> {
    let n_values = total.div_ceil(value as u64);
    let len_of = |k: u64| -> usize { (total - k * value as u64).min(value as u64) as usize };
    let pb = progress(total, quiet);
    pb.set_message("write");
    let mut pending: VecDeque<Ticket<SpillBuf>> = VecDeque::new();
    let t0 = Instant::now();
    for k in 0..n_values {
        let mut buf = match free.pop() {
            Some(b) => b,
            None => {
                let t = pending.pop_front().context("no buffer in flight")?;
                let b = t.wait().context("spill write")?;
                pb.inc(b.len() as u64);
                b
            }
        };
        buf.set_len(len_of(k))?;
        stamp(&mut buf, k);
        pending.push_back(store.submit_put(k, buf).context("submitting a spill write")?);
    }
    while let Some(t) = pending.pop_front() {
        let b = t.wait().context("spill write")?;
        pb.inc(b.len() as u64);
        free.push(b);
    }
    let write_s = t0.elapsed().as_secs_f64();
    pb.finish_and_clear();
    Ok(write_s)
}

/// Reads the `n_values` values back into the buffers in `free`, checking every tag; returns the
/// seconds taken and the number of 4 KiB blocks with a wrong tag.
fn read_phase(
    store: &SpillStore,
    free: &mut Vec<SpillBuf>,
    total: u64,
    n_values: u64,
    quiet: bool,
) -> anyhow::Result<(f64, usize)> {
    let pb = progress(total, quiet);
    pb.set_message("read");
    let mut bad_blocks = 0usize;
    let mut pending: VecDeque<(u64, Ticket<SpillBuf>)> = VecDeque::new();
    let t1 = Instant::now();
    let mut finish = |k: u64, t: Ticket<SpillBuf>, free: &mut Vec<SpillBuf>| -> anyhow::Result<()> {
        let b = t.wait().context("spill read")?;
        bad_blocks += check(&b, k);
        pb.inc(b.len() as u64);
        free.push(b);
        Ok(())
    };
    for k in 0..n_values {
        if free.is_empty()
            && let Some((pk, t)) = pending.pop_front()
        {
            finish(pk, t, free)?;
        }
        let buf = free.pop().context("no free buffer")?;
        pending.push_back((k, store.submit_get_into(k, buf).context("submitting a spill read")?));
    }
    while let Some((pk, t)) = pending.pop_front() {
        finish(pk, t, free)?;
    }
    let read_s = t1.elapsed().as_secs_f64();
    pb.finish_and_clear();
    Ok((read_s, bad_blocks))
}

/// Wall-clock seconds of the three phases.
struct Seconds {
    /// Opening the store (create + fallocate + probe).
    setup: f64,
    /// The write phase.
    write: f64,
    /// The read-back phase.
    read: f64,
}

/// Prints the figures (stderr, unless `--json`) and the JSON line (stdout).
fn print_results(args: &BenchSpillArgs, report: &SpillReport, total: u64, value: usize, s: Seconds) {
    let Seconds { setup: setup_s, write: write_s, read: read_s } = s;
    let mib = total as f64 / f64::from(1u32 << 20);
    let (write_mib_s, read_mib_s) = (mib / write_s, mib / read_s);
    let note = match report.engine {
        EngineKind::Mmap => "mmap measures page-cache (memory) speed, not the disk",
        _ if !report.direct_io => "buffered I/O: the read-back may come from the page cache",
        _ => "O_DIRECT: both directions measure the disk",
    };
    if !args.json {
        eprintln!("write: {mib:.0} MiB in {write_s:.3} s = {write_mib_s:.0} MiB/s");
        eprintln!("read:  {mib:.0} MiB in {read_s:.3} s = {read_mib_s:.0} MiB/s (verified)");
        eprintln!("setup (create + fallocate + probe): {setup_s:.3} s; {note}");
    }
    let out = serde_json::json!({
        "engine": report.engine.name(),
        "write_mib_s": (write_mib_s * 10.0).round() / 10.0,
        "read_mib_s": (read_mib_s * 10.0).round() / 10.0,
        "size_mib": args.size_mib,
        "request_kib": report.request_size >> 10,
        "queue_depth": report.queue_depth,
        "value_mib": value >> 20,
        "inflight_values": args.inflight,
        "o_direct": report.direct_io,
        "registered_buffers": report.registered_buffers,
        "huge_pages": report.huge_pages,
        "write_s": write_s,
        "read_s": read_s,
        "setup_s": setup_s,
        "verified": true,
        "fallbacks": report.fallbacks.iter().map(|f| f.to_string()).collect::<Vec<_>>(),
        "note": note,
    });
    println!("{out}");
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn verification_catches_misplaced_and_stale_blocks() {
        let mut a = vec![0u8; 5 * TAG_BLOCK + 100];
        stamp(&mut a, 7);
        assert_eq!(check(&a, 7), 0);
        assert_eq!(check(&a, 8), 6, "a value read back under the wrong key fails every block");
        // Two blocks swapped (an engine that mixed up offsets).
        let (x, y) = a.split_at_mut(2 * TAG_BLOCK);
        x[TAG_BLOCK..2 * TAG_BLOCK].swap_with_slice(&mut y[..TAG_BLOCK]);
        assert_eq!(check(&a, 7), 2);
    }

    #[test]
    fn a_small_run_writes_reads_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let args = BenchSpillArgs {
            dir: dir.path().to_path_buf(),
            size_mib: 9,
            engine: SpillEngineArg::Pread,
            request_kib: 1024,
            queue_depth: 4,
            value_mib: 4,
            inflight: 2,
            no_register: false,
            buffered: false,
            json: true,
        };
        run(&args).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the spill file is unlinked");
    }
}
