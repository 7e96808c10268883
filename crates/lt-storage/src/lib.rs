//! Storage for LazyTrain-rs: model files, activation spill and training checkpoints.
//!
//! `lt-storage` sits above `lt-core` and below `lt-exec`. It owns every byte that leaves RAM:
//! memory-mapped safetensors checkpoints (read), the NVMe activation spill tier, and crash-safe
//! training checkpoints. It has no Burn dependency.
//!
//! ```no_run
//! use lt_storage::safetensors_io::SafetensorsModel;
//! let model = SafetensorsModel::open(std::path::Path::new("my-model")).unwrap();
//! let w: Vec<f32> = model.read_f32("model.norm.weight").unwrap();
//! ```
#![deny(unsafe_op_in_unsafe_fn)]

pub mod checkpoint;
mod direct;
pub mod disk;
pub mod error;
/// XXH64 lives in lt-core so lt-optim can checksum its state with the same code.
pub use lt_core::hash;
pub mod export;
pub mod safetensors_io;
pub mod spill;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod testutil;

pub use error::StorageError;
