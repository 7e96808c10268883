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

    /// A randomly initialised model, as Hugging Face initialises one: weights from normal(0, 0.02),
    /// RMSNorm scales 1 (0 for the zero-centred `1 + w` norms of Qwen3.5, whose gated DeltaNet norm is a
    /// plain scale), `dt_bias` 1 and `A_log` = ln(uniform[1, 16]). Deterministic for a seed; layers are
    /// filled in parallel (each from its own stream), so a 7B model takes seconds on a many-core host.
    pub fn random_init(config: ModelConfig, seed: u64) -> Self {
        use lt_core::rng::SplitMix64;
        fn fill(spec_name: &str, n: usize, zero_centered: bool, rng: &mut SplitMix64) -> Vec<f32> {
            if spec_name.ends_with("norm.weight") {
                let plain = !zero_centered || spec_name.starts_with("linear_attn.");
                return vec![if plain { 1.0 } else { 0.0 }; n];
            }
            if spec_name.ends_with("dt_bias") {
                return vec![1.0; n];
            }
            if spec_name.ends_with("A_log") {
                return (0..n).map(|_| (1.0 + 15.0 * rng.next_f64()).ln() as f32).collect();
            }
            // The weight matrices: large and long-lived, so on huge pages (`lt_core::hostmem`).
            let mut out = lt_core::hostmem::huge_with_capacity(n);
            while out.len() < n {
                // Box-Muller: two normals from two uniforms in (0, 1].
                let u1 = 1.0 - rng.next_f64();
                let u2 = rng.next_f64();
                let r = 0.02 * (-2.0 * u1.ln()).sqrt();
                let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
                out.push((r * c) as f32);
                if out.len() < n {
                    out.push((r * s) as f32);
                }
            }
            out
        }
        let zc = config.zero_centered_norm;
        let tensor = |name: &str, shape: &[usize], stream: u64| {
            let n = shape.iter().product();
            let mut rng = SplitMix64::for_stream(seed, stream);
            HostTensor { shape: shape.to_vec(), data: fill(name, n, zc, &mut rng) }
        };
        let outer = config.outer_params();
        let outer_tensor = |name: &str, stream: u64| {
            let shape = outer.iter().find(|s| s.name == name).map(|s| s.shape.clone()).unwrap_or_default();
            tensor(name, &shape, stream)
        };
        let norm = outer_tensor("norm.weight", 1);
        let n_layers = config.num_layers();
        let threads = std::thread::available_parallelism().map(usize::from).unwrap_or(1).clamp(1, n_layers.max(1));
        let make_layer = |i: usize| {
            let specs = config.layer_params(i);
            let tensors =
                specs.iter().enumerate().map(|(j, s)| tensor(&s.name, &s.shape, 1000 * (i as u64 + 1) + j as u64));
            HostLayer { tensors: tensors.collect(), specs }
        };
        let mut layers: Vec<Option<HostLayer>> = (0..n_layers).map(|_| None).collect();
        // The embedding and the untied head (each one stream, so one thread each: 545M values apiece
        // on Qwen2.5-7B, 33 s of the first H200 run's 49 s when they ran before the layers) are made
        // beside the layers, same values.
        let (embed_tokens, lm_head) = std::thread::scope(|scope| {
            let embed = scope.spawn(|| outer_tensor("embed_tokens.weight", 0));
            let head = (!config.tie_word_embeddings).then(|| scope.spawn(|| outer_tensor("lm_head.weight", 2)));
            for (t, chunk) in layers.chunks_mut(n_layers.div_ceil(threads).max(1)).enumerate() {
                let first = t * n_layers.div_ceil(threads).max(1);
                let make_layer = &make_layer;
                scope.spawn(move || {
                    for (k, slot) in chunk.iter_mut().enumerate() {
                        *slot = Some(make_layer(first + k));
                    }
                });
            }
            let join = |h: std::thread::ScopedJoinHandle<'_, HostTensor>| {
                h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
            };
            (join(embed), head.map(join))
        });
        let layers = layers.into_iter().flatten().collect();
        Self { config, embed_tokens, norm, lm_head, layers, prefix: "model.".into() }
    }

    /// Checkpoint name of a layer parameter.
    pub fn layer_param_name(&self, layer: usize, rel: &str) -> String {
        layer_param_name(&self.prefix, layer, rel)
    }

    /// Checkpoint name of a model-relative layer parameter name (`layers.3.mlp.up_proj.weight`).
    pub fn layer_param_name_full(&self, rel: &str) -> String {
        format!("{}{rel}", self.prefix)
    }

    /// Checkpoint name of an outer parameter (`embed_tokens.weight`, `norm.weight`, `lm_head.weight`).
    pub fn outer_param_name(&self, rel: &str) -> String {
        outer_param_name(&self.prefix, rel)
    }
}

/// Checkpoint name of layer `layer`'s parameter `rel` under the decoder prefix `prefix` (`model.`).
pub fn layer_param_name(prefix: &str, layer: usize, rel: &str) -> String {
    format!("{prefix}layers.{layer}.{rel}")
}

/// Checkpoint name of an outer parameter (`embed_tokens.weight`, `norm.weight`, `lm_head.weight`)
/// under the decoder prefix `prefix`: the head sits outside it.
pub fn outer_param_name(prefix: &str, rel: &str) -> String {
    if rel == "lm_head.weight" { rel.to_string() } else { format!("{prefix}{rel}") }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    /// FNV-1a over the bits of every tensor, in checkpoint order.
    fn digest(h: &HostModel) -> u64 {
        let mut d: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |t: &HostTensor| {
            for v in &t.data {
                d = (d ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3);
            }
        };
        eat(&h.embed_tokens);
        eat(&h.norm);
        if let Some(t) = &h.lm_head {
            eat(t);
        }
        h.layers.iter().flat_map(|l| &l.tensors).for_each(eat);
        d
    }

    /// `random_init`'s values are fixed by the config and the seed, whatever runs in parallel: the
    /// digests were taken before the embedding and the untied head moved beside the layers.
    #[test]
    fn random_init_values_are_fixed_by_the_seed() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models");
        for (model, want) in
            [("qwen2-untied-mqa", 0x0ff5_f083_097e_a60a_u64), ("qwen3-tied-mqa", 0x4b64_d08a_e91b_127c)]
        {
            let cfg = ModelConfig::from_path(&dir.join(model).join("config.json")).unwrap();
            let h = HostModel::random_init(cfg, 42);
            assert_eq!(digest(&h), want, "{model}: {:#x}", digest(&h));
        }
    }
}
