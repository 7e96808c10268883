//! Saving and restoring the optimizer state, with a format version and a checksum.
//!
//! Layout (all integers and floats little-endian):
//!
//! ```text
//! magic    8 bytes  "LTOPTIM\0"
//! version  u32      FORMAT_VERSION
//! payload           kind u8 (0 adamw, 1 adamw8bit), block u32, min_8bit_numel u64,
//!                   lr, beta1, beta2, eps, weight_decay f64, has_max_norm u8, max_norm f64,
//!                   step u64, skipped u64, groups u32, then per group:
//!                     name, tensors u32, then per tensor:
//!                       name, numel u64, last_step u64, tag u8,
//!                       tag 0 (fp32): m f32[numel], v f32[numel]
//!                       tag 1 (8-bit): block u32, qm u8[numel], qv u8[numel],
//!                                      absmax_m f32[blocks], absmax_v f32[blocks]
//!                   (a name is u32 length + UTF-8 bytes)
//! checksum u64      XXH64 (seed 0) of every byte from `version` to the end of the payload
//! ```
//!
//! XXH64 runs at several GB/s, so the checksum does not slow down a checkpoint of tens of GB the
//! way a byte-at-a-time CRC would. A reader rejects a wrong magic, an unknown version or a checksum
//! mismatch with a specific [`OptimError`], and never trusts a length before bounding it.

use std::io::{Read, Write};

use lt_core::hash::Xxh64;

use crate::config::{AdamWConfig, OptimizerKind, Q8Codes, Quant8Config};
use crate::error::{OptimError, Result};
use crate::optimizer::{AdamW, Moments, ParamGroup, Q8State, TensorState};
use crate::qmap::QuantMaps;

/// First bytes of every checkpoint.
pub const MAGIC: [u8; 8] = *b"LTOPTIM\0";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

const MAX_NAME: usize = 1 << 20;
const MAX_COUNT: u32 = 1 << 24;
const MAX_NUMEL: u64 = 1 << 40;
/// Conversion buffer for float arrays.
const IO_CHUNK: usize = 1 << 16;

impl AdamW {
    /// Writes the full optimizer state (hyper-parameters, step counters, every group's moments).
    /// Wrap files in a `BufWriter` for speed; large arrays are written in 64 KiB pieces.
    pub fn save<W: Write>(&self, w: W) -> Result<()> {
        let mut w = HashWriter { inner: w, hash: Xxh64::new(0) };
        w.inner.write_all(&MAGIC)?;
        w.u32(FORMAT_VERSION)?;
        let (kind, q) = match self.kind {
            OptimizerKind::AdamW => (0u8, Quant8Config::default()),
            // 1 (dynamic maps) is what every checkpoint before the f8 codes holds.
            OptimizerKind::AdamW8bit(q) if q.codes == Q8Codes::Dynamic => (1u8, q),
            OptimizerKind::AdamW8bit(q) => (2u8, q),
        };
        w.u8(kind)?;
        w.u32(q.block_size as u32)?;
        w.u64(q.min_8bit_numel as u64)?;
        let c = &self.config;
        for x in [c.lr, c.beta1, c.beta2, c.eps, c.weight_decay] {
            w.f64(x)?;
        }
        w.u8(c.max_grad_norm.is_some() as u8)?;
        w.f64(c.max_grad_norm.unwrap_or(0.0))?;
        w.u64(self.step)?;
        w.u64(self.skipped)?;
        w.u32(self.groups.len() as u32)?;
        for g in &self.groups {
            w.str(&g.name)?;
            w.u32(g.tensors.len() as u32)?;
            for t in &g.tensors {
                w.str(&t.name)?;
                w.u64(t.numel as u64)?;
                w.u64(t.last_step)?;
                match &t.moments {
                    Moments::Fp32 { m, v } => {
                        w.u8(0)?;
                        w.f32s(m)?;
                        w.f32s(v)?;
                    }
                    Moments::Q8(s) => {
                        w.u8(1)?;
                        w.u32(s.block as u32)?;
                        w.bytes(&s.qm)?;
                        w.bytes(&s.qv)?;
                        w.f32s(&s.am)?;
                        w.f32s(&s.av)?;
                    }
                }
            }
        }
        let sum = w.hash.digest();
        w.inner.write_all(&sum.to_le_bytes())?;
        w.inner.flush()?;
        Ok(())
    }

