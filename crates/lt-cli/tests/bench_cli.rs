//! End-to-end checks of `lt bench train`, `lt profile` and `lt selftest` through the built binary:
//! the JSON contracts, the infeasible exit code, and that a measured profile loads in `lt plan`.
//! Every run is tiny (seconds); the figures themselves are not asserted, only their consistency.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn lt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lt"))
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures")
}

/// A two-layer Qwen3 with a 512-token vocabulary.
fn tiny_config(dir: &Path) -> PathBuf {
    let path = dir.join("tiny-qwen3.json");
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "max_position_embeddings": 512, "tie_word_embeddings": true, "attention_bias": false,
        "rope_theta": 10000.0, "torch_dtype": "float32",
    });
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

/// The last stdout line as JSON.
fn last_json(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_else(|| {
        panic!("no stdout; stderr: {}", String::from_utf8_lossy(&out.stderr));
    });
    serde_json::from_str(line).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {line}"))
}

fn bench(config: &Path, extra: &[&str]) -> Output {
    let mut cmd = lt();
    cmd.args(["bench", "train", "--model-config"]).arg(config);
    cmd.args([
        "--device",
        "cpu",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--threads",
        "1",
    ]);
    cmd.args(extra);
    cmd.output().unwrap()
}

fn f(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("`{key}` missing or not a number in {v}"))
}

#[test]
fn bench_train_reports_consistent_throughput() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path());
    let trace = dir.path().join("trace.json");
    let out = bench(&config, &["--json", "--trace", trace.to_str().unwrap()]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v = last_json(&out);
    assert_eq!(v["model"], "tiny-qwen3");
    assert_eq!(v["device"], "cpu");
    assert_eq!(v["policy"], "auto");
    assert_eq!(v["steps"], 1);
    assert_eq!(v["warmup"], 1);
    assert_eq!(v["batch_size"], 2);
    assert_eq!(v["seq_len"], 16);
    assert!(v["micro_batch_size"].as_u64().is_some_and(|m| (1..=2).contains(&m)));
    assert_eq!(v["step_seconds_all"].as_array().map(Vec::len), Some(1));
    assert_eq!(v["peak_device_source"], "predicted: lt-sched memory model");
    for key in ["params", "peak_device_bytes", "peak_host_bytes", "predicted_step_seconds", "tflops_full"] {
        assert!(f(&v, key) > 0.0, "{key} in {v}");
    }
    for s in ["h2d", "d2h", "nvme", "optimizer"] {
        assert!(v["exposed_seconds"][s].as_f64().is_some_and(|x| x >= 0.0), "exposed {s} in {v}");
    }
    let step = f(&v, "step_seconds");
    assert_eq!(Some(step), v["step_seconds_all"][0].as_f64(), "the mean of one step is that step");
    // Every position is a trained token: 2 x 16 per step. 1e-9 relative: the same arithmetic.
    let tokens = 32.0;
    assert!((f(&v, "tokens_per_s") * step / tokens - 1.0).abs() < 1e-9, "{v}");
    let six = 6.0 * f(&v, "params") * tokens / step / 1e12;
    assert!((f(&v, "tflops_6pt") / six - 1.0).abs() < 1e-9, "{v}");
    // The executed count adds attention and the graph-recording forward: above the published formula.
    assert!(f(&v, "tflops_full") > f(&v, "tflops_6pt"), "{v}");
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert!(t["traceEvents"].as_array().is_some_and(|e| e.len() > 5));
    assert_names_this_host(&v["host_cpu"]);
}

/// A host-speed report's `host_cpu`: the CPU `lt_core::HostCpu::detect` sees here, so that a figure
/// never travels without the CPU it was measured on.
fn assert_names_this_host(host: &serde_json::Value) {
    let here = serde_json::to_value(lt_core::HostCpu::detect()).unwrap();
    assert_eq!(host, &here, "host_cpu");
    assert!(host["logical_cpus"].as_u64().is_some_and(|n| n >= 1), "{host}");
}

