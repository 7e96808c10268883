//! Export -> reload: the model folder a run exports is a Hugging Face-format checkpoint that loads
//! back (config.json, safetensors under transformers' names) to exactly the trained weights: its
//! logits equal, bit for bit, those of the run's last checkpoint.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use lt_model::CpuBackend;
use lt_model::host::HostModel;
use lt_model::model::{forward_logits, to_vec};
use lt_model::weights::DeviceModel;
use lt_run::Run;
use lt_storage::checkpoint::{CheckpointStore, Retention, Verify};
use lt_storage::safetensors_io::SafetensorsModel;

#[test]
fn the_exported_model_reloads_to_the_trained_weights() {
    for name in ["qwen2-untied-mqa", "qwen35-hybrid"] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let report = Run::builder(common::fixture_run(name, &out, 3)).build().unwrap().execute().unwrap();

        // The exported folder, read as any HF checkpoint.
        let exported = HostModel::load(&report.model_dir).unwrap();
        let source = HostModel::load(&common::fixtures().join("models").join(name)).unwrap();
        assert_eq!(exported.config, source.config, "{name}: config.json round-trips");
        let names = |path: std::path::PathBuf| {
            let st = SafetensorsModel::open(&path).unwrap();
            let mut v: Vec<String> = st.names().iter().map(|n| n.to_string()).collect();
            v.sort();
            v
        };
        let (got, want) = (
            names(report.model_dir.join("model.safetensors")),
            names(common::fixtures().join("models").join(name).join("model.safetensors")),
        );
        assert_eq!(got, want, "{name}: the tensor names of the source checkpoint");

        // The run's last checkpoint holds the weights it trained to.
        let store = CheckpointStore::new(out.join("checkpoints"), Retention::KeepAll);
        let ck = store.find_latest(Verify::Full).unwrap().checkpoint.unwrap();
        assert_eq!(ck.step(), 3);
        let mut trained = source.clone();
        lt_exec::persist::load_checkpoint(&ck, &mut trained).unwrap();

        let ids = vec![vec![3u32, 14, 15, 9, 2, 6], vec![5, 3, 5, 8, 9, 7]];
        let logits =
            |h: &HostModel| to_vec(forward_logits(&DeviceModel::<CpuBackend>::from_host(h, &Default::default()), &ids));
        let (a, b, c) = (logits(&exported), logits(&trained), logits(&source));
        assert_eq!(a, b, "{name}: exported logits equal the checkpoint's");
        assert_ne!(a, c, "{name}: training changed the weights");
    }
}
