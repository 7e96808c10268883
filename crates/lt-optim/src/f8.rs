//! The `f8` 8-bit state codes: small floats found by integer rounding, not by table search.
//!
//! bitsandbytes' dynamic maps ([`crate::qmap`]) put 256 values in eight runs of evenly spaced
//! entries; finding a value's nearest entry costs a run index and several table reads per element,
//! and on AMD Zen 4 that search made the 8-bit update compute-bound and no faster than PyTorch's
//! memory-bound fused fp32 AdamW (issue 13; docs/benchmarks.md). The `f8` codes keep the dynamic
//! maps' block layout (blocks of 256, one exact f32 absmax per block and moment, the value divided
//! by it before coding) and replace the map by small floats, so that finding and reading a code is
//! a handful of integer operations:
//!
//! - **Rounding.** A normalized value's magnitude is rounded to 3 mantissa bits on its f32 bits:
//!   for `m` to nearest, ties away from zero, `q = (bits + 0x80000) >> 20`, the rounded value's
//!   exponent and top 3 mantissa bits (`q << 20` are its f32 bits), within 2^-4 (6.25%) of the
//!   value, relative; for `v` with a dither (below).
//! - **`m` (signed).** Code = sign (bit 7) | `c`, `c = q - M_BASE`, saturating at 0, and `c = 0`
//!   meaning zero: 127 steps of an eighth of an octave from `|m| / absmax = 1` down to 1.25 * 2^-16;
//!   smaller values flush to zero (a smaller step, never a larger one). This is FP8 E4M3 without
//!   subnormals.
//! - **`v` (unsigned).** Code = `q - V_BASE`, saturating at 0: 255 steps from 1 down to 1.125 * 2^-32
//!   (about 2^-16 in `sqrt(v)`, what the update divides by); smaller values read as that bottom (a
//!   larger `v`: a smaller step, never a larger one). A zero block reads as zeros.
//! - **`v` is rounded with a dither, not to nearest**: `q = (bits + r) >> 20` with `r` in
//!   `[0, 2^20)` from a Weyl sequence in the element's place in its block and the step number
//!   ([`v_dither`]), so a value rounds up with probability equal to its dropped fraction and its
//!   expected code is the value itself. At `beta2 = 0.999`, `v` moves 0.1% per step against its
//!   block's absmax, far less than half a step (3-6%): rounded to nearest, a `v` that should grow or
//!   shrink relative to its block stuck where it was (the noisy quadratic of
//!   `f8_codes_optimize_within_bounds_of_fp32`: 1.39x fp32 AdamW's final loss, against 1.006x
//!   dithered and 1.09x for the dynamic maps). The dither is a function of `(j, t)` only, so the
//!   update stays deterministic: every path, thread split and resumed run gives the same bits. `m`
//!   moves 10% per step (`beta1 = 0.9`) and is rounded to nearest (dithering it changed nothing).
//!
//! The absmax is the block's exact largest magnitude, as in bitsandbytes: a block whose values all
//! decay by `beta2` keeps its codes (but for a rounding at the edge of a step, at the same step
//! number) and reads back `beta2` smaller. (With a rounded, power-of-two scale the codes of a
//! slowly decaying block never moved, and the optimizer did measurably worse:
//! `f8_codes_optimize_within_bounds_of_fp32`.)
//! Against the dynamic maps: the same 2 bytes per parameter plus two f32 per block; each value to
//! 3.1-6.25% (`v`: within one step, 6.25-12.5%, and without bias over the steps; the dynamic maps:
//! 0.7% near the block's absmax, 7% at a tenth of it, coarser below).
//! This is the FP8 idea (torchao's `AdamWFp8` keeps both moments in E4M3 with block scales).
//!
//! The update's arithmetic is the dynamic-map kernel's (`crate::kernels::q8_block_scalar`):
//! `m1 = m0n * (absmax_m * beta1) + g * (scale * (1 - beta1))` with `m0n` the normalized old value,
//! `v1 = v0n * (absmax_v * beta2) + g * (scale^2 * (1 - beta2)) * g`,
//! `p = p * decay + m1 * (-lr / bc1) / (sqrt(v1) / sqrt(bc2) + eps)`, then `m1 * (1 / absmax)`
//! coded; only the codes differ. The dither costs the SIMD kernels no operation: its table, built
//! once per call with `V_FLOOR` folded in, replaces the constant of the rounding add. The portable
//! body below is the definition; the AVX-512 and AVX2 kernels (`x86`) do the same operations lane
//! for lane, and every operation is exact or correctly rounded (integer operations, `mul_add`,
//! `sqrt`, division), so every path gives the same bits.

use half::bf16;

use crate::config::MAX_BLOCK;
use crate::copy::bf16_rne;
use crate::grad::{Grad, GradElem};
use crate::kernels::{COPY_HW, COPY_INT, COPY_STREAM, Coeffs, KernelPath, NO_COPY, Q8Task, copy_mode, q8_tasks};
use crate::pool::ThreadPool;
use crate::qmap::block_absmax;
use crate::simd::SimdLevel;

/// The f32 bits below the 3 kept mantissa bits.
const SHIFT: u32 = 20;
/// `q` of 1.0, the largest normalized magnitude.
const ONE_Q: u32 = 127 << 3;
/// `q` of `m`'s code 0 (1.125 * 2^-16): code `c` is `q = M_BASE + c`, up to 127 (1.0).
const M_BASE: u32 = ONE_Q - 127;
/// `q` of `v`'s code 0 (1.125 * 2^-32): code `c` is `q = V_BASE + c`, up to 255 (1.0).
const V_BASE: u32 = ONE_Q - 255;

// The SIMD kernels' form of `m_code`/`v_code`: a magnitude raised to its window's bottom (bits
// `BASE << 20`) has bits of at least that, so the rounding add can take the base off at once,
// `(bits + ROUND) >> 20 = q - BASE`, and the raise replaces the saturating subtraction.
/// `m`'s window bottom as f32 bits.
const M_FLOOR: u32 = M_BASE << SHIFT;
/// `v`'s window bottom as f32 bits.
const V_FLOOR: u32 = V_BASE << SHIFT;
/// The rounding add with `m`'s base taken off.
const M_ROUND: u32 = 0x80000u32.wrapping_sub(M_FLOOR);

