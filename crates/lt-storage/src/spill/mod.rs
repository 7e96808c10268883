//! The spill store: NVMe (or tmpfs) as the third memory tier for layer-boundary activations and
//! any other large buffer.
//!
//! A [`SpillStore`] owns one preallocated file and a dedicated I/O thread. Callers hand it owned,
//! block-aligned buffers ([`SpillBuf`]) and get back a [`Ticket`]; submission never waits for the
//! disk, so the executor can overlap spills with compute and [`Ticket::wait`] later.
//!
//! * Space: the file is `fallocate`d to the capacity at open and unlinked at once, so a run never
//!   grows its spill directory and a crash leaves nothing behind. An extent allocator hands out
//!   and reuses its blocks; a value that does not fit is a clean [`StorageError::SpillFull`].
//! * Engines ([`EngineKind`]): io_uring with `O_DIRECT` and registered buffers; a pread/pwrite
//!   thread pool when io_uring is refused; a shared memory map for tmpfs or the page cache. What
//!   was asked for and what fell back is in [`SpillStore::report`].
//! * Requests are `request_size` bytes (4 MiB by default: request size, not queue depth, is what
//!   reaches the disk's bandwidth, see `shared/REFERENCE.md` §5), `queue_depth` in flight.
//!
//! ```no_run
//! use lt_storage::spill::{SpillConfig, SpillStore};
//! # fn main() -> Result<(), lt_storage::StorageError> {
//! let store = SpillStore::open(SpillConfig::new("/mnt/nvme/spill", 8 << 30))?;
//! let mut act = store.alloc_buf(64 << 20)?; // registered, 2 MiB-aligned
//! act.fill(7);
//! let t = store.submit_put(42, act)?; // returns at once
//! // ... compute ...
//! let buf = t.wait()?; // the buffer comes back for reuse
//! let back = store.submit_get_into(42, buf)?.wait()?;
//! assert!(back.iter().all(|&b| b == 7));
//! store.remove(42)?;
//! # Ok(()) }
//! ```

mod alloc;
mod buf;
mod engine;
mod uring;
mod worker;

use std::collections::HashMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender, bounded, unbounded};

pub use buf::SpillBuf;

use crate::error::StorageError;
use alloc::{Extent, ExtentAllocator};
use buf::{BLOCK, BufPool, HUGE, round_up};
use engine::{Engine, MmapEngine, Op, PreadEngine};
use uring::{UringEngine, UringHooks};
use worker::{Job, Worker};

/// A spill key; the executor packs (micro-batch, boundary, ...) into it.
pub type SpillKey = u64;

/// Which engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineChoice {
    /// io_uring, falling back to pread/pwrite; the memory map on tmpfs.
    #[default]
    Auto,
    /// io_uring (falls back to pread/pwrite if refused).
    IoUring,
    /// pread/pwrite on a thread pool.
    Pread,
    /// A shared memory map of the file (tmpfs or page-cache tier; no `O_DIRECT`).
    Mmap,
}

/// The engine a store actually runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// io_uring.
    IoUring,
    /// pread/pwrite on a thread pool.
    Pread,
    /// Memory map.
    Mmap,
}

impl EngineKind {
    /// Name as used on the command line and in JSON (`io_uring`, `pread`, `mmap`).
    pub fn name(self) -> &'static str {
        match self {
            Self::IoUring => "io_uring",
            Self::Pread => "pread",
            Self::Mmap => "mmap",
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Something the store could not do as configured, and what it does instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fallback {
    /// `io_uring_setup` failed (EPERM under seccomp or `io_uring_disabled`, ENOSYS on old
    /// kernels): the pread/pwrite pool is used.
    UringRefused {
        /// The errno.
        errno: i32,
    },
    /// A probe read through the ring failed (kernel lacks the opcodes): pread/pwrite is used.
    UringProbeFailed {
        /// The errno.
        errno: i32,
    },
    /// Buffer registration failed (usually `ulimit -l`): io_uring runs with plain buffers.
    RegisterFailed {
        /// The errno.
        errno: i32,
    },
    /// The file system refused `O_DIRECT` (e.g. EINVAL on older tmpfs): buffered I/O, so
    /// figures include the page cache.
    DirectRefused {
        /// The errno.
        errno: i32,
    },
    /// `fallocate` is unsupported: the file is sparse and a full disk shows up at write time.
    FallocateUnsupported {
        /// The errno.
        errno: i32,
    },
    /// The memory map needs a fully allocated file; without `fallocate` pread/pwrite is used.
    MmapNeedsFallocate,
    /// Auto selection found a tmpfs directory and uses the memory map.
    TmpfsUsesMmap,
}

fn errno_name(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UringRefused { errno } => {
                write!(f, "io_uring_setup refused ({}): using the pread/pwrite thread pool", errno_name(*errno))
            }
            Self::UringProbeFailed { errno } => {
                write!(f, "io_uring probe read failed ({}): using the pread/pwrite thread pool", errno_name(*errno))
            }
            Self::RegisterFailed { errno } => write!(
                f,
                "io_uring buffer registration failed ({}; check `ulimit -l`): using unregistered buffers",
                errno_name(*errno)
            ),
            Self::DirectRefused { errno } => write!(
                f,
                "O_DIRECT refused by the file system ({}): using buffered I/O (page cache included)",
                errno_name(*errno)
            ),
            Self::FallocateUnsupported { errno } => {
                write!(f, "fallocate unsupported ({}): spill file is sparse", errno_name(*errno))
            }
            Self::MmapNeedsFallocate => f.write_str("mmap engine needs fallocate: using pread/pwrite"),
            Self::TmpfsUsesMmap => f.write_str("directory is on tmpfs: using the mmap engine"),
        }
    }
}

