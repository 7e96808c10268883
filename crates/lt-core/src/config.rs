//! Hugging Face `config.json` parsing for the Qwen families, and the parameter inventory.
//!
//! [`HfConfig`] mirrors the JSON field for field; [`ModelConfig`] is the validated form the rest of
//! the code uses. A family differs only by flags (qkv bias, qk-norm, gated output, partial rotary,
//! zero-centred norms, hybrid layer types), so one set of layers serves every family.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Errors from reading or validating a model configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The JSON is malformed or a field has the wrong type.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: String,
        /// The parser error (names the field and line).
        source: serde_json::Error,
    },
    /// A field that the model needs is absent.
    #[error("{path}: missing field `{field}`")]
    MissingField {
        /// The file.
        path: String,
        /// The missing field.
        field: &'static str,
    },
    /// The `model_type` is not one we implement.
    #[error("{path}: unsupported model_type {model_type:?} (supported: qwen2, qwen3, qwen3_5_text, qwen3_5)")]
    UnsupportedModelType {
        /// The file.
        path: String,
        /// What the file said.
        model_type: String,
    },
    /// A field holds a value we do not implement or that is inconsistent.
    #[error("{path}: field `{field}`: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// RoPE parameters as transformers 5 writes them (`rope_parameters`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HfRopeParameters {
    /// Base of the rotary frequencies.
    pub rope_theta: Option<f64>,
    /// Fraction of the head dimension that is rotated.
    pub partial_rotary_factor: Option<f64>,
    /// `default` is the only type implemented.
    pub rope_type: Option<String>,
}

/// A Qwen `config.json`, field for field (only the fields we read; unknown fields are ignored).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HfConfig {
    /// `qwen2`, `qwen3`, `qwen3_5_text` or `qwen3_5`.
    pub model_type: Option<String>,
    /// For `qwen3_5`: the language model's config.
    pub text_config: Option<Box<HfConfig>>,
    /// Vocabulary size.
    pub vocab_size: Option<usize>,
    /// Model width.
    pub hidden_size: Option<usize>,
    /// MLP width.
    pub intermediate_size: Option<usize>,
    /// Number of decoder layers.
    pub num_hidden_layers: Option<usize>,
    /// Query heads.
    pub num_attention_heads: Option<usize>,
    /// Key/value heads (GQA); defaults to `num_attention_heads`.
    pub num_key_value_heads: Option<usize>,
    /// Explicit head dimension (qwen3, qwen3_5).
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: Option<f64>,
    /// Older style RoPE base.
    pub rope_theta: Option<f64>,
    /// Older style partial rotary factor.
    pub partial_rotary_factor: Option<f64>,
    /// transformers 5 style RoPE parameters.
    pub rope_parameters: Option<HfRopeParameters>,
    /// Non-default RoPE scaling; unsupported when set.
    pub rope_scaling: Option<serde_json::Value>,
    /// Tied input and output embeddings.
    pub tie_word_embeddings: Option<bool>,
    /// Bias on q/k/v/o projections (qwen3, qwen3_5).
    pub attention_bias: Option<bool>,
    /// Activation; only `silu` is implemented.
    pub hidden_act: Option<String>,
    /// Sliding window attention; unsupported when enabled.
    pub use_sliding_window: Option<bool>,
    /// Context length the model was trained for.
    pub max_position_embeddings: Option<usize>,
    /// Per-layer kinds for hybrid models.
    pub layer_types: Option<Vec<String>>,
    /// Hybrid interval when `layer_types` is absent.
    pub full_attention_interval: Option<usize>,
    /// Gated DeltaNet conv kernel.
    pub linear_conv_kernel_dim: Option<usize>,
    /// Gated DeltaNet key head dim.
    pub linear_key_head_dim: Option<usize>,
    /// Gated DeltaNet value head dim.
    pub linear_value_head_dim: Option<usize>,
    /// Gated DeltaNet key heads.
    pub linear_num_key_heads: Option<usize>,
    /// Gated DeltaNet value heads.
    pub linear_num_value_heads: Option<usize>,
    /// MoE experts; any value > 0 is unsupported.
    pub num_experts: Option<usize>,
}

