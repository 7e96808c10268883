//! `kill -9` at several points of a `save_every = 1` run, then resume: the run finishes and every
//! step's loss equals the uninterrupted run's (bit-exact in practice; the bar is rel 1e-5).
//!
//! This binary has its own `main`: run with `LT_TEST_CHILD_OUT=DIR` it is the training process
//! (the library API, resuming from DIR when it holds a checkpoint); otherwise it is the test, which
//! starts itself as that process and SIGKILLs it mid-run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lt_run::Run;

const STEPS: u64 = 24;
const CHILD: &str = "LT_TEST_CHILD_OUT";

fn run(out: &Path, resume: bool) {
    let config = common::fixture_run("qwen35-hybrid", out, STEPS).save_every(1).resume(resume);
    Run::builder(config)
        .without_default_outputs()
        .observer(lt_run::MetricsFile::new(out.join("metrics.jsonl")))
        .build()
        .unwrap()
        .execute()
        .unwrap();
}

/// The step of the newest committed checkpoint in `root` (0 when there is none).
fn newest_checkpoint(root: &Path) -> u64 {
    let store = lt_storage::checkpoint::CheckpointStore::new(root, lt_storage::checkpoint::Retention::KeepAll);
    store.list().unwrap_or_default().last().map_or(0, |(step, _)| *step)
}

fn main() {
    if let Some(out) = std::env::var_os(CHILD) {
        run(Path::new(&out), true);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    run(&straight, false);
    let want = common::losses(&straight.join("metrics.jsonl"));
    assert_eq!(want.len(), STEPS as usize);

    for (attempt, wait_lines) in [3usize, 9, 15].into_iter().enumerate() {
        let out: PathBuf = dir.path().join(format!("killed-{attempt}"));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(CHILD, &out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Kill once a few steps are done: the kill lands somewhere in the next step or save.
        let metrics = out.join("metrics.jsonl");
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(60) && common::losses(&metrics).len() < wait_lines {
            std::thread::sleep(Duration::from_millis(2));
        }
        child.kill().unwrap(); // SIGKILL, as `kill -9` sends
        child.wait().unwrap();
        let killed_at = common::losses(&metrics).len();
        // Every step is saved: the newest checkpoint is the last step reported or the one before it
        // (the kill landed in that step's save).
        let saved = newest_checkpoint(&out.join("checkpoints"));
        assert!(
            saved + 1 >= killed_at as u64,
            "attempt {attempt}: {killed_at} steps reported, newest checkpoint step {saved}: more than one step lost"
        );

        run(&out, true);
        let got = common::losses(&metrics);
        assert_eq!(got.len(), want.len(), "attempt {attempt}: one line per step after resume");
        for ((s1, a), (s2, b)) in got.iter().zip(&want) {
            assert_eq!(s1, s2);
            assert!(((a - b) / b).abs() <= 1e-5, "attempt {attempt} step {s1}: {a} vs {b}");
        }
        println!("attempt {attempt}: killed after {killed_at} steps, resumed, all {STEPS} losses match");
    }
    println!("test kill_9_then_resume_reproduces_the_uninterrupted_run ... ok");
}
