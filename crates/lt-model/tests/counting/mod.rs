//! A counting global allocator for the memory tests: ndarray keeps every tensor on the heap, so the
//! bytes live on the heap are the bytes a backend would hold. Each test binary installs it with
//! `#[global_allocator] static A: counting::Counting = counting::Counting;`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicIsize, Ordering};

/// Forwards to the system allocator and counts live bytes and their peak.
pub struct Counting;

static CUR: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = CUR.fetch_add(l.size() as isize, Ordering::Relaxed) + l.size() as isize;
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        CUR.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
}

/// One measurement at a time: the counters are process-wide.
pub static SERIAL: Mutex<()> = Mutex::new(());

/// Bytes live now.
pub fn live() -> isize {
    CUR.load(Ordering::SeqCst)
}

/// Start a measurement: the peak restarts from what is live now, which is returned.
pub fn start() -> isize {
    let base = live();
    PEAK.store(base, Ordering::SeqCst);
    base
}

/// The peak since [`start`] returned `base`, above `base`.
pub fn peak_above(base: isize) -> isize {
    PEAK.load(Ordering::SeqCst) - base
}
