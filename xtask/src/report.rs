//! Rows of a benchmark matrix, and how they are printed and written.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::bench_train::StepMetrics;
use crate::matrix::Policy;

/// Where a row's figures come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// lt-sched's cost model and simulator, in-process: no GPU ran.
    Predicted,
    /// `lt bench train` on the matching GPU.
    Measured,
}

impl Source {
    /// Name as printed.
    pub fn name(self) -> &'static str {
        match self {
            Source::Predicted => "predicted",
            Source::Measured => "measured",
        }
    }
}

/// How a row ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Figures are present.
    Ok,
    /// The configuration does not fit the machine (`reason` says what is short).
    Skipped,
    /// The run or the solve failed (`reason` says how).
    Failed,
}

/// One model x batch x policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRow {
    /// Model name.
    pub model: String,
    /// All parameters, embedding included (the 6PT formula's `P`).
    pub params: u64,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Policy.
    pub policy: Policy,
    /// Predicted or measured.
    pub source: Source,
    /// Ok, skipped or failed.
    pub status: Status,
    /// Why skipped or failed.
    pub reason: Option<String>,
    /// The figures (when ok).
    pub metrics: Option<StepMetrics>,
    /// MegaTrain's step time over this row's, at the same model and batch (auto rows).
    pub speedup_vs_megatrain: Option<f64>,
    /// The whole JSON line of `lt bench train` (measured rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lt_output: Option<serde_json::Value>,
}

/// One model x policy of a max-batch search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MaxBatchRow {
    /// Model name.
    pub model: String,
    /// All parameters.
    pub params: u64,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Policy.
    pub policy: Policy,
    /// Predicted or measured.
    pub source: Source,
    /// Ok, skipped (not even batch 1 fits) or failed.
    pub status: Status,
    /// Why skipped or failed.
    pub reason: Option<String>,
    /// Largest batch that fits in one micro-batch.
    pub max_batch: Option<usize>,
    /// Batches tried by a measured search and whether each ran.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub probes: Vec<(usize, bool)>,
}

/// Everything one `cargo xtask bench-*` produced.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Matrix name.
    pub matrix: String,
    /// Matrix description.
    pub description: String,
    /// The matrix file.
    pub matrix_file: String,
    /// Hardware profile name.
    pub hardware: String,
    /// Predicted or measured (every row carries its own too).
    pub source: Source,
    /// Why this mode was chosen.
    pub mode_reason: String,
    /// GPUs `nvidia-smi` listed.
    pub gpus: Vec<String>,
    /// The `lt` binary of a measured run.
    pub lt_binary: Option<String>,
    /// The host CPU of a measured run: the optimizer and the upload preparation run on it, so a
    /// measured step time holds for this host as well as this GPU.
    pub host_cpu: Option<lt_core::HostCpu>,
    /// Step rows.
    pub rows: Vec<StepRow>,
    /// Max-batch rows.
    pub max_batch: Vec<MaxBatchRow>,
    /// Wall time of the whole command, seconds.
    pub total_seconds: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Fill `speedup_vs_megatrain` of every ok auto row that has an ok MegaTrain row at its model and batch.
pub fn fill_speedups(rows: &mut [StepRow]) {
    let mt: BTreeMap<(String, usize), f64> = rows
        .iter()
        .filter(|r| r.policy == Policy::Megatrain)
        .filter_map(|r| Some(((r.model.clone(), r.batch_size), r.metrics.as_ref()?.step_seconds)))
        .collect();
    for r in rows.iter_mut().filter(|r| r.policy == Policy::Auto) {
        r.speedup_vs_megatrain =
            r.metrics.as_ref().and_then(|m| mt.get(&(r.model.clone(), r.batch_size)).map(|t| t / m.step_seconds));
    }
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.prec$}"))
}

fn gib(v: Option<u64>) -> String {
    v.map_or("-".into(), |b| format!("{:.2}", b as f64 / GIB))
}

/// Format a byte count for a reason line.
pub fn gib_text(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB)
}

/// The banner line saying where every figure comes from.
pub fn banner(r: &Report) -> String {
    match r.source {
        Source::Predicted => format!("PREDICTED (simulator, {})", r.mode_reason),
        Source::Measured => format!("MEASURED ({})", r.mode_reason),
    }
}

