//! The I/O engine trait and its two portable implementations: a pread/pwrite thread pool and a
//! memory map. The io_uring engine lives in `uring.rs`.
//!
//! An engine moves bytes between host memory and the spill file, one request at a time, with up
//! to `max_in_flight` requests outstanding. It knows nothing about keys or extents; the I/O
//! thread (`worker.rs`) cuts jobs into requests and handles short transfers.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender, unbounded};
use memmap2::MmapRaw;

use crate::spill::EngineKind;

/// Direction of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    Write,
}

/// One transfer between `[ptr, ptr + len)` and the spill file at `offset`.
#[derive(Debug)]
pub(crate) struct IoReq {
    pub id: u64,
    pub op: Op,
    pub offset: u64,
    pub ptr: *mut u8,
    pub len: usize,
    /// `(pool identity, slab)` when the memory lies in a registered pool slab.
    pub fixed: Option<(usize, usize)>,
}

// SAFETY: the pointer names memory owned by a job that the I/O thread keeps alive, untouched,
// until the request's completion comes back (the contract of `Engine::submit`).
unsafe impl Send for IoReq {}

/// The outcome of a request: bytes transferred (possibly short) or the OS error.
#[derive(Debug)]
pub(crate) struct IoDone {
    pub id: u64,
    pub result: io::Result<usize>,
}

/// A spill I/O engine.
pub(crate) trait Engine: Send {
    fn kind(&self) -> EngineKind;
    /// Most requests outstanding at once.
    fn max_in_flight(&self) -> usize;
    /// Requests submitted whose completion has not yet been returned.
    fn in_flight(&self) -> usize;
    /// Queue one request (the caller keeps `in_flight() < max_in_flight()`).
    ///
    /// # Safety
    /// `[req.ptr, req.ptr + req.len)` must be valid for the transfer (readable for a write,
    /// writable for a read) and must not be accessed by anyone else until `complete` returns the
    /// request's `IoDone`.
    unsafe fn submit(&mut self, req: IoReq) -> io::Result<()>;
    /// Start queued requests and move finished ones into `out`. With `block`, wait until at
    /// least one completion is available (if any request is outstanding).
    fn complete(&mut self, block: bool, out: &mut Vec<IoDone>) -> io::Result<()>;
}

/// Run one request synchronously with `pread`/`pwrite`.
///
/// # Safety
/// As for [`Engine::submit`].
unsafe fn transfer_at(file: &File, req: &IoReq) -> io::Result<usize> {
    loop {
        let r = match req.op {
            Op::Read => {
                // SAFETY: the caller guarantees the range is valid, writable and exclusively ours.
                let buf = unsafe { std::slice::from_raw_parts_mut(req.ptr, req.len) };
                file.read_at(buf, req.offset)
            }
            Op::Write => {
                // SAFETY: the caller guarantees the range is valid and not written concurrently.
                let buf = unsafe { std::slice::from_raw_parts(req.ptr.cast_const(), req.len) };
                file.write_at(buf, req.offset)
            }
        };
        match r {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// pread/pwrite on a pool of threads: the portable fallback when io_uring is refused.
pub(crate) struct PreadEngine {
    tx: Option<Sender<IoReq>>,
    done_rx: Receiver<IoDone>,
    workers: Vec<JoinHandle<()>>,
    in_flight: usize,
    max: usize,
}

impl PreadEngine {
    pub(crate) fn new(file: Arc<File>, threads: usize) -> io::Result<Self> {
        let (tx, rx) = unbounded::<IoReq>();
        let (done_tx, done_rx) = unbounded();
        let mut workers = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let done_tx = done_tx.clone();
            let file = Arc::clone(&file);
            let h = std::thread::Builder::new().name(format!("lt-spill-pio{i}")).spawn(move || {
                for req in rx {
                    // SAFETY: `submit`'s caller upheld the buffer contract for this request.
                    let result = unsafe { transfer_at(&file, &req) };
                    if done_tx.send(IoDone { id: req.id, result }).is_err() {
                        break;
                    }
                }
            })?;
            workers.push(h);
        }
        Ok(Self { tx: Some(tx), done_rx, workers, in_flight: 0, max: threads.max(1) })
    }
}

impl Engine for PreadEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Pread
    }
    fn max_in_flight(&self) -> usize {
        self.max
    }
    fn in_flight(&self) -> usize {
        self.in_flight
    }
    unsafe fn submit(&mut self, req: IoReq) -> io::Result<()> {
        let tx = self.tx.as_ref().ok_or_else(|| io::Error::from(io::ErrorKind::BrokenPipe))?;
        tx.send(req).map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
        self.in_flight += 1;
        Ok(())
    }
    fn complete(&mut self, block: bool, out: &mut Vec<IoDone>) -> io::Result<()> {
        if block && self.in_flight > 0 {
            let d = self.done_rx.recv().map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
            self.in_flight -= 1;
            out.push(d);
        }
        while let Ok(d) = self.done_rx.try_recv() {
            self.in_flight -= 1;
            out.push(d);
        }
        Ok(())
    }
}

