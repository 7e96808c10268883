//! Logits of a checkpoint: load a model folder (Hugging Face config.json + safetensors), run the
//! forward pass on the CPU, and compare with the logits transformers wrote for the same tokens.
//!
//! Run: `cargo run -p lt-model --example logits [MODEL_DIR]` (default: the qwen3-tied-mqa fixture,
//! made by tools/fixtures/gen_models.py, whose `expected.safetensors` holds transformers' logits).

use std::path::{Path, PathBuf};

use lt_model::CpuBackend;
use lt_model::host::HostModel;
use lt_model::model::{Batch, forward_logits, to_vec};
use lt_model::weights::DeviceModel;
use lt_storage::safetensors_io::SafetensorsModel;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models/qwen3-tied-mqa");
    let dir = std::env::args().nth(1).map_or(fixture, PathBuf::from);
    let host = HostModel::load(&dir)?;
    // The fixture's token rows (one JSON object with "input_ids" per line).
    let ids = Batch::read_jsonl(&dir.join("tokens.jsonl"))?.input_ids;
    let model = DeviceModel::<CpuBackend>::from_host(&host, &Default::default());
    let logits = forward_logits(&model, &ids);
    let [b, t, v] = logits.dims();
    let ours = to_vec(logits);
    println!("{}: logits [{b}, {t}, {v}], first row's first logits {:?}", dir.display(), &ours[..4.min(ours.len())]);

    let expected = dir.join("expected.safetensors");
    if expected.exists() {
        let theirs = SafetensorsModel::open(&expected)?.read_f32("logits")?;
        let diff = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("max |ours - transformers| = {diff:e}");
        assert!(ours.len() == theirs.len() && diff <= 1e-4, "logits differ from transformers by {diff}");
    }
    Ok(())
}
