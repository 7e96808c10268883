//! Test helpers: the LTFX fixture reader and the SplitMix64 stream shared with `gen_optim.py`.

use std::collections::HashMap;

/// One record of an LTFX file (see `tools/fixtures/gen_optim.py`).
pub(crate) enum Record {
    F32(Vec<f32>),
    U8(Vec<u8>),
    F64(Vec<f64>),
    U32(Vec<u32>),
}

/// An LTFX fixture file, parsed.
pub(crate) struct Fixture {
    name: String,
    records: HashMap<String, Record>,
}

impl Fixture {
    /// Loads `tools/fixtures/optim/<name>` from the repository.
    pub(crate) fn load(name: &str) -> Fixture {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/optim").join(name);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        Fixture::parse(name, &bytes)
    }

    fn parse(name: &str, b: &[u8]) -> Fixture {
        assert_eq!(&b[..4], b"LTFX", "{name}: bad magic");
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        assert_eq!(u32_at(4), 1, "{name}: version");
        let count = u32_at(8) as usize;
        let mut off = 12;
        let mut records = HashMap::new();
        for _ in 0..count {
            let nlen = u16::from_le_bytes([b[off], b[off + 1]]) as usize;
            off += 2;
            let rname = String::from_utf8(b[off..off + nlen].to_vec()).expect("utf-8 name");
            off += nlen;
            let dtype = b[off];
            let n = u32_at(off + 1) as usize;
            off += 5;
            let (rec, size) = match dtype {
                0 => (
                    Record::F32(
                        b[off..off + 4 * n]
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect(),
                    ),
                    4,
                ),
                1 => (Record::U8(b[off..off + n].to_vec()), 1),
                2 => (
                    Record::F64(
                        b[off..off + 8 * n]
                            .chunks_exact(8)
                            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                            .collect(),
                    ),
                    8,
                ),
                3 => (
                    Record::U32(
                        b[off..off + 4 * n]
                            .chunks_exact(4)
                            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect(),
                    ),
                    4,
                ),
                d => panic!("{name}: unknown dtype {d}"),
            };
            off += size * n;
            records.insert(rname, rec);
        }
        assert_eq!(off, b.len(), "{name}: trailing bytes");
        Fixture { name: name.to_string(), records }
    }

    fn get(&self, key: &str) -> &Record {
        self.records.get(key).unwrap_or_else(|| panic!("{}: no record {key:?}", self.name))
    }

    pub(crate) fn f32(&self, key: &str) -> Vec<f32> {
        match self.get(key) {
            Record::F32(v) => v.clone(),
            _ => panic!("{}: {key} is not f32", self.name),
        }
    }

    pub(crate) fn u8(&self, key: &str) -> Vec<u8> {
        match self.get(key) {
            Record::U8(v) => v.clone(),
            _ => panic!("{}: {key} is not u8", self.name),
        }
    }

    pub(crate) fn f64(&self, key: &str) -> Vec<f64> {
        match self.get(key) {
            Record::F64(v) => v.clone(),
            _ => panic!("{}: {key} is not f64", self.name),
        }
    }

    pub(crate) fn u32(&self, key: &str) -> Vec<u32> {
        match self.get(key) {
            Record::U32(v) => v.clone(),
            _ => panic!("{}: {key} is not u32", self.name),
        }
    }
}

/// SplitMix64, bit-identical to `Rng` in `tools/fixtures/gen_optim.py`.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1) with 24 random bits; exact in f32, so Python and Rust agree bit for bit.
    pub(crate) fn uniform(&mut self) -> f32 {
        let k = (self.next_u64() >> 40) as i64;
        (k - (1 << 23)) as f32 / (1u32 << 23) as f32
    }

    pub(crate) fn uniform_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}
