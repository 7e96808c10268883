//! The one error type of `lt-storage`.

use std::path::PathBuf;

/// Errors from storage: model files, spill files and checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// An OS-level I/O failure on a named file.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done (`open`, `read`, `mmap`, ...).
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// A safetensors header is malformed, truncated or inconsistent with the file size.
    #[error("{path}: invalid safetensors file: {reason}")]
    BadSafetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A sharded checkpoint index is malformed or points at a missing shard.
    #[error("{path}: invalid safetensors index: {reason}")]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor the model needs is absent from the checkpoint.
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor {
        /// The checkpoint file or folder.
        path: PathBuf,
        /// The tensor name.
        name: String,
    },
    /// A tensor has a dtype we cannot convert to f32.
    #[error("{path}: tensor `{name}` has unsupported dtype {dtype} (expected F32, BF16 or F16)")]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// A write or preallocation ran out of room: the file system is full (`ENOSPC`), a disk
    /// quota is exhausted (`EDQUOT`) or the process file-size limit was reached (`EFBIG`).
    #[error("{path}: {op}: out of space ({source}); free space on that file system or raise the limit")]
    NoSpace {
        /// The file or directory being written.
        path: PathBuf,
        /// What was being done (`write`, `fallocate`, ...).
        op: &'static str,
        /// The OS error (`ENOSPC`, `EDQUOT` or `EFBIG`).
        source: std::io::Error,
    },
    /// A host buffer could not be allocated.
    #[error("allocating a {bytes}-byte I/O buffer: {source}")]
    OutOfMemory {
        /// The requested size.
        bytes: usize,
        /// The OS error from `mmap`.
        source: std::io::Error,
    },
    /// A spill store or checkpoint setting is out of range.
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The setting.
        field: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// The spill store has no room left for a value: its preallocated file is at capacity.
    #[error("{path}: spill store full: {requested} bytes requested, {free} of {capacity} bytes free")]
    SpillFull {
        /// The spill file.
        path: PathBuf,
        /// Bytes needed (rounded up to the block size).
        requested: u64,
        /// Bytes still free.
        free: u64,
        /// The store's capacity.
        capacity: u64,
    },
    /// `get` or `remove` of a key that is not in the spill store.
    #[error("{path}: spill key {key} not found")]
    SpillKeyNotFound {
        /// The spill file.
        path: PathBuf,
        /// The key.
        key: u64,
    },
    /// A read was requested into a buffer smaller than the stored value.
    #[error("spill key {key}: buffer of {capacity} bytes is too small, {needed} bytes needed")]
    BufferTooSmall {
        /// The key.
        key: u64,
        /// Bytes the read needs (the value's size rounded up to the block size).
        needed: usize,
        /// The buffer's capacity.
        capacity: usize,
    },
    /// The value of a key could not be read because its write failed.
    #[error("{path}: spill key {key}: its write failed, so it has no value")]
    SpillWriteFailed {
        /// The spill file.
        path: PathBuf,
        /// The key.
        key: u64,
    },
    /// The spill store's I/O thread is gone (it stopped after an unrecoverable ring error).
    #[error("{path}: spill I/O thread stopped")]
    SpillClosed {
        /// The spill file.
        path: PathBuf,
    },
    /// A checkpoint file's contents do not match the checksum recorded in its manifest.
    #[error("{path}: checksum mismatch (expected xxh64 {expected:016x}, found {found:016x}): the file is corrupt")]
    ChecksumMismatch {
        /// The corrupt file.
        path: PathBuf,
        /// The recorded hash.
        expected: u64,
        /// The hash of the bytes on disk.
        found: u64,
    },
    /// A checkpoint file has a different size than its manifest records (truncated or partial).
    #[error(
        "{path}: size mismatch: manifest records {expected} bytes, file has {found}: the file is truncated or partial"
    )]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// Recorded size.
        expected: u64,
        /// Size on disk.
        found: u64,
    },
    /// A checkpoint manifest is missing, unreadable or malformed.
    #[error("{path}: invalid checkpoint manifest: {reason}")]
    BadManifest {
        /// The manifest (or checkpoint directory).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint has no blob of that name.
    #[error("{path}: checkpoint has no blob `{name}`")]
    MissingBlob {
        /// The checkpoint directory.
        path: PathBuf,
        /// The blob name.
        name: String,
    },
    /// A checkpoint blob has a different length than the caller's buffer.
    #[error("{path}: blob `{name}` holds {bytes} bytes, but {requested} were requested")]
    BlobLength {
        /// The checkpoint directory.
        path: PathBuf,
        /// The blob name.
        name: String,
        /// Its recorded size.
        bytes: u64,
        /// The size the caller's buffer implies.
        requested: u64,
    },
    /// A checkpoint blob or exported tensor name is not usable.
    #[error("invalid name `{name}`: {reason}")]
    InvalidName {
        /// The name.
        name: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// An exported tensor's data length does not match its shape.
    #[error("tensor `{tensor}`: shape {shape:?} holds {expected} elements, data has {found}")]
    ShapeMismatch {
        /// The tensor name.
        tensor: String,
        /// The declared shape.
        shape: Vec<usize>,
        /// Elements the shape implies.
        expected: usize,
        /// Elements supplied.
        found: usize,
    },
    /// An export needs a `config.json` and neither the caller nor the source folder supplied one.
    #[error("{path}: no config.json to export (pass one or point at the source model folder)")]
    MissingConfig {
        /// The source folder that was searched (or the output folder).
        path: PathBuf,
    },
}

impl StorageError {
    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), op, source }
    }

    /// Like [`StorageError::io`] for writes and preallocation: out-of-space errors (`ENOSPC`,
    /// `EDQUOT`, `EFBIG`) become [`StorageError::NoSpace`].
    pub(crate) fn io_write(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => Self::NoSpace { path: path.into(), op, source },
            _ => Self::Io { path: path.into(), op, source },
        }
    }

    /// True when the error is an out-of-space condition (full disk, quota or file-size limit).
    pub fn is_no_space(&self) -> bool {
        matches!(self, Self::NoSpace { .. })
    }
}
