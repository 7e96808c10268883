//! Large, long-lived host buffers on transparent huge pages.
//!
//! The host keeps every parameter's fp32 master, its gradient, its 8-bit optimizer state and its
//! bf16 upload copy: gigabytes, streamed end to end by the optimizer every step. On 4 KiB pages
//! that is one TLB entry per 4 KiB of each stream; on 2 MiB pages, one per 2 MiB. Linux backs an
//! anonymous mapping with huge pages only where it is asked to (`madvise(MADV_HUGEPAGE)`) when
//! `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise`, a common default; the hint must
//! come before the pages are first touched, which is why these buffers are created here rather
//! than with `vec!`.
//!
//! Measured (Intel Xeon family 6 model 207, Emerald Rapids, 2 vCPUs, AVX-512; THP `madvise`):
//! the 8-bit AdamW update of 64M parameters on 2 threads with the bf16 copy, two buffer sets in
//! one process alternating by step, huge pages against 4 KiB pages: 45.3 / 48.0 / 48.3 against
//! 48.5 / 52.9 / 51.8 ms median per step in three runs (7-10%), same bits.
//!
//! The hint is only a hint: where huge pages are off, unavailable or not Linux, the buffers are
//! plain vectors, and nothing else changes.

/// The huge page size the hint aims at (x86-64 and most aarch64 kernels).
pub const HUGE_PAGE: usize = 2 << 20;

/// An empty vector with room for `n` items, its allocation asked to live on transparent huge
/// pages (where it spans at least one) before anything touches it.
pub fn huge_with_capacity<T>(n: usize) -> Vec<T> {
    let v = Vec::with_capacity(n);
    advise_huge(v.as_ptr() as *const u8, n.saturating_mul(std::mem::size_of::<T>()));
    v
}

/// A vector of `n` copies of `value` on transparent huge pages ([`huge_with_capacity`], then
/// filled: the first touch).
pub fn huge_vec<T: Clone>(n: usize, value: T) -> Vec<T> {
    let mut v = huge_with_capacity(n);
    v.resize(n, value);
    v
}

/// The first `n` items of `iter` (fewer if it ends early) in a vector on transparent huge pages.
pub fn huge_collect<T, I: IntoIterator<Item = T>>(n: usize, iter: I) -> Vec<T> {
    let mut v = huge_with_capacity(n);
    v.extend(iter.into_iter().take(n));
    v
}

/// Asks the kernel to back the whole huge pages inside `[ptr, ptr + len)` with transparent huge
/// pages. Pages already touched keep their 4 KiB backing until the kernel's background collapse
/// reaches them. Errors are ignored: the call only changes speed.
pub fn advise_huge(ptr: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        let start = (ptr as usize).div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let end = (ptr as usize).saturating_add(len) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: madvise only attaches a hint to the address range; MADV_HUGEPAGE neither
            // reads nor changes the contents, and a range that is not mapped just gets an error.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// The size of the host's pages (the unit the kernel, and a driver's page-locking, work in): from
/// `sysconf(_SC_PAGESIZE)` on Unix, else 4 KiB.
pub fn page_size() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads a system constant.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 {
            return p as usize;
        }
    }
    4096
}

/// What [`tune_malloc`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MallocTuning {
    /// The thresholds were set.
    Set,
    /// The user's environment already sets glibc malloc parameters (`GLIBC_TUNABLES` with a
    /// `glibc.malloc.` entry, `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_`): left alone.
    UserSettings,
    /// Not glibc (or glibc refused a value): the allocator's defaults stay.
    Unsupported,
}

/// glibc's `mmap` threshold that [`tune_malloc`] sets: the most its adaptive default ever rises to
/// on 64-bit targets (`DEFAULT_MMAP_THRESHOLD_MAX`), and half the largest heap a thread's arena
/// can have (64 MiB), so blocks under it can be reused in any thread's arena. Larger blocks still
/// get a mapping of their own each time.
pub const MALLOC_MMAP_THRESHOLD: usize = 32 << 20;

/// glibc's trim threshold that [`tune_malloc`] sets: free memory at the top of a heap is returned
/// to the kernel only beyond this.
pub const MALLOC_TRIM_THRESHOLD: usize = 1 << 30;