/// The dither of `v`'s rounding (see [`v_dither`]): a two-dimensional Weyl sequence, the R2
/// sequence's constants (the plastic number's powers) in 32-bit fixed point.
const DITHER_J: u32 = 0xC13F_A9A9;
const DITHER_T: u32 = 0x91E1_0DA5;

/// What `v`'s rounding adds to the 20 dropped bits of element `j` of a block at step `t`:
/// `(j * DITHER_J + t * DITHER_T) mod 2^32`, top 20 bits, so `(bits + r) >> 20` rounds up with
/// probability equal to the dropped fraction. Over the steps each element's `r` runs through
/// `[0, 2^20)` evenly (an additive sequence), and within a block neighbours differ.
#[inline(always)]
fn v_dither(j: usize, step: u64) -> u32 {
    (j as u32).wrapping_mul(DITHER_J).wrapping_add((step as u32).wrapping_mul(DITHER_T)) >> (32 - SHIFT)
}

/// `|x|`'s bits (`abs_bits`: `x`'s without the sign) rounded to 3 mantissa bits, to nearest, ties
/// away from zero, as `exponent << 3 | mantissa` (the rounded value's f32 bits `>> 20`). Monotonic
/// in `|x|`. (Ties to even would cost two more operations per 16 values for a case that needs the
/// 20 dropped bits to be exactly `0x80000`.)
#[inline(always)]
fn round_q(abs_bits: u32) -> u32 {
    abs_bits.wrapping_add(0x80000) >> SHIFT
}

/// `1 / absmax`, or 0 where that is not finite (a zero block, whose values all code as 0).
#[inline(always)]
fn inv_scale(absmax: f32) -> f32 {
    let r = 1.0 / absmax;
    if r.is_finite() { r } else { 0.0 }
}

/// The normalized value of `m` code `code`.
#[inline(always)]
fn m_value(code: u8) -> f32 {
    let code = code as u32;
    let c = code & 0x7f;
    let mag = if c == 0 { 0 } else { (M_BASE + c) << SHIFT };
    f32::from_bits(mag | ((code & 0x80) << 24))
}

/// The normalized value of `v` code `code`.
#[inline(always)]
fn v_value(code: u8) -> f32 {
    f32::from_bits((V_BASE + code as u32) << SHIFT)
}

/// The `m` code of the normalized value `x` (`|x| <= 1`).
#[inline(always)]
fn m_code(x: f32) -> u8 {
    let b = x.to_bits();
    (round_q(b & 0x7fff_ffff).saturating_sub(M_BASE) | ((b >> 24) & 0x80)) as u8
}

/// The `v` code of the normalized value `x` (`0 <= x <= 1`: the bits have no sign), rounded with
/// the dither `r` (`v_dither`, below `2^20`): up with probability equal to the dropped fraction.
/// (`1.0`'s low 20 bits are zero, so nothing rounds above it.)
#[inline(always)]
fn v_code(x: f32, r: u32) -> u8 {
    (x.to_bits().wrapping_add(r) >> SHIFT).saturating_sub(V_BASE) as u8
}

/// Codes the block `x` as `m` into `out` (the same length); returns its absmax. The definition the
/// tests hold the fused update to.
#[cfg(test)]
pub(crate) fn quantize_m(x: &[f32], out: &mut [u8]) -> f32 {
    let absmax = block_absmax(x);
    let r = inv_scale(absmax);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = m_code(v * r);
    }
    absmax
}

/// As [`quantize_m`], for `v` (non-negative values) at step `step`: `x` is one block, or its
/// start.
#[cfg(test)]
pub(crate) fn quantize_v(x: &[f32], out: &mut [u8], step: u64) -> f32 {
    let absmax = block_absmax(x);
    let r = inv_scale(absmax);
    for (j, (o, &v)) in out.iter_mut().zip(x).enumerate() {
        *o = v_code(v * r, v_dither(j, step));
    }
    absmax
}

/// `out[i] = m_value(codes[i]) * absmax`.
pub(crate) fn dequantize_m(codes: &[u8], absmax: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = m_value(c) * absmax;
    }
}

/// `out[i] = v_value(codes[i]) * absmax`.
pub(crate) fn dequantize_v(codes: &[u8], absmax: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = v_value(c) * absmax;
    }
}

/// The 8-bit state of one tensor under `f8` codes, borrowed.
pub(crate) struct F8Slices<'a> {
    pub qm: &'a mut [u8],
    pub qv: &'a mut [u8],
    pub am: &'a mut [f32],
    pub av: &'a mut [f32],
    pub block: usize,
}

/// One block (at most [`MAX_BLOCK`] elements): the update, the copy when `COPY`, and the new codes.
/// `tm`/`tv` are scratch of at least the block's length.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block<G: GradElem, const COPY: bool>(
    p: &mut [f32],
    cp: &mut [bf16],
    g: &[G],
    qm: &mut [u8],
    qv: &mut [u8],
    am: &mut f32,
    av: &mut f32,
    c: &Coeffs,
    tm: &mut [f32],
    tv: &mut [f32],
    dither: &[u32],
) {
    let n = p.len();
    let (g, qm, qv, tm, tv, dither) = (&g[..n], &mut qm[..n], &mut qv[..n], &mut tm[..n], &mut tv[..n], &dither[..n]);
    let (am_b1, av_b2) = (*am * c.beta1, *av * c.beta2);
    for i in 0..n {
        let g = g[i].to_f32();
        let m1 = m_value(qm[i]).mul_add(am_b1, g * c.gm);
        let v1 = v_value(qv[i]).mul_add(av_b2, g * c.gv * g);
        let denom = v1.sqrt().mul_add(c.inv_bc2, c.eps);
        p[i] = p[i].mul_add(c.decay, m1 * c.neg_step / denom);
        tm[i] = m1;
        tv[i] = v1;
    }
    if COPY {
        for (d, &x) in cp[..n].iter_mut().zip(p.iter()) {
            *d = bf16_rne(x);
        }
    }
    *am = block_absmax(tm);
    *av = block_absmax(tv);
    let (rm, rv) = (inv_scale(*am), inv_scale(*av));
    for i in 0..n {
        qm[i] = m_code(tm[i] * rm);
        qv[i] = v_code(tv[i] * rv, dither[i]);
    }
}

