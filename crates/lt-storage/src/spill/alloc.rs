//! An extent allocator over a fixed range: the preallocated spill file, or the registered
//! buffer pool.
//!
//! Free space is a map `start -> len` of disjoint, coalesced extents. Allocation is first fit
//! by address with an alignment; when no single extent is large enough, a value may be split
//! over several extents (largest first) so that fragmentation alone never refuses a request
//! that the free total could hold.

use std::collections::BTreeMap;

/// A contiguous byte range `[start, start + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    pub start: u64,
    pub len: u64,
}

/// First-fit extent allocator in units of `granule` bytes.
#[derive(Debug)]
pub(crate) struct ExtentAllocator {
    free: BTreeMap<u64, u64>,
    capacity: u64,
    free_bytes: u64,
    granule: u64,
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

impl ExtentAllocator {
    /// An allocator over `[0, capacity)`. `granule` must be a power of two; `capacity` is rounded
    /// down to it.
    pub fn new(capacity: u64, granule: u64) -> Self {
        debug_assert!(granule.is_power_of_two());
        let capacity = capacity / granule * granule;
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self { free, capacity, free_bytes: capacity, granule }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Size actually reserved for a request of `len` bytes.
    pub fn rounded(&self, len: u64) -> u64 {
        round_up(len, self.granule)
    }

    /// One contiguous extent of `len` bytes (rounded up to the granule) whose start is a
    /// multiple of `align` (a power of two, at least the granule).
    pub fn alloc(&mut self, len: u64, align: u64) -> Option<Extent> {
        let len = self.rounded(len);
        if len == 0 {
            return Some(Extent { start: 0, len: 0 });
        }
        let align = align.max(self.granule);
        let (start, flen, at) = self.free.iter().find_map(|(&s, &l)| {
            let at = round_up(s, align);
            (at + len <= s + l).then_some((s, l, at))
        })?;
        self.take(start, flen, at, len);
        Some(Extent { start: at, len })
    }

    /// `len` bytes as one extent if possible (aligned to `align`), else as several extents taken
    /// largest first. `None` (and no change) when the free total is too small.
    pub fn alloc_multi(&mut self, len: u64, align: u64) -> Option<Vec<Extent>> {
        let len = self.rounded(len);
        if len > self.free_bytes {
            return None;
        }
        if let Some(e) = self.alloc(len, align) {
            return Some(if e.len == 0 { Vec::new() } else { vec![e] });
        }
        // Fragmented: take the largest extents until covered.
        let mut by_size: Vec<(u64, u64)> = self.free.iter().map(|(&s, &l)| (s, l)).collect();
        by_size.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut out = Vec::new();
        let mut need = len;
        for (s, l) in by_size {
            if need == 0 {
                break;
            }
            let take = l.min(need);
            self.take(s, l, s, take);
            out.push(Extent { start: s, len: take });
            need -= take;
        }
        // Unreachable with a consistent free map (len <= free_bytes), kept for safety.
        if need > 0 {
            for e in &out {
                self.free(*e);
            }
            return None;
        }
        out.sort_by_key(|e| e.start);
        Some(out)
    }

    /// Remove `[at, at + len)` from the free extent `[start, start + flen)`.
    fn take(&mut self, start: u64, flen: u64, at: u64, len: u64) {
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        let end = start + flen;
        if at + len < end {
            self.free.insert(at + len, end - (at + len));
        }
        self.free_bytes -= len;
    }

    /// Return an extent, merging it with free neighbours.
    ///
    /// # Panics
    /// In debug builds, on an extent that overlaps free space (a double free: a programmer error).
    pub fn free(&mut self, e: Extent) {
        if e.len == 0 {
            return;
        }
        let mut start = e.start;
        let mut len = e.len;
        if let Some((&ps, &pl)) = self.free.range(..=start).next_back() {
            debug_assert!(ps + pl <= start, "double free of extent {e:?}");
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some((&ns, &nl)) = self.free.range(start + len..).next() {
            debug_assert!(ns >= start + len, "double free of extent {e:?}");
            if ns == start + len {
                self.free.remove(&ns);
                len += nl;
            }
        }
        self.free.insert(start, len);
        self.free_bytes += e.len;
    }

    #[cfg(test)]
    pub fn extent_count(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesces_back_to_one_extent() {
        let mut a = ExtentAllocator::new(1 << 20, 4096);
        let x = a.alloc(5000, 4096).unwrap();
        let y = a.alloc(4096, 4096).unwrap();
        let z = a.alloc(1, 4096).unwrap();
        assert_eq!(x, Extent { start: 0, len: 8192 });
        assert_eq!(y.start, 8192);
        assert_eq!(z.start, 12288);
        assert_eq!(a.free_bytes(), (1 << 20) - 16384);
        a.free(y);
        a.free(x);
        a.free(z);
        assert_eq!(a.free_bytes(), 1 << 20);
        assert_eq!(a.extent_count(), 1);
    }

    #[test]
    fn alignment_is_respected_and_the_gap_stays_free() {
        let mut a = ExtentAllocator::new(8 << 20, 4096);
        let small = a.alloc(4096, 4096).unwrap();
        let big = a.alloc(3 << 20, 2 << 20).unwrap();
        assert_eq!(big.start % (2 << 20), 0);
        // The gap between `small` and `big` is still usable.
        let gap = a.alloc(8192, 4096).unwrap();
        assert_eq!(gap.start, small.len);
        assert_eq!(a.free_bytes(), (8 << 20) - 4096 - (3 << 20) - 8192);
    }

    #[test]
    fn fragmented_space_is_still_usable_through_multi_extent_allocation() {
        let mut a = ExtentAllocator::new(64 * 4096, 4096);
        let blocks: Vec<Extent> = (0..64).map(|_| a.alloc(4096, 4096).unwrap()).collect();
        assert!(a.alloc(1, 4096).is_none());
        // Free every other block: 32 free blocks, no two adjacent.
        for b in blocks.iter().step_by(2) {
            a.free(*b);
        }
        assert!(a.alloc(2 * 4096, 4096).is_none(), "no contiguous 8 KiB run exists");
        let parts = a.alloc_multi(10 * 4096 - 100, 4096).unwrap();
        assert_eq!(parts.len(), 10);
        assert_eq!(parts.iter().map(|e| e.len).sum::<u64>(), 10 * 4096);
        assert_eq!(a.free_bytes(), 22 * 4096);
        // More than the free total: refused without changing state.
        assert!(a.alloc_multi(23 * 4096, 4096).is_none());
        assert_eq!(a.free_bytes(), 22 * 4096);
    }

    #[test]
    fn random_alloc_free_cycles_keep_the_books_balanced() {
        let cap = 256 * 4096;
        let mut a = ExtentAllocator::new(cap, 4096);
        let mut live: Vec<Vec<Extent>> = Vec::new();
        let mut s = 0x1234_5678_9ABC_DEF0u64;
        for _ in 0..5000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if s.is_multiple_of(3) && !live.is_empty() {
                let i = (s as usize / 3) % live.len();
                for e in live.swap_remove(i) {
                    a.free(e);
                }
            } else if let Some(v) = a.alloc_multi(s % (20 * 4096) + 1, 4096) {
                live.push(v);
            }
            let used: u64 = live.iter().flatten().map(|e| e.len).sum();
            assert_eq!(used + a.free_bytes(), cap);
        }
        // No two live extents overlap.
        let mut all: Vec<Extent> = live.into_iter().flatten().collect();
        all.sort_by_key(|e| e.start);
        for w in all.windows(2) {
            assert!(w[0].start + w[0].len <= w[1].start);
        }
    }
}
