//! A run's inputs: the model and its tokenizer (a model folder, or the demo's small Qwen3 built
//! from scratch), the prepared training and held-out data, and their micro-batches.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Result, bail};
use lt_core::ModelConfig;
use lt_data::word_tokenizer::WordTokenizerFiles;
use lt_data::{ChatEncoder, PrepareOptions, Prepared, TrainBatch};
use lt_model::host::HostModel;
use lt_model::model::{Batch, PackInfo};

use crate::config::RunSettings;
use crate::evaluate::encoder_for;

/// Everything a run trains on, loaded and prepared.
pub(crate) struct Inputs {
    /// The fp32 master weights.
    pub host: HostModel,
    /// Tokenizer and chat template.
    pub encoder: ChatEncoder,
    /// The model folder (copied into the export: tokenizer, generation config); `None` for the demo.
    pub source_dir: Option<PathBuf>,
    /// The demo model's config.json (a model folder has its own).
    pub config_json: Option<serde_json::Value>,
    /// The demo's tokenizer files, written next to the exported model.
    pub demo_tokenizer: Option<WordTokenizerFiles>,
    /// Training and held-out data.
    pub prepared: Prepared,
    /// The demo's records (its held-out questions are written to `eval.json`).
    pub demo_records: Option<Vec<lt_data::MetaMathRecord>>,
}

/// Load the model and tokenizer and prepare the data `s` names (the built-in demo when it names none).
pub(crate) fn load(s: &RunSettings) -> Result<Inputs> {
    let data_file = match &s.data {
        Some(path) => Some(lt_data::DatasetFile::open(path, s.format)?),
        None => None,
    };
    let pretokenized = data_file.as_ref().is_some_and(|f| f.format() == lt_data::DatasetFormat::Tokens);
    // The demo's records come first: its tokenizer's vocabulary is built from them.
    let demo_records = match &s.data {
        Some(_) => None,
        None => Some(lt_data::synth::generate(&lt_data::SynthConfig::default())?),
    };
    let demo_tokenizer = demo_records.as_ref().map(|records| {
        lt_data::word_tokenizer::build(records.iter().flat_map(|r| [r.query.as_str(), r.response.as_str()]))
    });
    let (host, encoder, source_dir, config_json) = match (&s.model, &demo_tokenizer) {
        (Some(dir), _) => {
            let host = HostModel::load(dir)?;
            let encoder = match encoder_for(dir, host.config.vocab_size) {
                Ok(e) => e,
                // Pre-tokenized data needs no tokenizer: ids are only range-checked.
                Err(_) if pretokenized => ChatEncoder::new(
                    Arc::new(IdsOnly { vocab: host.config.vocab_size }),
                    lt_data::ByteTokenizer::chat_template(),
                ),
                Err(e) => return Err(e),
            };
            (host, encoder, Some(dir.clone()), None)
        }
        (None, Some(files)) => {
            let (tok, template) = files.load()?;
            let (host, cfg) = demo_model(tok.vocab_size(), s.seed)?;
            (host, ChatEncoder::new(tok, template), None, Some(cfg))
        }
        (None, None) => bail!("--model is required with --data"),
    };
    let encoder = encoder.with_train_on_prompt(s.train_on_prompt);
    let popts = PrepareOptions {
        seq_len: s.seq_len,
        eval_fraction: s.eval_fraction,
        split_seed: s.seed,
        skip_bad_records: s.skip_bad_records,
        max_eval_examples: Some(s.eval_limit),
        ..Default::default()
    };
    let prepared = match (&data_file, &demo_records) {
        (Some(file), _) => lt_data::prepare(file, &encoder, &popts)?,
        (None, Some(records)) => {
            let src = lt_data::MemorySource::from_records("built-in synthetic arithmetic", records);
            lt_data::prepare(&src, &encoder, &popts)?
        }
        (None, None) => bail!("--data is required with --model"),
    };
    Ok(Inputs { host, encoder, source_dir, config_json, demo_tokenizer, prepared, demo_records })
}

/// The demo's held-out questions that were evaluated (the `eval_limit` subset), as a MetaMathQA JSON
/// array, so `lt eval --data eval.json` reproduces the final score question for question.
pub(crate) fn write_demo_eval_set(s: &RunSettings, inputs: &Inputs, path: &Path) -> Result<()> {
    let Some(records) = &inputs.demo_records else { return Ok(()) };
    let split = lt_data::GroupSplit::new(s.eval_fraction, s.seed)?;
    let asked: std::collections::HashSet<(&str, &str)> =
        inputs.prepared.eval_examples.iter().map(|e| (e.query.as_str(), e.kind.as_str())).collect();
    let held: Vec<lt_data::MetaMathRecord> = records
        .iter()
        .filter(|r| split.side(&r.original_question) == lt_data::Side::Eval)
        .filter(|r| asked.contains(&(r.query.as_str(), r.kind.as_str())))
        .cloned()
        .collect();
    crate::fsutil::write_atomic(path, lt_data::synth::to_json_array(&held).as_bytes())
}

/// Stands in for a tokenizer when a model folder has none and the data is already tokenized: it
/// only knows the vocabulary size (for range checks) and refuses text.
#[derive(Debug)]
struct IdsOnly {
    vocab: usize,
}

impl lt_data::Tokenizer for IdsOnly {
    fn encode(&self, _text: &str) -> lt_data::error::Result<Vec<u32>> {
        Err(lt_data::DataError::Tokenize { reason: "the model folder has no tokenizer.json".into() })
    }
    fn decode(&self, _ids: &[u32], _skip: bool) -> lt_data::error::Result<String> {
        Err(lt_data::DataError::Tokenize { reason: "the model folder has no tokenizer.json".into() })
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn token_to_id(&self, _token: &str) -> Option<u32> {
        None
    }
    fn eos_id(&self) -> Option<u32> {
        None
    }
    fn pad_id(&self) -> Option<u32> {
        None
    }
}

/// A small Qwen3-architecture model, randomly initialised as Hugging Face would (see `HostModel::random_init`).
pub fn demo_model(vocab: usize, seed: u64) -> Result<(HostModel, serde_json::Value)> {
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "max_position_embeddings": 512, "tie_word_embeddings": true, "attention_bias": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "torch_dtype": "float32",
    });
    let cfg = ModelConfig::from_json_str(&config.to_string())?;
    let host = HostModel::random_init(cfg, seed);
    Ok((host, config))
}

/// Cut one step's batch into micro-batches of `micro` rows (the last may be shorter), keeping the
/// packing layout (positions and segments) of every row.
pub fn to_micro_batches(b: &TrainBatch, micro: usize) -> Vec<Batch> {
    let rows = b.rows();
    let micro = micro.clamp(1, rows.max(1));
    (0..rows)
        .step_by(micro)
        .map(|start| {
            let end = (start + micro).min(rows);
            Batch {
                input_ids: b.input_ids[start..end].to_vec(),
                labels: b.labels[start..end].to_vec(),
                packing: Some(PackInfo {
                    positions: b.position_ids[start..end].to_vec(),
                    segments: b.segment_ids[start..end].to_vec(),
                }),
            }
        })
        .collect()
}
