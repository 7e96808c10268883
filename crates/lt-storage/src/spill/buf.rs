//! Aligned host buffers for direct I/O.
//!
//! `O_DIRECT` needs the memory address, the file offset and the length aligned to the device's
//! logical block (we use 4 KiB). Buffers of 2 MiB or more are 2 MiB-aligned and advised
//! `MADV_HUGEPAGE`, which the disk measurements in `shared/REFERENCE.md` §5 tie to the ~4 GB/s
//! figure: fewer pages to pin per 4 MiB request.
//!
//! A [`SpillBuf`] owns its memory: either its own anonymous mapping, or a lease on a region of a
//! [`BufPool`] that the io_uring engine registered with the kernel (fixed buffers).

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::StorageError;
use crate::spill::alloc::{Extent, ExtentAllocator};

/// Direct-I/O block: offsets, lengths and addresses are multiples of this.
pub(crate) const BLOCK: usize = 4096;
/// Huge page size (x86-64 and aarch64 with 4 KiB base pages).
pub(crate) const HUGE: usize = 2 << 20;
/// The largest buffer io_uring registers as one fixed buffer.
const MAX_SLAB: usize = 1 << 30;

pub(crate) fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// An anonymous private mapping, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// Whether `madvise(MADV_HUGEPAGE)` was accepted.
    pub(crate) huge: bool,
}

// SAFETY: the mapping is plain memory owned by this value; nothing in it is thread-affine.
unsafe impl Send for Mapping {}
// SAFETY: `Mapping` hands out no references itself; its owners enforce aliasing rules.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes (a multiple of [`BLOCK`], > 0) of zeroed memory. Requests of at least
    /// [`HUGE`] bytes are 2 MiB-aligned and advised for transparent huge pages.
    pub(crate) fn new(len: usize) -> Result<Self, StorageError> {
        debug_assert!(len > 0 && len.is_multiple_of(BLOCK));
        let oom = |source| StorageError::OutOfMemory { bytes: len, source };
        let want_huge = len >= HUGE;
        let map_len = if want_huge {
            len.checked_add(HUGE).ok_or_else(|| oom(std::io::Error::from_raw_os_error(libc::ENOMEM)))?
        } else {
            len
        };
        // SAFETY: an anonymous private mapping with no address hint has no preconditions; the
        // result is checked against MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(oom(std::io::Error::last_os_error()));
        }
        let base = base.cast::<u8>();
        let mut ptr = base;
        let mut huge = false;
        if want_huge {
            let addr = base as usize;
            let aligned = round_up(addr, HUGE);
            let head = aligned - addr;
            let tail = map_len - head - len;
            // SAFETY: `head` and `tail` lie inside the mapping just created; unmapping them
            // leaves exactly `[aligned, aligned + len)` mapped. Failure only leaks address space.
            unsafe {
                if head > 0 {
                    libc::munmap(base.cast(), head);
                }
                if tail > 0 {
                    libc::munmap(base.add(head + len).cast(), tail);
                }
                ptr = base.add(head);
                // Advice only: kernels without THP answer EINVAL and we keep 4 KiB pages.
                huge = libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) == 0;
            }
        }
        let ptr = NonNull::new(ptr).ok_or_else(|| oom(std::io::Error::from_raw_os_error(libc::ENOMEM)))?;
        Ok(Self { ptr, len, huge })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `[ptr, ptr + len)` is exactly what `new` left mapped, and no borrow of it
        // outlives `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// A pool of host memory carved into leases, registered with io_uring as fixed buffers when the
/// engine can (one fixed buffer per slab of at most 1 GiB).
#[derive(Debug)]
pub(crate) struct BufPool {
    region: Mapping,
    slabs: Vec<Extent>,
    allocs: Mutex<Vec<ExtentAllocator>>,
}

impl BufPool {
    /// A pool of `bytes` (rounded up to 2 MiB); `None` for 0.
    pub(crate) fn new(bytes: usize) -> Result<Option<Arc<Self>>, StorageError> {
        if bytes == 0 {
            return Ok(None);
        }
        let bytes = round_up(bytes, HUGE);
        let region = Mapping::new(bytes)?;
        let mut slabs = Vec::new();
        let mut at = 0;
        while at < bytes {
            let len = (bytes - at).min(MAX_SLAB);
            slabs.push(Extent { start: at as u64, len: len as u64 });
            at += len;
        }
        let allocs = slabs.iter().map(|s| ExtentAllocator::new(s.len, BLOCK as u64)).collect();
        Ok(Some(Arc::new(Self { region, slabs, allocs: Mutex::new(allocs) })))
    }

    /// `(address, length)` of every slab, in fixed-buffer index order.
    pub(crate) fn slabs(&self) -> impl Iterator<Item = (*mut u8, usize)> + '_ {
        // SAFETY (of the pointer arithmetic): every slab lies inside the region.
        self.slabs.iter().map(|s| (self.region.as_ptr().wrapping_add(s.start as usize), s.len as usize))
    }

    pub(crate) fn huge(&self) -> bool {
        self.region.huge
    }

    /// A lease of `cap` bytes (a multiple of [`BLOCK`]), or `None` when the pool is exhausted.
    fn lease(self: &Arc<Self>, cap: usize) -> Option<(NonNull<u8>, PoolLease)> {
        let align = if cap >= HUGE { HUGE } else { BLOCK } as u64;
        let mut allocs = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
        for (slab, a) in allocs.iter_mut().enumerate() {
            if let Some(extent) = a.alloc(cap as u64, align) {
                let offset = self.slabs[slab].start + extent.start;
                let ptr = NonNull::new(self.region.as_ptr().wrapping_add(offset as usize))?;
                return Some((ptr, PoolLease { pool: Arc::clone(self), slab, extent }));
            }
        }
        None
    }
}

