//! The `lt` binary on burn-wgpu (lavapipe in CI): the self-test, `lt train` against `lt train
//! --device cpu`, and `lt logits` against transformers. Run with
//!
//! ```sh
//! cargo test -p lt-cli --features wgpu --test device_wgpu
//! ```
//!
//! Every `lt` process compiles its kernels afresh on lavapipe (measured: one `lt logits` of a
//! 2-layer fixture 41-57 s with a warm autotune cache, one hybrid `lt train` 194 s), so this file
//! runs as few processes as show the commands end to end. What the library can show in one process
//! runs there: every family's logits, loss and gradients against transformers (lt-model's device
//! suite) and every family under every plan against PyTorch (lt-exec's device suite).
#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures")
}

fn lt() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lt"));
    c.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    c
}

/// `lt selftest --device wgpu` on the hybrid fixture (full attention and the delta rule, the most
/// kernels of any family): logits, loss, every gradient group and streamed training under every
/// policy pass against the CPU. (The whole self-test, all seven fixtures, takes about 800 CPU-s on
/// lavapipe; every family's numerics on wgpu are the library suites' job, so this runs the command.
/// lt-exec's suite also keeps the case that once failed only here: dense families before the hybrid
/// in one process, sharing the autotune cache; see docs/architecture.md, "No burn-fusion".)
#[test]
fn selftest_on_wgpu_passes_every_check() {
    let out = lt().args(["selftest", "--device", "wgpu", "--json", "--only", "qwen35-hybrid"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "selftest failed:\n{stderr}");
    let last = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_string();
    let v: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(v["passed"], true, "{stderr}");
    let checks = v["checks"].as_array().unwrap();
    assert!(checks.iter().all(|c| c["backend"] == "wgpu-f32" && c["passed"] == true), "{stderr}");
    let names: Vec<&str> = checks.iter().map(|c| c["check"].as_str().unwrap()).collect();
    let mut want = vec!["logits", "loss", "grads head", "grads layers.0"];
    want.extend(["keep-all", "recompute-all", "megatrain", "all-host", "all-nvme"]);
    for w in want {
        assert!(names.iter().any(|n| n.starts_with("qwen35-hybrid/") && n.contains(w)), "no {w} check:\n{stderr}");
    }
}

fn losses(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("step").is_some())
        .filter_map(|v| v.get("loss")?.as_f64())
        .collect()
}

fn train(name: &str, policy: &str, device: &str, out: &Path) -> Vec<f64> {
    let f = fixtures();
    let model = f.join("models").join(name);
    let data = f.join("train").join(name).join("train.jsonl");
    let o = lt()
        .args(["train", "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap()])
        .args(["--steps", "4", "--batch-size", "2", "--seq-len", "12", "--lr", "1e-3"])
        .args(["--policy", policy, "--device", device, "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{name}/{policy} on {device}:\n{}", String::from_utf8_lossy(&o.stderr));
    losses(&out.join("metrics.jsonl"))
}

/// `lt train --device wgpu` follows `lt train --device cpu`: 4 steps, every step's loss within 1e-4
/// relative (the CPU train-parity bar), under `auto`: the command end to end (data, planner,
/// streamed steps, metrics, export). The hybrid trains under every policy in the self-test above
/// and every family under every plan in lt-exec's device suite, each in one process.
#[test]
fn lt_train_on_wgpu_follows_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let (name, policy) = ("qwen2-untied-mqa", "auto");
    let cpu = train(name, policy, "cpu", &dir.path().join("cpu"));
    let gpu = train(name, policy, "wgpu", &dir.path().join("wgpu"));
    assert_eq!(cpu.len(), 4, "{name}/{policy}");
    assert_eq!(gpu.len(), cpu.len(), "{name}/{policy}");
    for (s, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        let e = ((g - c) / c).abs();
        assert!(e <= 1e-4, "{name}/{policy} step {}: wgpu {g} vs cpu {c} (rel {e:e})", s + 1);
    }
}

/// `lt logits --device wgpu` reproduces transformers' logits (1e-4 max-abs, as on the CPU): the
/// command end to end (lt-model's device suite checks every family's logits against transformers).
#[test]
fn lt_logits_on_wgpu_reproduce_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let m = fixtures().join("models").join("qwen2-untied-mqa");
    let out = dir.path().join("logits.safetensors");
    let o = lt()
        .args(["logits", "--device", "wgpu", "--model", m.to_str().unwrap()])
        .args(["--tokens", m.join("tokens.jsonl").to_str().unwrap(), "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got = lt_storage::safetensors_io::SafetensorsModel::open(&out).unwrap().read_f32("logits").unwrap();
    let want = lt_storage::safetensors_io::SafetensorsModel::open(&m.join("expected.safetensors"))
        .unwrap()
        .read_f32("logits")
        .unwrap();
    assert_eq!(got.len(), want.len());
    let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(d <= 1e-4, "logits max-abs {d}");
}
