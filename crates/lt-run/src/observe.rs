//! What a run reports while it runs: [`Event`]s, delivered to [`Observer`]s in order.
//!
//! The run itself writes only its checkpoints, the exported model and the trace. Everything else
//! a user watches is an observer: [`MetricsFile`] (one JSON object per step and per evaluation,
//! `metrics.jsonl`), [`Pictures`] (`loss.png`, `timeline.svg`), and in `lt train` the progress bars.
//! A closure `FnMut(&Event<'_>) -> anyhow::Result<()>` is an observer too.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use lt_data::Accuracy;
use lt_exec::train::StepMetrics;

use crate::plan::ChosenPlan;
use crate::run::RunReport;

/// One thing that happened in a run.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event<'a> {
    /// The data is prepared: one line of what was kept, cut and skipped.
    Data {
        /// The summary line.
        summary: &'a str,
    },
    /// The plan is chosen.
    Planned {
        /// The plan and what the planner predicted.
        plan: &'a ChosenPlan,
    },
    /// Something worth a line (how the spill store opened, where a run resumed from).
    Note(&'a str),
    /// Something went wrong that the run survived (an unreadable checkpoint skipped).
    Warning(&'a str),
    /// Training starts (or resumes) at this step; later events are about steps after it.
    Training {
        /// Steps already done (0 for a fresh run).
        first_step: u64,
        /// Steps in the whole run.
        total_steps: u64,
    },
    /// One optimizer step finished.
    Step {
        /// What it measured.
        metrics: &'a StepMetrics,
        /// The data epoch the step's batch came from.
        epoch: u64,
        /// Trained tokens per second since this process started training.
        tokens_per_second: f64,
    },
    /// Exact-match evaluation starts on `total` held-out questions.
    EvalStarted {
        /// "eval" or "final eval".
        label: &'a str,
        /// Questions to score.
        total: usize,
    },
    /// `done` more questions were scored.
    EvalProgress {
        /// Questions in this batch.
        done: usize,
    },
    /// A checkpoint of `step` is being saved (a [`Event::Saved`] follows when it is durable).
    Saving {
        /// The step.
        step: u64,
        /// Bytes it will write, about (masters and optimizer state).
        bytes: u64,
    },
    /// A checkpoint of `step` was saved (durably) in `seconds`; its files hold `bytes`.
    Saved {
        /// The step.
        step: u64,
        /// Wall time of the save, the wait for the overlapped optimizer included.
        seconds: f64,
        /// Bytes of the checkpoint's files.
        bytes: u64,
    },
    /// The held-out loss after `step`.
    EvalLoss {
        /// The step.
        step: u64,
        /// Mean token loss on the held-out subset.
        loss: f64,
    },
    /// The held-out exact match after `step`.
    ExactMatch {
        /// The step.
        step: u64,
        /// The tally.
        accuracy: &'a Accuracy,
        /// Whether this is the final evaluation of the run.
        is_final: bool,
    },
    /// The run is over; outputs are written.
    Finished {
        /// The report the run returns.
        report: &'a RunReport,
        /// The measured per-stream timeline.
        trace: &'a lt_exec::trace::Trace,
        /// The plan that ran.
        plan: &'a ChosenPlan,
    },
}

/// Receives a run's events, in order. An error stops the run.
pub trait Observer {
    /// Handle one event.
    fn event(&mut self, event: &Event<'_>) -> Result<()>;

    /// Files this observer wrote (listed in the run's report).
    fn files(&self) -> Vec<PathBuf> {
        Vec::new()
    }
}

impl<F: FnMut(&Event<'_>) -> Result<()>> Observer for F {
    fn event(&mut self, event: &Event<'_>) -> Result<()> {
        self(event)
    }
}

/// `metrics.jsonl`: one JSON object per step (the step's [`StepMetrics`] plus `exposed_seconds` and
/// `epoch`), per held-out loss (`eval_loss`), per exact-match evaluation (`eval_exact_match`) and per
/// checkpoint saved (`checkpoint_seconds`, `checkpoint_bytes`).
/// A resumed run first drops the lines of steps after its checkpoint.
#[derive(Debug)]
pub struct MetricsFile {
    path: PathBuf,
    file: Option<std::fs::File>,
}

impl MetricsFile {
    /// Metrics go to `path` (appended to; created when missing).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into(), file: None }
    }

    fn write(&mut self, line: &serde_json::Value) -> Result<()> {
        let path = &self.path;
        let file = match &mut self.file {
            Some(f) => f,
            None => self.file.insert(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("{}: cannot open", path.display()))?,
            ),
        };
        writeln!(file, "{line}").with_context(|| format!("{}: write failed", path.display()))
    }
}

