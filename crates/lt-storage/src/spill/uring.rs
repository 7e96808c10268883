//! The io_uring engine: one ring owned by the I/O thread, `O_DIRECT` reads and writes, fixed
//! (registered) buffers for memory from the store's pool.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use io_uring::{IoUring, opcode, types};

use crate::spill::EngineKind;
use crate::spill::buf::BufPool;
use crate::spill::engine::{Engine, IoDone, IoReq, Op};

/// Test-only failure injection for engine setup (the ring and buffer registration).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct UringHooks {
    /// Pretend `io_uring_setup` failed with this errno.
    pub setup_errno: Option<i32>,
    /// Pretend `IORING_REGISTER_BUFFERS` failed with this errno.
    pub register_errno: Option<i32>,
}

pub(crate) struct UringEngine {
    ring: IoUring,
    /// Keeps the fd open for as long as requests may name it.
    file: Arc<File>,
    in_flight: usize,
    max: usize,
    /// The pool registered as fixed buffers (its identity and a reference that keeps the memory
    /// alive for as long as the ring).
    registered: Option<Arc<BufPool>>,
}

impl UringEngine {
    /// Set up a ring for `queue_depth` requests. Registration failure is not an error: it comes
    /// back as `Some(errno)` and the engine uses plain reads and writes.
    pub(crate) fn new(
        file: Arc<File>,
        queue_depth: usize,
        pool: Option<&Arc<BufPool>>,
        hooks: UringHooks,
    ) -> io::Result<(Self, Option<i32>)> {
        if let Some(errno) = hooks.setup_errno {
            return Err(io::Error::from_raw_os_error(errno));
        }
        let entries = queue_depth.clamp(1, 4096).next_power_of_two() as u32;
        // COOP_TASKRUN: completion work runs when the I/O thread enters the ring rather than by
        // interrupting it (5.19+; older kernels refuse the flag with EINVAL and get a plain ring).
        // Not SINGLE_ISSUER: the ring is built here and driven from the I/O thread.
        let ring = match IoUring::builder().setup_coop_taskrun().build(entries) {
            Ok(r) => r,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::new(entries)?,
            Err(e) => return Err(e),
        };
        let mut engine = Self { ring, file, in_flight: 0, max: queue_depth.clamp(1, 4096), registered: None };
        let mut register_err = None;
        if let Some(pool) = pool {
            let iovecs: Vec<libc::iovec> =
                pool.slabs().map(|(base, len)| libc::iovec { iov_base: base.cast(), iov_len: len }).collect();
            let r = match hooks.register_errno {
                Some(errno) => Err(io::Error::from_raw_os_error(errno)),
                // SAFETY: every iovec lies in the pool's mapping, which `engine.registered` keeps
                // alive until the ring is dropped (field order: `ring` drops first).
                None => unsafe { engine.ring.submitter().register_buffers(&iovecs) },
            };
            match r {
                Ok(()) => engine.registered = Some(Arc::clone(pool)),
                Err(e) => register_err = Some(e.raw_os_error().unwrap_or(libc::EIO)),
            }
        }
        Ok((engine, register_err))
    }

    pub(crate) fn registered(&self) -> bool {
        self.registered.is_some()
    }

    fn fixed_index(&self, req: &IoReq) -> Option<u16> {
        let pool = self.registered.as_ref()?;
        let (pool_id, slab) = req.fixed?;
        (Arc::as_ptr(pool) as usize == pool_id).then_some(u16::try_from(slab).ok()).flatten()
    }
}

impl Engine for UringEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::IoUring
    }
    fn max_in_flight(&self) -> usize {
        self.max
    }
    fn in_flight(&self) -> usize {
        self.in_flight
    }

    unsafe fn submit(&mut self, req: IoReq) -> io::Result<()> {
        let fd = types::Fd(self.file.as_raw_fd());
        let len = u32::try_from(req.len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let entry = match (req.op, self.fixed_index(&req)) {
            (Op::Write, Some(idx)) => {
                opcode::WriteFixed::new(fd, req.ptr.cast_const(), len, idx).offset(req.offset).build()
            }
            (Op::Read, Some(idx)) => opcode::ReadFixed::new(fd, req.ptr, len, idx).offset(req.offset).build(),
            (Op::Write, None) => opcode::Write::new(fd, req.ptr.cast_const(), len).offset(req.offset).build(),
            (Op::Read, None) => opcode::Read::new(fd, req.ptr, len).offset(req.offset).build(),
        }
        .user_data(req.id);
        loop {
            // SAFETY: the caller of `submit` guarantees the buffer outlives the request, and the
            // fd stays open while `self.file` lives (the ring is dropped first).
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                break;
            }
            // Submission queue full: hand what is queued to the kernel and retry.
            match self.ring.submit() {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => return Err(e),
            }
        }
        self.in_flight += 1;
        Ok(())
    }

    fn complete(&mut self, block: bool, out: &mut Vec<IoDone>) -> io::Result<()> {
        let want = usize::from(block && self.in_flight > 0);
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // EBUSY: the completion queue must be drained before more can be submitted.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => break,
                Err(e) => return Err(e),
            }
        }
        for cqe in self.ring.completion() {
            let res = cqe.result();
            let result = if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) };
            self.in_flight -= 1;
            out.push(IoDone { id: cqe.user_data(), result });
        }
        Ok(())
    }
}