/// The whole text report.
pub fn render_text(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{}", banner(r));
    let _ = writeln!(s, "matrix {} ({}), hardware profile {}", r.matrix, r.matrix_file, r.hardware);
    if !r.description.is_empty() {
        let _ = writeln!(s, "{}", r.description);
    }
    if let Some(host) = &r.host_cpu {
        let _ = writeln!(s, "host: {host}");
    }
    if !r.rows.is_empty() {
        s.push('\n');
        render_steps(&mut s, r);
        s.push('\n');
        render_tflops_matrix(&mut s, r);
    }
    if !r.max_batch.is_empty() {
        s.push('\n');
        render_max_batch(&mut s, r);
    }
    s
}

/// The rows of docs/benchmarks.md's predicted step table, as markdown: per model and batch with
/// both policies ok, `| model | auto TFLOPS | megatrain TFLOPS | speedup | auto peak GPU GiB |`.
/// (`--markdown` prints them; a test holds the committed docs to them.)
pub fn markdown_step_rows(rows: &[StepRow]) -> Vec<String> {
    fn ok(x: &StepRow) -> Option<&StepMetrics> {
        x.metrics.as_ref().filter(|_| x.status == Status::Ok)
    }
    let mut out = Vec::new();
    for a in rows.iter().filter(|x| x.policy == Policy::Auto) {
        let mt =
            rows.iter().find(|x| x.policy == Policy::Megatrain && x.model == a.model && x.batch_size == a.batch_size);
        let (Some(am), Some(mm)) = (ok(a), mt.and_then(ok)) else { continue };
        out.push(format!(
            "| {} | {} | {} | {}x | {} |",
            a.model,
            opt(am.tflops_6pt, 1),
            opt(mm.tflops_6pt, 1),
            opt(a.speedup_vs_megatrain, 3),
            gib(am.peak_device_bytes)
        ));
    }
    out
}

/// The rows of docs/benchmarks.md's predicted max-batch table: per model with both policies ok,
/// `| model | auto | megatrain | auto - megatrain |`.
pub fn markdown_max_batch_rows(max_batch: &[MaxBatchRow]) -> Vec<String> {
    let best = |model: &str, p: Policy| {
        max_batch.iter().find(|x| x.model == model && x.policy == p && x.status == Status::Ok).and_then(|x| x.max_batch)
    };
    let mut out = Vec::new();
    for a in max_batch.iter().filter(|x| x.policy == Policy::Auto) {
        if let (Some(ab), Some(mb)) = (best(&a.model, Policy::Auto), best(&a.model, Policy::Megatrain)) {
            out.push(format!("| {} | {ab} | {mb} | {:+} |", a.model, ab as i64 - mb as i64));
        }
    }
    out
}

fn render_steps(s: &mut String, r: &Report) {
    let measured = r.source == Source::Measured;
    let _ = write!(
        s,
        "{:<12} {:>7} {:>5} {:<9} {:<9} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9} {:>7} {:>8}",
        "model",
        "params",
        "batch",
        "policy",
        "source",
        "step s",
        "tokens/s",
        "TFLOPS",
        "TF exec",
        "GPU GiB",
        "host GiB",
        "mb x k",
        "speedup"
    );
    if measured {
        let _ = write!(s, " {:>8}", "pred s");
    }
    s.push('\n');
    for row in &r.rows {
        let _ = write!(
            s,
            "{:<12} {:>6.2}B {:>5} {:<9} {:<9}",
            row.model,
            row.params as f64 / 1e9,
            row.batch_size,
            row.policy.name(),
            row.source.name()
        );
        match (&row.metrics, row.status) {
            (Some(m), Status::Ok) => {
                let mbk = match (m.micro_batch_size, m.grad_accum_steps) {
                    (Some(a), Some(b)) => format!("{a}x{b}"),
                    _ => "-".into(),
                };
                let _ = write!(
                    s,
                    " {:>8.3} {:>9.0} {:>8.1} {:>8} {:>8} {:>9} {:>7} {:>8}",
                    m.step_seconds,
                    m.tokens_per_s.unwrap_or(f64::NAN),
                    m.tflops_6pt.unwrap_or(f64::NAN),
                    opt(m.tflops_full, 1),
                    gib(m.peak_device_bytes),
                    gib(m.peak_host_bytes),
                    mbk,
                    row.speedup_vs_megatrain.map_or("-".into(), |x| format!("{x:.3}x")),
                );
                if measured {
                    let _ = write!(s, " {:>8}", opt(m.predicted_step_seconds, 3));
                }
            }
            (_, Status::Failed) => {
                let _ = write!(s, " failed: {}", row.reason.as_deref().unwrap_or("?"));
            }
            _ => {
                let _ = write!(s, " skipped: {}", row.reason.as_deref().unwrap_or("?"));
            }
        }
        s.push('\n');
    }
    let _ = writeln!(
        s,
        "TFLOPS = 6 x params x tokens / step (published formula); TF exec = executed FLOPs (attention, \
         recompute) / step; speedup = megatrain step / auto step"
    );
}

