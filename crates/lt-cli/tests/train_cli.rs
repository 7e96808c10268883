//! `lt train` on a committed tiny checkpoint: budget errors and run-file errors, as the command
//! reports them. (Kill -9 and resume is a cross-crate test: the workspace's `tests/kill_and_resume.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures")
}

fn base_args(out: &Path, steps: u32) -> Vec<String> {
    let f = fixtures();
    [
        "train",
        "--model",
        f.join("models/qwen35-hybrid").to_str().unwrap(),
        "--data",
        f.join("train/qwen35-hybrid/train.jsonl").to_str().unwrap(),
        "--steps",
        &steps.to_string(),
        "--batch-size",
        "2",
        "--seq-len",
        "12",
        "--lr",
        "1e-3",
        "--out",
        out.to_str().unwrap(),
        "--policy",
        "recompute-all",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// `lt train` on the qwen3-tied-mqa fixture and its training file, writing to `out`, with `args`.
fn train_tied(out: &Path, args: &[&str]) -> std::process::Output {
    let f = fixtures();
    Command::new(env!("CARGO_BIN_EXE_lt"))
        .args(["train", "--model"])
        .arg(f.join("models/qwen3-tied-mqa"))
        .arg("--data")
        .arg(f.join("train/qwen3-tied-mqa/train.jsonl"))
        .arg("--out")
        .arg(out)
        .args(args)
        .output()
        .unwrap()
}

fn losses(metrics: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v.get("step")?.as_u64()?, v.get("loss")?.as_f64()?)))
        .collect()
}

#[test]
fn infeasible_budget_fails_before_training_with_the_minimum() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = base_args(dir.path(), 2);
    args.extend(["--gpu-memory".into(), "1KiB".into()]);
    let st = Command::new(env!("CARGO_BIN_EXE_lt")).args(&args).output().unwrap();
    let err = String::from_utf8_lossy(&st.stderr);
    assert!(!st.status.success());
    assert!(err.contains("too small") && err.contains("--gpu-memory"), "{err}");
    assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "{err}");
    assert!(!dir.path().join("metrics.jsonl").exists(), "no training step ran");
}