/// Settings of a [`SpillStore`].
#[derive(Debug, Clone)]
pub struct SpillConfig {
    /// Directory for the spill file (must exist).
    pub dir: PathBuf,
    /// Bytes to preallocate; values beyond it are refused with [`StorageError::SpillFull`].
    pub capacity: u64,
    /// Engine selection.
    pub engine: EngineChoice,
    /// Largest single request, bytes (multiple of 4 KiB; default 4 MiB).
    pub request_size: usize,
    /// Requests in flight (default 8).
    pub queue_depth: usize,
    /// Open the file with `O_DIRECT` (default true; ignored by the mmap engine).
    pub direct_io: bool,
    /// Register the buffer pool with io_uring (default true).
    pub register_buffers: bool,
    /// Size of the buffer pool behind [`SpillStore::alloc_buf`] (default 64 MiB; 0 for none).
    pub pool_bytes: usize,
}

impl SpillConfig {
    /// Defaults for a spill file in `dir` holding up to `capacity` bytes.
    pub fn new(dir: impl Into<PathBuf>, capacity: u64) -> Self {
        Self {
            dir: dir.into(),
            capacity,
            engine: EngineChoice::Auto,
            request_size: 4 << 20,
            queue_depth: 8,
            direct_io: true,
            register_buffers: true,
            pool_bytes: 64 << 20,
        }
    }

    fn validate(&self) -> Result<(), StorageError> {
        let bad = |field, reason: String| Err(StorageError::InvalidConfig { field, reason });
        if self.request_size < BLOCK || !self.request_size.is_multiple_of(BLOCK) || self.request_size > (256 << 20) {
            return bad(
                "request_size",
                format!("{} is not a multiple of 4 KiB between 4 KiB and 256 MiB", self.request_size),
            );
        }
        if self.queue_depth == 0 || self.queue_depth > 1024 {
            return bad("queue_depth", format!("{} is not in 1..=1024", self.queue_depth));
        }
        if self.capacity < BLOCK as u64 {
            return bad("capacity", format!("{} bytes is below one 4 KiB block", self.capacity));
        }
        Ok(())
    }
}

/// What a store runs: engine, I/O mode and every fallback taken.
#[derive(Debug, Clone)]
pub struct SpillReport {
    /// The engine in use.
    pub engine: EngineKind,
    /// The spill file (unlinked right after creation).
    pub path: PathBuf,
    /// Whether I/O bypasses the page cache.
    pub direct_io: bool,
    /// Whether pooled buffers are registered with io_uring.
    pub registered_buffers: bool,
    /// Whether the pool memory was advised for transparent huge pages.
    pub huge_pages: bool,
    /// Largest request, bytes.
    pub request_size: usize,
    /// Requests in flight.
    pub queue_depth: usize,
    /// Preallocated bytes.
    pub capacity: u64,
    /// What did not go as configured.
    pub fallbacks: Vec<Fallback>,
}

/// Byte counters of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpillStats {
    /// Capacity, bytes.
    pub capacity: u64,
    /// Bytes allocated to values (rounded to blocks), including values being written or freed
    /// but still read.
    pub used: u64,
    /// Keys present.
    pub keys: usize,
    /// Bytes written to the file since open.
    pub bytes_written: u64,
    /// Bytes read from the file since open.
    pub bytes_read: u64,
}

pub(crate) struct Entry {
    len: usize,
    alloc_id: u64,
    /// The job writing this value, while it runs.
    pub(crate) pending_put: Option<u64>,
}

struct Allocation {
    extents: Arc<[Extent]>,
    /// One for the key that owns it, one per running job.
    refs: u32,
}

pub(crate) struct Index {
    pub(crate) keys: HashMap<SpillKey, Entry>,
    allocs: HashMap<u64, Allocation>,
    space: ExtentAllocator,
    next_id: u64,
}

impl Index {
    pub(crate) fn release(&mut self, alloc_id: u64) {
        let Some(a) = self.allocs.get_mut(&alloc_id) else { return };
        a.refs = a.refs.saturating_sub(1);
        if a.refs == 0
            && let Some(a) = self.allocs.remove(&alloc_id)
        {
            for e in a.extents.iter() {
                self.space.free(*e);
            }
        }
    }
}