    /// Reads a state written by [`save`](Self::save). Fails with [`OptimError::BadMagic`],
    /// [`OptimError::UnsupportedVersion`], [`OptimError::ChecksumMismatch`] or
    /// [`OptimError::Corrupt`] rather than returning damaged state; a truncated stream is an
    /// [`OptimError::Io`] (unexpected end of file).
    pub fn load<R: Read>(r: R) -> Result<AdamW> {
        let mut r = HashReader { inner: r, hash: Xxh64::new(0) };
        let mut magic = [0u8; 8];
        r.inner.read_exact(&mut magic)?;
        if magic != MAGIC {
            return Err(OptimError::BadMagic { found: magic });
        }
        let version = r.u32()?;
        if version != FORMAT_VERSION {
            return Err(OptimError::UnsupportedVersion { found: version, supported: FORMAT_VERSION });
        }
        let kind = r.u8()?;
        let block_size = r.u32()? as usize;
        let min_8bit_numel = r.u64()? as usize;
        let mut f = [0f64; 5];
        for x in &mut f {
            *x = r.f64()?;
        }
        let has_max = r.u8()?;
        let max = r.f64()?;
        let step = r.u64()?;
        let skipped = r.u64()?;
        let n_groups = r.count()?;
        let mut groups = Vec::new();
        for _ in 0..n_groups {
            let name = r.str()?;
            let n_tensors = r.count()?;
            let mut tensors = Vec::new();
            for _ in 0..n_tensors {
                let tname = r.str()?;
                let numel = r.u64()?;
                if numel > MAX_NUMEL {
                    return Err(corrupt(format!("tensor {tname:?} claims {numel} elements")));
                }
                let numel = numel as usize;
                let last_step = r.u64()?;
                let moments = match r.u8()? {
                    0 => Moments::Fp32 { m: r.f32s(numel)?, v: r.f32s(numel)? },
                    1 => {
                        let block = r.u32()? as usize;
                        if block == 0 {
                            return Err(corrupt(format!("tensor {tname:?} has block size 0")));
                        }
                        let qm = r.bytes(numel)?;
                        let qv = r.bytes(numel)?;
                        let nb = numel.div_ceil(block);
                        Moments::Q8(Q8State {
                            block,
                            qm,
                            qv,
                            am: r.f32s(nb)?,
                            av: r.f32s(nb)?,
                            codes: if kind == 2 { Q8Codes::F8 } else { Q8Codes::Dynamic },
                            maps: QuantMaps::default(),
                        })
                    }
                    t => return Err(corrupt(format!("tensor {tname:?} has unknown state tag {t}"))),
                };
                tensors.push(TensorState { name: tname, numel, last_step, moments });
            }
            groups.push(ParamGroup { name, tensors });
        }
        let computed = r.hash.digest();
        let mut stored = [0u8; 8];
        r.inner.read_exact(&mut stored)?;
        let stored = u64::from_le_bytes(stored);
        if stored != computed {
            return Err(OptimError::ChecksumMismatch { stored, computed });
        }
        // The bytes are what was written; still refuse states this build could not have made.
        let config = AdamWConfig {
            lr: f[0],
            beta1: f[1],
            beta2: f[2],
            eps: f[3],
            weight_decay: f[4],
            max_grad_norm: (has_max != 0).then_some(max),
        };
        let q = Quant8Config { block_size, min_8bit_numel, codes: Q8Codes::Dynamic };
        let kind = match kind {
            0 => OptimizerKind::AdamW,
            1 => OptimizerKind::AdamW8bit(q),
            2 => OptimizerKind::AdamW8bit(Quant8Config { codes: Q8Codes::F8, ..q }),
            k => return Err(corrupt(format!("unknown optimizer kind {k}"))),
        };
        let mut opt = AdamW::new(config, kind).map_err(|e| corrupt(format!("stored settings are invalid: {e}")))?;
        for g in &groups {
            for t in &g.tensors {
                if let Moments::Q8(s) = &t.moments
                    && (kind == OptimizerKind::AdamW || s.block != block_size)
                {
                    return Err(corrupt(format!(
                        "tensor {:?} has 8-bit state of block {} under {}",
                        t.name,
                        s.block,
                        kind.name()
                    )));
                }
            }
        }
        opt.step = step;
        opt.skipped = skipped;
        opt.groups = groups;
        Ok(opt)
    }
}

