//! `lt plan --gpu-memory X` finds a plan if and only if `lt train --gpu-memory X` runs, for the same
//! model, batch and sequence length: both search the same space (every micro-batch, every loss
//! chunk) and the executor checks its budget with the planner's memory model. Checked at budgets
//! around the smallest one `lt plan` names, on two fixture families (a dense Qwen3 and the Qwen3.5
//! hybrid), at the shape the issue reported the two disagreeing on (batch 4 x seq 20).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures")
}

fn lt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lt"))
}

const SHAPE: [&str; 4] = ["--batch-size", "4", "--seq-len", "20"];

fn plan(family: &str, budget: u64) -> Output {
    lt().args(["plan", "--json", "--model-config"])
        .arg(fixtures().join("models").join(family))
        .args(SHAPE)
        .args(["--gpu-memory", &budget.to_string()])
        .output()
        .unwrap()
}

fn train(family: &str, budget: u64, out: &Path) -> Output {
    lt().args(["train", "--model"])
        .arg(fixtures().join("models").join(family))
        .arg("--data")
        .arg(fixtures().join("train").join(family).join("train.jsonl"))
        .args(SHAPE)
        .args(["--steps", "1", "--gpu-memory", &budget.to_string(), "--out"])
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn lt_plan_feasible_iff_lt_train_runs() {
    let dir = tempfile::tempdir().unwrap();
    for family in ["qwen3-tied-mqa", "qwen35-hybrid"] {
        // The smallest budget `lt plan` says works (1 KiB is far too small for any model).
        let st = plan(family, 1024);
        assert!(!st.status.success());
        let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
        let min = v["min_gpu_memory_bytes"].as_u64().unwrap();
        let message = v["error"].as_str().unwrap();
        assert!(message.contains("KiB") || message.contains("MiB"), "a small size in small units: {message}");
        for budget in [min / 2, min - 4096, min - 1, min, min + 1, min + 4096, 2 * min] {
            let planned = plan(family, budget);
            let out = dir.path().join(format!("{family}-{budget}"));
            let trained = train(family, budget, &out);
            let err = String::from_utf8_lossy(&trained.stderr);
            eprintln!(
                "{family} --gpu-memory {budget} (min {min}): lt plan {}, lt train {}",
                planned.status, trained.status
            );
            assert_eq!(
                planned.status.success(),
                trained.status.success(),
                "{family} at {budget} B (minimum {min} B): lt plan and lt train disagree\n{err}"
            );
            if budget >= min {
                assert!(trained.status.success(), "{family}: {budget} B >= the minimum {min} B must run\n{err}");
            }
            if !trained.status.success() {
                // A budget the plan does not fit is a one-line error (after the data summary) before
                // anything runs, naming the smallest budget that works.
                let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
                assert_eq!(errors.len(), 1, "{err}");
                assert!(errors[0].contains(&format!("({min} bytes)")), "{err}");
                assert!(!out.join("metrics.jsonl").exists(), "nothing ran");
            }
        }
    }
}
