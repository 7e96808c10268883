//! Plan -> train: a plan solved by lt-sched and saved to a file is what a run executes — its
//! boundaries, micro-batch and predicted step — and a plan for another shape is refused in one line.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use lt_core::ModelConfig;
use lt_core::hardware::BuiltinProfile;
use lt_run::Run;
use lt_sched::planner::{PlanRequest, plan};

#[test]
fn a_saved_plan_is_executed_as_solved() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = common::fixtures().join("models/qwen3-tied-mqa");
    let cfg = ModelConfig::from_path(&model_dir.join("config.json")).unwrap();
    let mut req = PlanRequest::new(2, 12);
    req.cost.attention = lt_sched::cost::AttentionKernel::Materialized;
    let solved = plan(&cfg, &BuiltinProfile::Cpu.profile(), &req).unwrap().plan;
    let path = dir.path().join("plan.json");
    solved.save(&path).unwrap();

    let out = dir.path().join("run");
    let chosen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let seen = chosen.clone();
    let report = Run::builder(common::fixture_run("qwen3-tied-mqa", &out, 3).plan(&path))
        .observer(move |e: &lt_run::Event<'_>| {
            if let lt_run::Event::Planned { plan } = e {
                *seen.lock().unwrap() = Some((plan.plan.clone(), plan.micro_batch_size()));
            }
            Ok(())
        })
        .build()
        .unwrap()
        .execute()
        .unwrap();
    let (executed, micro) = chosen.lock().unwrap().clone().unwrap();
    assert_eq!(executed, solved.step.clone());
    assert_eq!(micro, solved.step.shape.micro_batch_size);
    assert_eq!(report.predicted_step_seconds, Some(solved.predicted.step_seconds));
    assert_eq!(report.steps, 3);

    // The same file for another batch shape: refused when the run is built, in one line naming the
    // file, the field and both values.
    let config = common::fixture_run("qwen3-tied-mqa", &dir.path().join("b4"), 1).plan(&path).batch_size(4);
    let msg = format!("{:#}", Run::builder(config).build().err().unwrap());
    assert!(msg.contains("plan.json") && msg.contains("batch_size") && msg.contains("--batch-size is 4"), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
    assert!(!dir.path().join("b4/metrics.jsonl").exists(), "nothing ran");
}
