//! Shared types for LazyTrain-rs.
//!
//! `lt-core` sits at the bottom of the crate graph: every other crate depends on it and it depends on
//! nothing heavy (no Burn, no I/O engines). It holds the validated model configuration parsed from a
//! Hugging Face `config.json`, the parameter inventory derived from it, byte sizes, hardware
//! profiles, the host CPU label that every host-speed figure carries ([`host::HostCpu`]), and the
//! huge-page-backed allocation of the large host buffers ([`hostmem`]).
//!
//! ```
//! use lt_core::config::ModelConfig;
//! let json = r#"{"model_type":"qwen2","vocab_size":64,"hidden_size":16,"intermediate_size":32,
//!   "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-6,
//!   "rope_theta":10000.0,"tie_word_embeddings":true}"#;
//! let cfg = ModelConfig::from_json_str(json).unwrap();
//! assert_eq!(cfg.head_dim, 4);
//! assert_eq!(cfg.layer_params(0).len(), 12);
//! ```

pub mod config;
pub mod hardware;
pub mod hash;
pub mod host;
pub mod hostmem;
pub mod rng;
pub mod size;

pub use config::{ConfigError, Family, LayerKind, LinearAttnConfig, ModelConfig, ParamSpec};
pub use host::HostCpu;
pub use size::ByteSize;