#[derive(Debug)]
struct PoolLease {
    pool: Arc<BufPool>,
    slab: usize,
    extent: Extent,
}

impl Drop for PoolLease {
    fn drop(&mut self) {
        let mut allocs = self.pool.allocs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = allocs.get_mut(self.slab) {
            a.free(self.extent);
        }
    }
}

#[derive(Debug)]
enum Owner {
    Empty,
    Mapped(#[allow(dead_code)] Mapping),
    Pool(PoolLease),
}

/// An owned, block-aligned host buffer that spill I/O reads into and writes from without a copy.
///
/// Its capacity is a multiple of 4 KiB and its address 4 KiB-aligned (2 MiB-aligned from 2 MiB
/// up). Memory is always initialised: fresh buffers are zeroed; buffers from
/// [`crate::spill::SpillStore::alloc_buf`] may hold bytes of an earlier use.
///
/// To let a GPU copy into it directly, register it as pinned memory (e.g. `cudaHostRegister`)
/// through [`SpillBuf::as_mut_ptr`] and [`SpillBuf::capacity`].
#[derive(Debug)]
pub struct SpillBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    owner: Owner,
}

// SAFETY: a `SpillBuf` exclusively owns its memory (mapping or pool lease); moving it between
// threads moves that ownership.
unsafe impl Send for SpillBuf {}
// SAFETY: shared access only yields `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for SpillBuf {}

impl SpillBuf {
    /// A zeroed buffer of `len` bytes (capacity rounded up to 4 KiB).
    pub fn zeroed(len: usize) -> Result<Self, StorageError> {
        if len == 0 {
            return Ok(Self { ptr: NonNull::dangling(), len: 0, cap: 0, owner: Owner::Empty });
        }
        let cap = round_up(len, BLOCK);
        let m = Mapping::new(cap)?;
        let ptr = NonNull::new(m.as_ptr())
            .ok_or(StorageError::OutOfMemory { bytes: cap, source: std::io::Error::from_raw_os_error(libc::ENOMEM) })?;
        Ok(Self { ptr, len, cap, owner: Owner::Mapped(m) })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> Result<Self, StorageError> {
        let mut b = Self::zeroed(data.len())?;
        b.copy_from_slice(data);
        Ok(b)
    }

    /// A buffer of `len` bytes leased from `pool`, or `None` when the pool has no room.
    pub(crate) fn from_pool(pool: &Arc<BufPool>, len: usize) -> Option<Self> {
        if len == 0 {
            return None;
        }
        let cap = round_up(len, BLOCK);
        let (ptr, lease) = pool.lease(cap)?;
        Some(Self { ptr, len, cap, owner: Owner::Pool(lease) })
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when `len() == 0`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes available (a multiple of 4 KiB).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Change the length within the capacity; bytes newly exposed keep whatever they held.
    pub fn set_len(&mut self, len: usize) -> Result<(), StorageError> {
        if len > self.cap {
            return Err(StorageError::InvalidConfig {
                field: "len",
                reason: format!("{len} exceeds the buffer capacity {}", self.cap),
            });
        }
        self.len = len;
        Ok(())
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the buffer, for handing to a driver (e.g. to register it as pinned memory).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether the buffer comes from a store's registered pool.
    pub fn is_pooled(&self) -> bool {
        matches!(self.owner, Owner::Pool(_))
    }

    /// `(pool, slab index)` for a pooled buffer.
    pub(crate) fn pool_slot(&self) -> Option<(&Arc<BufPool>, usize)> {
        match &self.owner {
            Owner::Pool(l) => Some((&l.pool, l.slab)),
            _ => None,
        }
    }

    /// Base pointer for I/O over the whole capacity (engines write past `len` up to the block).
    pub(crate) fn io_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for SpillBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `cap >= len` initialised bytes (zeroed at mapping time) that
        // this value owns; for an empty buffer it is dangling with length 0, which is allowed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for SpillBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_huge_page_aligned_and_zeroed() {
        let b = SpillBuf::zeroed(5 << 20).unwrap();
        assert_eq!(b.as_ptr() as usize % HUGE, 0);
        assert_eq!(b.capacity(), 5 << 20);
        assert!(b.iter().all(|&x| x == 0));
        let s = SpillBuf::zeroed(10).unwrap();
        assert_eq!(s.as_ptr() as usize % BLOCK, 0);
        assert_eq!(s.capacity(), BLOCK);
        assert_eq!(s.len(), 10);
        assert!(SpillBuf::zeroed(0).unwrap().is_empty());
    }

    #[test]
    fn pool_leases_are_returned_on_drop() {
        let pool = BufPool::new(4 << 20).unwrap().unwrap();
        let a = SpillBuf::from_pool(&pool, 3 << 20).unwrap();
        assert_eq!(a.as_ptr() as usize % HUGE, 0);
        assert!(a.is_pooled());
        assert!(SpillBuf::from_pool(&pool, 2 << 20).is_none(), "only 1 MiB left");
        let small = SpillBuf::from_pool(&pool, 100).unwrap();
        assert_eq!(small.capacity(), BLOCK);
        drop(a);
        let again = SpillBuf::from_pool(&pool, 3 << 20).unwrap();
        assert_eq!(again.len(), 3 << 20);
    }

    #[test]
    fn set_len_beyond_capacity_is_an_error() {
        let mut b = SpillBuf::from_slice(b"hello").unwrap();
        assert!(b.set_len(BLOCK).is_ok());
        assert!(b.set_len(BLOCK + 1).is_err());
        b.set_len(5).unwrap();
        assert_eq!(&b[..], b"hello");
    }
}
