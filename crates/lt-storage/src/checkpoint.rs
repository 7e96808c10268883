//! Crash-safe training checkpoints: a set of named binary blobs plus one JSON metadata object.
//!
//! The trainer stores fp32 master weights and optimizer state (opaque blobs from `lt-optim`) as
//! blobs, and step, RNG state, data position and the plan in the metadata (or as blobs when
//! they are binary). This module does not interpret either.
//!
//! # On disk
//! ```text
//! <root>/step-000000001200/
//!     manifest.json      {format, version, step, created_unix_s, blobs: [{name, file, bytes, xxh64}], meta}
//!     manifest.xxh64     XXH64 of manifest.json, hex
//!     <blob>.bin         one file per blob
//! ```
//!
//! # Guarantees
//! * **Atomic.** A checkpoint is written into `<root>/.tmp-*`; every file is fsynced, then the
//!   temp directory, then it is renamed to `step-N` and `<root>` is fsynced. A crash, a kill or a
//!   full disk at any point leaves either the complete new checkpoint or none, and never touches
//!   an older one. Re-saving an existing step swaps the directories atomically
//!   (`renameat2(RENAME_EXCHANGE)`).
//! * **Checked.** Every blob's XXH64 and size is in the manifest, and the manifest has its own
//!   checksum. [`CheckpointStore::find_latest`] returns the newest checkpoint that verifies and
//!   reports every newer one it skipped, with the reason.
//! * **Bounded.** With [`Retention::KeepLast`], older checkpoints are pruned after each commit,
//!   counting only checkpoints that pass a size check, so corrupt newer ones never cause the last
//!   good one to be deleted.
//!
//! ```no_run
//! use lt_storage::checkpoint::{CheckpointStore, Retention, Verify};
//! # fn main() -> Result<(), lt_storage::StorageError> {
//! # let (weights, adam): (Vec<u8>, Vec<u8>) = (vec![], vec![]);
//! let store = CheckpointStore::new("runs/qwen3/ckpt", Retention::KeepLast(3.try_into().unwrap()));
//! let mut w = store.begin(1200)?;
//! w.add_blob("master_weights", &weights)?;
//! w.add_blob("optimizer", &adam)?;
//! w.commit(serde_json::json!({"rng": [1, 2], "data_position": 86400, "plan": {}}))?;
//!
//! let resume = store.find_latest(Verify::Full)?;
//! for s in &resume.skipped {
//!     eprintln!("warning: skipping {}: {}", s.path.display(), s.error);
//! }
//! if let Some(ckpt) = resume.checkpoint {
//!     let weights = ckpt.read_blob("master_weights")?;
//! }
//! # Ok(()) }
//! ```

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::num::NonZeroUsize;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::direct::SeqFile;
use crate::error::StorageError;
use lt_core::hash::{Xxh64, xxh64};

/// Name of the manifest file.
pub const MANIFEST: &str = "manifest.json";
/// Name of the manifest's checksum file.
pub const MANIFEST_SUM: &str = "manifest.xxh64";
const FORMAT: &str = "lazytrain-checkpoint";
const VERSION: u32 = 1;
const STEP_PREFIX: &str = "step-";
const TMP_PREFIX: &str = ".tmp-";
const TRASH_PREFIX: &str = ".trash-";
const READ_CHUNK: usize = 8 << 20;

/// How many checkpoints to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Never prune.
    KeepAll,
    /// Keep the newest N valid checkpoints (and anything newer than the oldest of them).
    KeepLast(NonZeroUsize),
}

/// How thoroughly to check a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Manifest checksum and every blob's size and XXH64 (reads every byte).
    Full,
    /// Manifest checksum and every blob's size (no data read).
    Sizes,
}

/// One blob as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobInfo {
    /// Blob name.
    pub name: String,
    /// File name inside the checkpoint directory.
    pub file: String,
    /// Size in bytes.
    pub bytes: u64,
    /// XXH64 (seed 0) of the contents.
    #[serde(with = "hex64")]
    pub xxh64: u64,
}

mod hex64 {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:016x}"))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        u64::from_str_radix(&s, 16).map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    step: u64,
    created_unix_s: u64,
    blobs: Vec<BlobInfo>,
    meta: serde_json::Value,
}

fn step_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:012}")
}

fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then(|| digits.parse().ok()).flatten()
}

fn check_name(name: &str) -> Result<(), StorageError> {
    let bad = |reason| Err(StorageError::InvalidName { name: name.to_string(), reason });
    if name.is_empty() || name.len() > 200 {
        return bad("blob names must be 1 to 200 characters");
    }
    if name.starts_with('.') {
        return bad("blob names must not start with '.'");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.')) {
        return bad("blob names may only hold ASCII letters, digits, '_', '-' and '.'");
    }
    Ok(())
}

fn fsync_dir(dir: &Path) -> Result<(), StorageError> {
    let f = File::open(dir).map_err(|e| StorageError::io(dir, "open directory for fsync", e))?;
    f.sync_all().map_err(|e| StorageError::io_write(dir, "fsync directory", e))
}

fn write_file_synced(path: &Path, bytes: &[u8]) -> Result<(), StorageError> {
    let mut f = File::create(path).map_err(|e| StorageError::io_write(path, "create", e))?;
    f.write_all(bytes).map_err(|e| StorageError::io_write(path, "write", e))?;
    f.sync_all().map_err(|e| StorageError::io_write(path, "fsync", e))
}