#[test]
fn run_file_fills_settings_and_bad_keys_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures();
    let toml = format!(
        "model = {:?}\ndata = {:?}\nsteps = 2\nbatch-size = 2\nseq-len = 12\npolicy = \"keep-all\"\n",
        f.join("models/qwen3-tied-mqa"),
        f.join("train/qwen3-tied-mqa/train.jsonl")
    );
    let run = dir.path().join("run.toml");
    std::fs::write(&run, toml).unwrap();
    // A flag overrides the file: 3 steps instead of 2.
    let out = dir.path().join("out");
    let st = Command::new(env!("CARGO_BIN_EXE_lt"))
        .args(["train", "--config", run.to_str().unwrap(), "--steps", "3", "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    assert_eq!(losses(&out.join("metrics.jsonl")).len(), 3);
    assert!(out.join("model/model.safetensors").exists() && out.join("model/config.json").exists());

    std::fs::write(&run, "stpes = 3\n").unwrap();
    let st =
        Command::new(env!("CARGO_BIN_EXE_lt")).args(["train", "--config", run.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&st.stderr);
    assert!(!st.status.success());
    assert!(err.contains("run.toml") && err.contains("stpes"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

/// `lt plan --out p.json` then `lt train --plan p.json`: batch and seq come from the plan, the run
/// prints the plan's predicted step, and a flag that contradicts the plan is a one-line error.
#[test]
fn plan_file_round_trip_runs_the_planned_step() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures();
    let plan = dir.path().join("p.json");
    let st = Command::new(env!("CARGO_BIN_EXE_lt"))
        .args(["plan", "--model-config"])
        .arg(f.join("models/qwen3-tied-mqa"))
        .args(["--batch-size", "2", "--seq-len", "12", "--out"])
        .arg(&plan)
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let predicted = p["predicted"]["step_seconds"].as_f64().unwrap();

    let plan_arg = plan.to_str().unwrap();
    let train = |extra: &[&str]| {
        let args = [&["--steps", "2", "--plan", plan_arg][..], extra].concat();
        train_tied(&dir.path().join(format!("run{}", extra.join(""))), &args)
    };
    let st = train(&[]);
    let (out, err) = (String::from_utf8_lossy(&st.stdout), String::from_utf8_lossy(&st.stderr));
    assert!(st.status.success(), "{err}");
    assert!(out.contains(&format!("vs {predicted:.3} s predicted")), "{out}");
    assert!(err.contains(&format!("predicted step {predicted:.3} s")), "{err}");
    let default = lt_run::OptimizerChoice::DEFAULT.name();
    assert!(
        err.contains(&format!("optimizer {default} (8-bit moments")),
        "the plan's 8-bit state runs the default: {err}"
    );

    // The plan fixes the state's size, which both 8-bit formats share: either runs under it.
    for name in ["adamw8bit", "adamw8bit-f8"] {
        let st = train(&["--optimizer", name]);
        let err = String::from_utf8_lossy(&st.stderr);
        assert!(st.status.success(), "{name}: {err}");
        assert!(err.contains(&format!("optimizer {name} (8-bit moments")), "{err}");
    }
    let st = train(&["--optimizer", "adamw"]);
    let err = String::from_utf8_lossy(&st.stderr);
    assert!(!st.status.success());
    assert!(err.contains("p.json") && err.contains("optimizer_state: the plan was solved for 8-bit"), "{err}");
    assert!(err.contains("--optimizer is adamw"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");

    let st = train(&["--seq-len", "16"]);
    let err = String::from_utf8_lossy(&st.stderr);
    assert!(!st.status.success());
    assert!(err.contains("p.json") && err.contains("seq_len") && err.contains("--seq-len is 16"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

/// A model folder whose tokenizer has more tokens than config.json's `vocab_size` (here the real Qwen3
/// tokenizer next to a 96-token fixture) is refused before any work, by `lt train` and `lt eval`
/// alike, in one line naming the tokenizer file and both sizes; nothing is written.
#[test]
fn a_tokenizer_larger_than_the_vocabulary_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for (from, name) in [
        (f.join("models/qwen3-tied-mqa/config.json"), "config.json"),
        (f.join("models/qwen3-tied-mqa/model.safetensors"), "model.safetensors"),
        (f.join("tokenizer/tokenizer.json"), "tokenizer.json"),
        (f.join("tokenizer/tokenizer_config.json"), "tokenizer_config.json"),
    ] {
        std::fs::copy(from, model.join(name)).unwrap();
    }
    let data = dir.path().join("data.json");
    std::fs::write(&data, r#"[{"query": "What is 1 + 1?", "response": "The answer is: 2"}]"#).unwrap();
    let out = dir.path().join("run");
    for cmd in ["train", "eval"] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_lt"));
        c.args([cmd, "--model"]).arg(&model).arg("--data").arg(&data);
        if cmd == "train" {
            c.args(["--steps", "1", "--out"]).arg(&out);
        }
        let st = c.output().unwrap();
        let err = String::from_utf8_lossy(&st.stderr);
        assert!(!st.status.success(), "{cmd}: {err}");
        assert!(err.contains("tokenizer.json") && err.contains("vocab_size is 96"), "{cmd}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{cmd}: {err}");
    }
    assert!(!out.join("checkpoints").exists(), "nothing trained");
}

/// With a device budget, a step smaller than what the budget fits says so (and by how much), once,
/// in the plan line; without one on the CPU (the host's memory is the "device") it stays quiet.
#[test]
fn a_step_that_leaves_device_memory_unused_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures();
    let run = |extra: &[&str]| {
        let args = [&["--steps", "1", "--batch-size", "2", "--seq-len", "12"][..], extra].concat();
        let st = train_tied(&dir.path().join(format!("run{}", extra.join(""))), &args);
        assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
        String::from_utf8_lossy(&st.stderr).into_owned()
    };
    let err = run(&["--gpu-memory", "16MiB"]);
    let plan = err.lines().find(|l| l.starts_with("plan (auto")).unwrap_or_default();
    let fits: usize = plan
        .split("fits up to ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no room figure in {plan:?}"));
    assert!(fits > 2 && plan.contains("this step has 2"), "{plan}");
    // The figure is the planner's largest micro-batch for that budget, the batch `lt plan` plans when
    // it is given none.
    let more = Command::new(env!("CARGO_BIN_EXE_lt"))
        .args(["plan", "--model-config"])
        .arg(f.join("models/qwen3-tied-mqa"))
        .args(["--seq-len", "12", "--gpu-memory", "16MiB", "--json"])
        .output()
        .unwrap();
    let last = String::from_utf8_lossy(&more.stdout).lines().last().unwrap_or_default().to_string();
    let v: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(v["batch_size"].as_u64(), Some(fits as u64), "lt plan without --batch-size agrees: {last}");
    assert_eq!(v["batch_size_chosen"], serde_json::json!(true), "{last}");
    assert!(!run(&[]).contains("fits up to"), "no budget on the CPU: no hint");
}

/// A run whose checkpoints cannot fit on the output folder's disk fails before its first step, in
/// one line that says what it needs, what is free and what to change. (A trillion kept
/// checkpoints of the tiny fixture exceed any disk.)
#[test]
fn a_run_that_cannot_fit_its_checkpoints_fails_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let st = train_tied(&out, &["--steps", "3", "--keep-checkpoints", "1000000000000"]);
    let err = String::from_utf8_lossy(&st.stderr);
    assert!(!st.status.success(), "{err}");
    let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("{err}"));
    for want in ["of disk and", "is free", "1000000000000 kept + the one being written", "--keep-checkpoints 1"] {
        assert!(line.contains(want), "{want:?} in {line}");
    }
    assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "{err}");
    assert!(!out.join("metrics.jsonl").exists() && !out.join("checkpoints").exists(), "nothing trained or saved");

    // Saving only at the end needs one checkpoint and the export: the same run then trains.
    let st = train_tied(&out, &["--steps", "3", "--keep-checkpoints", "1000000000000", "--save-every", "0"]);
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    assert_eq!(losses(&out.join("metrics.jsonl")).len(), 3);
}