/// The model family; it fixes the layer flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Family {
    /// Qwen2 / Qwen2.5.
    Qwen2,
    /// Qwen3 (dense).
    Qwen3,
    /// Qwen3.5 / Qwen3.6 hybrid (Gated DeltaNet + gated full attention).
    Qwen35,
}

/// What mixes tokens in a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LayerKind {
    /// Softmax attention.
    FullAttention,
    /// Gated DeltaNet linear attention.
    LinearAttention,
}

/// Gated DeltaNet shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearAttnConfig {
    /// Depthwise causal conv kernel width.
    pub conv_kernel: usize,
    /// Key (and query) head dimension.
    pub key_head_dim: usize,
    /// Value head dimension.
    pub value_head_dim: usize,
    /// Key (and query) heads.
    pub num_key_heads: usize,
    /// Value heads (a multiple of key heads).
    pub num_value_heads: usize,
}

impl LinearAttnConfig {
    /// Total key width (`num_key_heads * key_head_dim`).
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }
    /// Total value width.
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }
    /// Channels of the depthwise conv (q, k and v together).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Elements, in the compute dtype, that the chunked gated delta rule's autodiff graph holds for
    /// `b` sequences of `t` tokens from the end of its forward to its backward: per value head and per
    /// token (padded to whole chunks of [`DELTA_CHUNK`]), `40 C + 8 (dk + dv) + 2 dk dv / C` (the
    /// `C x C` decay, triangular-system and inverse tensors of every chunk, the `C x d` WY products,
    /// and the chunk states). Fitted to what `lt-model`'s implementation allocates, measured with a
    /// counting allocator (`crates/lt-model/tests/delta_memory.rs`, which keeps this formula at or
    /// above the measurement and within 1.5x of it): 38 C + 8 (dk + dv) + 1.4 dk dv / C there.
    pub fn chunked_rule_saved_elems(&self, b: usize, t: usize) -> f64 {
        let c = DELTA_CHUNK as f64;
        let (dk, dv) = (self.key_head_dim as f64, self.value_head_dim as f64);
        let padded = t.div_ceil(DELTA_CHUNK) * DELTA_CHUNK;
        let per = 40.0 * c + 8.0 * (dk + dv) + 2.0 * dk * dv / c;
        (b * padded * self.num_value_heads) as f64 * per
    }

    /// Peak elements of the chunked rule's forward plus backward beyond its inputs: what
    /// [`LinearAttnConfig::chunked_rule_saved_elems`] holds plus the backward's transients (measured:
    /// 5-11% more).
    pub fn chunked_rule_peak_elems(&self, b: usize, t: usize) -> f64 {
        1.12 * self.chunked_rule_saved_elems(b, t)
    }
}

/// Tokens per chunk of the gated delta rule's chunked form (`lt_model::delta::CHUNK`, as
/// flash-linear-attention and transformers use).
pub const DELTA_CHUNK: usize = 64;

/// The validated configuration the code uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Family.
    pub family: Family,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Query heads of full attention.
    pub num_heads: usize,
    /// KV heads of full attention.
    pub num_kv_heads: usize,
    /// Head dimension of full attention.
    pub head_dim: usize,
    /// Rotated dimensions per head (even; `head_dim` unless partial rotary).
    pub rotary_dim: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Tied embeddings: the head reuses `embed_tokens`.
    pub tie_word_embeddings: bool,
    /// Bias on q, k, v (qwen2) — and on o for `attention_bias` models.
    pub qkv_bias: bool,
    /// Bias on o_proj (`attention_bias` in qwen3 / qwen3_5).
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k.
    pub qk_norm: bool,
    /// q_proj also emits a sigmoid output gate.
    pub attn_output_gate: bool,
    /// RMSNorm scale is `1 + w`.
    pub zero_centered_norm: bool,
    /// Kind of each decoder layer.
    pub layer_types: Vec<LayerKind>,
    /// Gated DeltaNet shape, present when any layer is linear attention.
    pub linear: Option<LinearAttnConfig>,
    /// Context length.
    pub max_position_embeddings: usize,
}