/// Atomically swap two directory entries (`renameat2(RENAME_EXCHANGE)`).
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    let ca = CString::new(a.as_os_str().as_bytes())?;
    let cb = CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: two NUL-terminated paths relative to the current directory; the syscall reads
    // nothing else.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A directory of checkpoints.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    root: PathBuf,
    retention: Retention,
    direct: bool,
}

/// The result of looking for a checkpoint to resume from.
#[derive(Debug)]
pub struct Resume {
    /// The newest checkpoint that verified, if any.
    pub checkpoint: Option<Checkpoint>,
    /// Newer checkpoints that failed verification, newest first, with the reason (warn the user).
    pub skipped: Vec<Skipped>,
    /// Temporary directories of saves that never finished (a crash or kill during a save).
    pub incomplete: Vec<PathBuf>,
}

/// A checkpoint that was passed over.
#[derive(Debug)]
pub struct Skipped {
    /// Its directory.
    pub path: PathBuf,
    /// Why it was skipped.
    pub error: StorageError,
}

/// A successful [`CheckpointWriter::commit`].
#[derive(Debug)]
pub struct Committed {
    /// The new checkpoint's directory.
    pub path: PathBuf,
    /// Checkpoints removed by retention.
    pub pruned: Vec<PathBuf>,
    /// Pruning problems (the new checkpoint is safe regardless).
    pub prune_errors: Vec<StorageError>,
}

impl CheckpointStore {
    /// A store rooted at `root` (created on the first save). Does no I/O.
    pub fn new(root: impl Into<PathBuf>, retention: Retention) -> Self {
        let direct = std::env::var("LT_CHECKPOINT_DIRECT").map_or(true, |v| v != "0");
        Self { root: root.into(), retention, direct }
    }

    /// Write blobs through the page cache (`false`) or around it with `O_DIRECT` where the file
    /// system allows (`true`, the default unless `LT_CHECKPOINT_DIRECT=0`; see `direct.rs`).
    #[must_use]
    pub fn with_direct_io(mut self, on: bool) -> Self {
        self.direct = on;
        self
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Start writing the checkpoint of `step` in a temporary directory. Also clears temp and
    /// trash directories left by processes that no longer run.
    pub fn begin(&self, step: u64) -> Result<CheckpointWriter<'_>, StorageError> {
        std::fs::create_dir_all(&self.root)
            .map_err(|e| StorageError::io_write(&self.root, "create checkpoint directory", e))?;
        self.clear_stale();
        let tmp = self.root.join(format!(
            "{TMP_PREFIX}{}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed),
            step_dir_name(step)
        ));
        std::fs::create_dir(&tmp)
            .map_err(|e| StorageError::io_write(&tmp, "create temporary checkpoint directory", e))?;
        Ok(CheckpointWriter { store: self, step, tmp, blobs: Vec::new(), committed: false })
    }

