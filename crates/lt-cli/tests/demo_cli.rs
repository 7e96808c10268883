//! The embedded demo end to end, shortened: `lt train` with no model and no data writes every promised
//! output, and `lt eval` on the exported model reproduces the score training reported.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn json_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

#[test]
fn demo_writes_its_outputs_and_lt_eval_reproduces_its_score() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let train = Command::new(env!("CARGO_BIN_EXE_lt"))
        .args(["train", "--steps", "4", "--eval-limit", "6", "--eval-loss-every", "2", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&train.stdout);
    assert!(train.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&train.stderr));
    assert!(stdout.contains("held-out exact match:"), "{stdout}");

    // metrics.jsonl: one line per step, held-out loss every 2 steps and at the end, the final score.
    let lines = json_lines(&out.join("metrics.jsonl"));
    let steps: Vec<u64> = lines.iter().filter(|v| v.get("loss").is_some()).filter_map(|v| v["step"].as_u64()).collect();
    assert_eq!(steps, [1, 2, 3, 4]);
    let eval_losses: Vec<(u64, f64)> =
        lines.iter().filter_map(|v| Some((v["step"].as_u64()?, v.get("eval_loss")?.as_f64()?))).collect();
    assert_eq!(eval_losses.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 4]);
    assert!(eval_losses.iter().all(|e| e.1.is_finite() && e.1 > 0.0), "{eval_losses:?}");
    // `--save-every auto` (the default) saves after the first step, to time a save, and at the end.
    let saved: Vec<u64> =
        lines.iter().filter(|v| v.get("checkpoint_seconds").is_some()).filter_map(|v| v["step"].as_u64()).collect();
    assert_eq!(saved.first(), Some(&1), "{saved:?}");
    assert_eq!(saved.last(), Some(&4), "{saved:?}");
    assert!(lines.iter().filter_map(|v| v.get("checkpoint_bytes")?.as_u64()).all(|b| b > 0));
    let stderr = String::from_utf8_lossy(&train.stderr);
    assert!(stderr.contains("checkpoints (--save-every auto): a save takes"), "{stderr}");
    let last = lines.iter().rev().find(|v| v.get("final").is_some()).unwrap();
    let (correct, total) = (last["eval"]["overall"]["correct"].as_u64(), last["eval"]["overall"]["total"].as_u64());
    assert_eq!(total, Some(6));

    // Pictures and the exported model with its tokenizer files.
    let png = std::fs::read(out.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg = std::fs::read_to_string(out.join("timeline.svg")).unwrap();
    assert!(svg.contains("predicted (simulator") && svg.contains("measured:"), "{svg}");
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        assert!(out.join("model").join(f).is_file(), "model/{f}");
    }
    let held: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("eval.json")).unwrap()).unwrap();
    assert_eq!(held.len(), 6, "eval.json holds exactly the evaluated questions");

    // `lt eval` on the exported model scores the same questions the same way, with the whole model
    // bound and with its layers streamed (what the run's own evaluation does).
    for stream in [false, true] {
        let eval = Command::new(env!("CARGO_BIN_EXE_lt"))
            .args(["eval", "--json", "--max-new-tokens", "48", "--model"])
            .arg(out.join("model"))
            .arg("--data")
            .arg(out.join("eval.json"))
            .args(stream.then_some("--stream"))
            .output()
            .unwrap();
        let eval_out = String::from_utf8_lossy(&eval.stdout);
        assert!(eval.status.success(), "{eval_out}\n{}", String::from_utf8_lossy(&eval.stderr));
        let v: serde_json::Value = serde_json::from_str(eval_out.lines().last().unwrap()).unwrap();
        assert_eq!((v["correct"].as_u64(), v["total"].as_u64()), (correct, total), "stream {stream}");
        assert_eq!(v["by_type"], last["eval"]["by_type"], "stream {stream}");
    }
}