impl Observer for MetricsFile {
    fn event(&mut self, event: &Event<'_>) -> Result<()> {
        match event {
            Event::Training { first_step, .. } => truncate_metrics(&self.path, *first_step),
            Event::Step { metrics, epoch, .. } => {
                let mut line = serde_json::to_value(metrics)?;
                if let Some(obj) = line.as_object_mut() {
                    obj.insert("exposed_seconds".into(), serde_json::to_value(&metrics.timing.exposed)?);
                    obj.insert("epoch".into(), (*epoch).into());
                }
                self.write(&line)
            }
            Event::EvalLoss { step, loss } => self.write(&serde_json::json!({"step": step, "eval_loss": loss})),
            Event::Saved { step, seconds, bytes } => {
                self.write(&serde_json::json!({"step": step, "checkpoint_seconds": seconds, "checkpoint_bytes": bytes}))
            }
            Event::ExactMatch { step, accuracy, is_final } => {
                let mut line = serde_json::json!({"step": step, "eval_exact_match": accuracy.rate(), "eval": accuracy});
                if *is_final && let Some(obj) = line.as_object_mut() {
                    obj.insert("final".into(), true.into());
                }
                self.write(&line)
            }
            _ => Ok(()),
        }
    }

    fn files(&self) -> Vec<PathBuf> {
        vec![self.path.clone()]
    }
}

/// The run's pictures: `loss.png` from the metrics file (so a resumed run plots its whole history)
/// and `timeline.svg` of the last step, predicted (when the planner ran) above measured.
#[derive(Debug)]
pub struct Pictures {
    out: PathBuf,
    metrics: PathBuf,
    hardware: String,
    written: Vec<PathBuf>,
}

impl Pictures {
    /// Pictures go to `out`, the loss curve read from `metrics`; `hardware` names the profile the
    /// prediction was made for.
    pub fn new(out: &Path, metrics: &Path, hardware: &str) -> Self {
        Self { out: out.to_path_buf(), metrics: metrics.to_path_buf(), hardware: hardware.into(), written: Vec::new() }
    }

    /// `loss.png` from the metrics file (so a resumed run plots its whole history) and `timeline.svg` of the
    /// last step, predicted (when the planner ran) above measured. Returns the paths written.
    fn write_pictures(&self, chosen: &ChosenPlan, trace: &lt_exec::trace::Trace, step: u64) -> Result<[PathBuf; 2]> {
        use crate::plot::{Panel, Series, Span};
        let text = std::fs::read_to_string(&self.metrics).unwrap_or_default();
        let (mut train, mut eval) = (Vec::new(), Vec::new());
        for v in text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()) {
            let Some(x) = v.get("step").and_then(serde_json::Value::as_f64) else { continue };
            if let Some(y) = v.get("loss").and_then(serde_json::Value::as_f64) {
                train.push((x, y));
            }
            if let Some(y) = v.get("eval_loss").and_then(serde_json::Value::as_f64) {
                eval.push((x, y));
            }
        }
        let mut series = vec![Series { label: "train loss".into(), color: [31, 119, 180], points: train, dots: false }];
        if !eval.is_empty() {
            series.push(Series { label: "eval loss".into(), color: [214, 39, 40], points: eval, dots: true });
        }
        let loss_png = self.out.join("loss.png");
        crate::fsutil::write_atomic(&loss_png, &crate::plot::line_chart_png("loss", "step", "loss (log)", &series))?;

        let lanes = lt_exec::trace::Stream::ALL.map(|s| s.name());
        let events: Vec<_> = trace.events().into_iter().filter(|e| e.step == step).collect();
        let t0 = events.iter().map(|e| e.start_us).fold(f64::INFINITY, f64::min);
        let measured: Vec<Span> = events
            .iter()
            .map(|e| Span {
                lane: e.stream.index(),
                start: (e.start_us - t0) / 1e6,
                dur: e.dur_us / 1e6,
                name: e.name.clone(),
                wait: e.waited_on.is_some(),
            })
            .collect();
        let measured_step = measured.iter().map(|x| x.start + x.dur).fold(0.0f64, f64::max);
        let mut panels = Vec::new();
        if let Some(pred) = &chosen.predicted_trace {
            let spans: Vec<Span> = pred
                .trace_events
                .iter()
                .filter(|e| e.ph == "X")
                .filter_map(|e| {
                    Some(Span {
                        lane: e.tid as usize,
                        start: e.ts? / 1e6,
                        dur: e.dur? / 1e6,
                        name: e.name.clone(),
                        wait: false,
                    })
                })
                .collect();
            panels.push(Panel {
                title: format!(
                    "predicted (simulator, {} profile): step {:.1} ms",
                    self.hardware,
                    chosen.predicted_step_seconds.unwrap_or(0.0) * 1e3
                ),
                spans,
            });
        }
        panels.push(Panel {
            title: format!(
                "measured: step {:.1} ms (red: compute waiting on a transfer = exposed)",
                measured_step * 1e3
            ),
            spans: measured,
        });
        let svg = crate::plot::timeline_svg(&format!("step {step}: per-stream timeline"), &lanes, &panels);
        let timeline = self.out.join("timeline.svg");
        crate::fsutil::write_atomic(&timeline, svg.as_bytes())?;
        Ok([loss_png, timeline])
    }
}

impl Observer for Pictures {
    fn event(&mut self, event: &Event<'_>) -> Result<()> {
        if let Event::Finished { report, trace, plan } = event {
            self.written = self.write_pictures(plan, trace, report.steps)?.to_vec();
        }
        Ok(())
    }

    fn files(&self) -> Vec<PathBuf> {
        self.written.clone()
    }
}

/// Keep only metrics lines of steps <= `step` (a resumed run rewrites what came after its checkpoint).
fn truncate_metrics(path: &Path, step: u64) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
                .is_some_and(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    crate::fsutil::write_atomic(path, kept.as_bytes())
}