/// Blocks `done..` of a run (the last may be short); `cp` is empty (no copy) or as long as `p`.
#[inline(always)]
fn blocks<G: GradElem>(p: &mut [f32], cp: &mut [bf16], g: &[G], s: F8Slices<'_>, c: &Coeffs, done: usize) {
    let b = s.block;
    if done >= s.am.len() {
        // Nothing left (the SIMD kernels call this for a short last block): skip the set-up.
        return;
    }
    let mut tm = [0f32; MAX_BLOCK];
    let mut tv = [0f32; MAX_BLOCK];
    let mut dither = [0u32; MAX_BLOCK];
    for (j, d) in dither[..b].iter_mut().enumerate() {
        *d = v_dither(j, c.step);
    }
    let copy = !cp.is_empty();
    for k in done..s.am.len() {
        let lo = k * b;
        let hi = (lo + b).min(p.len());
        let (pb, gb, qm, qv) = (&mut p[lo..hi], &g[lo..hi], &mut s.qm[lo..hi], &mut s.qv[lo..hi]);
        let (am, av) = (&mut s.am[k], &mut s.av[k]);
        if copy {
            block::<G, true>(pb, &mut cp[lo..hi], gb, qm, qv, am, av, c, &mut tm, &mut tv, &dither);
        } else {
            block::<G, false>(pb, &mut [], gb, qm, qv, am, av, c, &mut tm, &mut tv, &dither);
        }
    }
}

/// The kernel that updates whole blocks of `block` elements on `path`: the rule [`run`] dispatches
/// by, and what [`crate::q8_kernel_name_for`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum F8Kernel {
    /// AVX-512 (blocks that are a multiple of 32).
    Avx512,
    /// AVX2, and AVX-512 CPUs for other blocks.
    Avx2,
    /// The portable body.
    Scalar,
}

impl F8Kernel {
    pub(crate) fn select(path: KernelPath, block: usize) -> F8Kernel {
        match path.level {
            SimdLevel::Avx512 if cfg!(target_arch = "x86_64") && block.is_multiple_of(32) => F8Kernel::Avx512,
            SimdLevel::Avx2 | SimdLevel::Avx512 if cfg!(target_arch = "x86_64") => F8Kernel::Avx2,
            _ => F8Kernel::Scalar,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            F8Kernel::Avx512 => "avx512",
            F8Kernel::Avx2 => "avx2",
            F8Kernel::Scalar => "scalar",
        }
    }

    /// Whether it has a streaming form for `COPY_STREAM` (the AVX-512 kernel).
    pub(crate) fn streams_copy(self) -> bool {
        self == F8Kernel::Avx512
    }
}

