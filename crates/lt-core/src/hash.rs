//! XXH64, the 64-bit xxHash, used to checksum checkpoint files and optimizer state.
//!
//! Implemented here (about 100 lines) rather than pulled in as a dependency. XXH64 runs at memory
//! speed on one core, so verifying a 100 GB checkpoint costs the read, not the hash; it is a
//! checksum against torn writes and bit rot, not a defence against an adversary.
//!
//! ```
//! use lt_core::hash::{xxh64, Xxh64};
//! let mut h = Xxh64::new(0);
//! h.update(b"Nobody inspects");
//! h.update(b" the spammish repetition");
//! assert_eq!(h.digest(), xxh64(b"Nobody inspects the spammish repetition", 0));
//! ```

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

#[inline(always)]
fn round(acc: u64, input: u64) -> u64 {
    acc.wrapping_add(input.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1)
}

#[inline(always)]
fn merge(acc: u64, v: u64) -> u64 {
    (acc ^ round(0, v)).wrapping_mul(P1).wrapping_add(P4)
}

#[inline(always)]
fn read_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

#[inline(always)]
fn read_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

/// One-shot XXH64 of `data` with `seed`.
pub fn xxh64(data: &[u8], seed: u64) -> u64 {
    let mut h = Xxh64::new(seed);
    h.update(data);
    h.digest()
}

/// Streaming XXH64: feed bytes with [`Xxh64::update`] in any split, read with [`Xxh64::digest`].
#[derive(Debug, Clone)]
pub struct Xxh64 {
    seed: u64,
    v: [u64; 4],
    total: u64,
    buf: [u8; 32],
    buf_len: usize,
}

impl Xxh64 {
    /// A hasher with `seed` (checkpoints use 0).
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            v: [seed.wrapping_add(P1).wrapping_add(P2), seed.wrapping_add(P2), seed, seed.wrapping_sub(P1)],
            total: 0,
            buf: [0; 32],
            buf_len: 0,
        }
    }

    #[inline(always)]
    fn stripe(v: &mut [u64; 4], s: &[u8]) {
        v[0] = round(v[0], read_u64(&s[0..]));
        v[1] = round(v[1], read_u64(&s[8..]));
        v[2] = round(v[2], read_u64(&s[16..]));
        v[3] = round(v[3], read_u64(&s[24..]));
    }

    /// Hash more bytes.
    pub fn update(&mut self, mut data: &[u8]) {
        self.total = self.total.wrapping_add(data.len() as u64);
        if self.buf_len > 0 {
            let take = (32 - self.buf_len).min(data.len());
            self.buf[self.buf_len..self.buf_len + take].copy_from_slice(&data[..take]);
            self.buf_len += take;
            data = &data[take..];
            if self.buf_len < 32 {
                return;
            }
            let buf = self.buf;
            Self::stripe(&mut self.v, &buf);
            self.buf_len = 0;
        }
        let mut chunks = data.chunks_exact(32);
        for s in &mut chunks {
            Self::stripe(&mut self.v, s);
        }
        let rest = chunks.remainder();
        self.buf[..rest.len()].copy_from_slice(rest);
        self.buf_len = rest.len();
    }

    /// The hash of everything fed so far (the hasher stays usable).
    pub fn digest(&self) -> u64 {
        let mut h = if self.total >= 32 {
            let [v1, v2, v3, v4] = self.v;
            let mut h = v1
                .rotate_left(1)
                .wrapping_add(v2.rotate_left(7))
                .wrapping_add(v3.rotate_left(12))
                .wrapping_add(v4.rotate_left(18));
            for v in self.v {
                h = merge(h, v);
            }
            h
        } else {
            self.seed.wrapping_add(P5)
        };
        h = h.wrapping_add(self.total);
        let mut rest = &self.buf[..self.buf_len];
        while rest.len() >= 8 {
            h ^= round(0, read_u64(rest));
            h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
            rest = &rest[8..];
        }
        if rest.len() >= 4 {
            h ^= u64::from(read_u32(rest)).wrapping_mul(P1);
            h = h.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
            rest = &rest[4..];
        }
        for &b in rest {
            h ^= u64::from(b).wrapping_mul(P5);
            h = h.rotate_left(11).wrapping_mul(P1);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(P2);
        h ^= h >> 29;
        h = h.wrapping_mul(P3);
        h ^= h >> 32;
        h
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    fn xxh64_0(data: &[u8]) -> u64 {
        let mut h = Xxh64::new(0);
        h.update(data);
        h.digest()
    }

    /// Reference values from the `xxhash` Python package (python-xxhash 4.1.0, `xxh64_intdigest(data, 0)`).
    #[test]
    fn python_xxhash_vectors_and_streaming() {
        assert_eq!(xxh64_0(b""), 0xEF46_DB37_51D8_E999);
        assert_eq!(xxh64_0(b"a"), XXH64_A);
        assert_eq!(xxh64_0(b"abc"), XXH64_ABC);
        let long: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        assert_eq!(xxh64_0(&long), XXH64_LONG);
        // Split anywhere: same digest.
        for cut in [0, 1, 31, 32, 33, 500, 999, 1000] {
            let mut h = Xxh64::new(0);
            h.update(&long[..cut]);
            h.update(&long[cut..]);
            assert_eq!(h.digest(), XXH64_LONG, "cut {cut}");
        }
    }

    const XXH64_A: u64 = 0xD24E_C4F1_A98C_6E5B;
    const XXH64_ABC: u64 = 0x44BC_2CF5_AD77_0999;
    const XXH64_LONG: u64 = 0x5F23_5FA0_33F1_A3FB;

    #[test]
    fn matches_published_xxh64_vectors() {
        // Reference values from the xxHash project and python-xxhash's README.
        assert_eq!(xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
        assert_eq!(xxh64(b"a", 0), 0xD24E_C4F1_A98C_6E5B);
        assert_eq!(xxh64(b"abc", 0), 0x44BC_2CF5_AD77_0999);
        assert_eq!(xxh64(b"Nobody inspects the spammish repetition", 0), 0xFBCE_A83C_8A37_8BF1);
    }

    #[test]
    fn streaming_equals_one_shot_for_every_split() {
        let data: Vec<u8> = (0..300u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0usize, 1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 65, 100, 300] {
            let whole = xxh64(&data[..len], 7);
            for split in 0..=len {
                let mut h = Xxh64::new(7);
                h.update(&data[..split]);
                h.update(&data[split..len]);
                assert_eq!(h.digest(), whole, "len {len} split {split}");
            }
        }
    }

    #[test]
    fn one_flipped_bit_changes_the_hash() {
        let mut data = vec![0x5Au8; 4096];
        let before = xxh64(&data, 0);
        data[1234] ^= 0x10;
        assert_ne!(xxh64(&data, 0), before);
    }
}