/// State shared by the store handle and its I/O thread.
pub(crate) struct Shared {
    pub(crate) path: PathBuf,
    index: Mutex<Index>,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The pending result of a submitted transfer.
#[must_use = "a ticket must be waited on to learn whether the transfer succeeded"]
#[derive(Debug)]
pub struct Ticket<T> {
    rx: Receiver<Result<T, StorageError>>,
    path: Arc<Path>,
}

impl<T> Ticket<T> {
    /// Block until the transfer is done; returns the buffer (written from, or read into).
    pub fn wait(self) -> Result<T, StorageError> {
        self.rx.recv().unwrap_or_else(|_| Err(StorageError::SpillClosed { path: self.path.to_path_buf() }))
    }

    /// True once [`Ticket::wait`] would return without blocking.
    pub fn is_done(&self) -> bool {
        !self.rx.is_empty()
    }

    /// The result if the transfer is done, else the ticket back.
    pub fn try_wait(self) -> Result<Result<T, StorageError>, Self> {
        if self.is_done() { Ok(self.wait()) } else { Err(self) }
    }
}

/// Test-only fault injection for store setup.
#[derive(Debug, Default, Clone)]
pub(crate) struct Hooks {
    pub uring: UringHooks,
    /// Pretend enabling `O_DIRECT` failed with this errno.
    pub direct_errno: Option<i32>,
    /// Fail writes reaching this file offset with EIO, reporting failures once the gate opens.
    #[cfg(test)]
    pub fail_writes_from: Option<(u64, Arc<std::sync::atomic::AtomicBool>)>,
}

/// A spill file with its I/O thread. Dropping it waits for every submitted transfer.
pub struct SpillStore {
    shared: Arc<Shared>,
    path: Arc<Path>,
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    pool: Option<Arc<BufPool>>,
    report: SpillReport,
}

impl fmt::Debug for SpillStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpillStore").field("report", &self.report).finish_non_exhaustive()
    }
}

static FILE_SEQ: AtomicU64 = AtomicU64::new(0);

pub(crate) fn is_tmpfs(dir: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: `statfs` is a plain struct of integers, for which all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    #[allow(clippy::unnecessary_cast)]
    let tmpfs = st.f_type as i64 == libc::TMPFS_MAGIC as i64;
    r == 0 && tmpfs
}

fn set_direct(file: &File, on: bool) -> std::io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL/F_SETFL on an fd we own; no memory is passed.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let flags = if on { flags | libc::O_DIRECT } else { flags & !libc::O_DIRECT };
        if libc::fcntl(fd, libc::F_SETFL, flags) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Create, unlink and preallocate the spill file. Returns the file and whether `fallocate` worked.
fn create_file(path: &Path, capacity: u64, fallbacks: &mut Vec<Fallback>) -> Result<(File, bool), StorageError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| StorageError::io_write(path, "create spill file", e))?;
    // Unlinked at once: the space returns to the file system when the store (or the process)
    // goes away, however it goes away.
    std::fs::remove_file(path).map_err(|e| StorageError::io(path, "unlink spill file", e))?;
    let len = libc::off_t::try_from(capacity).map_err(|_| StorageError::InvalidConfig {
        field: "capacity",
        reason: format!("{capacity} bytes exceeds the largest file offset"),
    })?;
    // SAFETY: fallocate on an fd we own, mode 0 (allocate), range within off_t.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if r == 0 {
        return Ok((file, true));
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(errno @ (libc::EOPNOTSUPP | libc::ENOSYS)) => {
            fallbacks.push(Fallback::FallocateUnsupported { errno });
            file.set_len(capacity).map_err(|e| StorageError::io_write(path, "extend spill file", e))?;
            Ok((file, false))
        }
        _ => Err(StorageError::io_write(path, "preallocate spill file (fallocate)", e)),
    }
}

/// Write and read back block 0 with `O_DIRECT` to learn whether the file system honours it.
fn probe_direct(file: &File) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut b = SpillBuf::zeroed(BLOCK).map_err(|_| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
    file.write_all_at(&b, 0)?;
    file.read_exact_at(&mut b, 0)
}

