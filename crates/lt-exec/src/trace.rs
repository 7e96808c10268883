//! Runtime tracing: per-stream start/end of every operation, measured exposure, Chrome trace JSON.

use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

/// An execution stream: lt-sched's, the same lanes the simulator replays.
pub use lt_sched::sim::Stream;

/// One timed operation.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    /// Stream it ran on.
    pub stream: Stream,
    /// What it was (`fwd L3`, `upload L4`, `wait h2d`...).
    pub name: String,
    /// Start, microseconds since the trace began.
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
    /// Training step.
    pub step: u64,
    /// For compute-stream waits: the stream waited on (this is measured exposure).
    pub waited_on: Option<Stream>,
}

/// Thread-safe event recorder.
#[derive(Debug)]
pub struct Trace {
    t0: Instant,
    events: Mutex<Vec<Event>>,
}

impl Default for Trace {
    fn default() -> Self {
        Self::new()
    }
}

/// Steps of events a [`Trace`] keeps (the reports use the last one or two).
pub const KEEP_STEPS: u64 = 8;

impl Trace {
    /// A trace starting now.
    pub fn new() -> Self {
        Self { t0: Instant::now(), events: Mutex::new(Vec::new()) }
    }

    /// Microseconds since the trace began, on the clock of [`Event::start_us`] (to place an outside
    /// observation, such as an allocator's peak, on the timeline).
    pub fn micros_since_start(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.t0).as_secs_f64() * 1e6
    }

    fn push(&self, e: Event) {
        if let Ok(mut v) = self.events.lock() {
            // Keep the last KEEP_STEPS steps: a long run must not grow the trace (and the per-step
            // summary, which scans it) without bound. Pruned in batches, so pushing stays O(1) amortised.
            let newest = e.step;
            if v.first().is_some_and(|f| f.step + 2 * KEEP_STEPS <= newest) {
                v.retain(|x| x.step + KEEP_STEPS > newest);
            }
            v.push(e);
        }
    }

    /// Time `f` as an operation on `stream`.
    pub fn span<T>(&self, stream: Stream, step: u64, name: impl Into<String>, f: impl FnOnce() -> T) -> T {
        let s = Instant::now();
        let out = f();
        self.record(stream, step, name.into(), s, None);
        out
    }

    /// Time `f` as the compute stream waiting on `on` (counted as exposed time of `on`).
    pub fn wait<T>(&self, on: Stream, step: u64, name: impl Into<String>, f: impl FnOnce() -> T) -> T {
        let s = Instant::now();
        let out = f();
        self.record(Stream::Compute, step, name.into(), s, Some(on));
        out
    }

    /// Time `f` as stream `who` waiting on stream `on` (e.g. an upload waiting for the optimizer).
    pub fn wait_as<T>(&self, who: Stream, on: Stream, step: u64, name: impl Into<String>, f: impl FnOnce() -> T) -> T {
        let s = Instant::now();
        let out = f();
        if s.elapsed().as_micros() > 0 {
            self.record(who, step, name.into(), s, Some(on));
        }
        out
    }

    fn record(&self, stream: Stream, step: u64, name: String, start: Instant, waited_on: Option<Stream>) {
        let start_us = start.duration_since(self.t0).as_secs_f64() * 1e6;
        let dur_us = start.elapsed().as_secs_f64() * 1e6;
        self.push(Event { stream, name, start_us, dur_us, step, waited_on });
    }

    /// A copy of the events of the last [`KEEP_STEPS`] or more steps.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Summary of one step.
    pub fn summary(&self, step: u64) -> StepTiming {
        let ev: Vec<Event> = self.events().into_iter().filter(|e| e.step == step).collect();
        let mut t = StepTiming::default();
        let start = ev.iter().map(|e| e.start_us).fold(f64::INFINITY, f64::min);
        let end = ev.iter().map(|e| e.start_us + e.dur_us).fold(0.0, f64::max);
        t.step_seconds = if ev.is_empty() { 0.0 } else { (end - start) / 1e6 };
        for e in &ev {
            let secs = e.dur_us / 1e6;
            match (e.stream, e.waited_on) {
                (Stream::Compute, Some(on)) => *t.exposed.entry(on) += secs,
                (s, None) => *t.busy.entry(s) += secs,
                (_, Some(on)) => *t.upstream_waits.entry(on) += secs,
            }
        }
        t
    }

    /// Chrome trace JSON (`chrome://tracing`, Perfetto) of the given steps.
    pub fn chrome_json(&self, steps: std::ops::RangeInclusive<u64>) -> String {
        let evs: Vec<serde_json::Value> = self
            .events()
            .into_iter()
            .filter(|e| steps.contains(&e.step))
            .map(|e| {
                serde_json::json!({
                    "name": e.name, "ph": "X", "ts": e.start_us, "dur": e.dur_us,
                    "pid": 1, "tid": e.stream.index(),
                    "args": {"step": e.step, "stream": e.stream, "waited_on": e.waited_on},
                })
            })
            .collect();
        let names: Vec<serde_json::Value> = Stream::ALL
            .iter()
            .map(|s| {
                serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": s.index(),
                    "args": {"name": format!("{s:?}")}})
            })
            .collect();
        serde_json::json!({"traceEvents": names.into_iter().chain(evs).collect::<Vec<_>>()}).to_string()
    }
}

