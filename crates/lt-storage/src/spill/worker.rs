//! The I/O thread: owns the engine, turns jobs (whole values) into requests of at most
//! `request_size` bytes, keeps the engine's queue full, retries short transfers and answers each
//! job's ticket.
//!
//! Ordering: jobs start in submission order. A `get` submitted while the `put` of the same key is
//! still running waits for that put (it would otherwise read stale blocks); nothing else is
//! serialised. Freed extents are only reused once no request touches them (reference counts in
//! the index), so a new put can never overwrite blocks an older get is still reading.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam::channel::{Receiver, Sender, TryRecvError};

use crate::error::StorageError;
use crate::spill::Shared;
use crate::spill::alloc::Extent;
use crate::spill::buf::SpillBuf;
use crate::spill::engine::{Engine, IoDone, IoReq, Op};

/// A whole-value transfer sent from the store to the I/O thread.
pub(crate) struct Job {
    pub id: u64,
    pub key: u64,
    pub op: Op,
    pub buf: SpillBuf,
    /// File extents holding the value, in value order; they cover `len` rounded up to a block.
    pub extents: Arc<[Extent]>,
    pub alloc_id: u64,
    /// For a get: the put of the same key that must finish first.
    pub after: Option<u64>,
    pub reply: Sender<Result<SpillBuf, StorageError>>,
}

#[derive(Debug, Clone, Copy)]
struct Chunk {
    file_off: u64,
    buf_off: usize,
    len: usize,
}

struct Active {
    job: Job,
    chunks: VecDeque<Chunk>,
    outstanding: usize,
    error: Option<StorageError>,
}

pub(crate) struct Worker {
    engine: Box<dyn Engine>,
    shared: Arc<Shared>,
    request_size: usize,
    active: HashMap<u64, Active>,
    order: VecDeque<u64>,
    requests: HashMap<u64, (u64, Chunk)>,
    next_req: u64,
    /// Puts that failed. A get of the same key may have been queued (under the index lock) just
    /// before the failure reached the index; it must fail too, not read the unwritten blocks.
    /// Only I/O errors add entries, so the set stays tiny.
    failed_puts: HashSet<u64>,
}

impl Worker {
    pub(crate) fn new(engine: Box<dyn Engine>, shared: Arc<Shared>, request_size: usize) -> Self {
        Self {
            engine,
            shared,
            request_size,
            active: HashMap::new(),
            order: VecDeque::new(),
            requests: HashMap::new(),
            next_req: 0,
            failed_puts: HashSet::new(),
        }
    }