/// Read block 0 through the ring, synchronously.
fn probe_uring(engine: &mut UringEngine) -> std::io::Result<()> {
    let mut b = SpillBuf::zeroed(BLOCK).map_err(|_| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
    let req = engine::IoReq { id: 0, op: Op::Read, offset: 0, ptr: b.io_ptr(), len: BLOCK, fixed: None };
    // SAFETY: `b` is a valid, exclusively owned 4 KiB buffer that lives until the loop below has
    // collected the request's completion (or the ring failed, in which case we leak it).
    unsafe { engine.submit(req)? };
    let mut out = Vec::new();
    while out.is_empty() {
        if let Err(e) = engine.complete(true, &mut out) {
            std::mem::forget(b);
            return Err(e);
        }
    }
    out.pop().map_or(Ok(()), |d| d.result.map(|_| ()))
}

impl SpillStore {
    /// Create the spill file in `cfg.dir`, preallocate it and start the I/O thread.
    ///
    /// Errors: a missing directory ([`StorageError::Io`] naming it), not enough space for the
    /// preallocation ([`StorageError::NoSpace`] naming the file), invalid settings.
    pub fn open(cfg: SpillConfig) -> Result<Self, StorageError> {
        Self::open_with(cfg, Hooks::default())
    }

    pub(crate) fn open_with(cfg: SpillConfig, hooks: Hooks) -> Result<Self, StorageError> {
        cfg.validate()?;
        let meta = std::fs::metadata(&cfg.dir).map_err(|e| StorageError::io(&cfg.dir, "open spill directory", e))?;
        if !meta.is_dir() {
            return Err(StorageError::io(
                &cfg.dir,
                "open spill directory",
                std::io::Error::from_raw_os_error(libc::ENOTDIR),
            ));
        }
        let capacity = cfg.capacity.checked_next_multiple_of(BLOCK as u64).ok_or_else(|| {
            StorageError::InvalidConfig { field: "capacity", reason: format!("{} bytes is out of range", cfg.capacity) }
        })?;
        let seq = FILE_SEQ.fetch_add(1, Ordering::Relaxed);
        let path = cfg.dir.join(format!("lt-spill-{}-{seq}.bin", std::process::id()));
        let mut fallbacks = Vec::new();

        let tmpfs = is_tmpfs(&cfg.dir);
        let choice = match cfg.engine {
            EngineChoice::Auto if tmpfs => {
                fallbacks.push(Fallback::TmpfsUsesMmap);
                EngineChoice::Mmap
            }
            c => c,
        };

        let (file, allocated) = create_file(&path, capacity, &mut fallbacks)?;
        let mut direct = false;
        if cfg.direct_io && choice != EngineChoice::Mmap {
            let r = match hooks.direct_errno {
                Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
                None => set_direct(&file, true).and_then(|()| probe_direct(&file)),
            };
            match r {
                Ok(()) => direct = true,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP)) => {
                    let _ = set_direct(&file, false);
                    fallbacks.push(Fallback::DirectRefused { errno: e.raw_os_error().unwrap_or(libc::EINVAL) });
                }
                Err(e) => return Err(StorageError::io_write(&path, "probe O_DIRECT", e)),
            }
        }
        let file = Arc::new(file);
        let pool = BufPool::new(cfg.pool_bytes)?;

        let mut registered = false;
        let engine: Box<dyn Engine> = match choice {
            EngineChoice::Mmap if allocated => Box::new(
                MmapEngine::new(Arc::clone(&file), capacity, tmpfs)
                    .map_err(|e| StorageError::io(&path, "mmap spill file", e))?,
            ),
            EngineChoice::Mmap => {
                fallbacks.push(Fallback::MmapNeedsFallocate);
                Box::new(pread_engine(&file, &cfg, &path)?)
            }
            EngineChoice::Pread => Box::new(pread_engine(&file, &cfg, &path)?),
            EngineChoice::Auto | EngineChoice::IoUring => {
                let reg_pool = if cfg.register_buffers { pool.as_ref() } else { None };
                match UringEngine::new(Arc::clone(&file), cfg.queue_depth, reg_pool, hooks.uring) {
                    Ok((mut e, reg_err)) => {
                        if let Some(errno) = reg_err {
                            fallbacks.push(Fallback::RegisterFailed { errno });
                        }
                        match probe_uring(&mut e) {
                            Ok(()) => {
                                registered = e.registered();
                                Box::new(e)
                            }
                            Err(err) => {
                                fallbacks.push(Fallback::UringProbeFailed {
                                    errno: err.raw_os_error().unwrap_or(libc::EIO),
                                });
                                Box::new(pread_engine(&file, &cfg, &path)?)
                            }
                        }
                    }
                    Err(err) => {
                        fallbacks.push(Fallback::UringRefused { errno: err.raw_os_error().unwrap_or(libc::ENOSYS) });
                        Box::new(pread_engine(&file, &cfg, &path)?)
                    }
                }
            }
        };

        #[cfg(test)]
        let engine: Box<dyn Engine> = match hooks.fail_writes_from {
            Some((from, gate)) => {
                Box::new(engine::FailingWrites { inner: engine, from, failed: Default::default(), gate })
            }
            None => engine,
        };
        let report = SpillReport {
            engine: engine.kind(),
            path: path.clone(),
            direct_io: direct && engine.kind() != EngineKind::Mmap,
            registered_buffers: registered,
            huge_pages: pool.as_ref().is_some_and(|p| p.huge()),
            request_size: cfg.request_size,
            queue_depth: if engine.kind() == EngineKind::Mmap { 1 } else { cfg.queue_depth },
            capacity,
            fallbacks,
        };
        let shared = Arc::new(Shared {
            path: path.clone(),
            index: Mutex::new(Index {
                keys: HashMap::new(),
                allocs: HashMap::new(),
                space: ExtentAllocator::new(capacity, BLOCK as u64),
                next_id: 1,
            }),
            bytes_written: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
        });
        let (tx, rx) = unbounded();
        let worker = Worker::new(engine, Arc::clone(&shared), cfg.request_size);
        let thread = std::thread::Builder::new()
            .name("lt-spill-io".into())
            .spawn(move || worker.run(rx))
            .map_err(|e| StorageError::io(&path, "start spill I/O thread", e))?;
        Ok(Self { shared, path: Arc::from(path.as_path()), tx: Some(tx), thread: Some(thread), pool, report })
    }

    /// Engine, I/O mode and fallbacks of this store.
    pub fn report(&self) -> &SpillReport {
        &self.report
    }

    /// A buffer of `len` bytes for spill I/O: from the registered pool when it has room (fixed
    /// buffers, no per-request page pinning), else freshly mapped. Contents are unspecified.
    pub fn alloc_buf(&self, len: usize) -> Result<SpillBuf, StorageError> {
        match self.pool.as_ref().and_then(|p| SpillBuf::from_pool(p, len)) {
            Some(b) => Ok(b),
            None => SpillBuf::zeroed(len),
        }
    }

    fn send(&self, job: Job) -> Result<(), StorageError> {
        let tx = self.tx.as_ref().ok_or_else(|| StorageError::SpillClosed { path: self.shared.path.clone() })?;
        tx.send(job).map_err(|_| StorageError::SpillClosed { path: self.shared.path.clone() })
    }

    /// Start writing `buf[..buf.len()]` as the value of `key` (replacing any previous value).
    /// Returns at once; the ticket yields `buf` back when the data is on disk.
    ///
    /// Errors now: [`StorageError::SpillFull`] when the value does not fit (a replaced value is
    /// already gone by then). Errors at `wait`: the I/O error, naming the spill file.
    pub fn submit_put(&self, key: SpillKey, buf: SpillBuf) -> Result<Ticket<SpillBuf>, StorageError> {
        let (reply, rx) = bounded(1);
        let len = buf.len();
        {
            let mut idx = self.shared.lock();
            if let Some(old) = idx.keys.remove(&key) {
                idx.release(old.alloc_id);
            }
            let align = if len >= HUGE { HUGE } else { BLOCK } as u64;
            let Some(extents) = idx.space.alloc_multi(len as u64, align) else {
                return Err(StorageError::SpillFull {
                    path: self.shared.path.clone(),
                    requested: idx.space.rounded(len as u64),
                    free: idx.space.free_bytes(),
                    capacity: idx.space.capacity(),
                });
            };
            let extents: Arc<[Extent]> = extents.into();
            let id = idx.next_id;
            idx.next_id += 1;
            idx.allocs.insert(id, Allocation { extents: Arc::clone(&extents), refs: 2 });
            idx.keys.insert(key, Entry { len, alloc_id: id, pending_put: Some(id) });
            // Sent under the index lock, so the I/O thread sees jobs in index order: a get that
            // observed `pending_put` always arrives after that put.
            let job = Job { id, key, op: Op::Write, buf, extents, alloc_id: id, after: None, reply };
            if let Err(e) = self.send(job) {
                idx.keys.remove(&key);
                idx.release(id);
                idx.release(id);
                return Err(e);
            }
        }
        Ok(Ticket { rx, path: Arc::clone(&self.path) })
    }

    fn submit_read(&self, key: SpillKey, buf: Option<SpillBuf>) -> Result<Ticket<SpillBuf>, StorageError> {
        let (reply, rx) = bounded(1);
        {
            let mut idx = self.shared.lock();
            let Some(e) = idx.keys.get(&key) else {
                return Err(StorageError::SpillKeyNotFound { path: self.shared.path.clone(), key });
            };
            let (len, alloc_id, after) = (e.len, e.alloc_id, e.pending_put);
            let needed = round_up(len, BLOCK);
            let mut buf = match buf {
                Some(b) => b,
                None => self.alloc_buf(len)?,
            };
            if buf.capacity() < needed {
                return Err(StorageError::BufferTooSmall { key, needed, capacity: buf.capacity() });
            }
            buf.set_len(len)?;
            let extents = match idx.allocs.get_mut(&alloc_id) {
                Some(a) => {
                    a.refs += 1;
                    Arc::clone(&a.extents)
                }
                None => return Err(StorageError::SpillKeyNotFound { path: self.shared.path.clone(), key }),
            };
            let id = idx.next_id;
            idx.next_id += 1;
            let job = Job { id, key, op: Op::Read, buf, extents, alloc_id, after, reply };
            if let Err(e) = self.send(job) {
                idx.release(alloc_id);
                return Err(e);
            }
        }
        Ok(Ticket { rx, path: Arc::clone(&self.path) })
    }

    /// Start reading the value of `key` into a new buffer (from the pool when it has room).
    /// A get submitted right after a put of the same key sees the new value.
    pub fn submit_get(&self, key: SpillKey) -> Result<Ticket<SpillBuf>, StorageError> {
        self.submit_read(key, None)
    }

    /// Start reading the value of `key` into `buf`, whose capacity must be at least the value's
    /// length rounded up to 4 KiB ([`StorageError::BufferTooSmall`] otherwise). The buffer's
    /// length becomes the value's length.
    pub fn submit_get_into(&self, key: SpillKey, buf: SpillBuf) -> Result<Ticket<SpillBuf>, StorageError> {
        self.submit_read(key, Some(buf))
    }

    /// Write `data` as the value of `key` and wait for it (one copy into an aligned buffer).
    pub fn put(&self, key: SpillKey, data: &[u8]) -> Result<(), StorageError> {
        let mut b = self.alloc_buf(data.len())?;
        b.copy_from_slice(data);
        self.submit_put(key, b)?.wait().map(drop)
    }

    /// Read the value of `key` and wait for it.
    pub fn get(&self, key: SpillKey) -> Result<Vec<u8>, StorageError> {
        Ok(self.submit_get(key)?.wait()?.to_vec())
    }

    /// Free the value of `key`. Its blocks are reused once transfers still touching them finish.
    pub fn remove(&self, key: SpillKey) -> Result<(), StorageError> {
        let mut idx = self.shared.lock();
        let Some(e) = idx.keys.remove(&key) else {
            return Err(StorageError::SpillKeyNotFound { path: self.shared.path.clone(), key });
        };
        idx.release(e.alloc_id);
        Ok(())
    }

    /// Whether `key` has a value (possibly still being written).
    pub fn contains(&self, key: SpillKey) -> bool {
        self.shared.lock().keys.contains_key(&key)
    }

    /// Length of the value of `key`.
    pub fn value_len(&self, key: SpillKey) -> Option<usize> {
        self.shared.lock().keys.get(&key).map(|e| e.len)
    }

    /// Space and traffic counters.
    pub fn stats(&self) -> SpillStats {
        let idx = self.shared.lock();
        SpillStats {
            capacity: idx.space.capacity(),
            used: idx.space.capacity() - idx.space.free_bytes(),
            keys: idx.keys.len(),
            bytes_written: self.shared.bytes_written.load(Ordering::Relaxed),
            bytes_read: self.shared.bytes_read.load(Ordering::Relaxed),
        }
    }
}