/// Model x (batch, policy) grid of the published-formula TFLOPS.
fn render_tflops_matrix(s: &mut String, r: &Report) {
    let mut batches: Vec<usize> = r.rows.iter().map(|x| x.batch_size).collect();
    batches.dedup();
    batches.sort_unstable();
    batches.dedup();
    let mut policies: Vec<Policy> = Vec::new();
    for row in &r.rows {
        if !policies.contains(&row.policy) {
            policies.push(row.policy);
        }
    }
    let both = policies.contains(&Policy::Auto) && policies.contains(&Policy::Megatrain);
    let _ = writeln!(s, "TFLOPS matrix (6PT, seq {}, {}):", r.rows.first().map_or(0, |x| x.seq_len), r.source.name());
    let _ = write!(s, "{:<12} {:<9}", "model", "source");
    for b in &batches {
        for p in &policies {
            let _ = write!(s, " {:>14}", format!("b{b} {}", p.name()));
        }
        if both {
            let _ = write!(s, " {:>8}", format!("b{b} x"));
        }
    }
    s.push('\n');
    let mut models: Vec<&str> = Vec::new();
    for row in &r.rows {
        if !models.contains(&row.model.as_str()) {
            models.push(&row.model);
        }
    }
    for m in models {
        let _ = write!(s, "{:<12} {:<9}", m, r.source.name());
        for &b in &batches {
            let find = |p: Policy| r.rows.iter().find(|x| x.model == m && x.batch_size == b && x.policy == p);
            for &p in &policies {
                let cell = match find(p) {
                    Some(x) if x.status == Status::Ok => opt(x.metrics.as_ref().and_then(|m| m.tflops_6pt), 1),
                    Some(x) if x.status == Status::Skipped => "skipped".into(),
                    Some(_) => "failed".into(),
                    None => "-".into(),
                };
                let _ = write!(s, " {cell:>14}");
            }
            if both {
                let x = find(Policy::Auto).and_then(|x| x.speedup_vs_megatrain);
                let _ = write!(s, " {:>8}", x.map_or("-".into(), |v| format!("{v:.3}x")));
            }
        }
        s.push('\n');
    }
}

