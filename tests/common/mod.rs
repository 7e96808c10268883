//! Shared by the end-to-end tests: fixture paths and a small run config on a fixture model.
#![allow(dead_code)] // each test binary uses a different part

use std::path::{Path, PathBuf};

use lt_run::{Policy, RunConfig};

/// `tools/fixtures` (tiny checkpoints made by tools/fixtures/gen_models.py, and their data).
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/fixtures")
}

/// A short run of fixture model `name` on its pre-tokenized training rows, into `out`.
pub fn fixture_run(name: &str, out: &Path, steps: u64) -> RunConfig {
    let f = fixtures();
    RunConfig::default()
        .model(f.join("models").join(name))
        .data(f.join("train").join(name).join("train.jsonl"))
        .steps(steps)
        .batch_size(2)
        .seq_len(12)
        .lr(1e-3)
        .policy(Policy::RecomputeAll)
        .out(out)
}

/// `(step, loss)` of every training line of a metrics file.
pub fn losses(metrics: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v.get("step")?.as_u64()?, v.get("loss")?.as_f64()?)))
        .collect()
}