fn pread_engine(file: &Arc<File>, cfg: &SpillConfig, path: &Path) -> Result<PreadEngine, StorageError> {
    PreadEngine::new(Arc::clone(file), cfg.queue_depth.min(64))
        .map_err(|e| StorageError::io(path, "start pread/pwrite threads", e))
}

impl Drop for SpillStore {
    fn drop(&mut self) {
        // Closing the channel tells the I/O thread to finish what it holds and exit; joining
        // makes sure no transfer outlives the store.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;
    use crate::testutil::Rng;

    fn cfg(dir: &Path, capacity: u64, engine: EngineChoice) -> SpillConfig {
        SpillConfig {
            // Small requests so that values span many requests and the queue really fills.
            request_size: 256 << 10,
            queue_depth: 4,
            pool_bytes: 8 << 20,
            engine,
            ..SpillConfig::new(dir, capacity)
        }
    }

    /// Sizes that stress alignment: empty, sub-block, block edges, multi-request, random.
    fn sizes(rng: &mut Rng, n: usize) -> Vec<usize> {
        let mut v = vec![0, 1, 7, 4095, 4096, 4097, (256 << 10) - 1, (256 << 10) + 1, (3 << 20) + 5];
        while v.len() < n {
            v.push(rng.below(3 << 20) as usize + 1);
        }
        v
    }

    /// Puts (async, several in flight), gets (some submitted before their put finished), removals
    /// and re-puts into freed space; every byte checked.
    fn exercise(store: &SpillStore, seed: u64) {
        let mut rng = Rng::new(seed);
        let sizes = sizes(&mut rng, 24);
        let values: Vec<Vec<u8>> = sizes.iter().map(|&n| rng.bytes(n)).collect();

        // Round 1: all puts in flight together; alternate pooled and fresh buffers.
        let mut tickets = Vec::new();
        for (k, v) in values.iter().enumerate() {
            let mut b = if k % 2 == 0 { store.alloc_buf(v.len()).unwrap() } else { SpillBuf::zeroed(v.len()).unwrap() };
            b.copy_from_slice(v);
            tickets.push(store.submit_put(k as u64, b).unwrap());
        }
        // Gets submitted before the puts are waited on must still see the new data.
        let early: Vec<_> = (0..values.len()).step_by(3).map(|k| (k, store.submit_get(k as u64).unwrap())).collect();
        for (k, t) in tickets.into_iter().enumerate() {
            let b = t.wait().unwrap();
            assert_eq!(b.len(), values[k].len());
        }
        for (k, t) in early {
            assert!(t.wait().unwrap()[..] == values[k][..], "early get of key {k} ({} bytes)", values[k].len());
        }
        for (k, v) in values.iter().enumerate() {
            assert!(store.get(k as u64).unwrap() == *v, "key {k} ({} bytes)", v.len());
            assert_eq!(store.value_len(k as u64), Some(v.len()));
        }

        // Round 2: free every other key, write new values into the freed space.
        let mut values = values;
        for k in (0..values.len()).step_by(2) {
            store.remove(k as u64).unwrap();
            assert!(!store.contains(k as u64));
        }
        for k in (0..values.len()).step_by(2) {
            let n = rng.below(2 << 20) as usize + 1;
            values[k] = rng.bytes(n);
            store.put(k as u64, &values[k]).unwrap();
        }
        // Read everything back concurrently into reused buffers.
        let tickets: Vec<_> = values
            .iter()
            .enumerate()
            .map(|(k, v)| store.submit_get_into(k as u64, SpillBuf::zeroed(v.len().max(1)).unwrap()).unwrap())
            .collect();
        for (k, t) in tickets.into_iter().enumerate() {
            assert!(t.wait().unwrap()[..] == values[k][..], "round 2 key {k}");
        }
        let st = store.stats();
        assert_eq!(st.keys, values.len());
        let expected_used: u64 = values.iter().map(|v| round_up(v.len(), BLOCK) as u64).sum();
        assert_eq!(st.used, expected_used);
        assert!(st.bytes_written >= expected_used);
    }

    #[test]
    fn round_trip_random_sizes_on_every_engine() {
        for (i, engine) in [EngineChoice::IoUring, EngineChoice::Pread, EngineChoice::Mmap].into_iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let store = SpillStore::open(cfg(dir.path(), 128 << 20, engine)).unwrap();
            let r = store.report().clone();
            eprintln!(
                "{engine:?}: {:?} direct={} registered={} fallbacks={:?}",
                r.engine, r.direct_io, r.registered_buffers, r.fallbacks
            );
            match engine {
                EngineChoice::Pread => assert_eq!(r.engine, EngineKind::Pread),
                EngineChoice::Mmap => assert_eq!(r.engine, EngineKind::Mmap),
                // io_uring, unless this machine refuses it (then the refusal must be reported).
                _ => assert!(
                    r.engine == EngineKind::IoUring
                        || r.fallbacks
                            .iter()
                            .any(|f| matches!(f, Fallback::UringRefused { .. } | Fallback::UringProbeFailed { .. }))
                ),
            }
            exercise(&store, 0xC0FFEE + i as u64);
            drop(store);
            // The spill file was unlinked at open: nothing is left in the directory.
            assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        }
    }