fn render_max_batch(s: &mut String, r: &Report) {
    let mut policies: Vec<Policy> = Vec::new();
    let mut models: Vec<(&str, u64)> = Vec::new();
    for row in &r.max_batch {
        if !policies.contains(&row.policy) {
            policies.push(row.policy);
        }
        if !models.iter().any(|(m, _)| *m == row.model) {
            models.push((&row.model, row.params));
        }
    }
    let _ = writeln!(
        s,
        "largest batch in one micro-batch (seq {}, {}):",
        r.max_batch.first().map_or(0, |x| x.seq_len),
        r.source.name()
    );
    let _ = write!(s, "{:<12} {:>7} {:<9}", "model", "params", "source");
    for p in &policies {
        let _ = write!(s, " {:>10}", p.name());
    }
    let both = policies.contains(&Policy::Auto) && policies.contains(&Policy::Megatrain);
    if both {
        let _ = write!(s, " {:>16}", "auto - megatrain");
    }
    s.push('\n');
    let mut notes = Vec::new();
    for (m, params) in models {
        let _ = write!(s, "{:<12} {:>6.2}B {:<9}", m, params as f64 / 1e9, r.source.name());
        let find = |p: Policy| r.max_batch.iter().find(|x| x.model == m && x.policy == p);
        for &p in &policies {
            let cell = match find(p) {
                Some(x) if x.status == Status::Ok => x.max_batch.map_or("-".into(), |b| b.to_string()),
                Some(x) => {
                    notes.push(format!(
                        "{m} {}: {}: {}",
                        p.name(),
                        if x.status == Status::Skipped { "skipped" } else { "failed" },
                        x.reason.as_deref().unwrap_or("?")
                    ));
                    if x.status == Status::Skipped { "skipped".into() } else { "failed".into() }
                }
                None => "-".into(),
            };
            let _ = write!(s, " {cell:>10}");
        }
        if both {
            let get = |p| find(p).and_then(|x| x.max_batch);
            let d = match (get(Policy::Auto), get(Policy::Megatrain)) {
                (Some(a), Some(b)) => format!("{:+}", a as i64 - b as i64),
                _ => "-".into(),
            };
            let _ = write!(s, " {d:>16}");
        }
        s.push('\n');
    }
    for n in notes {
        let _ = writeln!(s, "{n}");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    fn row(model: &str, policy: Policy, step: Option<f64>) -> StepRow {
        StepRow {
            model: model.into(),
            params: 3_000_000_000,
            batch_size: 72,
            seq_len: 1024,
            policy,
            source: Source::Predicted,
            status: if step.is_some() { Status::Ok } else { Status::Skipped },
            reason: step.is_none().then(|| "needs 200.0 GiB host memory, profile has 120.0 GiB".into()),
            metrics: step.map(|s| StepMetrics {
                step_seconds: s,
                tokens_per_s: Some(73728.0 / s),
                tflops_6pt: Some(6.0 * 3e9 * 73728.0 / s / 1e12),
                tflops_full: None,
                peak_device_bytes: Some(1 << 30),
                peak_host_bytes: None,
                exposed_seconds: None,
                predicted_step_seconds: Some(s),
                micro_batch_size: Some(72),
                grad_accum_steps: Some(1),
            }),
            speedup_vs_megatrain: None,
            lt_output: None,
        }
    }

    #[test]
    fn speedup_pairs_auto_with_megatrain_and_every_row_says_predicted() {
        let mut rows = vec![
            row("a", Policy::Auto, Some(2.0)),
            row("a", Policy::Megatrain, Some(2.5)),
            row("b", Policy::Auto, None),
            row("b", Policy::Megatrain, None),
        ];
        fill_speedups(&mut rows);
        assert_eq!(rows[0].speedup_vs_megatrain, Some(1.25));
        assert_eq!(rows[1].speedup_vs_megatrain, None);
        assert_eq!(rows[2].speedup_vs_megatrain, None);
        let r = Report {
            matrix: "t".into(),
            description: String::new(),
            matrix_file: "t.toml".into(),
            hardware: "h800".into(),
            source: Source::Predicted,
            mode_reason: "no matching GPU found".into(),
            gpus: vec![],
            lt_binary: None,
            host_cpu: None,
            rows,
            max_batch: vec![],
            total_seconds: 0.0,
        };
        let text = render_text(&r);
        assert!(text.starts_with("PREDICTED (simulator, no matching GPU found)"), "{text}");
        assert!(text.contains("skipped: needs 200.0 GiB host memory"), "{text}");
        // Every table line that names a model also says "predicted".
        for line in text.lines().filter(|l| l.starts_with("a ") || l.starts_with("b ")) {
            assert!(line.contains("predicted"), "{line}");
        }
        let json = serde_json::to_value(&r).unwrap();
        for row in json["rows"].as_array().unwrap() {
            assert_eq!(row["source"], "predicted");
        }
        // A simulation ran on no particular host; a measured run names the CPU next to its figures.
        assert!(!text.contains("host:"), "{text}");
        let cpuinfo = "vendor_id : GenuineIntel\ncpu family : 6\nmodel : 143\nmodel name : Intel Xeon\n";
        let measured = Report {
            source: Source::Measured,
            host_cpu: Some(lt_core::HostCpu::from_cpuinfo(cpuinfo, 16, vec!["avx512f".into()])),
            ..r
        };
        let text = render_text(&measured);
        let host = "host: Intel Xeon (GenuineIntel family 6 model 143), 16 logical CPUs, SIMD avx512f";
        assert_eq!(text.lines().nth(2), Some(host), "{text}");
    }
}