    /// Serve jobs until the store is dropped and every accepted job has finished.
    pub(crate) fn run(mut self, rx: Receiver<Job>) {
        let mut open = true;
        let mut done = Vec::new();
        loop {
            while open {
                match rx.try_recv() {
                    Ok(job) => self.accept(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            self.fill();
            if self.engine.in_flight() == 0 {
                if !open && self.active.is_empty() {
                    return;
                }
                if !open {
                    // Jobs left with nothing in flight cannot make progress (only possible if the
                    // engine refused every submission); fail them rather than spin.
                    self.fail_all_idle();
                    continue;
                }
                match rx.recv() {
                    Ok(job) => self.accept(job),
                    Err(_) => open = false,
                }
                continue;
            }
            match self.engine.complete(true, &mut done) {
                Ok(()) => {
                    for d in done.drain(..) {
                        self.on_done(d);
                    }
                }
                Err(_) => {
                    // The ring itself failed: requests may still be in the kernel's hands, so the
                    // buffers they point into must never be freed. Leak every job (its ticket
                    // reports the store closed) and stop.
                    for (_, a) in self.active.drain() {
                        std::mem::forget(a.job.buf);
                    }
                    return;
                }
            }
        }
    }

    fn accept(&mut self, job: Job) {
        let mut chunks = VecDeque::new();
        let mut buf_off = 0usize;
        for e in job.extents.iter() {
            let mut off = 0u64;
            while off < e.len {
                let len = (e.len - off).min(self.request_size as u64) as usize;
                chunks.push_back(Chunk { file_off: e.start + off, buf_off, len });
                off += len as u64;
                buf_off += len;
            }
        }
        let id = job.id;
        let mut error = None;
        if job.after.is_some_and(|dep| self.failed_puts.contains(&dep)) {
            chunks.clear();
            error = Some(StorageError::SpillWriteFailed { path: self.shared.path.clone(), key: job.key });
        }
        self.active.insert(id, Active { job, chunks, outstanding: 0, error });
        self.order.push_back(id);
    }

    /// Submit requests from runnable jobs until the engine is full; finish jobs with nothing left.
    fn fill(&mut self) {
        let ids: Vec<u64> = self.order.iter().copied().collect();
        let mut finished = Vec::new();
        for id in ids {
            let blocked = match self.active.get(&id).and_then(|a| a.job.after) {
                Some(dep) => self.active.contains_key(&dep),
                None => false,
            };
            if blocked {
                continue;
            }
            let Some(a) = self.active.get_mut(&id) else { continue };
            while self.engine.in_flight() < self.engine.max_in_flight() {
                let Some(c) = a.chunks.pop_front() else { break };
                let req_id = self.next_req;
                self.next_req += 1;
                let fixed = a.job.buf.pool_slot().map(|(p, slab)| (Arc::as_ptr(p) as usize, slab));
                // `wrapping_add` stays in bounds: chunks cover at most the buffer's capacity
                // (checked when the job was submitted).
                let ptr = a.job.buf.io_ptr().wrapping_add(c.buf_off);
                let req = IoReq { id: req_id, op: a.job.op, offset: c.file_off, ptr, len: c.len, fixed };
                // SAFETY: `ptr..ptr+len` lies inside the job's buffer (chunks cover at most its
                // capacity). The job, and with it the buffer, stays in `self.active`, untouched,
                // until this request's completion has been processed in `on_done`.
                match unsafe { self.engine.submit(req) } {
                    Ok(()) => {
                        a.outstanding += 1;
                        self.requests.insert(req_id, (id, c));
                    }
                    Err(e) => {
                        a.error.get_or_insert_with(|| io_error(&self.shared, a.job.op, e));
                        a.chunks.clear();
                    }
                }
            }
            if a.chunks.is_empty() && a.outstanding == 0 {
                finished.push(id);
            }
            if self.engine.in_flight() >= self.engine.max_in_flight() {
                break;
            }
        }
        for id in finished {
            self.finish(id);
        }
    }

    fn on_done(&mut self, d: IoDone) {
        let Some((job_id, c)) = self.requests.remove(&d.id) else { return };
        let Some(a) = self.active.get_mut(&job_id) else { return };
        a.outstanding -= 1;
        match d.result {
            Ok(n) if n == c.len => {
                let counter = match a.job.op {
                    Op::Write => &self.shared.bytes_written,
                    Op::Read => &self.shared.bytes_read,
                };
                counter.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok(0) => {
                let e = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "transfer made no progress");
                a.error.get_or_insert_with(|| io_error(&self.shared, a.job.op, e));
                a.chunks.clear();
            }
            Ok(n) => {
                // Short transfer: queue the rest first so it keeps its place.
                let n = n.min(c.len);
                a.chunks.push_front(Chunk { file_off: c.file_off + n as u64, buf_off: c.buf_off + n, len: c.len - n });
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) => a.chunks.push_front(c),
            Err(e) => {
                a.error.get_or_insert_with(|| io_error(&self.shared, a.job.op, e));
                a.chunks.clear();
            }
        }
        if a.chunks.is_empty() && a.outstanding == 0 {
            self.finish(job_id);
        }
    }

    fn finish(&mut self, id: u64) {
        let Some(a) = self.active.remove(&id) else { return };
        self.order.retain(|&x| x != id);
        let failed = a.error.is_some();
        {
            let mut idx = self.shared.lock();
            if a.job.op == Op::Write {
                let is_current = idx.keys.get(&a.job.key).is_some_and(|e| e.pending_put == Some(id));
                if is_current {
                    if failed {
                        if let Some(e) = idx.keys.remove(&a.job.key) {
                            idx.release(e.alloc_id);
                        }
                    } else if let Some(e) = idx.keys.get_mut(&a.job.key) {
                        e.pending_put = None;
                    }
                }
            }
            idx.release(a.job.alloc_id);
        }
        if failed && a.job.op == Op::Write {
            self.failed_puts.insert(id);
            // Gets waiting on this put would read garbage: fail them.
            for w in self.active.values_mut() {
                if w.job.after == Some(id) {
                    w.chunks.clear();
                    w.error.get_or_insert_with(|| StorageError::SpillWriteFailed {
                        path: self.shared.path.clone(),
                        key: w.job.key,
                    });
                }
            }
        }
        let result = match a.error {
            Some(e) => Err(e),
            None => Ok(a.job.buf),
        };
        // The ticket may have been dropped; that is fine.
        let _ = a.job.reply.send(result);
    }

    fn fail_all_idle(&mut self) {
        let ids: Vec<u64> = self.order.iter().copied().collect();
        for id in ids {
            if let Some(a) = self.active.get_mut(&id) {
                a.chunks.clear();
                a.error.get_or_insert_with(|| StorageError::SpillClosed { path: self.shared.path.clone() });
                if a.outstanding == 0 {
                    self.finish(id);
                }
            }
        }
    }
}

fn io_error(shared: &Shared, op: Op, e: std::io::Error) -> StorageError {
    match op {
        Op::Write => StorageError::io_write(&shared.path, "spill write", e),
        Op::Read => StorageError::io(&shared.path, "spill read", e),
    }
}
