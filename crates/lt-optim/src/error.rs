//! The one error type of this crate.

/// Everything that can go wrong in `lt-optim`. Library code returns these instead of panicking on
/// caller data (mismatched lengths, bad hyper-parameters, damaged checkpoints).
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A hyper-parameter is out of its valid range.
    #[error("invalid optimizer setting {field} = {value}: {reason}")]
    InvalidConfig {
        /// Which setting.
        field: &'static str,
        /// The value given.
        value: f64,
        /// What it must satisfy.
        reason: &'static str,
    },
    /// A quantization block size the kernels cannot use.
    #[error("invalid quantization block size {block}: must be a multiple of 16 in 16..=4096")]
    InvalidBlockSize {
        /// The block size given.
        block: usize,
    },
    /// Two buffers that must have the same length do not.
    #[error("length mismatch for {what}: expected {expected}, found {found}")]
    LengthMismatch {
        /// Which buffer (tensor name or role).
        what: String,
        /// The length the optimizer state was created with.
        expected: usize,
        /// The length passed in.
        found: usize,
    },
    /// A group was asked to apply a step it has already applied (or an older one).
    #[error("group {group:?} already applied step {last} (asked to apply step {step})")]
    StepAlreadyApplied {
        /// Group name.
        group: String,
        /// Last step the group applied.
        last: u64,
        /// Step requested.
        step: u64,
    },
    /// Two groups, or two tensors in a group, have the same name.
    #[error("duplicate name {name:?}")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// A worker thread could not be started.
    #[error("starting optimizer worker thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// Reading or writing a checkpoint failed at the I/O level (a truncated file shows up here).
    #[error("optimizer checkpoint I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The stream is not an `lt-optim` checkpoint.
    #[error("not an lt-optim optimizer checkpoint (bad magic {found:?})")]
    BadMagic {
        /// The first bytes found.
        found: [u8; 8],
    },
    /// The checkpoint was written by an incompatible format version.
    #[error("optimizer checkpoint format version {found} is not supported (this build reads version {supported})")]
    UnsupportedVersion {
        /// Version in the file.
        found: u32,
        /// Version this build reads and writes.
        supported: u32,
    },
    /// The checkpoint's checksum does not match its contents.
    #[error("optimizer checkpoint is corrupt: checksum {computed:#018x} does not match stored {stored:#018x}")]
    ChecksumMismatch {
        /// Checksum stored in the file.
        stored: u64,
        /// Checksum of the bytes read.
        computed: u64,
    },
    /// The checkpoint parses to something impossible (before the checksum could even be checked).
    #[error("optimizer checkpoint is corrupt: {reason}")]
    Corrupt {
        /// What was wrong.
        reason: String,
    },
}

/// Shorthand for this crate's results.
pub type Result<T, E = OptimError> = std::result::Result<T, E>;