#[test]
fn bench_optimizer_names_the_cpu_and_kernel_next_to_its_speed() {
    // (The bench itself fails when the bf16 copy differs from the updated weights.)
    // The kernel named is the one that ran: it depends on the codes and on the block size (the f8
    // codes' AVX-512 kernel takes blocks that are a multiple of 32 only).
    use lt_optim::{Q8Codes, Quant8Config, q8_kernel_name_for};
    for (optimizer, codes, block) in
        [("adamw8bit", Q8Codes::Dynamic, 256), ("adamw8bit-f8", Q8Codes::F8, 256), ("adamw8bit-f8", Q8Codes::F8, 48)]
    {
        let out = lt()
            .args(["bench", "optimizer", "--optimizer", optimizer, "--params", "64K", "--steps", "2", "--warmup", "1"])
            .args(["--threads", "1", "--write-copy", "bf16", "--json", "--block", &block.to_string()])
            .output()
            .unwrap();
        assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
        let v = last_json(&out);
        assert_eq!(v["optimizer"], optimizer, "{v}");
        assert!(f(&v, "gparams_per_s") > 0.0, "{v}");
        let want = q8_kernel_name_for(&Quant8Config { block_size: block, codes, ..Default::default() });
        assert_eq!(v["kernel"], want, "{v}");
        assert_names_this_host(&v["host_cpu"]);
        let human = String::from_utf8_lossy(&out.stderr);
        let name = v["host_cpu"]["name"].as_str().unwrap();
        assert!(human.contains("Gparam/s") && human.contains(&format!("host {name}")), "{human}");
    }
}

#[test]
fn bench_train_fixed_policy_is_predicted_by_the_simulator() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path());
    let out = bench(&config, &["--policy", "megatrain", "--optimizer", "adamw"]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v = last_json(&out);
    assert_eq!(v["policy"], "megatrain");
    assert_eq!(v["plan"], "G.G", "2 layers: boundaries 0 and 2 kept");
    assert!(f(&v, "predicted_step_seconds") > 0.0);
    assert!(v["predicted_source"].as_str().is_some_and(|s| s.contains("MegaTrain baseline")));
    assert_eq!(v["overlap_optimizer"], false, "MegaTrain runs the optimizer after backward");
    assert_eq!(v["loss_chunk_tokens"], 4096.min(f(&v, "micro_batch_size") as u64 * 16), "{v}");
    // Without --json the human summary is on stderr.
    assert!(String::from_utf8_lossy(&out.stderr).contains("TFLOPS"));
}

#[test]
fn bench_train_too_small_a_device_exits_2_with_device_memory() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path());
    for policy in ["auto", "keep-all"] {
        let out = bench(&config, &["--gpu-memory", "1KiB", "--policy", policy, "--json"]);
        assert_eq!(out.status.code(), Some(2), "{policy}: stderr: {}", String::from_utf8_lossy(&out.stderr));
        let v = last_json(&out);
        assert_eq!(v["kind"], "device_memory", "{policy}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty() && !e.contains('\n')));
    }
}

#[test]
fn bench_train_bad_config_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.json");
    std::fs::write(&path, r#"{"model_type": "qwen3", "hidden_size": "wide"}"#).unwrap();
    let out = bench(&path, &["--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v = last_json(&out);
    assert_eq!(v["kind"], "error");
    assert!(v["error"].as_str().is_some_and(|e| e.contains("bad.json")), "{v}");
}

#[test]
fn selftest_cpu_passes_with_checks() {
    let out = lt().args(["selftest", "--device", "cpu", "--json", "--fixtures"]).arg(fixtures()).output().unwrap();
    let v = last_json(&out);
    assert!(out.status.success(), "{v}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(v["passed"], true);
    let checks = v["checks"].as_array().unwrap();
    assert!(!checks.is_empty());
    let has = |what: &str| checks.iter().any(|c| c["check"].as_str().is_some_and(|s| s.contains(what)));
    assert!(has("/logits") && has("/loss") && has("/grads layers.0") && has("/train all-nvme"), "{v}");
}

#[test]
fn selftest_without_fixtures_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let out = lt().args(["selftest", "--device", "cpu", "--fixtures"]).arg(dir.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--fixtures") && err.lines().count() == 1, "{err}");
}

#[test]
fn profile_writes_a_profile_that_plan_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("measured.toml");
    let out = lt()
        .args(["profile", "--device", "cpu", "--quick", "--json", "--threads", "1", "--out"])
        .arg(&out_file)
        .arg("--spill-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v = last_json(&out);
    for key in ["h2d_gb_per_s", "gemm_tflops", "efficiency", "nvme_write_gb_per_s", "adamw8bit_gparams_per_s"] {
        assert!(v["measured"][key].as_f64().is_some_and(|x| x > 0.0), "{key} in {v}");
    }
    let text = std::fs::read_to_string(&out_file).unwrap();
    assert!(text.contains("# measured:"), "{text}");
    let config = tiny_config(dir.path());
    let plan = lt()
        .args(["plan", "--json", "--batch-size", "2", "--seq-len", "16", "--model-config"])
        .arg(&config)
        .arg("--hardware")
        .arg(&out_file)
        .output()
        .unwrap();
    assert!(plan.status.success(), "lt plan: {}", String::from_utf8_lossy(&plan.stderr));
    let p = last_json(&plan);
    assert_eq!(p["feasible"], true);
    assert_eq!(p["hardware"], "cpu-measured");
}
