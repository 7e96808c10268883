//! Running `lt bench train` and reading its one-line JSON answer.
//!
//! # The interface (what `lt bench train --json` promises)
//! - Success: exit 0, the last stdout line is an object with `step_seconds`, `tokens_per_s`,
//!   `tflops_6pt`, `tflops_full`, `peak_device_bytes`, `peak_host_bytes`, `exposed_seconds` (an
//!   object) and `predicted_step_seconds`. Other fields are ignored, and fields other than
//!   `step_seconds` may be missing.
//! - Does not fit: exit 2, the last line is `{"error": "...", "kind": "device_memory" | "host_memory" |
//!   "infeasible"}`: the row is skipped, not failed.
//! - Anything else is a failure of the run.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::matrix::Policy;

/// Exit code of `lt bench train` when the configuration does not fit.
pub const EXIT_DOES_NOT_FIT: i32 = 2;

/// Figures of one run (measured by `lt`, or predicted by lt-sched in the same shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Mean step time, seconds.
    pub step_seconds: f64,
    /// Tokens per second (padding included, as published).
    #[serde(default)]
    pub tokens_per_s: Option<f64>,
    /// `6 x params x tokens / step` (the published formula), TFLOPS.
    #[serde(default)]
    pub tflops_6pt: Option<f64>,
    /// FLOPs executed (attention and recompute included) per second, TFLOPS.
    #[serde(default)]
    pub tflops_full: Option<f64>,
    /// Peak device memory, bytes.
    #[serde(default)]
    pub peak_device_bytes: Option<u64>,
    /// Peak host memory, bytes.
    #[serde(default)]
    pub peak_host_bytes: Option<u64>,
    /// Time the compute stream waited on each other stream per step, seconds (an object by stream).
    #[serde(default)]
    pub exposed_seconds: Option<serde_json::Value>,
    /// lt-sched's prediction of the same step, seconds.
    #[serde(default)]
    pub predicted_step_seconds: Option<f64>,
    /// Sequences per micro-batch, when known.
    #[serde(default)]
    pub micro_batch_size: Option<usize>,
    /// Micro-batches per step, when known.
    #[serde(default)]
    pub grad_accum_steps: Option<usize>,
}

/// Why a configuration does not fit (the `kind` of the error line).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DoesNotFit {
    /// Out of GPU memory.
    DeviceMemory,
    /// Out of host memory.
    HostMemory,
    /// The planner found no plan.
    Infeasible,
}

/// What one `lt bench train` run ended with.
#[derive(Debug, Clone, PartialEq)]
pub enum BenchOutcome {
    /// It ran: the figures, and the whole JSON line (plan, losses, memory sources, ...).
    Ok(StepMetrics, serde_json::Value),
    /// It does not fit (exit 2 with an error line).
    DoesNotFit {
        /// Which resource ran out.
        kind: DoesNotFit,
        /// `lt`'s message.
        reason: String,
    },
    /// It failed for another reason.
    Failed(String),
}

#[derive(Deserialize)]
struct ErrorLine {
    error: String,
    #[serde(default)]
    kind: Option<String>,
}

/// Read the outcome from `lt`'s stdout and exit code (`None`: killed by a signal).
pub fn parse_output(stdout: &str, code: Option<i32>) -> BenchOutcome {
    let last = stdout.lines().rev().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
    let error_line = serde_json::from_str::<ErrorLine>(last).ok();
    match code {
        Some(0) => match serde_json::from_str::<StepMetrics>(last) {
            Ok(m) if m.step_seconds.is_finite() && m.step_seconds > 0.0 => {
                BenchOutcome::Ok(m, serde_json::from_str(last).unwrap_or_default())
            }
            Ok(m) => BenchOutcome::Failed(format!("step_seconds {} is not a positive number", m.step_seconds)),
            Err(e) => match error_line {
                Some(el) => BenchOutcome::Failed(el.error),
                None => BenchOutcome::Failed(format!("last stdout line is not the JSON summary ({e}): {last:?}")),
            },
        },
        Some(EXIT_DOES_NOT_FIT) => {
            let Some(el) = error_line else {
                return BenchOutcome::Failed(format!("exit 2 without a JSON error line; last line {last:?}"));
            };
            let kind = el.kind.as_deref().and_then(|k| serde_json::from_value(serde_json::json!(k)).ok());
            match kind {
                Some(kind) => BenchOutcome::DoesNotFit { kind, reason: el.error },
                None => BenchOutcome::Failed(format!("{} (kind {:?})", el.error, el.kind)),
            }
        }
        Some(c) => BenchOutcome::Failed(match error_line {
            Some(el) => format!("exit {c}: {}", el.error),
            None => format!("exit {c}"),
        }),
        None => BenchOutcome::Failed("killed by a signal".into()),
    }
}

/// One `lt bench train` invocation.
#[derive(Debug, Clone)]
pub struct BenchArgs<'a> {
    /// The model config.
    pub model_config: &'a Path,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Policy.
    pub policy: Policy,
    /// Timed steps.
    pub steps: usize,
    /// Warm-up steps.
    pub warmup: usize,
    /// `--hardware` value (built-in name or TOML path).
    pub hardware: String,
}

