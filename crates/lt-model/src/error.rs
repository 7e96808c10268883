//! The one error type of `lt-model`.

use std::path::PathBuf;

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The config is missing, malformed or unsupported.
    #[error(transparent)]
    Config(#[from] lt_core::ConfigError),
    /// A checkpoint file could not be read or is malformed.
    #[error(transparent)]
    Storage(#[from] lt_storage::StorageError),
    /// A tensor's shape disagrees with the config.
    #[error("{path}: tensor `{name}` has shape {found:?}, but the config implies {expected:?}")]
    ShapeMismatch {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor name.
        name: String,
        /// Shape implied by config.json.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A token id is outside the vocabulary.
    #[error("{source_name}: token id {id} at sequence {row}, position {col} is >= vocab_size {vocab}")]
    TokenOutOfRange {
        /// Where the tokens came from.
        source_name: String,
        /// Sequence index.
        row: usize,
        /// Position in the sequence.
        col: usize,
        /// The id.
        id: i64,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A layer's weights lack a required tensor (the relative name, e.g. `self_attn.q_proj.weight`).
    #[error("layer tensor `{name}` is missing")]
    MissingParam {
        /// The tensor's name relative to its layer.
        name: &'static str,
    },
    /// Inputs of inconsistent shape (ragged batch, labels not aligned, empty batch).
    #[error("{source_name}: {reason}")]
    BadBatch {
        /// Where the batch came from.
        source_name: String,
        /// What is wrong.
        reason: String,
    },
}
