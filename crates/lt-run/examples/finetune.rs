//! Fine-tune a fixture model through the library API: a [`RunConfig`] built in code, a closure
//! observer printing each step, and the typed [`RunReport`] at the end.
//!
//! Run: `cargo run -p lt-run --example finetune [OUT_DIR]` (default: a fresh temporary folder).

use std::path::Path;

use lt_run::{Event, Policy, Run, RunConfig};

fn main() -> anyhow::Result<()> {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures");
    let tmp = std::env::temp_dir().join(format!("lt-run-example-{}", std::process::id()));
    let given = std::env::args().nth(1);
    let out = given.clone().map_or(tmp, Into::into);
    let config = RunConfig::default()
        .model(fixtures.join("models/qwen35-hybrid")) // the hybrid family: linear + full attention
        .data(fixtures.join("train/qwen35-hybrid/train.jsonl")) // pre-tokenized rows
        .steps(12)
        .batch_size(2)
        .seq_len(12)
        .lr(1e-3)
        .policy(Policy::Auto) // the MILP chooses keep / recompute / host / NVMe per boundary
        .out(&out);
    let report = Run::builder(config)
        .observer(|e: &Event<'_>| {
            match e {
                Event::Planned { plan } => println!("{}", plan.summary),
                Event::Step { metrics, .. } => println!("step {:>2}: loss {:.4}", metrics.step, metrics.loss),
                _ => {}
            }
            Ok(())
        })
        .build()?
        .execute()?;

    let (first, last) = (report.losses[0].1, report.losses[report.losses.len() - 1].1);
    println!(
        "loss {first:.4} -> {last:.4} in {:.1} s; model exported to {}",
        report.seconds,
        report.model_dir.display()
    );
    if let (Some(m), Some(p)) = (&report.last_step, report.predicted_step_seconds) {
        println!("last step {:.3} s measured vs {p:.3} s predicted (cpu profile)", m.step_seconds);
    }
    if given.is_none() {
        std::fs::remove_dir_all(&out)?;
    }
    anyhow::ensure!(last < first, "the loss should fall: {first} -> {last}");
    Ok(())
}