impl BenchArgs<'_> {
    /// The argument list after the binary.
    pub fn to_args(&self) -> Vec<String> {
        [
            "bench",
            "train",
            "--model-config",
            &self.model_config.display().to_string(),
            "--batch-size",
            &self.batch_size.to_string(),
            "--seq-len",
            &self.seq_len.to_string(),
            "--policy",
            self.policy.name(),
            "--steps",
            &self.steps.to_string(),
            "--warmup",
            &self.warmup.to_string(),
            "--device",
            "cuda",
            "--hardware",
            &self.hardware,
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

/// A CUDA-enabled `lt` binary.
#[derive(Debug, Clone)]
pub struct Lt {
    /// Its path.
    pub path: PathBuf,
    /// Wall-clock limit of one run.
    pub timeout: Duration,
}

impl Lt {
    /// Run `lt bench train`; its stderr (progress) passes through.
    ///
    /// # Errors
    /// Only when the binary cannot be started; a failed run is [`BenchOutcome::Failed`].
    pub fn bench_train(&self, args: &BenchArgs<'_>) -> Result<BenchOutcome> {
        let mut child = Command::new(&self.path)
            .args(args.to_args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", self.path.display()))?;
        let mut out = child.stdout.take().context("child stdout")?;
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            out.read_to_string(&mut s).map(|_| s)
        });
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if started.elapsed() > self.timeout {
                // The child is ours; kill it by its handle, then reap it.
                child.kill().ok();
                child.wait().ok();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let stdout = reader.join().map_err(|_| anyhow::anyhow!("stdout reader panicked"))??;
        Ok(match status {
            Some(s) => parse_output(&stdout, s.code()),
            None => BenchOutcome::Failed(format!("timed out after {:.0} s", self.timeout.as_secs_f64())),
        })
    }

    /// Whether the binary exists and knows `bench train`.
    pub fn has_bench_train(&self) -> bool {
        Command::new(&self.path)
            .args(["bench", "train", "--help"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    const OK_LINE: &str = r#"{"step_seconds": 2.5, "tokens_per_s": 29491.2, "tflops_6pt": 190.1, "tflops_full": 230.0,
        "peak_device_bytes": 68840000000, "peak_host_bytes": 361580000000,
        "exposed_seconds": {"h2d": 0.01, "d2h": 0.0, "nvme": 0.0, "cpu": 0.2},
        "predicted_step_seconds": 2.4, "policy": "auto", "extra": [1, 2, 3]}"#;

    #[test]
    fn summary_line_is_read_and_extra_fields_ignored() {
        let stdout = format!("step 1/3 ...\nstep 2/3 ...\n{}\n\n", OK_LINE.replace('\n', " "));
        let BenchOutcome::Ok(m, raw) = parse_output(&stdout, Some(0)) else { panic!() };
        assert_eq!(raw["policy"], "auto");
        assert_eq!(m.step_seconds, 2.5);
        assert_eq!(m.tflops_6pt, Some(190.1));
        assert_eq!(m.peak_device_bytes, Some(68_840_000_000));
        assert_eq!(m.exposed_seconds.as_ref().and_then(|e| e["cpu"].as_f64()), Some(0.2));
        assert_eq!(m.predicted_step_seconds, Some(2.4));
        // Missing optional fields are fine.
        let BenchOutcome::Ok(m, _) = parse_output(r#"{"step_seconds": 1.0, "predicted_step_seconds": null}"#, Some(0))
        else {
            panic!()
        };
        assert_eq!(m.predicted_step_seconds, None);
        assert_eq!(m.tflops_full, None);
    }

    #[test]
    fn error_line_with_exit_2_is_a_skip_with_its_kind() {
        let stdout = "planning...\n{\"error\": \"needs 90.1 GiB of GPU memory\", \"kind\": \"device_memory\"}\n";
        assert_eq!(
            parse_output(stdout, Some(2)),
            BenchOutcome::DoesNotFit { kind: DoesNotFit::DeviceMemory, reason: "needs 90.1 GiB of GPU memory".into() }
        );
        let line = r#"{"error": "host short", "kind": "host_memory", "min_host_memory_bytes": 1}"#;
        assert!(matches!(parse_output(line, Some(2)), BenchOutcome::DoesNotFit { kind: DoesNotFit::HostMemory, .. }));
        let line = r#"{"error": "no plan", "kind": "infeasible"}"#;
        assert!(matches!(parse_output(line, Some(2)), BenchOutcome::DoesNotFit { kind: DoesNotFit::Infeasible, .. }));
    }

    #[test]
    fn other_failures_are_failures() {
        // Exit 2 with an unknown kind, or without a JSON line, is not a "does not fit".
        let line = r#"{"error": "bad", "kind": "cosmic_ray"}"#;
        assert!(matches!(parse_output(line, Some(2)), BenchOutcome::Failed(_)));
        assert!(matches!(parse_output("error: boom", Some(2)), BenchOutcome::Failed(_)));
        let BenchOutcome::Failed(m) = parse_output(r#"{"error": "CUDA driver"}"#, Some(1)) else { panic!() };
        assert_eq!(m, "exit 1: CUDA driver");
        assert!(matches!(parse_output("not json", Some(0)), BenchOutcome::Failed(_)));
        assert!(matches!(parse_output(r#"{"step_seconds": 0}"#, Some(0)), BenchOutcome::Failed(_)));
        assert!(matches!(parse_output("", None), BenchOutcome::Failed(_)));
    }

    #[test]
    fn arguments_follow_the_interface() {
        let a = BenchArgs {
            model_config: Path::new("configs/models/qwen2.5-7b.json"),
            batch_size: 8,
            seq_len: 1024,
            policy: Policy::Megatrain,
            steps: 3,
            warmup: 1,
            hardware: "h200".into(),
        };
        assert_eq!(
            a.to_args().join(" "),
            "bench train --model-config configs/models/qwen2.5-7b.json --batch-size 8 --seq-len 1024 \
             --policy megatrain --steps 3 --warmup 1 --device cuda --hardware h200 --json"
        );
    }
}