/// One parameter tensor: its checkpoint-relative name and shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Name relative to the layer (`self_attn.q_proj.weight`) or the model (`embed_tokens.weight`).
    pub name: String,
    /// Shape in PyTorch order (`[out, in]` for linear weights).
    pub shape: Vec<usize>,
}

impl ParamSpec {
    fn new(name: &str, shape: &[usize]) -> Self {
        Self { name: name.to_string(), shape: shape.to_vec() }
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl ModelConfig {
    /// Read and validate `config.json` (or a model folder holding one).
    pub fn from_path(path: &Path) -> Result<Self, ConfigError> {
        let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
        let name = file.display().to_string();
        let text = std::fs::read_to_string(&file).map_err(|source| ConfigError::Io { path: name.clone(), source })?;
        Self::from_json_named(&text, &name)
    }

    /// Parse and validate a config from a JSON string.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        Self::from_json_named(text, "config.json")
    }

    fn from_json_named(text: &str, path: &str) -> Result<Self, ConfigError> {
        let hf: HfConfig =
            serde_json::from_str(text).map_err(|source| ConfigError::Json { path: path.to_string(), source })?;
        Self::from_hf(&hf, path)
    }

    /// Validate an [`HfConfig`]; `path` names the source in errors.
    pub fn from_hf(hf: &HfConfig, path: &str) -> Result<Self, ConfigError> {
        let p = || path.to_string();
        let model_type = hf.model_type.clone().ok_or(ConfigError::MissingField { path: p(), field: "model_type" })?;
        let (family, c) = match model_type.as_str() {
            "qwen2" => (Family::Qwen2, hf),
            "qwen3" => (Family::Qwen3, hf),
            "qwen3_5_text" => (Family::Qwen35, hf),
            "qwen3_5" => {
                let tc =
                    hf.text_config.as_deref().ok_or(ConfigError::MissingField { path: p(), field: "text_config" })?;
                (Family::Qwen35, tc)
            }
            _ => return Err(ConfigError::UnsupportedModelType { path: p(), model_type }),
        };
        macro_rules! req {
            ($f:ident) => {
                c.$f.ok_or(ConfigError::MissingField { path: p(), field: stringify!($f) })?
            };
        }
        let invalid = |field: &'static str, reason: String| ConfigError::Invalid { path: p(), field, reason };

        let vocab_size = req!(vocab_size);
        let hidden_size = req!(hidden_size);
        let intermediate_size = req!(intermediate_size);
        let num_layers = req!(num_hidden_layers);
        let num_heads = req!(num_attention_heads);
        let num_kv_heads = c.num_key_value_heads.unwrap_or(num_heads);
        let rms_norm_eps = req!(rms_norm_eps);
        for (field, v) in [
            ("vocab_size", vocab_size),
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("num_hidden_layers", num_layers),
            ("num_attention_heads", num_heads),
            ("num_key_value_heads", num_kv_heads),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be > 0".into()));
            }
        }
        if num_heads % num_kv_heads != 0 {
            return Err(invalid(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = match family {
            Family::Qwen2 => {
                if hidden_size % num_heads != 0 {
                    return Err(invalid(
                        "num_attention_heads",
                        format!("{num_heads} does not divide hidden_size {hidden_size}"),
                    ));
                }
                hidden_size / num_heads
            }
            _ => c.head_dim.unwrap_or(hidden_size / num_heads),
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(invalid("head_dim", format!("{head_dim} must be even and > 0")));
        }
        if let Some(act) = &c.hidden_act
            && act != "silu"
        {
            return Err(invalid("hidden_act", format!("{act:?} is not supported (only \"silu\")")));
        }
        if c.use_sliding_window == Some(true) {
            return Err(invalid("use_sliding_window", "sliding-window attention is not supported".into()));
        }
        if c.num_experts.unwrap_or(0) > 0 {
            return Err(invalid("num_experts", "mixture-of-experts models are not supported".into()));
        }
        if let Some(v) = &c.rope_scaling
            && !v.is_null()
        {
            return Err(invalid("rope_scaling", "RoPE scaling is not supported".into()));
        }
        let rp = c.rope_parameters.clone().unwrap_or_default();
        if let Some(t) = &rp.rope_type
            && t != "default"
        {
            return Err(invalid("rope_parameters", format!("rope_type {t:?} is not supported")));
        }
        let rope_theta =
            rp.rope_theta.or(c.rope_theta).ok_or(ConfigError::MissingField { path: p(), field: "rope_theta" })?;
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(invalid("rope_theta", format!("{rope_theta} must be a finite number > 1")));
        }
        let default_partial = if family == Family::Qwen35 { 0.25 } else { 1.0 };
        let partial = rp.partial_rotary_factor.or(c.partial_rotary_factor).unwrap_or(default_partial);
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(invalid("partial_rotary_factor", format!("{partial} must be in (0, 1]")));
        }
        // transformers: dim = int(head_dim * factor); inv_freq over arange(0, dim, 2).
        let rotary_dim = ((head_dim as f64 * partial) as usize) / 2 * 2;
        if rotary_dim == 0 {
            return Err(invalid("partial_rotary_factor", "rotates no dimension".into()));
        }

        let layer_types = match (&c.layer_types, family) {
            (Some(lt), Family::Qwen35) => {
                if lt.len() != num_layers {
                    return Err(invalid(
                        "layer_types",
                        format!("has {} entries but num_hidden_layers is {num_layers}", lt.len()),
                    ));
                }
                lt.iter()
                    .map(|s| match s.as_str() {
                        "full_attention" => Ok(LayerKind::FullAttention),
                        "linear_attention" => Ok(LayerKind::LinearAttention),
                        other => Err(invalid("layer_types", format!("unknown layer type {other:?}"))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            (None, Family::Qwen35) => {
                let every = c.full_attention_interval.unwrap_or(4).max(1);
                (0..num_layers)
                    .map(|i| if (i + 1) % every == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention })
                    .collect()
            }
            (Some(lt), _) => {
                if let Some(bad) = lt.iter().find(|s| s.as_str() != "full_attention") {
                    return Err(invalid("layer_types", format!("{bad:?} is not supported for {model_type}")));
                }
                vec![LayerKind::FullAttention; num_layers]
            }
            (None, _) => vec![LayerKind::FullAttention; num_layers],
        };
        let linear = if layer_types.contains(&LayerKind::LinearAttention) {
            let l = LinearAttnConfig {
                conv_kernel: c.linear_conv_kernel_dim.unwrap_or(4),
                key_head_dim: c.linear_key_head_dim.unwrap_or(128),
                value_head_dim: c.linear_value_head_dim.unwrap_or(128),
                num_key_heads: c.linear_num_key_heads.unwrap_or(16),
                num_value_heads: c.linear_num_value_heads.unwrap_or(32),
            };
            if l.conv_kernel == 0 || l.key_head_dim == 0 || l.value_head_dim == 0 || l.num_key_heads == 0 {
                return Err(invalid("linear_num_key_heads", "linear attention dims must be > 0".into()));
            }
            if !l.num_value_heads.is_multiple_of(l.num_key_heads) {
                return Err(invalid(
                    "linear_num_value_heads",
                    format!("{} is not a multiple of linear_num_key_heads {}", l.num_value_heads, l.num_key_heads),
                ));
            }
            Some(l)
        } else {
            None
        };
        let attention_bias = c.attention_bias.unwrap_or(false);
        Ok(Self {
            family,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            rope_theta,
            rms_norm_eps,
            tie_word_embeddings: c.tie_word_embeddings.or(hf.tie_word_embeddings).unwrap_or(false),
            qkv_bias: family == Family::Qwen2 || attention_bias,
            o_bias: family != Family::Qwen2 && attention_bias,
            qk_norm: family != Family::Qwen2,
            attn_output_gate: family == Family::Qwen35,
            zero_centered_norm: family == Family::Qwen35,
            layer_types,
            linear,
            max_position_embeddings: c.max_position_embeddings.unwrap_or(32768),
        })
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// The parameters of decoder layer `i`, named relative to `layers.{i}.`.
    ///
    /// # Panics
    /// If `i >= num_layers()` (a programmer error).
    pub fn layer_params(&self, i: usize) -> Vec<ParamSpec> {
        let h = self.hidden_size;
        let mut v = vec![ParamSpec::new("input_layernorm.weight", &[h])];
        match self.layer_types[i] {
            LayerKind::FullAttention => {
                let q_out = self.num_heads * self.head_dim * if self.attn_output_gate { 2 } else { 1 };
                let kv_out = self.num_kv_heads * self.head_dim;
                v.push(ParamSpec::new("self_attn.q_proj.weight", &[q_out, h]));
                if self.qkv_bias {
                    v.push(ParamSpec::new("self_attn.q_proj.bias", &[q_out]));
                }
                v.push(ParamSpec::new("self_attn.k_proj.weight", &[kv_out, h]));
                if self.qkv_bias {
                    v.push(ParamSpec::new("self_attn.k_proj.bias", &[kv_out]));
                }
                v.push(ParamSpec::new("self_attn.v_proj.weight", &[kv_out, h]));
                if self.qkv_bias {
                    v.push(ParamSpec::new("self_attn.v_proj.bias", &[kv_out]));
                }
                v.push(ParamSpec::new("self_attn.o_proj.weight", &[h, self.num_heads * self.head_dim]));
                if self.o_bias {
                    v.push(ParamSpec::new("self_attn.o_proj.bias", &[h]));
                }
                if self.qk_norm {
                    v.push(ParamSpec::new("self_attn.q_norm.weight", &[self.head_dim]));
                    v.push(ParamSpec::new("self_attn.k_norm.weight", &[self.head_dim]));
                }
            }
            LayerKind::LinearAttention => {
                // Present whenever a layer is linear (validated in `from_hf`).
                let l = self.linear.unwrap_or(LinearAttnConfig {
                    conv_kernel: 0,
                    key_head_dim: 0,
                    value_head_dim: 0,
                    num_key_heads: 0,
                    num_value_heads: 0,
                });
                v.push(ParamSpec::new("linear_attn.in_proj_qkv.weight", &[l.conv_dim(), h]));
                v.push(ParamSpec::new("linear_attn.in_proj_z.weight", &[l.value_dim(), h]));
                v.push(ParamSpec::new("linear_attn.in_proj_b.weight", &[l.num_value_heads, h]));
                v.push(ParamSpec::new("linear_attn.in_proj_a.weight", &[l.num_value_heads, h]));
                v.push(ParamSpec::new("linear_attn.conv1d.weight", &[l.conv_dim(), 1, l.conv_kernel]));
                v.push(ParamSpec::new("linear_attn.dt_bias", &[l.num_value_heads]));
                v.push(ParamSpec::new("linear_attn.A_log", &[l.num_value_heads]));
                v.push(ParamSpec::new("linear_attn.norm.weight", &[l.value_head_dim]));
                v.push(ParamSpec::new("linear_attn.out_proj.weight", &[h, l.value_dim()]));
            }
        }
        v.push(ParamSpec::new("post_attention_layernorm.weight", &[h]));
        v.push(ParamSpec::new("mlp.gate_proj.weight", &[self.intermediate_size, h]));
        v.push(ParamSpec::new("mlp.up_proj.weight", &[self.intermediate_size, h]));
        v.push(ParamSpec::new("mlp.down_proj.weight", &[h, self.intermediate_size]));
        v
    }

    /// Parameters outside the decoder layers: embedding, final norm and (untied) head.
    pub fn outer_params(&self) -> Vec<ParamSpec> {
        let mut v = vec![
            ParamSpec::new("embed_tokens.weight", &[self.vocab_size, self.hidden_size]),
            ParamSpec::new("norm.weight", &[self.hidden_size]),
        ];
        if !self.tie_word_embeddings {
            v.push(ParamSpec::new("lm_head.weight", &[self.vocab_size, self.hidden_size]));
        }
        v
    }

    /// Element count of decoder layer `i`.
    pub fn layer_numel(&self, i: usize) -> usize {
        self.layer_params(i).iter().map(ParamSpec::numel).sum()
    }

    /// Total parameter count, embedding and head included (the published TFLOPS formula's `params`).
    pub fn total_params(&self) -> usize {
        let layers: usize = (0..self.num_layers()).map(|i| self.layer_numel(i)).sum();
        layers + self.outer_params().iter().map(ParamSpec::numel).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "model_type": "qwen3", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": false
        })
    }

    #[test]
    fn qwen3_head_dim_differs_from_hidden_over_heads() {
        let c = ModelConfig::from_json_str(&base().to_string()).unwrap();
        assert_eq!(c.head_dim, 16);
        assert!(c.qk_norm && !c.qkv_bias && !c.attn_output_gate);
        assert_eq!(c.rotary_dim, 16);
        let q = c.layer_params(0).into_iter().find(|p| p.name == "self_attn.q_proj.weight").unwrap();
        assert_eq!(q.shape, vec![64, 32]);
    }

    #[test]
    fn rope_parameters_style_is_accepted() {
        let mut j = base();
        j.as_object_mut().unwrap().remove("rope_theta");
        j["rope_parameters"] = serde_json::json!({"rope_theta": 5000.0, "rope_type": "default"});
        let c = ModelConfig::from_json_str(&j.to_string()).unwrap();
        assert_eq!(c.rope_theta, 5000.0);
    }

    #[test]
    fn qwen3_5_wrapper_with_text_config_and_hybrid_layers() {
        let j = serde_json::json!({"model_type": "qwen3_5", "text_config": {
            "model_type": "qwen3_5_text", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}});
        let c = ModelConfig::from_json_str(&j.to_string()).unwrap();
        assert_eq!(c.family, Family::Qwen35);
        assert_eq!(c.rotary_dim, 4);
        assert_eq!(
            c.layer_types,
            vec![
                LayerKind::LinearAttention,
                LayerKind::LinearAttention,
                LayerKind::LinearAttention,
                LayerKind::FullAttention
            ]
        );
        assert_eq!(c.linear.unwrap().conv_dim(), 2 * 16 + 32);
        let q = c.layer_params(3).into_iter().find(|p| p.name == "self_attn.q_proj.weight").unwrap();
        assert_eq!(q.shape, vec![64, 32], "gated attention doubles q_proj");
    }

    #[test]
    fn unknown_model_type_is_rejected() {
        let mut j = base();
        j["model_type"] = "llama".into();
        let e = ModelConfig::from_json_str(&j.to_string()).unwrap_err().to_string();
        assert!(e.contains("unsupported model_type \"llama\""), "{e}");
    }

    #[test]
    fn moe_and_sliding_window_are_rejected_by_field() {
        let mut j = base();
        j["num_experts"] = 8.into();
        let e = ModelConfig::from_json_str(&j.to_string()).unwrap_err().to_string();
        assert!(e.contains("num_experts"), "{e}");
        let mut j = base();
        j["use_sliding_window"] = true.into();
        let e = ModelConfig::from_json_str(&j.to_string()).unwrap_err().to_string();
        assert!(e.contains("use_sliding_window"), "{e}");
    }

    #[test]
    fn missing_field_is_named() {
        let mut j = base();
        j.as_object_mut().unwrap().remove("hidden_size");
        let e = ModelConfig::from_json_str(&j.to_string()).unwrap_err().to_string();
        assert_eq!(e, "config.json: missing field `hidden_size`");
    }
}