    #[test]
    fn pread_fallback_is_chosen_when_io_uring_setup_is_refused() {
        for errno in [libc::EPERM, libc::ENOSYS] {
            let dir = tempfile::tempdir().unwrap();
            let hooks =
                Hooks { uring: UringHooks { setup_errno: Some(errno), ..Default::default() }, ..Default::default() };
            let store = SpillStore::open_with(cfg(dir.path(), 64 << 20, EngineChoice::Auto), hooks).unwrap();
            assert_eq!(store.report().engine, EngineKind::Pread);
            assert!(store.report().fallbacks.contains(&Fallback::UringRefused { errno }));
            assert!(store.report().fallbacks.iter().any(|f| f.to_string().contains("pread/pwrite")));
            exercise(&store, errno as u64);
        }
    }

    #[test]
    fn failed_buffer_registration_keeps_io_uring_with_plain_buffers() {
        let dir = tempfile::tempdir().unwrap();
        let hooks = Hooks {
            uring: UringHooks { register_errno: Some(libc::ENOMEM), ..Default::default() },
            ..Default::default()
        };
        let store = SpillStore::open_with(cfg(dir.path(), 64 << 20, EngineChoice::IoUring), hooks).unwrap();
        let r = store.report();
        assert!(!r.registered_buffers);
        if r.engine == EngineKind::IoUring {
            assert!(r.fallbacks.contains(&Fallback::RegisterFailed { errno: libc::ENOMEM }));
        } else {
            eprintln!("io_uring unavailable here ({:?}); checked the pread fallback instead", r.fallbacks);
        }
        exercise(&store, 11);
    }

