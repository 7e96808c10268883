//! `lt logits` end to end: parity on every fixture, and one-line errors on malformed input.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use lt_storage::safetensors_io::SafetensorsModel;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models")
}

fn lt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lt"))
}

/// Copy a fixture model folder into a temp dir so a test can damage it.
fn copy_model(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    dir
}

#[test]
fn logits_reproduce_expected_for_every_fixture() {
    let out = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures()).unwrap() {
        let dir = entry.unwrap().path();
        let target = out.path().join("logits.safetensors");
        let st = lt()
            .args(["logits", "--model"])
            .arg(&dir)
            .arg("--tokens")
            .arg(dir.join("tokens.jsonl"))
            .arg("--out")
            .arg(&target)
            .output()
            .unwrap();
        assert!(st.status.success(), "{}: {}", dir.display(), String::from_utf8_lossy(&st.stderr));
        let got = SafetensorsModel::open(&target).unwrap().read_f32("logits").unwrap();
        let want = SafetensorsModel::open(&dir.join("expected.safetensors")).unwrap().read_f32("logits").unwrap();
        assert_eq!(got.len(), want.len());
        let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(d <= 1e-4, "{}: max-abs {d}", dir.display());
    }
}

/// Run `lt logits`, expect failure with exactly one stderr line containing every `needles`, and
/// check that a pre-existing output file is left byte-identical.
fn expect_one_line_error(model: &Path, tokens: &Path, needles: &[&str]) {
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("logits.safetensors");
    std::fs::write(&target, b"previous result").unwrap();
    let st = lt()
        .args(["logits", "--model"])
        .arg(model)
        .arg("--tokens")
        .arg(tokens)
        .arg("--out")
        .arg(&target)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&st.stderr);
    assert!(!st.status.success(), "expected failure, got success");
    assert_eq!(err.trim_end().lines().count(), 1, "one line expected, got:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "missing {n:?} in: {err}");
    }
    assert_eq!(std::fs::read(&target).unwrap(), b"previous result", "output overwritten");
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 1, "stray temp file left");
}

fn tokens_file(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("tokens.jsonl");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn missing_config_field_is_named() {
    let m = copy_model("qwen3-tied-mqa");
    let cfg = m.path().join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(&cfg, v.to_string()).unwrap();
    expect_one_line_error(m.path(), &m.path().join("tokens.jsonl"), &["config.json", "missing field `hidden_size`"]);
}

#[test]
fn bad_config_json_is_reported() {
    let m = copy_model("qwen3-tied-mqa");
    std::fs::write(m.path().join("config.json"), "{\"model_type\": \"qwen3\",").unwrap();
    expect_one_line_error(m.path(), &m.path().join("tokens.jsonl"), &["config.json", "invalid JSON"]);
}

#[test]
fn truncated_safetensors_is_reported() {
    let m = copy_model("qwen2-tied-gqa");
    let p = m.path().join("model.safetensors");
    let data = std::fs::read(&p).unwrap();
    std::fs::write(&p, &data[..data.len() / 2]).unwrap();
    expect_one_line_error(m.path(), &m.path().join("tokens.jsonl"), &["model.safetensors", "invalid safetensors"]);
}

#[test]
fn lying_safetensors_header_is_reported() {
    let m = copy_model("qwen2-tied-gqa");
    let p = m.path().join("model.safetensors");
    let mut data = std::fs::read(&p).unwrap();
    data[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    std::fs::write(&p, &data).unwrap();
    expect_one_line_error(m.path(), &m.path().join("tokens.jsonl"), &["model.safetensors", "invalid safetensors"]);
}

#[test]
fn wrong_tensor_shape_is_named() {
    let m = copy_model("qwen3-tied-mqa");
    let cfg = m.path().join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["intermediate_size"] = 50.into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    expect_one_line_error(
        m.path(),
        &m.path().join("tokens.jsonl"),
        &["model.safetensors", "model.layers.0.mlp.gate_proj.weight", "[48, 32]", "[50, 32]"],
    );
}

#[test]
fn token_id_out_of_vocab_is_located() {
    let m = copy_model("qwen3-tied-mqa");
    let t = tokens_file(m.path(), "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 96, 5]}\n");
    expect_one_line_error(m.path(), &t, &["tokens.jsonl", "token id 96", "sequence 1", "position 1", "vocab_size 96"]);
}

#[test]
fn bad_tokens_json_and_fields_are_located() {
    let m = copy_model("qwen3-tied-mqa");
    let t = tokens_file(m.path(), "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, \n");
    expect_one_line_error(m.path(), &t, &["tokens.jsonl:2", "invalid JSON"]);
    let t = tokens_file(m.path(), "{\"ids\": [1, 2]}\n");
    expect_one_line_error(m.path(), &t, &["tokens.jsonl:1", "`input_ids`"]);
    let t = tokens_file(m.path(), "{\"input_ids\": [1, -2]}\n");
    expect_one_line_error(m.path(), &t, &["tokens.jsonl:1", "input_ids[1]"]);
    let t = tokens_file(m.path(), "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1]}\n");
    expect_one_line_error(m.path(), &t, &["tokens.jsonl", "equal lengths"]);
    // Labels are optional, but when present they are checked too (the fixtures' files have them).
    let t = tokens_file(m.path(), "{\"input_ids\": [1, 2], \"labels\": [-100, \"x\"]}\n");
    expect_one_line_error(m.path(), &t, &["tokens.jsonl:1", "labels[1]", "not an integer"]);
    let t = tokens_file(m.path(), "\n{\"input_ids\": [1, 2], \"labels\": 5}\n");
    expect_one_line_error(m.path(), &t, &["tokens.jsonl:2", "`labels` is not an array"]);
}

#[test]
fn missing_files_are_named() {
    let m = copy_model("qwen3-tied-mqa");
    std::fs::remove_file(m.path().join("model.safetensors")).unwrap();
    expect_one_line_error(m.path(), &m.path().join("tokens.jsonl"), &["model.safetensors", "no model.safetensors"]);
    let m = copy_model("qwen3-tied-mqa");
    expect_one_line_error(m.path(), &m.path().join("nope.jsonl"), &["nope.jsonl", "cannot open"]);
    let empty = tempfile::tempdir().unwrap();
    expect_one_line_error(empty.path(), &m.path().join("tokens.jsonl"), &["config.json", "cannot read"]);
}