/// Per-stream seconds, indexable by [`Stream`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct PerStream {
    /// Compute.
    pub compute: f64,
    /// Host to device.
    pub h2d: f64,
    /// Device to host.
    pub d2h: f64,
    /// NVMe.
    pub nvme: f64,
    /// Optimizer.
    pub optimizer: f64,
}

impl PerStream {
    fn entry(&mut self, s: Stream) -> &mut f64 {
        match s {
            Stream::Compute => &mut self.compute,
            Stream::H2d => &mut self.h2d,
            Stream::D2h => &mut self.d2h,
            Stream::Nvme => &mut self.nvme,
            Stream::Optimizer => &mut self.optimizer,
        }
    }
    /// Sum over streams.
    pub fn total(&self) -> f64 {
        self.compute + self.h2d + self.d2h + self.nvme + self.optimizer
    }
}

/// Measured timing of one step.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepTiming {
    /// Wall time from the first to the last event of the step.
    pub step_seconds: f64,
    /// Busy time per stream.
    pub busy: PerStream,
    /// Measured exposure: time the compute stream waited on each other stream.
    pub exposed: PerStream,
    /// Time other streams waited on a stream (e.g. uploads held back by a late optimizer update;
    /// such waits become exposure only if compute then waits on the upload).
    pub upstream_waits: PerStream,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_recent_steps_are_kept() {
        let t = Trace::new();
        for step in 0..100 {
            t.span(Stream::Compute, step, "op", || ());
            t.span(Stream::H2d, step, "op", || ());
        }
        let steps: std::collections::BTreeSet<u64> = t.events().iter().map(|e| e.step).collect();
        assert!(steps.len() as u64 >= KEEP_STEPS && steps.len() as u64 <= 2 * KEEP_STEPS, "{steps:?}");
        assert_eq!(steps.last(), Some(&99));
        assert_eq!(t.events().iter().filter(|e| e.step == 99).count(), 2);
        assert_eq!(t.summary(0).step_seconds, 0.0, "step 0 was pruned");
    }

    #[test]
    fn waits_count_as_exposure_of_the_awaited_stream() {
        let t = Trace::new();
        t.span(Stream::H2d, 0, "upload", || std::thread::sleep(std::time::Duration::from_millis(2)));
        t.wait(Stream::H2d, 0, "wait", || std::thread::sleep(std::time::Duration::from_millis(3)));
        let s = t.summary(0);
        assert!(s.exposed.h2d >= 0.003 && s.busy.h2d >= 0.002, "{s:?}");
        assert_eq!(s.exposed.d2h, 0.0);
        let j: serde_json::Value = serde_json::from_str(&t.chrome_json(0..=0)).unwrap();
        assert_eq!(j["traceEvents"].as_array().unwrap().len(), Stream::ALL.len() + 2);
    }
}