    #[test]
    fn refused_o_direct_falls_back_to_buffered_io_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let hooks = Hooks { direct_errno: Some(libc::EINVAL), ..Default::default() };
        let store = SpillStore::open_with(cfg(dir.path(), 64 << 20, EngineChoice::IoUring), hooks).unwrap();
        assert!(!store.report().direct_io);
        assert!(store.report().fallbacks.contains(&Fallback::DirectRefused { errno: libc::EINVAL }));
        exercise(&store, 12);
    }

    #[test]
    fn capacity_is_enforced_and_freed_space_is_reused() {
        let dir = tempfile::tempdir().unwrap();
        let store = SpillStore::open(cfg(dir.path(), 1 << 20, EngineChoice::Auto)).unwrap();
        store.put(1, &vec![1u8; 600 << 10]).unwrap();
        match store.put(2, &vec![2u8; 600 << 10]) {
            Err(StorageError::SpillFull { path, requested, free, capacity }) => {
                assert_eq!(path, store.report().path);
                assert_eq!(requested, 600 << 10);
                assert_eq!(free, (1 << 20) - (600 << 10));
                assert_eq!(capacity, 1 << 20);
            }
            other => panic!("expected SpillFull, got {other:?}"),
        }
        assert!(!store.contains(2));
        // A bounded store serves unbounded traffic as long as values are freed.
        let mut rng = Rng::new(5);
        for i in 0..200u64 {
            let n = rng.below(400 << 10) as usize + 1;
            let v = rng.bytes(n);
            store.put(100 + i, &v).unwrap();
            assert_eq!(store.get(100 + i).unwrap(), v);
            store.remove(100 + i).unwrap();
            assert!(store.stats().used <= 1 << 20);
        }
        assert_eq!(store.get(1).unwrap(), vec![1u8; 600 << 10]);
        assert_eq!(store.stats().used, 600 << 10);
        assert!(store.stats().bytes_written > 10 * (1 << 20), "traffic far beyond capacity");
    }

    #[test]
    fn get_submitted_right_after_an_overwrite_sees_the_newest_value() {
        let dir = tempfile::tempdir().unwrap();
        let store = SpillStore::open(cfg(dir.path(), 32 << 20, EngineChoice::Auto)).unwrap();
        let mut pending = Vec::new();
        for round in 0..20u8 {
            let b = SpillBuf::from_slice(&vec![round; (1 << 20) + 3]).unwrap();
            pending.push(store.submit_put(9, b).unwrap());
            let got = store.submit_get(9).unwrap().wait().unwrap();
            assert!(got.iter().all(|&x| x == round), "round {round}");
        }
        for t in pending {
            t.wait().unwrap();
        }
        // Overwrites released the old extents.
        assert_eq!(store.stats().used, round_up((1 << 20) + 3, BLOCK) as u64);
    }

    #[test]
    fn a_failed_write_is_reported_and_the_key_and_its_space_are_released() {
        let dir = tempfile::tempdir().unwrap();
        // Writes beyond the first MiB of the file fail with EIO; failures surface when the gate opens.
        let gate = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let hooks = Hooks { fail_writes_from: Some((1 << 20, Arc::clone(&gate))), ..Default::default() };
        let store = SpillStore::open_with(cfg(dir.path(), 8 << 20, EngineChoice::Auto), hooks).unwrap();
        store.put(1, &[1u8; 512 << 10]).unwrap();
        gate.store(false, Ordering::Release);
        let t = store.submit_put(2, SpillBuf::from_slice(&[2u8; 3 << 20]).unwrap()).unwrap();
        let early_get = store.submit_get(2).unwrap(); // queued before the failure is known
        assert!(!t.is_done());
        gate.store(true, Ordering::Release);
        let err = t.wait().unwrap_err();
        assert!(
            matches!(&err, StorageError::Io { path, op: "spill write", source }
            if *path == store.report().path && source.raw_os_error() == Some(libc::EIO)),
            "{err:?}"
        );
        assert!(matches!(early_get.wait(), Err(StorageError::SpillWriteFailed { key: 2, .. })));
        assert!(!store.contains(2));
        assert!(matches!(store.get(2), Err(StorageError::SpillKeyNotFound { key: 2, .. })));
        assert_eq!(store.stats().used, 512 << 10, "the failed value's blocks were freed");
        assert_eq!(store.get(1).unwrap(), vec![1u8; 512 << 10], "other keys are unharmed");
        store.put(3, &[3u8; 100]).unwrap();
        assert_eq!(store.get(3).unwrap(), vec![3u8; 100]);
    }

    #[test]
    fn threads_can_share_a_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = SpillStore::open(cfg(dir.path(), 64 << 20, EngineChoice::Auto)).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let store = &store;
                s.spawn(move || {
                    let mut rng = Rng::new(t + 1);
                    for i in 0..20 {
                        let key = t * 1000 + i;
                        let n = rng.below(1 << 20) as usize;
                        let v = rng.bytes(n);
                        store.put(key, &v).unwrap();
                        assert_eq!(store.get(key).unwrap(), v);
                        store.remove(key).unwrap();
                    }
                });
            }
        });
        assert_eq!(store.stats().used, 0);
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-such-dir");
        let err = SpillStore::open(cfg(&missing, 1 << 20, EngineChoice::Auto)).unwrap_err();
        assert!(matches!(&err, StorageError::Io { path, .. } if *path == missing), "{err:?}");
        assert!(err.to_string().contains("no-such-dir"));

        let store = SpillStore::open(cfg(dir.path(), 1 << 20, EngineChoice::Auto)).unwrap();
        assert!(matches!(store.get(77), Err(StorageError::SpillKeyNotFound { key: 77, .. })));
        assert!(matches!(store.remove(77), Err(StorageError::SpillKeyNotFound { key: 77, .. })));
        store.put(1, &[5u8; 5000]).unwrap();
        let small = SpillBuf::zeroed(4096).unwrap();
        assert!(matches!(
            store.submit_get_into(1, small),
            Err(StorageError::BufferTooSmall { key: 1, needed: 8192, capacity: 4096 })
        ));
        let bad = SpillConfig { request_size: 1000, ..SpillConfig::new(dir.path(), 1 << 20) };
        assert!(matches!(SpillStore::open(bad), Err(StorageError::InvalidConfig { field: "request_size", .. })));
    }

    #[test]
    fn preallocation_larger_than_the_disk_is_a_clean_no_space_error() {
        let dir = tempfile::tempdir().unwrap();
        // 1 EiB: no file system here has that much room (ext4/xfs answer ENOSPC or EFBIG).
        let err = SpillStore::open(cfg(dir.path(), 1 << 60, EngineChoice::Pread)).unwrap_err();
        assert!(err.is_no_space(), "{err:?}");
        assert!(err.to_string().contains("lt-spill-"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
