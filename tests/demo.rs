//! The embedded demo through the library API, shortened: every promised output is written, and
//! scoring the exported model again (tokenizer and weights read back from disk) on the written
//! `eval.json` gives the score the run reported.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use lt_data::{DatasetFile, DatasetFormat, PrepareOptions, prepare};
use lt_model::CpuBackend;
use lt_model::host::HostModel;
use lt_model::weights::DeviceModel;
use lt_run::evaluate::{encoder_for, evaluate};
use lt_run::{Run, RunConfig};

#[test]
fn demo_writes_its_outputs_and_its_exported_model_reproduces_the_score() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let config = RunConfig::default().steps(4).eval_limit(6).eval_loss_every(2).out(&out);
    let report = Run::builder(config).build().unwrap().execute().unwrap();

    assert_eq!(report.steps, 4);
    assert_eq!(report.losses.iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert!(report.losses.iter().all(|l| l.1.is_finite() && l.1 > 0.0), "{:?}", report.losses);
    assert!(report.predicted_step_seconds.is_some_and(|p| p > 0.0), "the demo plans with the MILP");
    let acc = report.exact_match.clone().expect("the demo holds out questions");
    assert_eq!(acc.overall.total, 6);
    let names: Vec<_> = report.files.iter().filter_map(|p| p.file_name()?.to_str()).collect();
    assert_eq!(names, ["loss.png", "timeline.svg"]);
    assert_eq!(&std::fs::read(out.join("loss.png")).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        assert!(report.model_dir.join(f).is_file(), "model/{f}");
    }
    assert!(report.trace.is_file() && report.metrics.is_file());

    // Score again from disk only: the exported weights and tokenizer, the written question set.
    let host = HostModel::load(&report.model_dir).unwrap();
    let encoder = encoder_for(&report.model_dir, host.config.vocab_size).unwrap();
    let file = DatasetFile::open(&out.join("eval.json"), DatasetFormat::Auto).unwrap();
    let opts = PrepareOptions { seq_len: 256, eval_fraction: 1.0, ..Default::default() };
    let examples = prepare(&file, &encoder, &opts).unwrap().eval_examples;
    assert_eq!(examples.len(), 6, "eval.json holds exactly the evaluated questions");
    let model = DeviceModel::<CpuBackend>::from_host(&host, &Default::default());
    let (again, _) =
        evaluate(&mut &model, encoder.tokenizer(), encoder.stop_token_id(), &examples, 48, 32, |_| {}).unwrap();
    assert_eq!(again.overall, acc.overall);
    assert_eq!(again.by_type, acc.by_type);
}