/// Makes glibc's malloc keep freed blocks of up to [`MALLOC_MMAP_THRESHOLD`] for reuse instead of
/// handing them back to the kernel after every free.
///
/// The CPU backend allocates a fresh tensor for nearly every operation: megabytes each for the
/// demo's attention scores and activations. With glibc's defaults those land just above its
/// adaptive `mmap` threshold or at the top of the heap, so each step maps, page-faults, zeroes and
/// unmaps them again: the `lt train` demo spent 30 of its 139 s in the kernel (`time`: sys), 1.8%
/// of its samples in `clear_page_erms` alone. Both thresholds must be set together: setting one
/// turns off glibc's adaptation of the other, and either alone was slower than the defaults
/// (30-step demo, AMD EPYC family 25 model 17, 2 vCPUs: sys 4.4 s by default, 0.14 s with both,
/// 10.4 s with the `mmap` threshold alone, 35.4 s with the trim threshold alone).
///
/// The cost is that the process keeps the memory it freed (up to its peak, which a training step
/// reaches every step anyway). For the binary to call once at start-up, before its threads:
/// a library should not change a process-wide allocator policy behind its caller's back. Settings
/// the user made in the environment win.
pub fn tune_malloc() -> MallocTuning {
    let user = std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc."))
        || std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
        || std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_some();
    if user {
        return MallocTuning::UserSettings;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes glibc's allocation parameters; both values are within the
        // ranges it accepts (it returns 0 and changes nothing otherwise).
        let ok = unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD as libc::c_int) == 1
        };
        if ok { MallocTuning::Set } else { MallocTuning::Unsupported }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    MallocTuning::Unsupported
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Minor page faults of the calling thread so far.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn minor_faults() -> i64 {
        // SAFETY: getrusage writes one rusage into the zeroed struct it is given.
        unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut u), 0);
            u.ru_minflt
        }
    }

    /// The churn `tune_malloc` removes: a step's worth of megabyte tensors allocated, touched and
    /// freed, again and again. With glibc's defaults the blocks are mapped and unmapped, or
    /// trimmed off the top of the heap, and every round faults its pages in again (24,484 of
    /// 24,576 pages here with the call removed); tuned, later rounds reuse them.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn tuned_malloc_reuses_freed_megabytes_without_page_faults() {
        let tuned = tune_malloc();
        if tuned == MallocTuning::UserSettings {
            eprintln!("skipped: the environment sets glibc malloc parameters");
            return;
        }
        assert_eq!(tuned, MallocTuning::Set);
        const BLOCK: usize = 1 << 20;
        const BLOCKS: usize = 24;
        let round = || {
            let v: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![i as u8 | 1; BLOCK]).collect();
            assert!(v.iter().enumerate().all(|(i, b)| b[BLOCK - 1] == i as u8 | 1));
        };
        round();
        let before = minor_faults();
        for _ in 0..4 {
            round();
        }
        let faults = minor_faults() - before;
        let pages = (4 * BLOCKS * BLOCK / page_size()) as i64;
        eprintln!("{faults} minor faults in 4 rounds of {BLOCKS} x 1 MiB ({pages} pages touched)");
        assert!(faults * 20 < pages, "{faults} faults for {pages} pages: freed memory was not reused");
    }

    #[test]
    fn huge_vectors_hold_what_was_asked() {
        for n in [0, 1, 1000, 3 * HUGE_PAGE / 4 + 5] {
            let v = huge_vec(n, 7u32);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 7));
            let c = huge_collect(n, (0..n as u32).map(|i| i ^ 5));
            assert_eq!(c.len(), n);
            assert!(c.iter().enumerate().all(|(i, &x)| x == i as u32 ^ 5));
        }
        // Fewer items than announced: the vector holds what there was.
        assert_eq!(huge_collect(10, 0..3u8), vec![0, 1, 2]);
    }

    /// On Linux with THP in `madvise` or `always` mode, a huge buffer made here is (at least
    /// partly) backed by huge pages; where THP is off the test has nothing to check and says so.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_buffer_gets_huge_pages_where_the_kernel_offers_them() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if !(mode.contains("[madvise]") || mode.contains("[always]")) {
            eprintln!("transparent huge pages are off here ({}); nothing to check", mode.trim());
            return;
        }
        let n = 16 * HUGE_PAGE / 4;
        let v = huge_vec(n, 1.0f32);
        let (lo, hi) = (v.as_ptr() as usize, v.as_ptr() as usize + 4 * n);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let mut huge_kb = 0u64;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = a < hi && b > lo;
            } else if inside && let Some(kb) = line.strip_prefix("AnonHugePages:") {
                huge_kb += kb.trim().trim_end_matches(" kB").trim().parse::<u64>().unwrap_or(0);
            }
        }
        std::hint::black_box(&v);
        assert!(huge_kb > 0, "no huge pages behind a {} MiB buffer (THP mode {})", (4 * n) >> 20, mode.trim());
    }
}
