//! A counting global allocator for the memory tests: ndarray keeps every tensor on the heap, so the
//! bytes live on the heap are the bytes a backend would hold. Each test binary installs it with
//! `#[global_allocator] static A: counting::Counting = counting::Counting;`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};

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
            log(l.size() as isize, p as usize, l.align());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        CUR.fetch_sub(l.size() as isize, Ordering::Relaxed);
        log(-(l.size() as isize), p as usize, l.align());
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

/// Capacity of the event log: allocations and frees of one recorded call.
const LOG_CAP: usize = 1 << 17;
static LOGGING: AtomicBool = AtomicBool::new(false);
static LOG_LEN: AtomicUsize = AtomicUsize::new(0);
static LOG_SIZE: [AtomicIsize; LOG_CAP] = [const { AtomicIsize::new(0) }; LOG_CAP];
static LOG_PTR: [AtomicUsize; LOG_CAP] = [const { AtomicUsize::new(0) }; LOG_CAP];
static LOG_ALIGN: [AtomicUsize; LOG_CAP] = [const { AtomicUsize::new(0) }; LOG_CAP];

fn log(size: isize, ptr: usize, align: usize) {
    if LOGGING.load(Ordering::Relaxed) {
        let i = LOG_LEN.fetch_add(1, Ordering::Relaxed);
        if i < LOG_CAP {
            LOG_SIZE[i].store(size, Ordering::Relaxed);
            LOG_PTR[i].store(ptr, Ordering::Relaxed);
            LOG_ALIGN[i].store(align, Ordering::Relaxed);
        }
    }
}

/// One allocation (`size > 0`) or free (`size < 0`) of the block at `ptr`.
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)]
pub struct Event {
    pub size: isize,
    pub ptr: usize,
    /// The layout's alignment.
    pub align: usize,
}

/// Every allocation and free `f` makes (on any thread), in order.
#[allow(dead_code)]
pub fn record<R>(f: impl FnOnce() -> R) -> (R, Vec<Event>) {
    LOG_LEN.store(0, Ordering::SeqCst);
    LOGGING.store(true, Ordering::SeqCst);
    let r = f();
    LOGGING.store(false, Ordering::SeqCst);
    let n = LOG_LEN.load(Ordering::SeqCst);
    assert!(n <= LOG_CAP, "{n} events overflow the log of {LOG_CAP}");
    let events = (0..n)
        .map(|i| Event {
            size: LOG_SIZE[i].load(Ordering::Relaxed),
            ptr: LOG_PTR[i].load(Ordering::Relaxed),
            align: LOG_ALIGN[i].load(Ordering::Relaxed),
        })
        .collect();
    (r, events)
}