    /// Remove `.tmp-*` / `.trash-*` directories whose writer process is gone (best effort).
    fn clear_stale(&self) {
        let Ok(rd) = std::fs::read_dir(&self.root) else { return };
        let me = std::process::id();
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(rest) = name.strip_prefix(TMP_PREFIX).or_else(|| name.strip_prefix(TRASH_PREFIX)) else {
                continue;
            };
            let pid: Option<u32> = rest.split('-').next().and_then(|p| p.parse().ok());
            let alive = pid.is_some_and(|p| p == me || Path::new(&format!("/proc/{p}")).exists());
            if !alive {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }

    /// Finished checkpoints as `(step, directory)`, oldest first (not verified).
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>, StorageError> {
        let rd =
            std::fs::read_dir(&self.root).map_err(|e| StorageError::io(&self.root, "read checkpoint directory", e))?;
        let mut out = Vec::new();
        for e in rd {
            let e = e.map_err(|e| StorageError::io(&self.root, "read checkpoint directory", e))?;
            if let Some(step) = e.file_name().to_str().and_then(parse_step_dir) {
                out.push((step, e.path()));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The newest checkpoint that passes `verify`, skipping (and reporting) corrupt or partial
    /// ones. A missing root directory is an error naming it.
    pub fn find_latest(&self, verify: Verify) -> Result<Resume, StorageError> {
        let list = self.list()?;
        let mut skipped = Vec::new();
        let mut checkpoint = None;
        for (_, path) in list.into_iter().rev() {
            match Checkpoint::open(&path).and_then(|c| c.verify(verify).map(|()| c)) {
                Ok(c) => {
                    checkpoint = Some(c);
                    break;
                }
                Err(error) => skipped.push(Skipped { path, error }),
            }
        }
        let mut incomplete = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&self.root) {
            for e in rd.flatten() {
                if e.file_name().to_str().is_some_and(|n| n.starts_with(TMP_PREFIX)) {
                    incomplete.push(e.path());
                }
            }
        }
        incomplete.sort();
        Ok(Resume { checkpoint, skipped, incomplete })
    }

    /// Apply the retention policy now; returns the directories removed.
    pub fn prune(&self) -> Result<Vec<PathBuf>, StorageError> {
        let Retention::KeepLast(keep) = self.retention else { return Ok(Vec::new()) };
        let list = self.list()?;
        let mut valid = 0usize;
        let mut cut = None;
        for (i, (_, path)) in list.iter().enumerate().rev() {
            if Checkpoint::open(path).and_then(|c| c.verify(Verify::Sizes)).is_ok() {
                valid += 1;
                if valid == keep.get() {
                    cut = Some(i);
                    break;
                }
            }
        }
        let Some(cut) = cut else { return Ok(Vec::new()) };
        let mut removed = Vec::new();
        for (_, path) in &list[..cut] {
            self.remove_dir(path)?;
            removed.push(path.clone());
        }
        Ok(removed)
    }

    /// Delete a checkpoint: rename it out of the `step-*` namespace first, so a crash halfway
    /// through deleting never leaves a half-deleted directory that looks like a checkpoint.
    fn remove_dir(&self, path: &Path) -> Result<(), StorageError> {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let trash = self.root.join(format!(
            "{TRASH_PREFIX}{}-{}-{name}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::rename(path, &trash).map_err(|e| StorageError::io(path, "move old checkpoint to trash", e))?;
        std::fs::remove_dir_all(&trash).map_err(|e| StorageError::io(&trash, "delete old checkpoint", e))
    }
}

/// A checkpoint being written. Dropping it without [`CheckpointWriter::commit`] deletes the
/// temporary directory; older checkpoints are never touched either way.
#[derive(Debug)]
pub struct CheckpointWriter<'a> {
    store: &'a CheckpointStore,
    step: u64,
    tmp: PathBuf,
    blobs: Vec<BlobInfo>,
    committed: bool,
}

impl<'a> CheckpointWriter<'a> {
    /// The step being saved.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The temporary directory being written.
    pub fn temp_dir(&self) -> &Path {
        &self.tmp
    }

    /// Stream a blob: write with [`BlobWriter::append`] (or `std::io::Write`), then
    /// [`BlobWriter::finish`]. A blob not finished is not part of the checkpoint.
    pub fn blob(&mut self, name: &str) -> Result<BlobWriter<'_, 'a>, StorageError> {
        check_name(name)?;
        if self.blobs.iter().any(|b| b.name == name) {
            return Err(StorageError::InvalidName {
                name: name.to_string(),
                reason: "a blob of this name was already added",
            });
        }
        let file_name = format!("{name}.bin");
        let path = self.tmp.join(&file_name);
        let out = SeqFile::create(&path, self.store.direct)?;
        Ok(BlobWriter { owner: self, name: name.to_string(), file_name, out, hasher: Xxh64::new(0), bytes: 0 })
    }

    /// Add a whole blob.
    pub fn add_blob(&mut self, name: &str, bytes: &[u8]) -> Result<(), StorageError> {
        let mut w = self.blob(name)?;
        w.append(bytes)?;
        w.finish()
    }

    /// Add a blob of f32 values, stored little-endian (e.g. the fp32 master weights); read it
    /// back with [`Checkpoint::read_f32_into`].
    pub fn add_f32(&mut self, name: &str, values: &[f32]) -> Result<(), StorageError> {
        let mut w = self.blob(name)?;
        w.append_f32(values)?;
        w.finish()
    }

    /// Write the manifest, make everything durable, publish the checkpoint atomically and
    /// apply retention.
    pub fn commit(mut self, meta: serde_json::Value) -> Result<Committed, StorageError> {
        let manifest = Manifest {
            format: FORMAT.to_string(),
            version: VERSION,
            step: self.step,
            created_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            blobs: self.blobs.clone(),
            meta,
        };
        let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| StorageError::BadManifest {
            path: self.tmp.join(MANIFEST),
            reason: format!("serialising: {e}"),
        })?;
        write_file_synced(&self.tmp.join(MANIFEST), &bytes)?;
        write_file_synced(&self.tmp.join(MANIFEST_SUM), format!("{:016x}\n", xxh64(&bytes, 0)).as_bytes())?;
        fsync_dir(&self.tmp)?;

        let root = &self.store.root;
        let fin = root.join(step_dir_name(self.step));
        if fin.exists() {
            // Same step saved again: swap atomically, then delete the old one (now at `tmp`).
            exchange(&self.tmp, &fin).map_err(|e| StorageError::io_write(&fin, "replace checkpoint (renameat2)", e))?;
            fsync_dir(root)?;
            self.committed = true;
            let _ = std::fs::remove_dir_all(&self.tmp);
        } else {
            std::fs::rename(&self.tmp, &fin)
                .map_err(|e| StorageError::io_write(&fin, "publish checkpoint (rename)", e))?;
            self.committed = true;
            fsync_dir(root)?;
        }
        let (pruned, prune_errors) = match self.store.prune() {
            Ok(p) => (p, Vec::new()),
            Err(e) => (Vec::new(), vec![e]),
        };
        Ok(Committed { path: fin, pruned, prune_errors })
    }
}

impl Drop for CheckpointWriter<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// A blob being streamed into a checkpoint.
#[derive(Debug)]
pub struct BlobWriter<'w, 'a> {
    owner: &'w mut CheckpointWriter<'a>,
    name: String,
    file_name: String,
    out: SeqFile,
    hasher: Xxh64,
    bytes: u64,
}

impl BlobWriter<'_, '_> {
    /// Append bytes. Out-of-space conditions come back as [`StorageError::NoSpace`] naming the
    /// blob file.
    pub fn append(&mut self, data: &[u8]) -> Result<(), StorageError> {
        self.out.write_all(data)?;
        self.hasher.update(data);
        self.bytes += data.len() as u64;
        Ok(())
    }

    /// Append `values` as little-endian f32 (on little-endian hosts straight from their memory,
    /// without a byte copy).
    pub fn append_f32(&mut self, values: &[f32]) -> Result<(), StorageError> {
        #[cfg(target_endian = "little")]
        self.append(bytemuck::cast_slice(values))?;
        #[cfg(target_endian = "big")]
        for chunk in values.chunks(1 << 16) {
            let le: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
            self.append(&le)?;
        }
        Ok(())
    }

    /// Flush, fsync and record the blob in the checkpoint.
    pub fn finish(self) -> Result<(), StorageError> {
        let BlobWriter { owner, name, file_name, out, hasher, bytes, .. } = self;
        out.finish()?;
        owner.blobs.push(BlobInfo { name, file: file_name, bytes, xxh64: hasher.digest() });
        Ok(())
    }

    /// Whether this blob's writes bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.out.is_direct()
    }
}

impl Write for BlobWriter<'_, '_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.append(buf).map_err(std::io::Error::other)?;
        Ok(buf.len())
    }
    /// Nothing to do: [`BlobWriter::finish`] writes out and fsyncs.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A finished checkpoint on disk (manifest checked; blobs checked as they are read).
#[derive(Debug, Clone)]
pub struct Checkpoint {
    path: PathBuf,
    manifest: Manifest,
}

impl Checkpoint {
    /// Open the checkpoint in `dir`: read and checksum its manifest.
    pub fn open(dir: &Path) -> Result<Self, StorageError> {
        let mpath = dir.join(MANIFEST);
        let spath = dir.join(MANIFEST_SUM);
        let bad = |path: &Path, reason: String| StorageError::BadManifest { path: path.to_path_buf(), reason };
        let md = std::fs::metadata(dir).map_err(|e| StorageError::io(dir, "open checkpoint", e))?;
        if !md.is_dir() {
            return Err(StorageError::io(dir, "open checkpoint", std::io::Error::from_raw_os_error(libc::ENOTDIR)));
        }
        let bytes = std::fs::read(&mpath).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => bad(&mpath, "missing (the save did not finish)".into()),
            _ => StorageError::io(&mpath, "read", e),
        })?;
        let sum = std::fs::read_to_string(&spath).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => bad(&spath, "missing (the save did not finish)".into()),
            _ => StorageError::io(&spath, "read", e),
        })?;
        let expected = u64::from_str_radix(sum.trim(), 16)
            .map_err(|_| bad(&spath, format!("not a hex checksum: {:?}", sum.trim())))?;
        let found = xxh64(&bytes, 0);
        if found != expected {
            return Err(StorageError::ChecksumMismatch { path: mpath, expected, found });
        }
        let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| bad(&mpath, e.to_string()))?;
        if manifest.format != FORMAT {
            return Err(bad(&mpath, format!("format {:?}, expected {FORMAT:?}", manifest.format)));
        }
        if manifest.version != VERSION {
            return Err(bad(&mpath, format!("version {} not supported (expected {VERSION})", manifest.version)));
        }
        if let Some(step) = dir.file_name().and_then(|n| n.to_str()).and_then(parse_step_dir)
            && step != manifest.step
        {
            return Err(bad(&mpath, format!("records step {} but the directory is step {step}", manifest.step)));
        }
        for b in &manifest.blobs {
            check_name(&b.name).map_err(|e| bad(&mpath, e.to_string()))?;
            if b.file != format!("{}.bin", b.name) {
                return Err(bad(&mpath, format!("blob `{}` names file {:?}", b.name, b.file)));
            }
        }
        Ok(Self { path: dir.to_path_buf(), manifest })
    }

    /// The checkpoint directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The training step.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The metadata object given to [`CheckpointWriter::commit`].
    pub fn meta(&self) -> &serde_json::Value {
        &self.manifest.meta
    }

    /// Recorded blobs.
    pub fn blobs(&self) -> &[BlobInfo] {
        &self.manifest.blobs
    }

    fn info(&self, name: &str) -> Result<&BlobInfo, StorageError> {
        self.manifest
            .blobs
            .iter()
            .find(|b| b.name == name)
            .ok_or_else(|| StorageError::MissingBlob { path: self.path.clone(), name: name.to_string() })
    }

    fn check_size(&self, b: &BlobInfo) -> Result<(File, PathBuf), StorageError> {
        let path = self.path.join(&b.file);
        let f = File::open(&path).map_err(|e| StorageError::io(&path, "open checkpoint blob", e))?;
        let len = f.metadata().map_err(|e| StorageError::io(&path, "stat checkpoint blob", e))?.len();
        if len != b.bytes {
            return Err(StorageError::SizeMismatch { path, expected: b.bytes, found: len });
        }
        Ok((f, path))
    }

    /// Check every blob (see [`Verify`]).
    pub fn verify(&self, level: Verify) -> Result<(), StorageError> {
        for b in &self.manifest.blobs {
            match level {
                Verify::Sizes => {
                    self.check_size(b)?;
                }
                Verify::Full => self.read_blob_with(&b.name, |_| {})?,
            }
        }
        Ok(())
    }

    /// Stream blob `name` to `sink` in chunks of up to 8 MiB, then check its size and checksum.
    /// On an error the sink has seen unverified bytes and must discard them.
    pub fn read_blob_with(&self, name: &str, mut sink: impl FnMut(&[u8])) -> Result<(), StorageError> {
        let b = self.info(name)?;
        let (mut f, path) = self.check_size(b)?;
        let mut buf = vec![0u8; READ_CHUNK.min(b.bytes.max(1) as usize)];
        let mut h = Xxh64::new(0);
        let mut total = 0u64;
        loop {
            let n = match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(StorageError::io(&path, "read checkpoint blob", e)),
            };
            h.update(&buf[..n]);
            sink(&buf[..n]);
            total += n as u64;
        }
        if total != b.bytes {
            return Err(StorageError::SizeMismatch { path, expected: b.bytes, found: total });
        }
        let found = h.digest();
        if found != b.xxh64 {
            return Err(StorageError::ChecksumMismatch { path, expected: b.xxh64, found });
        }
        Ok(())
    }

    /// Read blob `name` (written by [`CheckpointWriter::add_f32`]) straight into `out`, whose
    /// length must match, and verify it. No intermediate copy: a 100 GB master copy needs no
    /// second 100 GB. On an error `out` holds unverified data.
    pub fn read_f32_into(&self, name: &str, out: &mut [f32]) -> Result<(), StorageError> {
        let b = self.info(name)?;
        let requested = (out.len() as u64).saturating_mul(4);
        if b.bytes != requested {
            return Err(StorageError::BlobLength {
                path: self.path.clone(),
                name: name.to_string(),
                bytes: b.bytes,
                requested,
            });
        }
        let (mut f, path) = self.check_size(b)?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        let mut h = Xxh64::new(0);
        for chunk in bytes.chunks_mut(READ_CHUNK) {
            f.read_exact(chunk).map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    StorageError::SizeMismatch { path: path.clone(), expected: b.bytes, found: 0 }
                }
                _ => StorageError::io(&path, "read checkpoint blob", e),
            })?;
            h.update(chunk);
        }
        let found = h.digest();
        if found != b.xxh64 {
            return Err(StorageError::ChecksumMismatch { path, expected: b.xxh64, found });
        }
        #[cfg(target_endian = "big")]
        for x in out.iter_mut() {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
        Ok(())
    }

    /// Read and verify blob `name`.
    pub fn read_blob(&self, name: &str) -> Result<Vec<u8>, StorageError> {
        let cap = self.info(name)?.bytes as usize;
        let mut out = Vec::with_capacity(cap);
        self.read_blob_with(name, |c| out.extend_from_slice(c))?;
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;
    use crate::testutil::{Rng, assert_child_passed, child_test, run_child_on_small_tmpfs};
    use serde_json::json;

    fn keep(n: usize) -> Retention {
        Retention::KeepLast(NonZeroUsize::new(n).unwrap())
    }

    /// A checkpoint with the trainer's kinds of state; returns the blobs written.
    fn save(store: &CheckpointStore, step: u64, seed: u64, big: usize) -> Vec<(String, Vec<u8>)> {
        let mut rng = Rng::new(seed);
        let blobs = vec![
            ("master_weights".to_string(), rng.bytes(big)),
            ("optimizer.adamw8bit".to_string(), rng.bytes(big / 3 + 1)),
            ("rng_state".to_string(), rng.bytes(17)),
            ("empty".to_string(), Vec::new()),
        ];
        let mut w = store.begin(step).unwrap();
        for (name, data) in &blobs {
            w.add_blob(name, data).unwrap();
        }
        w.commit(json!({"step": step, "data_position": step * 72, "plan": {"kept": [0, 4, 8]}})).unwrap();
        blobs
    }

    fn assert_loads(c: &Checkpoint, blobs: &[(String, Vec<u8>)]) {
        c.verify(Verify::Full).unwrap();
        for (name, data) in blobs {
            assert!(c.read_blob(name).unwrap() == *data, "blob {name}");
        }
    }

    #[test]
    fn save_then_load_round_trips_blobs_and_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path().join("ckpt"), Retention::KeepAll);
        let blobs = save(&store, 7, 1, 3 << 20);
        let resume = store.find_latest(Verify::Full).unwrap();
        assert!(resume.skipped.is_empty() && resume.incomplete.is_empty());
        let c = resume.checkpoint.unwrap();
        assert_eq!(c.step(), 7);
        assert_eq!(c.meta()["data_position"], 7 * 72);
        assert_eq!(c.meta()["plan"]["kept"][2], 8);
        assert_eq!(c.blobs().len(), 4);
        assert_loads(&c, &blobs);
        // Streaming write equals whole write.
        let mut w = store.begin(8).unwrap();
        let mut b = w.blob("streamed").unwrap();
        for chunk in blobs[0].1.chunks(12345) {
            b.write_all(chunk).unwrap();
        }
        b.finish().unwrap();
        w.commit(json!(null)).unwrap();
        let c8 = Checkpoint::open(&dir.path().join("ckpt").join("step-000000000008")).unwrap();
        assert_eq!(c8.blobs()[0].xxh64, c.blobs().iter().find(|b| b.name == "master_weights").unwrap().xxh64);
        assert!(c8.read_blob("streamed").unwrap() == blobs[0].1);
    }

    #[test]
    fn f32_master_weights_round_trip_without_a_byte_copy() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), Retention::KeepAll);
        // Not a multiple of the 8 MiB read chunk, so the last chunk is partial.
        let w: Vec<f32> = (0..(2 << 20) + 3).map(|i| (i as f32 * 0.001).sin()).collect();
        let mut wr = store.begin(1).unwrap();
        wr.add_f32("master_weights", &w).unwrap();
        wr.commit(json!({})).unwrap();
        let c = store.find_latest(Verify::Sizes).unwrap().checkpoint.unwrap();
        let mut back = vec![0f32; w.len()];
        c.read_f32_into("master_weights", &mut back).unwrap();
        assert!(back.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits()));
        let mut short = vec![0f32; w.len() - 1];
        assert!(matches!(
            c.read_f32_into("master_weights", &mut short),
            Err(StorageError::BlobLength { bytes, requested, .. }) if bytes == 4 * w.len() as u64 && requested == bytes - 4
        ));
        // A flipped bit in the middle is caught.
        let f = c.path().join("master_weights.bin");
        let mut raw = std::fs::read(&f).unwrap();
        raw[(4 << 20) + 1] ^= 0x80;
        std::fs::write(&f, raw).unwrap();
        assert!(matches!(c.read_f32_into("master_weights", &mut back), Err(StorageError::ChecksumMismatch { .. })));
    }

    #[test]
    fn keep_last_prunes_older_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), keep(2));
        for step in 1..=5 {
            save(&store, step * 10, step, 1000);
        }
        let steps: Vec<u64> = store.list().unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![40, 50]);
        // No temp or trash directories are left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn pruning_never_deletes_the_last_valid_checkpoints_for_corrupt_newer_ones() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), keep(2));
        save(&store, 1, 1, 1000);
        save(&store, 2, 2, 1000);
        // Step 3 directory with a truncated blob: counts for nothing.
        let b3 = save(&CheckpointStore::new(dir.path(), Retention::KeepAll), 3, 3, 1000);
        let f = dir.path().join("step-000000000003").join("master_weights.bin");
        std::fs::write(&f, &b3[0].1[..10]).unwrap();
        let removed = store.prune().unwrap();
        assert!(removed.is_empty(), "removed {removed:?}");
        assert_eq!(store.list().unwrap().len(), 3);
    }

    #[test]
    fn a_corrupted_byte_is_detected_and_the_previous_checkpoint_is_used() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), Retention::KeepAll);
        let good = save(&store, 100, 1, 1 << 20);
        save(&store, 200, 2, 1 << 20);
        let victim = dir.path().join("step-000000000200").join("optimizer.adamw8bit.bin");
        let mut bytes = std::fs::read(&victim).unwrap();
        bytes[4321] ^= 0x01;
        std::fs::write(&victim, &bytes).unwrap();

        let c200 = Checkpoint::open(&dir.path().join("step-000000000200")).unwrap();
        c200.verify(Verify::Sizes).unwrap(); // same size: only the checksum can tell
        match c200.verify(Verify::Full) {
            Err(StorageError::ChecksumMismatch { path, expected, found }) => {
                assert_eq!(path, victim);
                assert_ne!(expected, found);
            }
            other => panic!("expected a checksum mismatch, got {other:?}"),
        }
        assert!(matches!(c200.read_blob("optimizer.adamw8bit"), Err(StorageError::ChecksumMismatch { .. })));
        assert!(c200.read_blob("rng_state").is_ok(), "other blobs still read");

        let resume = store.find_latest(Verify::Full).unwrap();
        let c = resume.checkpoint.unwrap();
        assert_eq!(c.step(), 100);
        assert_loads(&c, &good);
        assert_eq!(resume.skipped.len(), 1);
        assert_eq!(resume.skipped[0].path, dir.path().join("step-000000000200"));
        assert!(resume.skipped[0].error.to_string().contains("optimizer.adamw8bit.bin"));
    }

    #[test]
    fn a_corrupted_manifest_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), Retention::KeepAll);
        save(&store, 1, 1, 100);
        let m = dir.path().join("step-000000000001").join(MANIFEST);
        let mut bytes = std::fs::read(&m).unwrap();
        let i = bytes.iter().position(|&b| b == b'7').unwrap_or(10);
        bytes[i] = b'8';
        std::fs::write(&m, &bytes).unwrap();
        assert!(matches!(Checkpoint::open(m.parent().unwrap()), Err(StorageError::ChecksumMismatch { .. })));
        std::fs::remove_file(&m).unwrap();
        let err = Checkpoint::open(m.parent().unwrap()).unwrap_err();
        assert!(matches!(&err, StorageError::BadManifest { path, .. } if *path == m), "{err:?}");
        let resume = store.find_latest(Verify::Full).unwrap();
        assert!(resume.checkpoint.is_none());
        assert_eq!(resume.skipped.len(), 1);
    }

    #[test]
    fn partial_temp_dir_and_truncated_file_are_skipped_with_warnings() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), Retention::KeepAll);
        let good = save(&store, 5, 1, 1 << 16);
        // What a crash can leave: a published checkpoint whose blob lost its tail (a file system
        // that reordered the rename before the data)...
        save(&store, 7, 7, 1 << 16);
        let f = dir.path().join("step-000000000007").join("master_weights.bin");
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len / 2).unwrap();
        // ...and a temp dir from a dead writer (pid 4294967295 cannot exist) holding a partial
        // blob and no manifest.
        let stale = dir.path().join(".tmp-4294967295-0-step-000000000008");
        std::fs::create_dir(&stale).unwrap();
        std::fs::write(stale.join("master_weights.bin"), [1u8; 100]).unwrap();

        let resume = store.find_latest(Verify::Full).unwrap();
        assert_eq!(resume.checkpoint.as_ref().unwrap().step(), 5);
        assert_loads(resume.checkpoint.as_ref().unwrap(), &good);
        assert!(matches!(
            &resume.skipped[0].error,
            StorageError::SizeMismatch { path, expected, found } if *path == f && *expected == len && *found == len / 2
        ));
        assert_eq!(resume.incomplete, vec![stale.clone()]);
        // The next save clears the dead writer's leftovers.
        save(&store, 9, 9, 10);
        assert!(!stale.exists());
    }

    #[test]
    fn saving_the_same_step_again_replaces_it_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), Retention::KeepAll);
        save(&store, 3, 1, 1000);
        let second = save(&store, 3, 2, 2000);
        let c = store.find_latest(Verify::Full).unwrap().checkpoint.unwrap();
        assert_loads(&c, &second);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn bad_names_and_missing_directories_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let store = CheckpointStore::new(&missing, Retention::KeepAll);
        let err = store.find_latest(Verify::Full).unwrap_err();
        assert!(matches!(&err, StorageError::Io { path, .. } if *path == missing), "{err:?}");
        assert!(err.to_string().contains("nope"));
        assert!(
            Checkpoint::open(&missing.join("step-000000000001")).unwrap_err().to_string().contains("step-000000000001")
        );

        let mut w = store.begin(1).unwrap();
        for bad in ["", "../x", ".hidden", "a/b", "sp ace"] {
            assert!(matches!(w.add_blob(bad, b"x"), Err(StorageError::InvalidName { .. })), "{bad:?}");
        }
        w.add_blob("ok", b"x").unwrap();
        assert!(matches!(w.add_blob("ok", b"y"), Err(StorageError::InvalidName { .. })));
        let tmp = w.temp_dir().to_path_buf();
        drop(w); // abandoned: the temp dir goes, nothing is published
        assert!(!tmp.exists());
        assert!(store.list().unwrap().is_empty());
        let c = {
            let mut w = store.begin(2).unwrap();
            w.add_blob("ok", b"x").unwrap();
            w.commit(json!({})).unwrap();
            store.find_latest(Verify::Full).unwrap().checkpoint.unwrap()
        };
        assert!(matches!(c.read_blob("absent"), Err(StorageError::MissingBlob { .. })));
    }

    const ENV_DIR: &str = "LT_STORAGE_TEST_DIR";

    fn child_dir() -> Option<PathBuf> {
        std::env::var_os(ENV_DIR).map(PathBuf::from)
    }

    #[test]
    fn a_kill_during_a_save_leaves_the_previous_checkpoint_loadable() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), keep(2));
        let good = save(&store, 1, 1, 1 << 20);
        let marker = dir.path().join("..").join(format!("lt-marker-{}", std::process::id()));
        let _ = std::fs::remove_file(&marker);
        let mut child = child_test("checkpoint::tests::child_slow_writer")
            .env(ENV_DIR, dir.path())
            .env("LT_STORAGE_TEST_MARKER", &marker)
            .spawn()
            .unwrap();
        let t0 = std::time::Instant::now();
        while !marker.exists() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(60), "child never reached mid-write");
            if let Some(status) = child.try_wait().unwrap() {
                panic!("child exited early: {status}");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        child.kill().unwrap(); // SIGKILL, mid-blob
        child.wait().unwrap();
        let _ = std::fs::remove_file(&marker);

        let resume = store.find_latest(Verify::Full).unwrap();
        assert_eq!(resume.checkpoint.as_ref().map(Checkpoint::step), Some(1));
        assert_loads(resume.checkpoint.as_ref().unwrap(), &good);
        assert!(resume.skipped.is_empty());
        assert_eq!(resume.incomplete.len(), 1, "the killed save's temp dir is reported");
        // Saving again works and clears the dead writer's temp dir.
        save(&store, 2, 2, 1000);
        assert_eq!(store.find_latest(Verify::Full).unwrap().incomplete.len(), 0);
    }

    #[test]
    #[ignore = "helper: run in a child process by a_kill_during_a_save_leaves_the_previous_checkpoint_loadable"]
    fn child_slow_writer() {
        let (Some(dir), Some(marker)) = (child_dir(), std::env::var_os("LT_STORAGE_TEST_MARKER")) else {
            panic!("run only as a child of the kill test");
        };
        let store = CheckpointStore::new(dir, keep(2));
        let mut w = store.begin(2).unwrap();
        let mut b = w.blob("master_weights").unwrap();
        let chunk = vec![0xABu8; 1 << 20];
        for i in 0..1000 {
            b.append(&chunk).unwrap();
            if i == 3 {
                b.flush().unwrap();
                std::fs::write(&marker, b"mid-write").unwrap();
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("the parent should have killed this process");
    }

    #[test]
    fn efbig_from_a_file_size_limit_is_reported_and_harms_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), keep(1));
        let good = save(&store, 1, 1, 100 << 10);
        let mut c = child_test("checkpoint::tests::child_under_file_size_limit");
        c.env(ENV_DIR, dir.path());
        // SAFETY: between fork and exec only async-signal-safe calls: setrlimit and signal.
        // SIGXFSZ is ignored so the kernel reports EFBIG instead of killing the child; both
        // settings survive exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            c.pre_exec(|| {
                let lim = libc::rlimit { rlim_cur: 1 << 20, rlim_max: 1 << 20 };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                Ok(())
            });
        }
        let out = c.output().unwrap();
        assert_child_passed(&out, "EFBIG child");
        let resume = store.find_latest(Verify::Full).unwrap();
        assert_eq!(resume.checkpoint.as_ref().map(Checkpoint::step), Some(1));
        assert_loads(resume.checkpoint.as_ref().unwrap(), &good);
        assert!(resume.incomplete.is_empty(), "the failed save cleaned up after itself");
    }

    #[test]
    #[ignore = "helper: run under RLIMIT_FSIZE by efbig_from_a_file_size_limit_is_reported_and_harms_nothing"]
    fn child_under_file_size_limit() {
        let dir = child_dir().expect("run only as a child of the EFBIG test");
        let store = CheckpointStore::new(&dir, keep(1));
        let mut w = store.begin(2).unwrap();
        let err = w.add_blob("master_weights", &vec![7u8; 3 << 20]).unwrap_err();
        println!("checkpoint error: {err}");
        assert!(err.is_no_space(), "{err:?}");
        assert!(matches!(&err, StorageError::NoSpace { path, source, .. }
            if path.ends_with("master_weights.bin") && source.raw_os_error() == Some(libc::EFBIG)));
        drop(w);
        assert_eq!(store.find_latest(Verify::Full).unwrap().checkpoint.map(|c| c.step()), Some(1));

        let err = crate::spill::SpillStore::open(crate::spill::SpillConfig::new(&dir, 4 << 20)).unwrap_err();
        println!("spill error: {err}");
        assert!(matches!(&err, StorageError::NoSpace { path, source, .. }
            if path.to_string_lossy().contains("lt-spill-") && source.raw_os_error() == Some(libc::EFBIG)));
    }

    #[test]
    fn enospc_on_a_full_file_system_is_reported_and_harms_nothing() {
        let base = tempfile::tempdir().unwrap();
        let mnt = base.path().join("small");
        std::fs::create_dir(&mnt).unwrap();
        match run_child_on_small_tmpfs("checkpoint::tests::child_on_full_tmpfs", &mnt, &[(ENV_DIR, &mnt)]) {
            Ok(out) => {
                assert_child_passed(&out, "ENOSPC child");
                println!("{}", String::from_utf8_lossy(&out.stdout));
            }
            Err(reason) => println!("SKIPPED enospc test: {reason}"),
        }
        // Whatever happened, nothing stays mounted here.
        assert_eq!(std::fs::read_dir(&mnt).unwrap().count(), 0);
    }

    #[test]
    #[ignore = "helper: run on a 1 MiB tmpfs by enospc_on_a_full_file_system_is_reported_and_harms_nothing"]
    fn child_on_full_tmpfs() {
        let dir = child_dir().expect("run only as a child of the ENOSPC test");
        assert!(crate::spill::is_tmpfs(&dir), "{} is not the test tmpfs", dir.display());
        let store = CheckpointStore::new(dir.join("ckpt"), keep(2));
        let good = save(&store, 1, 1, 200 << 10);
        let mut w = store.begin(2).unwrap();
        let err = w.add_blob("master_weights", &vec![1u8; 2 << 20]).unwrap_err();
        println!("checkpoint error: {err}");
        assert!(matches!(&err, StorageError::NoSpace { path, source, .. }
            if path.ends_with("master_weights.bin") && source.raw_os_error() == Some(libc::ENOSPC)));
        drop(w);
        let resume = store.find_latest(Verify::Full).unwrap();
        assert_eq!(resume.checkpoint.as_ref().map(Checkpoint::step), Some(1));
        assert_loads(resume.checkpoint.as_ref().unwrap(), &good);
        assert!(resume.incomplete.is_empty());

        // The spill store: preallocation beyond the free space is refused cleanly...
        let err = crate::spill::SpillStore::open(crate::spill::SpillConfig::new(&dir, 2 << 20)).unwrap_err();
        println!("spill error: {err}");
        assert!(matches!(&err, StorageError::NoSpace { source, .. } if source.raw_os_error() == Some(libc::ENOSPC)));
        // ...and one that fits works on tmpfs (auto-selects the memory map).
        let s = crate::spill::SpillStore::open(crate::spill::SpillConfig {
            pool_bytes: 0,
            ..crate::spill::SpillConfig::new(&dir, 256 << 10)
        })
        .unwrap();
        assert_eq!(s.report().engine, crate::spill::EngineKind::Mmap);
        s.put(1, &[9u8; 5000]).unwrap();
        assert_eq!(s.get(1).unwrap(), vec![9u8; 5000]);
    }
}