fn corrupt(reason: String) -> OptimError {
    OptimError::Corrupt { reason }
}

struct HashWriter<W> {
    inner: W,
    hash: Xxh64,
}

impl<W: Write> HashWriter<W> {
    fn bytes(&mut self, b: &[u8]) -> Result<()> {
        self.hash.update(b);
        self.inner.write_all(b)?;
        Ok(())
    }
    fn u8(&mut self, x: u8) -> Result<()> {
        self.bytes(&[x])
    }
    fn u32(&mut self, x: u32) -> Result<()> {
        self.bytes(&x.to_le_bytes())
    }
    fn u64(&mut self, x: u64) -> Result<()> {
        self.bytes(&x.to_le_bytes())
    }
    fn f64(&mut self, x: f64) -> Result<()> {
        self.bytes(&x.to_le_bytes())
    }
    fn str(&mut self, s: &str) -> Result<()> {
        self.u32(s.len() as u32)?;
        self.bytes(s.as_bytes())
    }
    fn f32s(&mut self, xs: &[f32]) -> Result<()> {
        let mut buf = vec![0u8; 4 * IO_CHUNK.min(xs.len())];
        for c in xs.chunks(IO_CHUNK) {
            for (o, x) in buf.chunks_exact_mut(4).zip(c) {
                o.copy_from_slice(&x.to_le_bytes());
            }
            self.bytes(&buf[..4 * c.len()])?;
        }
        Ok(())
    }
}

struct HashReader<R> {
    inner: R,
    hash: Xxh64,
}

