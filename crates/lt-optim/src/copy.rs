//! The bf16 copy of the fp32 master weights, which streaming uploads to the GPU.
//!
//! A streamed layer goes to the device in bf16 for its forward and again for its backward. Rather
//! than convert the fp32 master before every upload, the update kernels can write the bf16 bits of
//! each parameter in the same pass that writes the parameter ([`ParamGroup::update_with_copy`],
//! [`TensorState::update_with_copy`]): the values are in registers already, so the copy costs its
//! 2 bytes of stores per parameter and a few instructions. [`fill_bf16`] makes the first copy (after
//! loading or resuming) on the pool's threads.
//!
//! The rounding is `half::bf16::from_f32`'s, bit for bit, on every path: round to nearest, ties to
//! even; a NaN keeps its top 16 bits and gets the quiet bit (`0x0040`); infinities and subnormals
//! are rounded like any other bit pattern. That is also what `lt-model`'s upload conversion
//! computes, so a copy made here and a conversion made there are interchangeable.
//!
//! [`ParamGroup::update_with_copy`]: crate::ParamGroup::update_with_copy
//! [`TensorState::update_with_copy`]: crate::TensorState::update_with_copy

use half::bf16;

use crate::error::{OptimError, Result};
use crate::kernels::{KernelPath, PAR_MIN, bf16_chunk};
use crate::pool::{ThreadPool, run_tasks};

/// Elements per parallel task of [`fill_bf16`].
const TASK: usize = 1 << 16;

/// f32 -> bf16 exactly as `half::bf16::from_f32` (see the module docs), without branches so that
/// loops over it vectorize: adding `0x7fff` plus the kept half's lowest bit carries into bit 16
/// exactly when the dropped half is above one half, or equal to it with an odd result. It cannot
/// overflow: only NaNs are above `0xffff_8000`, and they take the other arm.
#[inline(always)]
pub(crate) fn bf16_rne(v: f32) -> bf16 {
    let x = v.to_bits();
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let nan = ((x >> 16) | 0x0040) as u16;
    bf16::from_bits(if x & 0x7fff_ffff > 0x7f80_0000 { nan } else { rounded })
}

/// Writes `dst[i] = half::bf16::from_f32(src[i])` for every `i`, on the pool's threads for large
/// slices: the bf16 copy that [`ParamGroup::update_with_copy`](crate::ParamGroup::update_with_copy)
/// then keeps up to date, made once after loading or resuming the fp32 master weights.
///
/// Returns [`OptimError::LengthMismatch`] (and writes nothing) when the lengths differ.
///
/// ```
/// use lt_optim::{ThreadPool, bf16, fill_bf16};
///
/// let pool = ThreadPool::new(2)?;
/// let master = vec![1.0f32, -0.5, 3.0e-3];
/// let mut copy = vec![bf16::ZERO; master.len()];
/// fill_bf16(&master, &mut copy, &pool)?;
/// assert_eq!(copy[1], bf16::from_f32(-0.5));
/// # Ok::<(), lt_optim::OptimError>(())
/// ```
pub fn fill_bf16(src: &[f32], dst: &mut [bf16], pool: &ThreadPool) -> Result<()> {
    if src.len() != dst.len() {
        return Err(OptimError::LengthMismatch {
            what: "bf16 copy".to_string(),
            expected: src.len(),
            found: dst.len(),
        });
    }
    fill_with(src, dst, pool, KernelPath::detect());
    Ok(())
}

