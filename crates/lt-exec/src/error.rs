//! The one error type of `lt-exec`.

/// Errors from planning checks or running a step.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The plan does not fit the model.
    #[error("plan does not match the model: {reason}")]
    PlanMismatch {
        /// What is wrong.
        reason: String,
    },
    /// The device memory budget is too small for this plan and batch.
    #[error(
        "device memory budget {budget} is too small for {what}: needs at least {needed} (peak), try --gpu-memory {needed_round} or a smaller batch"
    )]
    OutOfDeviceMemory {
        /// The budget.
        budget: lt_core::ByteSize,
        /// What was being placed when it ran out.
        what: String,
        /// The peak this step needs.
        needed: lt_core::ByteSize,
        /// `needed` rounded up to a friendly size.
        needed_round: String,
    },
    /// A boundary is placed on NVMe but no spill store is configured.
    #[error("boundary {boundary} is placed on NVMe but no spill directory is configured")]
    NoSpillStore {
        /// The boundary.
        boundary: usize,
    },
    /// The spill store failed.
    #[error(transparent)]
    Storage(#[from] lt_storage::StorageError),
    /// The batch is malformed.
    #[error(transparent)]
    Model(#[from] lt_model::ModelError),
    /// The optimizer rejected its configuration or inputs.
    #[error(transparent)]
    Optim(lt_optim::OptimError),
    /// The optimizer update failed on its thread.
    #[error("optimizer update failed: {0}")]
    OptimizerFailed(#[source] lt_optim::OptimError),
    /// A checkpoint does not belong to this model.
    #[error("{path}: cannot resume: {reason}")]
    CheckpointMismatch {
        /// The checkpoint directory.
        path: std::path::PathBuf,
        /// What differs.
        reason: String,
    },
    /// Reading a tensor back from the device failed (the runtime reported an error).
    #[error("reading {what} from the device failed: {reason}")]
    DeviceRead {
        /// What was being read.
        what: String,
        /// The runtime's error.
        reason: String,
    },
    /// A slot's bf16 upload copy does not match its tensors (a bug: copies are made from them).
    #[error("the bf16 upload copy of {what} does not match its tensors")]
    UploadCopy {
        /// The layer or head.
        what: String,
    },
    /// A worker thread died (a bug).
    #[error("executor worker `{0}` stopped unexpectedly")]
    Worker(&'static str),
}