/// A run of blocks on the calling thread with the kernel of `path` (the same bits on each).
fn run<G: GradElem>(p: &mut [f32], cp: &mut [bf16], g: &[G], s: F8Slices<'_>, c: &Coeffs, path: KernelPath) {
    match F8Kernel::select(path, s.block) {
        #[cfg(target_arch = "x86_64")]
        F8Kernel::Avx512 => {
            let kernel = match copy_mode(path, cp) {
                NO_COPY => x86::blocks_avx512::<G, NO_COPY>,
                COPY_INT => x86::blocks_avx512::<G, COPY_INT>,
                COPY_STREAM => x86::blocks_avx512::<G, COPY_STREAM>,
                _ => x86::blocks_avx512::<G, COPY_HW>,
            };
            // SAFETY: `select` picks this kernel only where `path.level` (from `simd_level`) is
            // AVX-512, which it reports only when the CPU has AVX-512F/BW/DQ (and so FMA, which
            // every AVX-512 CPU has), and for a block size that is a multiple of 32 (at most
            // MAX_BLOCK: `Quant8Config::validate`); `KernelPath::detect` sets `bf16_hw` (COPY_HW,
            // COPY_STREAM) only with AVX512-BF16, and `copy_mode` picks COPY_STREAM only for a
            // 64-byte-aligned copy.
            unsafe { kernel(p, cp, g, s, c) }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `select` picks this kernel only where `path.level` is AVX2 or AVX-512, which
        // `simd_level` reports only on CPUs with AVX2 and FMA.
        F8Kernel::Avx2 => unsafe { x86::blocks_avx2(p, cp, g, s, c) },
        _ => blocks(p, cp, g, s, c, 0),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use half::bf16;

    use super::*;
    use crate::kernels::x86::{PREFETCH_AHEAD, Scratch, prefetch64, store_bf16x8, store_bf16x32, stream_bf16x32};

    /// A block's `v` rounding addends in the SIMD kernels' form: `v_dither(j, step) - V_FLOOR`
    /// (wrapping), so that one add of a value raised to `V_FLOOR` both dithers and takes the base
    /// off, as `M_ROUND` does for `m`: `(bits + r - V_FLOOR) >> 20 = ((bits + r) >> 20) - V_BASE`.
    #[repr(C, align(64))]
    struct Dither([MaybeUninit<u32>; MAX_BLOCK]);

    impl Dither {
        /// The first `b` (at most `MAX_BLOCK`) addends for step `step` written, the rest not.
        #[inline(always)]
        fn new(b: usize, step: u64) -> Dither {
            let mut d = Dither([MaybeUninit::uninit(); MAX_BLOCK]);
            for (j, x) in d.0[..b].iter_mut().enumerate() {
                x.write(v_dither(j, step).wrapping_sub(V_FLOOR));
            }
            d
        }
    }

    /// Whole blocks with AVX-512 (16 lanes, the operations of `block` lane for lane), then the
    /// short last block, if any, with the portable body.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW/DQ and FMA, and AVX512-BF16 for `COPY_HW` and
    /// `COPY_STREAM`; `s.block` must be a multiple of 32 and at most `MAX_BLOCK`; `cp` empty or as
    /// long as `p` (and 64-byte aligned for `COPY_STREAM`), and the state as long as `p` needs.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,fma")]
    pub(super) unsafe fn blocks_avx512<G: GradElem, const COPY: u8>(
        p: &mut [f32],
        cp: &mut [bf16],
        g: &[G],
        s: F8Slices<'_>,
        c: &Coeffs,
    ) {
        let b = s.block;
        let full = p.len() / b;
        // Each block's new moments; the second pass reads only what the first wrote.
        let mut t = Scratch([MaybeUninit::<f32>::uninit(); 2 * MAX_BLOCK]);
        let (tm, tv) = t.0.split_at_mut(MAX_BLOCK);
        let (tm, tv) = (tm.as_mut_ptr() as *mut f32, tv.as_mut_ptr() as *mut f32);
        let (gm, gv) = (_mm512_set1_ps(c.gm), _mm512_set1_ps(c.gv));
        let (inv_bc2, eps, neg_step, decay) =
            (_mm512_set1_ps(c.inv_bc2), _mm512_set1_ps(c.eps), _mm512_set1_ps(c.neg_step), _mm512_set1_ps(c.decay));
        let low7 = _mm512_set1_epi32(0x7f);
        let sign = _mm512_set1_epi32(i32::MIN);
        let bit7 = _mm512_set1_epi32(0x80);
        let (mbase, vbase) = (_mm512_set1_epi32(M_BASE as i32), _mm512_set1_epi32(V_BASE as i32));
        let (mfloor, vfloor) = (_mm512_set1_ps(f32::from_bits(M_FLOOR)), _mm512_set1_ps(f32::from_bits(V_FLOOR)));
        let mhalf = _mm512_set1_epi32(M_ROUND as i32);
        let dither = Dither::new(b, c.step);
        let dv = dither.0.as_ptr() as *const __m512i;
        for k in 0..full {
            let lo = k * b;
            // SAFETY: block k lies within every slice (`full` whole blocks of `p`; the state and
            // a non-empty copy are as long as `p`); the scratch holds MAX_BLOCK >= b per moment;
            // `dither` holds `b` written addends, 64-byte aligned, read at multiples of 16.
            unsafe {
                let (pp, gp, qm, qv) =
                    (p.as_mut_ptr().add(lo), g.as_ptr().add(lo), s.qm.as_mut_ptr().add(lo), s.qv.as_mut_ptr().add(lo));
                let am_b1 = _mm512_set1_ps(s.am[k] * c.beta1);
                let av_b2 = _mm512_set1_ps(s.av[k] * c.beta2);
                let (mut mx, mut vx) = (_mm512_setzero_ps(), _mm512_setzero_ps());
                let mut i = 0;
                while i < b {
                    // Two groups of 16 per turn, so that the copy converts 32 lanes at once.
                    if i % 64 == 0 {
                        // As the dynamic-map kernels do (`kernels::x86::PREFETCH_AHEAD`), but not
                        // the copy for writing: without that, 64M parameters, 2 threads, bf16 +
                        // copy, alternating binaries (session 25), 20.7-21.3 against 20.5-21.5 ms
                        // per step, faster in 5 of 6.
                        let o = lo + i + PREFETCH_AHEAD;
                        prefetch64(o, p.as_ptr(), g.as_ptr(), s.qm.as_ptr(), s.qv.as_ptr());
                    }
                    let mut pn = [_mm512_setzero_ps(); 2];
                    for (h, pn) in pn.iter_mut().enumerate() {
                        let i = i + 16 * h;
                        let gr = G::load16(gp.add(i));
                        // m_value: ((c & 0x7f) + M_BASE) << 20, zero where c & 0x7f is, and the
                        // code's bit 7 as the sign: the sign-extended code has it in bit 31.
                        let cm = _mm512_cvtepi8_epi32(_mm_loadu_si128(qm.add(i) as *const __m128i));
                        let nz = _mm512_test_epi32_mask(cm, low7);
                        let mag =
                            _mm512_maskz_slli_epi32::<20>(nz, _mm512_add_epi32(_mm512_and_si512(cm, low7), mbase));
                        let m0 = _mm512_ternarylogic_epi32::<0xf8>(mag, cm, sign);
                        let cv = _mm512_cvtepu8_epi32(_mm_loadu_si128(qv.add(i) as *const __m128i));
                        let v0 = _mm512_slli_epi32::<20>(_mm512_add_epi32(cv, vbase));
                        let m1 = _mm512_fmadd_ps(_mm512_castsi512_ps(m0), am_b1, _mm512_mul_ps(gr, gm));
                        let v1 =
                            _mm512_fmadd_ps(_mm512_castsi512_ps(v0), av_b2, _mm512_mul_ps(_mm512_mul_ps(gr, gv), gr));
                        let denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v1), inv_bc2, eps);
                        let step = _mm512_div_ps(_mm512_mul_ps(m1, neg_step), denom);
                        *pn = _mm512_fmadd_ps(_mm512_loadu_ps(pp.add(i)), decay, step);
                        _mm512_storeu_ps(pp.add(i), *pn);
                        _mm512_store_ps(tm.add(i), m1);
                        _mm512_store_ps(tv.add(i), v1);
                        // `block_absmax`'s maxima (no NaN reaches the update: such a step is
                        // skipped).
                        // The larger magnitude, sign cleared (`mx` is never negative).
                        mx = _mm512_range_ps::<0b1011>(mx, m1);
                        vx = _mm512_max_ps(vx, v1);
                    }
                    if COPY == COPY_STREAM {
                        // 64-byte aligned: the copy is (`copy_mode`), and lo + i is a multiple of 32.
                        stream_bf16x32(cp.as_mut_ptr().add(lo + i), pn[0], pn[1]);
                    } else if COPY != NO_COPY {
                        store_bf16x32::<COPY>(cp.as_mut_ptr().add(lo + i), pn[0], pn[1]);
                    }
                    i += 32;
                }
                let (am, av) = (_mm512_reduce_max_ps(mx), _mm512_reduce_max_ps(vx));
                s.am[k] = am;
                s.av[k] = av;
                let (rm, rv) = (_mm512_set1_ps(inv_scale(am)), _mm512_set1_ps(inv_scale(av)));
                let mut i = 0;
                while i < b {
                    // m_code and v_code in the `M_ROUND` form (`vrangeps`: the larger magnitude,
                    // sign cleared).
                    let x = _mm512_mul_ps(_mm512_load_ps(tm.add(i)), rm);
                    let a = _mm512_castps_si512(_mm512_range_ps::<0b1011>(x, mfloor));
                    let cm = _mm512_srli_epi32::<20>(_mm512_add_epi32(a, mhalf));
                    let cm =
                        _mm512_ternarylogic_epi32::<0xf8>(cm, _mm512_srli_epi32::<24>(_mm512_castps_si512(x)), bit7);
                    _mm_storeu_si128(qm.add(i) as *mut __m128i, _mm512_cvtepi32_epi8(cm));
                    // v_code with the dither in the `V_ROUND` form (`Dither`).
                    let x = _mm512_max_ps(_mm512_mul_ps(_mm512_load_ps(tv.add(i)), rv), vfloor);
                    let cv = _mm512_srli_epi32::<20>(_mm512_add_epi32(
                        _mm512_castps_si512(x),
                        _mm512_load_si512(dv.add(i / 16)),
                    ));
                    _mm_storeu_si128(qv.add(i) as *mut __m128i, _mm512_cvtepi32_epi8(cv));
                    i += 16;
                }
            }
        }
        if COPY == COPY_STREAM {
            // Streaming stores are weakly ordered: make the copy visible before returning.
            _mm_sfence();
        }
        blocks(p, cp, g, s, c, full)
    }

    /// Whole blocks with AVX2 (8 lanes, the operations of `block` lane for lane), then the short
    /// last block, if any, with the portable body.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `s.block` must be a multiple of 8 (blocks are multiples
    /// of 16: `Quant8Config::validate`); `cp` empty or as long as `p`, and the state as long as `p`
    /// needs.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn blocks_avx2<G: GradElem>(
        p: &mut [f32],
        cp: &mut [bf16],
        g: &[G],
        s: F8Slices<'_>,
        c: &Coeffs,
    ) {
        let b = s.block;
        let full = p.len() / b;
        let copy = !cp.is_empty();
        let mut t = Scratch([MaybeUninit::<f32>::uninit(); 2 * MAX_BLOCK]);
        let (tm, tv) = t.0.split_at_mut(MAX_BLOCK);
        let (tm, tv) = (tm.as_mut_ptr() as *mut f32, tv.as_mut_ptr() as *mut f32);
        let (gm, gv) = (_mm256_set1_ps(c.gm), _mm256_set1_ps(c.gv));
        let (inv_bc2, eps, neg_step, decay) =
            (_mm256_set1_ps(c.inv_bc2), _mm256_set1_ps(c.eps), _mm256_set1_ps(c.neg_step), _mm256_set1_ps(c.decay));
        let low7 = _mm256_set1_epi32(0x7f);
        let sign = _mm256_set1_epi32(i32::MIN);
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let bit7 = _mm256_set1_epi32(0x80);
        let (mbase, vbase) = (_mm256_set1_epi32(M_BASE as i32), _mm256_set1_epi32(V_BASE as i32));
        let (mfloor, vfloor) = (_mm256_set1_ps(f32::from_bits(M_FLOOR)), _mm256_set1_ps(f32::from_bits(V_FLOOR)));
        let mhalf = _mm256_set1_epi32(M_ROUND as i32);
        let dither = Dither::new(b, c.step);
        let dv = dither.0.as_ptr() as *const __m256i;
        for k in 0..full {
            let lo = k * b;
            // SAFETY: block k lies within every slice (`full` whole blocks of `p`; the state and
            // a non-empty copy are as long as `p`); the scratch holds MAX_BLOCK >= b per moment;
            // `dither` holds `b` written addends, 64-byte aligned, read at multiples of 8.
            unsafe {
                let (pp, gp, qm, qv) =
                    (p.as_mut_ptr().add(lo), g.as_ptr().add(lo), s.qm.as_mut_ptr().add(lo), s.qv.as_mut_ptr().add(lo));
                let am_b1 = _mm256_set1_ps(s.am[k] * c.beta1);
                let av_b2 = _mm256_set1_ps(s.av[k] * c.beta2);
                let (mut mx, mut vx) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut i = 0;
                while i < b {
                    let gr = G::load8(gp.add(i));
                    // m_value, as in the AVX-512 kernel; the zero test by a compare.
                    let cm = _mm256_cvtepi8_epi32(_mm_loadl_epi64(qm.add(i) as *const __m128i));
                    let c7 = _mm256_and_si256(cm, low7);
                    let nz = _mm256_cmpgt_epi32(c7, _mm256_setzero_si256());
                    let mag = _mm256_and_si256(_mm256_slli_epi32::<20>(_mm256_add_epi32(c7, mbase)), nz);
                    let m0 = _mm256_or_si256(mag, _mm256_and_si256(cm, sign));
                    let cv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qv.add(i) as *const __m128i));
                    let v0 = _mm256_slli_epi32::<20>(_mm256_add_epi32(cv, vbase));
                    let m1 = _mm256_fmadd_ps(_mm256_castsi256_ps(m0), am_b1, _mm256_mul_ps(gr, gm));
                    let v1 = _mm256_fmadd_ps(_mm256_castsi256_ps(v0), av_b2, _mm256_mul_ps(_mm256_mul_ps(gr, gv), gr));
                    let denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v1), inv_bc2, eps);
                    let step = _mm256_div_ps(_mm256_mul_ps(m1, neg_step), denom);
                    let pn = _mm256_fmadd_ps(_mm256_loadu_ps(pp.add(i)), decay, step);
                    _mm256_storeu_ps(pp.add(i), pn);
                    if copy {
                        store_bf16x8(cp.as_mut_ptr().add(lo + i), pn);
                    }
                    _mm256_store_ps(tm.add(i), m1);
                    _mm256_store_ps(tv.add(i), v1);
                    mx = _mm256_max_ps(mx, _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(m1), abs)));
                    vx = _mm256_max_ps(vx, v1);
                    i += 8;
                }
                let (am, av) = (max8(mx), max8(vx));
                s.am[k] = am;
                s.av[k] = av;
                let (rm, rv) = (_mm256_set1_ps(inv_scale(am)), _mm256_set1_ps(inv_scale(av)));
                let mut i = 0;
                while i < b {
                    // m_code and v_code as in the AVX-512 kernel, the clamp by a maximum.
                    let x = _mm256_mul_ps(_mm256_load_ps(tm.add(i)), rm);
                    let a = _mm256_max_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(x), abs)), mfloor);
                    let cm = _mm256_srli_epi32::<20>(_mm256_add_epi32(_mm256_castps_si256(a), mhalf));
                    let cm =
                        _mm256_or_si256(cm, _mm256_and_si256(_mm256_srli_epi32::<24>(_mm256_castps_si256(x)), bit7));
                    store_bytes8(qm.add(i), cm);
                    let x = _mm256_max_ps(_mm256_mul_ps(_mm256_load_ps(tv.add(i)), rv), vfloor);
                    let cv = _mm256_srli_epi32::<20>(_mm256_add_epi32(
                        _mm256_castps_si256(x),
                        _mm256_load_si256(dv.add(i / 8)),
                    ));
                    store_bytes8(qv.add(i), cv);
                    i += 8;
                }
            }
        }
        blocks(p, cp, g, s, c, full)
    }

    /// The largest of 8 lanes (no NaN).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn max8(x: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m)))
    }

    /// Stores 8 i32 lanes in 0..=255 as 8 bytes at `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writing 8 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store_bytes8(dst: *mut u8, x: __m256i) {
        // Every lane fits a byte, so the saturating packs are exact: each 128-bit lane ends with
        // its 4 results in its first 4 bytes.
        let w = _mm256_packus_epi32(x, x);
        let b = _mm256_packus_epi16(w, w);
        let lo = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
        // SAFETY: the caller guarantees 8 writable bytes.
        unsafe { _mm_storel_epi64(dst as *mut __m128i, lo) }
    }
}

