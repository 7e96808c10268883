//! Measured rows: real steps through `lt bench train` on the matching GPU.

use std::time::Instant;

use anyhow::Result;

use crate::bench_train::{BenchArgs, BenchOutcome, Lt};
use crate::matrix::{Matrix, Policy};
use crate::predict::{LoadedModel, load_models};
use crate::report::{MaxBatchRow, Source, Status, StepRow};

/// What one probe of a max-batch search found.
#[derive(Debug, Clone, PartialEq)]
pub enum Probe {
    /// The batch ran.
    Fits,
    /// The batch does not fit.
    DoesNotFit,
    /// The run failed for another reason: the search stops.
    Failed(String),
}

/// Largest batch in `1..=limit` for which `probe` says [`Probe::Fits`], assuming fitting is monotone
/// (memory grows with the batch): double from 1, then bisect. `Ok(None)` when batch 1 does not fit.
///
/// # Errors
/// The first [`Probe::Failed`] message.
pub fn search_max_batch(limit: usize, mut probe: impl FnMut(usize) -> Probe) -> Result<Option<usize>, String> {
    let mut fits = |b: usize| match probe(b) {
        Probe::Fits => Ok(true),
        Probe::DoesNotFit => Ok(false),
        Probe::Failed(e) => Err(format!("batch {b}: {e}")),
    };
    if limit == 0 || !fits(1)? {
        return Ok(None);
    }
    let (mut lo, mut hi) = (1, 2);
    loop {
        if hi > limit {
            // Everything up to `lo` fits; `limit` itself is the last candidate.
            if lo == limit || !fits(limit)? {
                hi = limit;
                break;
            }
            return Ok(Some(limit));
        }
        if !fits(hi)? {
            break;
        }
        lo = hi;
        hi *= 2;
    }
    // Invariant: lo fits, hi does not (or hi == limit was refused).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}

fn bench_args<'a>(m: &'a Matrix, path: &'a std::path::Path, batch: usize, policy: Policy) -> BenchArgs<'a> {
    let hardware = match &m.hardware {
        lt_sched::hardware::HardwareSpec::Builtin(b) => b.name().to_string(),
        lt_sched::hardware::HardwareSpec::File(p) => p.display().to_string(),
    };
    BenchArgs {
        model_config: path,
        batch_size: batch,
        seq_len: m.file.seq_len,
        policy,
        steps: m.file.steps,
        warmup: m.file.warmup,
        hardware,
    }
}

fn step_row(m: &Matrix, lt: &Lt, model: &LoadedModel, path: &std::path::Path, b: usize, p: Policy) -> Result<StepRow> {
    let args = bench_args(m, path, b, p);
    let (status, reason, metrics, raw) = match lt.bench_train(&args)? {
        BenchOutcome::Ok(x, raw) => (Status::Ok, None, Some(x), Some(raw)),
        BenchOutcome::DoesNotFit { reason, .. } => (Status::Skipped, Some(reason), None, None),
        BenchOutcome::Failed(e) => (Status::Failed, Some(e), None, None),
    };
    Ok(StepRow {
        model: model.name.clone(),
        params: model.config.total_params() as u64,
        batch_size: b,
        seq_len: m.file.seq_len,
        policy: p,
        source: Source::Measured,
        status,
        reason,
        metrics,
        speedup_vs_megatrain: None,
        lt_output: raw,
    })
}

fn max_batch_row(
    m: &Matrix,
    lt: &Lt,
    model: &LoadedModel,
    path: &std::path::Path,
    p: Policy,
    limit: usize,
) -> MaxBatchRow {
    let mut probes = Vec::new();
    let mut start_error = None;
    let mut first_refusal = None;
    let found = search_max_batch(limit, |b| {
        let mut args = bench_args(m, path, b, p);
        args.steps = 1;
        args.warmup = 0;
        eprintln!("    probing batch {b} ...");
        let r = match lt.bench_train(&args) {
            Ok(BenchOutcome::Ok(..)) => Probe::Fits,
            Ok(BenchOutcome::DoesNotFit { reason, .. }) => {
                first_refusal.get_or_insert(reason);
                Probe::DoesNotFit
            }
            Ok(BenchOutcome::Failed(e)) => Probe::Failed(e),
            Err(e) => {
                start_error = Some(format!("{e:#}"));
                Probe::Failed(format!("{e:#}"))
            }
        };
        probes.push((b, r == Probe::Fits));
        r
    });
    let (status, reason, max_batch) = match found {
        Ok(Some(b)) => (Status::Ok, None, Some(b)),
        Ok(None) => {
            let why =
                first_refusal.map_or_else(|| "batch 1 does not fit".into(), |r| format!("batch 1 does not fit: {r}"));
            (Status::Skipped, Some(why), None)
        }
        Err(e) => (Status::Failed, Some(start_error.unwrap_or(e)), None),
    };
    MaxBatchRow {
        model: model.name.clone(),
        params: model.config.total_params() as u64,
        seq_len: m.file.seq_len,
        policy: p,
        source: Source::Measured,
        status,
        reason,
        max_batch,
        probes,
    }
}

/// Every measured row of `m`, with progress on stderr.
///
/// # Errors
/// When a model does not load or `lt` cannot be started.
pub fn run(m: &Matrix, lt: &Lt) -> Result<(Vec<StepRow>, Vec<MaxBatchRow>)> {
    let models = load_models(m)?;
    let f = &m.file;
    let mb = f.max_batch.as_ref();
    let mb_policies = mb.map_or(&[][..], |x| &x.policies[..]);
    let total = models.len() * (f.batch_sizes.len() * f.policies.len() + mb_policies.len());
    let mut done = 0;
    let (mut rows, mut max_rows) = (Vec::new(), Vec::new());
    for (model, path) in models.iter().zip(&m.model_paths) {
        for &b in &f.batch_sizes {
            for &p in &f.policies {
                done += 1;
                let t = Instant::now();
                eprintln!(
                    "[{done}/{total}] measuring {} batch {b} x {} {p}: {} steps + {} warm-up",
                    model.name, f.seq_len, f.steps, f.warmup
                );
                let row = step_row(m, lt, model, path, b, p)?;
                let what = match (&row.metrics, &row.reason) {
                    (Some(x), _) => {
                        format!("{:.3} s/step, {:.1} TFLOPS", x.step_seconds, x.tflops_6pt.unwrap_or(f64::NAN))
                    }
                    (None, r) => format!(
                        "{}: {}",
                        if row.status == Status::Skipped { "skipped" } else { "failed" },
                        r.as_deref().unwrap_or("?")
                    ),
                };
                eprintln!("[{done}/{total}] {what} ({:.1} s)", t.elapsed().as_secs_f64());
                rows.push(row);
            }
        }
        for &p in mb_policies {
            done += 1;
            let t = Instant::now();
            eprintln!("[{done}/{total}] searching the max batch of {} at seq {} {p}", model.name, f.seq_len);
            let row = max_batch_row(m, lt, model, path, p, mb.map_or(1024, |x| x.limit));
            let what = match (row.max_batch, row.status) {
                (Some(b), _) => format!("max batch {b}"),
                (None, Status::Skipped) => format!("skipped: {}", row.reason.as_deref().unwrap_or("?")),
                (None, _) => format!("failed: {}", row.reason.as_deref().unwrap_or("?")),
            };
            eprintln!("[{done}/{total}] {what} ({:.1} s)", t.elapsed().as_secs_f64());
            max_rows.push(row);
        }
    }
    Ok((rows, max_rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn search(limit: usize, max: usize) -> (Option<usize>, usize) {
        let mut calls = 0;
        let r = search_max_batch(limit, |b| {
            calls += 1;
            if b <= max { Probe::Fits } else { Probe::DoesNotFit }
        });
        (r.ok().flatten(), calls)
    }

    #[test]
    fn search_finds_the_boundary_in_log_probes() {
        for max in [1, 2, 3, 5, 33, 42, 64, 135, 1000] {
            let (got, calls) = search(1024, max);
            assert_eq!(got, Some(max), "max {max}");
            // Doubling then bisecting: at most 2 log2(1024) + 2 probes.
            assert!(calls <= 22, "max {max}: {calls} probes");
        }
        assert_eq!(search(1024, 0).0, None);
        assert_eq!(search(1024, 5000).0, Some(1024));
        assert_eq!(search(100, 5000).0, Some(100));
        assert_eq!(search(100, 99).0, Some(99));
    }

    #[test]
    fn search_stops_at_the_first_failure() {
        let r = search_max_batch(64, |b| if b < 8 { Probe::Fits } else { Probe::Failed("CUDA error".into()) });
        assert_eq!(r, Err("batch 8: CUDA error".into()));
    }
}