/// [`fill_bf16`] with a given kernel path (lengths already checked).
fn fill_with(src: &[f32], dst: &mut [bf16], pool: &ThreadPool, path: KernelPath) {
    let tasks = src.chunks(TASK).zip(dst.chunks_mut(TASK));
    let work = |(s, d): (&[f32], &mut [bf16])| bf16_chunk(s, d, path);
    if src.len() < PAR_MIN || pool.threads() == 1 {
        tasks.for_each(work);
    } else {
        run_tasks(pool, tasks, work);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::simd::SimdLevel;
    use crate::testutil::SplitMix64;

    /// Bit patterns that exercise every rounding case: every exponent (zero/subnormal and
    /// infinity/NaN included) with random mantissas, mantissas exactly at a tie (odd and even kept
    /// half), just below and above a tie, the smallest subnormals, and NaN payloads whose top
    /// mantissa bits are all clear (signalling NaNs that only the quiet bit keeps NaN).
    pub(crate) fn bf16_probe_bits() -> Vec<u32> {
        let mut rng = SplitMix64::new(0xbf16);
        let mut v = Vec::new();
        for sign in [0u32, 1] {
            for e in 0..256u32 {
                for k in 0..96u32 {
                    let r = rng.next_u64() as u32;
                    let m = match k % 6 {
                        0 => r & 0x7f_ffff,
                        1 => (r & 0x7f_0000) | 0x8000,
                        2 => (r & 0x7f_0000) | 0x7fff,
                        3 => (r & 0x7f_0000) | 0x8001,
                        4 => k / 6,
                        _ => r & 0xffff,
                    };
                    v.push((sign << 31) | (e << 23) | m);
                }
            }
        }
        v.extend([0x7f7f_8000, 0x7f7f_7fff, 0x7f7f_ffff, 0x0080_0000, 0x007f_ffff, 0x0000_8000, 0x0001_8000]);
        v
    }

    /// The paths of `bf16_chunk` this CPU can run.
    fn paths() -> Vec<KernelPath> {
        let mut v = vec![KernelPath::plain(SimdLevel::Scalar)];
        let best = crate::simd::simd_level();
        if best >= SimdLevel::Avx2 {
            v.push(KernelPath::plain(SimdLevel::Avx2));
        }
        if best >= SimdLevel::Avx512 {
            v.push(KernelPath::plain(SimdLevel::Avx512));
            if crate::simd::has_avx512bf16() {
                v.push(KernelPath { bf16_hw: true, ..KernelPath::plain(SimdLevel::Avx512) });
            }
        }
        v
    }

    #[test]
    fn bf16_rne_is_half_from_f32_on_every_rounding_case() {
        for b in bf16_probe_bits() {
            let x = f32::from_bits(b);
            assert_eq!(bf16_rne(x).to_bits(), bf16::from_f32(x).to_bits(), "{b:08x}");
        }
    }

    /// All 2^32 inputs (about 20 s in a release build): `cargo test -p lt-optim --release --
    /// --ignored bf16_rne_is_half_from_f32_exhaustively`.
    #[test]
    #[ignore]
    fn bf16_rne_is_half_from_f32_exhaustively() {
        for b in 0..=u32::MAX {
            let x = f32::from_bits(b);
            assert_eq!(bf16_rne(x).to_bits(), bf16::from_f32(x).to_bits(), "{b:08x}");
        }
    }

    /// Every conversion path on all 2^32 inputs (about 30 s in a release build):
    /// `cargo test -p lt-optim --release -- --ignored fill_bf16_matches_half_exhaustively`.
    #[test]
    #[ignore]
    fn fill_bf16_matches_half_exhaustively() {
        let pool = ThreadPool::new(1).unwrap();
        let chunk = 1u64 << 20;
        let mut src = vec![0f32; chunk as usize];
        let mut dst = vec![bf16::ZERO; chunk as usize];
        for start in (0..1u64 << 32).step_by(chunk as usize) {
            for (i, x) in src.iter_mut().enumerate() {
                *x = f32::from_bits((start + i as u64) as u32);
            }
            for path in paths() {
                fill_with(&src, &mut dst, &pool, path);
                for (x, d) in src.iter().zip(&dst) {
                    assert_eq!(d.to_bits(), bf16::from_f32(*x).to_bits(), "{path:?} {:08x}", x.to_bits());
                }
            }
        }
    }

    /// Every SIMD conversion (integer rounding on AVX2 and AVX-512, `vcvtneps2bf16` where the CPU
    /// has it) equals `half` on every rounding case, at every offset of a ragged tail and on both
    /// the threaded and the single-threaded split.
    #[test]
    fn fill_bf16_matches_half_on_every_path() {
        let pool = ThreadPool::new(2).unwrap();
        let mut bits = bf16_probe_bits();
        // Long enough for several parallel tasks, with a ragged end.
        while bits.len() < 3 * TASK + 13 {
            bits.extend_from_within(..bits.len().min(3 * TASK + 13 - bits.len()));
        }
        let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let want: Vec<u16> = src.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        for path in paths() {
            for len in [src.len(), 1000 + 7, 15, 0] {
                let mut dst = vec![bf16::from_bits(0x5555); len];
                fill_with(&src[..len], &mut dst, &pool, path);
                if let Some(i) = (0..len).find(|&i| dst[i].to_bits() != want[i]) {
                    panic!(
                        "{path:?} len {len}: [{i}] {:08x} -> {:04x}, want {:04x}",
                        bits[i],
                        dst[i].to_bits(),
                        want[i]
                    );
                }
            }
        }
    }

    #[test]
    fn fill_bf16_rejects_a_length_mismatch_and_writes_nothing() {
        let pool = ThreadPool::new(1).unwrap();
        let mut dst = vec![bf16::ONE; 3];
        let err = fill_bf16(&[1.0, 2.0], &mut dst, &pool).unwrap_err();
        assert!(matches!(err, OptimError::LengthMismatch { expected: 2, found: 3, .. }), "{err}");
        assert!(dst.iter().all(|&x| x == bf16::ONE));
    }
}