/// Updates one tensor with `f8` state, and writes its bf16 copy when `cp` is given. Lengths must
/// be consistent (checked by the caller).
pub(crate) fn update_f8(
    p: &mut [f32],
    g: Grad<'_>,
    s: F8Slices<'_>,
    cp: Option<&mut [bf16]>,
    c: &Coeffs,
    pool: &ThreadPool,
    path: KernelPath,
) {
    let b = s.block;
    let whole = Q8Task { p, cp: cp.unwrap_or_default(), g, qm: s.qm, qv: s.qv, am: s.am, av: s.av };
    q8_tasks(whole, b, pool, |t| {
        let s = F8Slices { qm: t.qm, qv: t.qv, am: t.am, av: t.av, block: b };
        match t.g {
            Grad::F32(g) => run(t.p, t.cp, g, s, c, path),
            Grad::Bf16(g) => run(t.p, t.cp, g, s, c, path),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AdamWConfig;
    use crate::simd::simd_level;
    use crate::testutil::SplitMix64;

    fn coeffs(step: u64, scale: f32) -> Coeffs {
        Coeffs::new(&AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() }, step, scale)
    }

    /// Values over 40 octaves, both signs, with exact zeros and ties of the rounding.
    fn spread(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match i % 29 {
                0 => 0.0,
                // A tie: 3 kept mantissa bits, then exactly half a step.
                1 => f32::from_bits((120 << 23) | (5 << 20) | 0x80000),
                _ => (rng.uniform() - 0.5) * 2f32.powi(-((i % 41) as i32)),
            })
            .collect()
    }

    /// The f32 of the `q` that `x` rounds to, by the definition: the representable value nearest
    /// to `|x|` with 3 mantissa bits, the larger one on a tie (in f64, exact for these values).
    fn nearest_3bit(x: f32) -> f32 {
        let a = x.abs() as f64;
        if a == 0.0 {
            return 0.0;
        }
        let e = a.log2().floor();
        let step = 2f64.powf(e - 3.0);
        let lo = (a / step).floor() * step;
        let r = if a - lo >= step / 2.0 { lo + step } else { lo };
        r as f32
    }

    /// The two values with 3 mantissa bits around `|x|` (both `|x|` when it has 3 bits).
    fn bracket_3bit(x: f32) -> (f32, f32) {
        let a = x.abs() as f64;
        if a == 0.0 {
            return (0.0, 0.0);
        }
        let step = 2f64.powf(a.log2().floor() - 3.0);
        let lo = (a / step).floor() * step;
        (lo as f32, if lo == a { lo as f32 } else { (lo + step) as f32 })
    }

    #[test]
    fn rounding_is_nearest_with_three_mantissa_bits() {
        let mut rng = SplitMix64::new(11);
        for x in spread(&mut rng, 20_000).into_iter().filter(|x| x.abs() >= f32::MIN_POSITIVE) {
            let r = f32::from_bits(round_q(x.to_bits() & 0x7fff_ffff) << SHIFT);
            assert_eq!(r, nearest_3bit(x), "{x:e}");
            assert!((r - x.abs()).abs() <= x.abs() / 16.0, "{x:e} -> {r:e}");
        }
    }

    /// A value reads back as its block's absmax times the normalized value rounded to 3 mantissa
    /// bits (`m`: to nearest, with its sign; `v`: to one of its two neighbours, the dither's
    /// choice), down to 2^-16 of the absmax for `m` (below: 0) and 2^-32 for `v` (below: 2^-32 of
    /// the absmax, never a smaller `v`); the absmax is the block's exact largest magnitude; a zero
    /// block reads back as zeros; and a block scaled by `beta2` keeps its codes.
    #[test]
    fn codes_read_back_as_the_format_says() {
        let mut rng = SplitMix64::new(12);
        for _ in 0..50 {
            let x = spread(&mut rng, 256);
            let (mut cm, mut cv) = (vec![0u8; 256], vec![0u8; 256]);
            let am = quantize_m(&x, &mut cm);
            let vx: Vec<f32> = x.iter().map(|a| a * a).collect();
            let step = rng.next_u64() % 100_000;
            let av = quantize_v(&vx, &mut cv, step);
            assert_eq!(am, x.iter().fold(0f32, |a, b| a.max(b.abs())));
            assert_eq!(av, vx.iter().fold(0f32, |a, &b| a.max(b)));
            let (mut m, mut v) = (vec![0f32; 256], vec![0f32; 256]);
            dequantize_m(&cm, am, &mut m);
            dequantize_v(&cv, av, &mut v);
            let (rm, rv) = (1.0 / am, 1.0 / av);
            // The windows' bottoms: codes 1 of `m` (1.25 * 2^-16) and 0 of `v` (1.125 * 2^-32).
            let (m_floor, v_floor) = (m_value(1), v_value(0));
            assert_eq!((m_floor, v_floor), (1.25 * 2f32.powi(-16), 1.125 * 2f32.powi(-32)));
            for i in 0..256 {
                let n = nearest_3bit(x[i] * rm);
                let want = if n >= m_floor { n.copysign(x[i]) * am } else { 0.0 };
                assert_eq!(m[i].abs(), want.abs(), "m {:e}", x[i]);
                assert!(m[i] == 0.0 || m[i].signum() == x[i].signum(), "m {:e}: sign", x[i]);
                let (lo, hi) = bracket_3bit(vx[i] * rv);
                let (lo, hi) = (lo.max(v_floor) * av, hi.max(v_floor) * av);
                assert!(v[i] == lo || v[i] == hi, "v {:e}: {:e} not {lo:e} or {hi:e}", vx[i], v[i]);
            }
            let mut again = vec![0u8; 256];
            let b2 = AdamWConfig::default().beta2 as f32;
            let decayed: Vec<f32> = vx.iter().map(|a| a * b2).collect();
            assert_eq!(quantize_v(&decayed, &mut again, step), av * b2);
            let moved = again.iter().zip(&cv).filter(|(a, b)| a != b).count();
            assert!(moved <= 2, "{moved} codes moved under a uniform decay");
        }
        let (mut cm, mut cv) = (vec![9u8; 64], vec![9u8; 64]);
        assert_eq!(quantize_m(&[0.0; 64], &mut cm), 0.0);
        assert_eq!(quantize_v(&[0.0; 64], &mut cv, 1), 0.0);
        let (mut m, mut v) = (vec![1f32; 64], vec![1f32; 64]);
        dequantize_m(&cm, 0.0, &mut m);
        dequantize_v(&cv, 0.0, &mut v);
        assert!(m.iter().chain(&v).all(|&x| x.to_bits() == 0));
    }

    /// `v`'s dithered rounding is unbiased: a normalized value held fixed and coded at steps
    /// 1..=4096 reads back on average as itself to within 1/256 of its rounding step (rounding to
    /// nearest is off by up to half a step, and that bias is what let `v` stick), for elements at
    /// the start, inside and at the end of a block; and the 256 elements of a block, all holding
    /// that value, read back on average within 1/32 of a step of it at one step.
    #[test]
    fn v_rounding_is_unbiased_over_steps() {
        let mut rng = SplitMix64::new(14);
        let read = |x: f32, j: usize, t: u64| v_value(v_code(x, v_dither(j, t))) as f64;
        let mut checked = 0;
        while checked < 200 {
            let x = rng.uniform().abs() * 2f32.powi(-((rng.next_u64() % 30) as i32));
            let (lo, hi) = bracket_3bit(x);
            if lo < v_value(0) || lo == hi {
                continue;
            }
            let step = (hi - lo) as f64;
            for j in [0usize, 7, 255] {
                let mean = (1..=4096u64).map(|t| read(x, j, t)).sum::<f64>() / 4096.0;
                assert!((mean - x as f64).abs() <= step / 256.0, "{x:e}, element {j}: mean {mean:e}");
                assert!((1..=64u64).all(|t| [lo, hi].contains(&(read(x, j, t) as f32))), "{x:e}: a neighbour");
            }
            let mean = (0..256).map(|j| read(x, j, 9)).sum::<f64>() / 256.0;
            assert!((mean - x as f64).abs() <= step / 32.0, "{x:e}, one step: mean {mean:e}");
            checked += 1;
        }
    }

    /// The kernel reported for a block size is the one `run` dispatches to: AVX-512 only for
    /// blocks that are a multiple of 32, where the CPU has it.
    #[test]
    fn the_kernel_name_follows_the_dispatch_rule() {
        let path = KernelPath::detect();
        for b in [256usize, 64, 48, 16] {
            let cfg = crate::Quant8Config { block_size: b, codes: crate::Q8Codes::F8, ..Default::default() };
            let k = F8Kernel::select(path, b);
            assert_eq!(crate::q8_kernel_name_for(&cfg), k.name());
            let want = match simd_level() {
                SimdLevel::Avx512 if b.is_multiple_of(32) => F8Kernel::Avx512,
                SimdLevel::Avx2 | SimdLevel::Avx512 => F8Kernel::Avx2,
                _ => F8Kernel::Scalar,
            };
            assert_eq!(k, want, "block {b}");
        }
    }

    type State = (Vec<f32>, Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>);

    /// The whole update as a composition of the format's parts, on plain slices: the normalized
    /// old values, AdamW in f32 (the operations of the dynamic-map kernel), `quantize_m/v`.
    fn reference(st: &mut State, g: &[f32], b: usize, c: &Coeffs) {
        let (p, qm, qv, am, av) = st;
        for k in 0..am.len() {
            let r = k * b..(k * b + b).min(p.len());
            let n = r.len();
            let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
            for (j, i) in r.clone().enumerate() {
                m[j] = m_value(qm[i]).mul_add(am[k] * c.beta1, g[i] * c.gm);
                v[j] = v_value(qv[i]).mul_add(av[k] * c.beta2, g[i] * c.gv * g[i]);
                let denom = v[j].sqrt().mul_add(c.inv_bc2, c.eps);
                p[i] = p[i].mul_add(c.decay, m[j] * c.neg_step / denom);
            }
            am[k] = quantize_m(&m, &mut qm[r.clone()]);
            av[k] = quantize_v(&v, &mut qv[r], c.step);
        }
    }

    fn run_path(path: KernelPath, b: usize, grad: Grad<'_>, c: &Coeffs, pool: &ThreadPool, st: &State) -> State {
        let (mut p, mut qm, mut qv, mut am, mut av) = st.clone();
        let s = F8Slices { qm: &mut qm, qv: &mut qv, am: &mut am, av: &mut av, block: b };
        update_f8(&mut p, grad, s, None, c, pool, path);
        let plain = (p, qm, qv, am, av);
        // The copy 64-byte aligned and not (the kernels store 64 and 16 bytes at a time).
        let mut buf = vec![bf16::from_bits(0x5555); plain.0.len() + 33];
        let aligned = buf.as_ptr().align_offset(64);
        for off in [aligned, aligned + 1] {
            let (mut p, mut qm, mut qv, mut am, mut av) = st.clone();
            let cp = &mut buf[off..off + p.len()];
            let s = F8Slices { qm: &mut qm, qv: &mut qv, am: &mut am, av: &mut av, block: b };
            update_f8(&mut p, grad, s, Some(cp), c, pool, path);
            assert!(bits(&(p, qm, qv, am, av)) == bits(&plain), "{path:?}: the copy changed the update");
            for (x, y) in plain.0.iter().zip(&buf[off..]) {
                assert_eq!(y.to_bits(), bf16::from_f32(*x).to_bits(), "{path:?}, offset {off}: copy of {x:e}");
            }
        }
        plain
    }

    /// Every bit of a state, for comparing states.
    fn bits(s: &State) -> Vec<u32> {
        let f = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let c = |v: &Vec<u8>| v.iter().map(|&x| x as u32).collect::<Vec<_>>();
        [f(&s.0), c(&s.1), c(&s.2), f(&s.3), f(&s.4)].concat()
    }

    /// Every kernel this CPU runs (the AVX-512 one, with each bf16 conversion and with the copy's
    /// streaming stores, and the portable body compiled for AVX2 and for no SIMD) gives the bits of
    /// the composition above, step after step, for bf16 and f32 gradients, with and without the
    /// bf16 copy (aligned and not: `run_path`), for blocks the AVX-512 kernel takes (256, 64) and
    /// one it leaves to the portable body (48), and a short last block; with clipping, zero and
    /// tiny gradients, and a subnormal weight for the copy.
    #[test]
    fn every_path_gives_the_composition_bits() {
        let pool = ThreadPool::new(2).unwrap();
        let mut paths = vec![KernelPath::plain(SimdLevel::Scalar)];
        if simd_level() >= SimdLevel::Avx2 {
            paths.push(KernelPath::plain(SimdLevel::Avx2));
        }
        if simd_level() >= SimdLevel::Avx512 {
            paths.push(KernelPath::plain(SimdLevel::Avx512));
            if crate::simd::has_avx512bf16() {
                paths.push(KernelPath { bf16_hw: true, ..KernelPath::plain(SimdLevel::Avx512) });
                paths.push(KernelPath { bf16_hw: true, stream_copy: true, ..KernelPath::plain(SimdLevel::Avx512) });
            }
        }
        let mut rng = SplitMix64::new(13);
        for (b, n) in [(256usize, 256 * 300 + 100), (64, 64 * 9), (48, 48 * 7 + 5), (256, 70_000usize)] {
            let nb = n.div_ceil(b);
            let mut p: Vec<f32> = rng.uniform_vec(n).iter().map(|x| x - 0.5).collect();
            p[3] = f32::from_bits(5); // subnormal: `vcvtneps2bf16` alone would read it as 0
            let mut st: State = (p, vec![0; n], vec![0; n], vec![0.0; nb], vec![0.0; nb]);
            for step in 1..=6u64 {
                let mut g = spread(&mut rng, n);
                if step == 4 {
                    g[..b].iter_mut().for_each(|x| *x = 0.0); // a block with no gradient
                }
                let g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
                let g16f: Vec<f32> = g16.iter().map(|x| x.to_f32()).collect();
                let c = coeffs(step, if step % 2 == 0 { 0.5 } else { 1.0 });
                let mut want32 = st.clone();
                reference(&mut want32, &g, b, &c);
                let mut want16 = st.clone();
                reference(&mut want16, &g16f, b, &c);
                for &path in &paths {
                    let got = run_path(path, b, Grad::F32(&g), &c, &pool, &st);
                    assert!(bits(&got) == bits(&want32), "{path:?}, block {b}, {n} params, step {step}, f32 grads");
                    let got = run_path(path, b, Grad::Bf16(&g16), &c, &pool, &st);
                    assert!(bits(&got) == bits(&want16), "{path:?}, block {b}, {n} params, step {step}, bf16 grads");
                }
                st = want32;
            }
            // The state moved: nonzero codes of both signs, and blocks of different maxima.
            assert!(st.1.iter().any(|&c| c > 0x80) && st.1.iter().any(|&c| c > 0 && c < 0x80));
            assert!(st.3.iter().any(|&a| a != st.3[0]));
        }
    }
}