impl Drop for PreadEngine {
    fn drop(&mut self) {
        // Closing the request channel ends the workers once they finish what they hold, so no
        // thread touches a job's buffer after this returns.
        self.tx = None;
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

/// A shared memory map of the spill file: the tier for tmpfs or page cache. Transfers are
/// `memcpy`s done synchronously on the I/O thread.
pub(crate) struct MmapEngine {
    map: MmapRaw,
    done: VecDeque<IoDone>,
    _file: Arc<File>,
}

impl MmapEngine {
    /// Map the first `len` bytes of `file`, which must be allocated (fallocate) so that a store
    /// into the map can never hit a hole on a full file system (SIGBUS).
    ///
    /// With `prefault` (tmpfs: the pages already exist and are never written back) the page
    /// tables are filled now, so transfers run at `memcpy` speed instead of taking one fault per
    /// 4 KiB page. Not done on disk file systems, where it would dirty the whole file.
    pub(crate) fn new(file: Arc<File>, len: u64, prefault: bool) -> io::Result<Self> {
        let map = memmap2::MmapOptions::new().len(len as usize).map_raw(&*file)?;
        if prefault && map.len() > 0 {
            // SAFETY: advice on exactly the range just mapped. MADV_POPULATE_WRITE faults pages
            // in as if written, without changing their contents; kernels before 5.14 answer
            // EINVAL, which only costs the speed-up.
            unsafe {
                libc::madvise(map.as_mut_ptr().cast(), map.len(), libc::MADV_POPULATE_WRITE);
            }
        }
        Ok(Self { map, done: VecDeque::new(), _file: file })
    }
}

impl Engine for MmapEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Mmap
    }
    fn max_in_flight(&self) -> usize {
        usize::MAX
    }
    fn in_flight(&self) -> usize {
        self.done.len()
    }
    unsafe fn submit(&mut self, req: IoReq) -> io::Result<()> {
        let in_bounds = (req.offset as usize).checked_add(req.len).is_some_and(|end| end <= self.map.len());
        let result = if in_bounds {
            // SAFETY: `offset + len` is inside the map (checked above), the map is this store's
            // private, fully allocated file (see `new`), and the caller guarantees the request
            // range is valid and exclusively ours; the two ranges cannot overlap (one is file
            // memory, the other a job buffer).
            unsafe {
                let file_mem = self.map.as_mut_ptr().add(req.offset as usize);
                match req.op {
                    Op::Write => std::ptr::copy_nonoverlapping(req.ptr.cast_const(), file_mem, req.len),
                    Op::Read => std::ptr::copy_nonoverlapping(file_mem.cast_const(), req.ptr, req.len),
                }
            }
            Ok(req.len)
        } else {
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        };
        self.done.push_back(IoDone { id: req.id, result });
        Ok(())
    }
    fn complete(&mut self, _block: bool, out: &mut Vec<IoDone>) -> io::Result<()> {
        out.extend(self.done.drain(..));
        Ok(())
    }
}

/// Test-only: an engine that fails every write touching file offsets at or beyond `from` with
/// EIO, and passes everything else to the wrapped engine.
#[cfg(test)]
pub(crate) struct FailingWrites {
    pub inner: Box<dyn Engine>,
    pub from: u64,
    pub failed: VecDeque<IoDone>,
    /// While false, failed completions are held back (lets a test queue more work first).
    pub gate: Arc<std::sync::atomic::AtomicBool>,
}

#[cfg(test)]
impl Engine for FailingWrites {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }
    fn max_in_flight(&self) -> usize {
        self.inner.max_in_flight()
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.failed.len()
    }
    unsafe fn submit(&mut self, req: IoReq) -> io::Result<()> {
        if req.op == Op::Write && req.offset + req.len as u64 > self.from {
            self.failed.push_back(IoDone { id: req.id, result: Err(io::Error::from_raw_os_error(libc::EIO)) });
            return Ok(());
        }
        // SAFETY: forwarded unchanged; our caller upholds the contract.
        unsafe { self.inner.submit(req) }
    }
    fn complete(&mut self, block: bool, out: &mut Vec<IoDone>) -> io::Result<()> {
        if !self.gate.load(std::sync::atomic::Ordering::Acquire) {
            std::thread::sleep(std::time::Duration::from_millis(1));
            return self.inner.complete(false, out);
        }
        let had_failed = !self.failed.is_empty();
        out.extend(self.failed.drain(..));
        self.inner.complete(block && !had_failed, out)
    }
}