impl<R: Read> HashReader<R> {
    fn fill(&mut self, b: &mut [u8]) -> Result<()> {
        self.inner.read_exact(b)?;
        self.hash.update(b);
        Ok(())
    }
    fn u8(&mut self) -> Result<u8> {
        let mut b = [0u8; 1];
        self.fill(&mut b)?;
        Ok(b[0])
    }
    fn u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        self.fill(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        self.fill(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_bits(self.u64()?))
    }
    fn count(&mut self) -> Result<u32> {
        let n = self.u32()?;
        if n > MAX_COUNT {
            return Err(corrupt(format!("count {n} is implausible")));
        }
        Ok(n)
    }
    fn str(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        if n > MAX_NAME {
            return Err(corrupt(format!("name length {n} is implausible")));
        }
        String::from_utf8(self.bytes(n)?).map_err(|_| corrupt("a name is not UTF-8".to_string()))
    }
    fn bytes(&mut self, n: usize) -> Result<Vec<u8>> {
        let mut v = try_alloc::<u8>(n)?;
        v.resize(n, 0);
        self.fill(&mut v)?;
        Ok(v)
    }
    fn f32s(&mut self, n: usize) -> Result<Vec<f32>> {
        let mut v = try_alloc::<f32>(n)?;
        let mut buf = vec![0u8; 4 * IO_CHUNK.min(n)];
        let mut left = n;
        while left > 0 {
            let k = left.min(IO_CHUNK);
            self.fill(&mut buf[..4 * k])?;
            v.extend(buf[..4 * k].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
            left -= k;
        }
        Ok(v)
    }
}

/// An empty vector with room for `n`, or a `Corrupt` error instead of an allocation abort when a
/// damaged length asks for more memory than there is.
fn try_alloc<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| corrupt(format!("cannot allocate {n} elements")))?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grad::Grad;
    use crate::optimizer::StepOutcome;
    use crate::pool::ThreadPool;
    use crate::testutil::SplitMix64;

    fn trained(kind: OptimizerKind) -> AdamW {
        let pool = ThreadPool::new(1).unwrap();
        let mut rng = SplitMix64::new(3);
        let mut opt = AdamW::new(AdamWConfig { max_grad_norm: Some(2.0), ..Default::default() }, kind).unwrap();
        opt.add_group("layers.0", &[("q_proj", 5000), ("norm", 64)]).unwrap();
        opt.add_group("layers.1", &[("q_proj", 5000)]).unwrap();
        let mut p0 = rng.uniform_vec(5000);
        let mut p1 = rng.uniform_vec(64);
        let mut p2 = rng.uniform_vec(5000);
        for _ in 0..3 {
            let (g0, g1, g2) = (rng.uniform_vec(5000), rng.uniform_vec(64), rng.uniform_vec(5000));
            let StepOutcome::Apply(ctx) = opt.begin_step(3.0) else { panic!() };
            let (a, b) = opt.groups_mut().split_at_mut(1);
            a[0].update(&mut [&mut p0, &mut p1], &[Grad::F32(&g0), Grad::F32(&g1)], &ctx, &pool).unwrap();
            b[0].update(&mut [&mut p2], &[Grad::F32(&g2)], &ctx, &pool).unwrap();
        }
        let _ = opt.begin_step(f64::NAN);
        opt
    }

    fn same(a: &AdamW, b: &AdamW) {
        assert_eq!(a.config, b.config);
        assert_eq!(a.kind, b.kind);
        assert_eq!((a.step, a.skipped), (b.step, b.skipped));
        assert_eq!(a.groups.len(), b.groups.len());
        for (x, y) in a.groups.iter().zip(&b.groups) {
            assert_eq!(x.name, y.name);
            for (s, t) in x.tensors.iter().zip(&y.tensors) {
                assert_eq!((&s.name, s.numel, s.last_step), (&t.name, t.numel, t.last_step));
                assert_eq!(s.moments, t.moments);
            }
        }
    }

    #[test]
    fn save_load_round_trips_every_kind() {
        for kind in [OptimizerKind::AdamW, OptimizerKind::adamw8bit(), OptimizerKind::adamw8bit_f8()] {
            let opt = trained(kind);
            assert_eq!(opt.skipped_steps(), 1);
            let mut bytes = Vec::new();
            opt.save(&mut bytes).unwrap();
            let back = AdamW::load(bytes.as_slice()).unwrap();
            same(&opt, &back);
            assert!(back.groups()[0].tensors()[0].is_8bit() == matches!(kind, OptimizerKind::AdamW8bit(_)));
            // The codes' kind travels in the optimizer kind byte: 1 for the dynamic maps (every
            // checkpoint written before the f8 codes), 2 for f8.
            let tag = match kind {
                OptimizerKind::AdamW => 0,
                OptimizerKind::AdamW8bit(q) if q.codes == Q8Codes::Dynamic => 1,
                OptimizerKind::AdamW8bit(_) => 2,
            };
            assert_eq!(bytes[MAGIC.len() + 4], tag);
        }
    }

    #[test]
    fn load_rejects_bad_magic_version_checksum_and_truncation() {
        let opt = trained(OptimizerKind::adamw8bit());
        let mut bytes = Vec::new();
        opt.save(&mut bytes).unwrap();

        let mut b = bytes.clone();
        b[0] = b'X';
        assert!(matches!(AdamW::load(b.as_slice()), Err(OptimError::BadMagic { .. })));

        let mut b = bytes.clone();
        b[8..12].copy_from_slice(&2u32.to_le_bytes());
        let e = AdamW::load(b.as_slice()).unwrap_err();
        assert!(matches!(e, OptimError::UnsupportedVersion { found: 2, supported: 1 }), "{e}");

        // Flip one bit in the middle of the state arrays: only the checksum can notice.
        let mut b = bytes.clone();
        let mid = b.len() / 2;
        b[mid] ^= 0x10;
        let e = AdamW::load(b.as_slice()).unwrap_err();
        assert!(matches!(e, OptimError::ChecksumMismatch { .. }), "{e}");
        assert!(e.to_string().contains("checksum"));

        // Damaged trailer.
        let mut b = bytes.clone();
        let last = b.len() - 1;
        b[last] ^= 1;
        assert!(matches!(AdamW::load(b.as_slice()), Err(OptimError::ChecksumMismatch { .. })));

        let b = &bytes[..bytes.len() - 100];
        assert!(matches!(AdamW::load(b), Err(OptimError::Io(_))));

        // A length field blown up to 2^40 elements fails cleanly, without trying to allocate it.
        let mut b = bytes.clone();
        let name = b"layers.0";
        let at = b.windows(name.len()).position(|w| w == name).unwrap() + name.len() + 4 + 4 + b"q_proj".len();
        b[at..at + 8].copy_from_slice(&(1u64 << 41).to_le_bytes());
        assert!(matches!(AdamW::load(b.as_slice()), Err(OptimError::Corrupt { .. })));
    }
}
