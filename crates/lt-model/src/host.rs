//! Host-resident model state: fp32 buffers named as in the Hugging Face checkpoint.
//!
//! This is what the executor streams from: each [`HostLayer`] is a flat list of fp32 tensors in
//! [`ModelConfig::layer_params`] order, so a layer can be bound to device tensors without any module
//! tree (see [`crate::weights::LayerWeights::from_host`]).

use std::path::Path;

use lt_core::{ModelConfig, ParamSpec};
use lt_storage::safetensors_io::SafetensorsModel;

use crate::error::ModelError;

/// One fp32 host tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Shape in PyTorch order.
    pub shape: Vec<usize>,
    /// Row-major data.
    pub data: Vec<f32>,
}

/// The parameters of one decoder layer, in [`ModelConfig::layer_params`] order.
#[derive(Debug, Clone, PartialEq)]
pub struct HostLayer {
    /// Specs (relative names and shapes).
    pub specs: Vec<ParamSpec>,
    /// Tensors, aligned with `specs`.
    pub tensors: Vec<HostTensor>,
}

impl HostLayer {
    /// The tensor with relative name `name`.
    pub fn get(&self, name: &str) -> Option<&HostTensor> {
        self.specs.iter().position(|s| s.name == name).map(|i| &self.tensors[i])
    }
    /// Total elements.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }
}

/// A whole model in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostModel {
    /// Validated config.
    pub config: ModelConfig,
    /// `embed_tokens.weight` [vocab, hidden].
    pub embed_tokens: HostTensor,
    /// Final `norm.weight` [hidden].
    pub norm: HostTensor,
    /// `lm_head.weight` [vocab, hidden]; `None` when tied to `embed_tokens`.
    pub lm_head: Option<HostTensor>,
    /// Decoder layers.
    pub layers: Vec<HostLayer>,
    /// The prefix of decoder tensors in the checkpoint (`model.` or `model.language_model.`).
    pub prefix: String,
}

/// Where the language model's tensors live in a checkpoint: plain causal LMs use `model.`; the
/// Qwen3.5/3.6 multimodal release nests it under `model.language_model.`.
fn detect_prefix(st: &SafetensorsModel) -> String {
    if st.contains("model.language_model.embed_tokens.weight") {
        "model.language_model.".into()
    } else {
        "model.".into()
    }
}

fn load_tensor(st: &SafetensorsModel, full: &str, expected: &[usize]) -> Result<HostTensor, ModelError> {
    let meta = st.meta(full).ok_or_else(|| lt_storage::StorageError::MissingTensor {
        path: st.root().to_path_buf(),
        name: full.to_string(),
    })?;
    if meta.shape != expected {
        return Err(ModelError::ShapeMismatch {
            path: st.file_of(full),
            name: full.to_string(),
            expected: expected.to_vec(),
            found: meta.shape,
        });
    }
    Ok(HostTensor { shape: expected.to_vec(), data: st.read_f32(full)? })
}

impl HostModel {
    /// Load `config.json` and the safetensors weights of a model folder, checking every tensor's
    /// presence, dtype and shape against the config (the first mismatch is reported by name).
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let config = ModelConfig::from_path(dir)?;
        let st = SafetensorsModel::open(dir)?;
        Self::from_safetensors(config, &st)
    }

    /// Build from an opened checkpoint.
    pub fn from_safetensors(config: ModelConfig, st: &SafetensorsModel) -> Result<Self, ModelError> {
        let prefix = detect_prefix(st);
        let outer = config.outer_params();
        let get_outer = |name: &str| -> Result<HostTensor, ModelError> {
            let spec = outer.iter().find(|s| s.name == name).map(|s| s.shape.clone()).unwrap_or_default();
            let full = if name == "lm_head.weight" { name.to_string() } else { format!("{prefix}{name}") };
            load_tensor(st, &full, &spec)
        };
        let embed_tokens = get_outer("embed_tokens.weight")?;
        let norm = get_outer("norm.weight")?;
        let lm_head = if config.tie_word_embeddings { None } else { Some(get_outer("lm_head.weight")?) };
        let mut layers = Vec::with_capacity(config.num_layers());
        for i in 0..config.num_layers() {
            let specs = config.layer_params(i);
            let tensors = specs
                .iter()
                .map(|s| load_tensor(st, &format!("{prefix}layers.{i}.{}", s.name), &s.shape))
                .collect::<Result<Vec<_>, _>>()?;
            layers.push(HostLayer { specs, tensors });
        }
        Ok(Self { config, embed_tokens, norm, lm_head, layers, prefix })
    }

    /// Checkpoint name of a layer parameter.
    pub fn layer_param_name(&self, layer: usize, rel: &str) -> String {
        format!("{}layers.{layer}.{rel}", self.prefix)
    }

    /// Checkpoint name of a model-relative layer parameter name (`layers.3.mlp.up_proj.weight`).
    pub fn layer_param_name_full(&self, rel: &str) -> String {
        format!("{}{rel}", self.prefix)
    }

    /// Checkpoint name of an outer parameter (`embed_tokens.weight`, `norm.weight`, `lm_head.weight`).
    pub fn outer_param_name(&self, rel: &str) -> String {
        if rel == "lm_head.weight" { rel.to_string() } else { format!("{}{rel}", self.prefix) }
    }
}
