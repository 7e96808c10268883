//! Gradients as they arrive, and the sum of squares taken in the same pass ("fast clipping").
//!
//! Global-norm clipping needs `sum(g^2)` over every gradient of the model before any update. Reading
//! all gradients once more just for that would cost as much memory traffic as a third of the 8-bit
//! update itself, so the executor instead asks for the sum of squares while it is already touching
//! each layer's gradients: when it converts bf16 to f32 ([`copy_into`]), accumulates micro-batches
//! ([`accumulate_into`]), or, when it hands bf16 gradients straight to the optimizer, with
//! [`sum_squares`] over the freshly downloaded buffer. [`GradNorm`] adds the per-layer sums; the clip
//! scale then goes into the update kernel (see [`crate::AdamW::begin_step`]).
//!
//! Sums are taken in f64 over fixed 32 Ki-element chunks and added in chunk order, so the result does
//! not depend on the number of threads.

use half::bf16;

use crate::error::{OptimError, Result};
use crate::pool::{ThreadPool, run_tasks};
use crate::simd::{SimdLevel, simd_level};

/// A read-only view of one tensor's gradient, f32 or bf16.
#[derive(Debug, Clone, Copy)]
pub enum Grad<'a> {
    /// fp32 gradient.
    F32(&'a [f32]),
    /// bf16 gradient (as downloaded from the GPU); widened to f32 inside the kernels, exactly.
    Bf16(&'a [bf16]),
}

impl<'a> Grad<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Grad::F32(g) => g.len(),
            Grad::Bf16(g) => g.len(),
        }
    }

    /// Whether the gradient has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per element (4 or 2).
    pub fn elem_bytes(&self) -> usize {
        match self {
            Grad::F32(_) => 4,
            Grad::Bf16(_) => 2,
        }
    }

    /// The sub-range `start..start + len`, clamped to the gradient (internal callers pass valid ranges).
    pub(crate) fn slice(&self, start: usize, len: usize) -> Grad<'a> {
        let n = self.len();
        let s = start.min(n);
        let e = start.saturating_add(len).min(n);
        match self {
            Grad::F32(g) => Grad::F32(&g[s..e]),
            Grad::Bf16(g) => Grad::Bf16(&g[s..e]),
        }
    }
}

impl<'a> From<&'a [f32]> for Grad<'a> {
    fn from(g: &'a [f32]) -> Self {
        Grad::F32(g)
    }
}

impl<'a> From<&'a [bf16]> for Grad<'a> {
    fn from(g: &'a [bf16]) -> Self {
        Grad::Bf16(g)
    }
}

/// An element type a gradient can be stored in.
pub(crate) trait GradElem: Copy + Send + Sync + 'static {
    /// Widen to f32 (exact for both types).
    fn to_f32(self) -> f32;

    /// Loads 16 elements widened to f32.
    ///
    /// # Safety
    /// `ptr` must be valid for reading 16 elements and the CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(ptr: *const Self) -> std::arch::x86_64::__m512;

    /// Loads 8 elements widened to f32.
    ///
    /// # Safety
    /// `ptr` must be valid for reading 8 elements and the CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(ptr: *const Self) -> std::arch::x86_64::__m256;
}

impl GradElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(ptr: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller guarantees 16 readable elements.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(ptr) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(ptr: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller guarantees 8 readable elements.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(ptr) }
    }
}

impl GradElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the top half of an f32: widening is a shift, exact for every value including NaN.
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(ptr: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 16 readable elements (32 bytes); bf16 is a transparent u16.
        let h = unsafe { _mm256_loadu_si256(ptr as *const __m256i) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(ptr: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 8 readable elements (16 bytes); bf16 is a transparent u16.
        let h = unsafe { _mm_loadu_si128(ptr as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

/// Running global gradient norm: add each layer's sum of squares as it arrives.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GradNorm {
    sumsq: f64,
}

impl GradNorm {
    /// An empty accumulator.
    pub fn new() -> Self {
        GradNorm::default()
    }

    /// Adds one tensor's or layer's sum of squares (as returned by this module's functions).
    pub fn add(&mut self, sumsq: f64) {
        self.sumsq += sumsq;
    }

    /// Adds another accumulator (e.g. one per pipeline stage).
    pub fn merge(&mut self, other: GradNorm) {
        self.sumsq += other.sumsq;
    }

    /// Total sum of squares so far.
    pub fn sum_squares(&self) -> f64 {
        self.sumsq
    }

    /// The L2 norm. NaN or infinite when any gradient held a NaN or an infinity (squares of finite
    /// f32 values cannot overflow f64), which makes [`crate::AdamW::begin_step`] skip the step.
    pub fn norm(&self) -> f64 {
        self.sumsq.sqrt()
    }
}

/// Elements per task and per partial sum. Fixed, so sums are identical for any thread count.
const CHUNK: usize = 1 << 15;
/// Below this, threads cost more than they save.
const PAR_MIN: usize = 1 << 17;

/// `sum(g^2)` in f64.
pub fn sum_squares(g: Grad<'_>, pool: &ThreadPool) -> f64 {
    let n = g.len();
    let mut partial = vec![0f64; n.div_ceil(CHUNK)];
    let tasks = partial.iter_mut().enumerate();
    let work = |(i, out): (usize, &mut f64)| {
        *out = match g.slice(i * CHUNK, CHUNK) {
            Grad::F32(x) => sumsq_dispatch(x),
            Grad::Bf16(x) => sumsq_dispatch(x),
        }
    };
    if n < PAR_MIN || pool.threads() == 1 {
        tasks.for_each(work);
    } else {
        run_tasks(pool, tasks, work);
    }
    partial.iter().sum()
}

/// `dst = src * scale`, returning `sum(dst^2)`: the bf16 -> f32 widening and the norm in one pass.
/// `scale` is usually 1 (exact) or `1 / micro_batches`.
pub fn copy_into(src: Grad<'_>, dst: &mut [f32], scale: f32, pool: &ThreadPool) -> Result<f64> {
    fuse(src, dst, scale, pool, false)
}

/// `dst += src * scale`, returning `sum(dst^2)` of the updated buffer: accumulate micro-batch
/// gradients into the host master buffer; the value returned by the last micro-batch's call is the
/// layer's contribution to the global norm.
pub fn accumulate_into(src: Grad<'_>, dst: &mut [f32], scale: f32, pool: &ThreadPool) -> Result<f64> {
    fuse(src, dst, scale, pool, true)
}

/// `dst = src` for a bf16 gradient kept as it landed (the optimizer then reads it as bf16), with -0
/// stored as +0, returning `sum(dst^2)`: widened, `dst` is bit for bit what [`accumulate_into`] of
/// `src` into a zeroed f32 buffer leaves (where `+0 + -0 = +0`), and the sum is that call's, bit for
/// bit (same chunks, same lanes, same order), so the clip scale and every update are unchanged by
/// keeping the gradient in half the memory.
pub fn land_bf16(src: &[bf16], dst: &mut [bf16], pool: &ThreadPool) -> Result<f64> {
    if src.len() != dst.len() {
        return Err(OptimError::LengthMismatch {
            what: "bf16 gradient destination".into(),
            expected: src.len(),
            found: dst.len(),
        });
    }
    Ok(chunked_sum(dst, pool, |i, d| land_dispatch(&src[i * CHUNK..i * CHUNK + d.len()], d)))
}

/// Runs `work(i, chunk i of dst)` over `dst` in [`CHUNK`]-element chunks (on `pool` above
/// [`PAR_MIN`] elements) and adds the sums it returns in chunk order, so that the result does not
/// depend on the number of threads.
fn chunked_sum<D: Send>(dst: &mut [D], pool: &ThreadPool, work: impl Fn(usize, &mut [D]) -> f64 + Sync) -> f64 {
    let n = dst.len();
    let mut partial = vec![0f64; n.div_ceil(CHUNK)];
    let tasks = dst.chunks_mut(CHUNK).zip(partial.iter_mut()).enumerate();
    let job = |(i, (d, out)): (usize, (&mut [D], &mut f64))| *out = work(i, d);
    if n < PAR_MIN || pool.threads() == 1 {
        tasks.for_each(job);
    } else {
        run_tasks(pool, tasks, job);
    }
    partial.iter().sum()
}

fn fuse(src: Grad<'_>, dst: &mut [f32], scale: f32, pool: &ThreadPool, acc: bool) -> Result<f64> {
    if src.len() != dst.len() {
        return Err(OptimError::LengthMismatch {
            what: "gradient destination".into(),
            expected: src.len(),
            found: dst.len(),
        });
    }
    Ok(chunked_sum(dst, pool, |i, d| match src.slice(i * CHUNK, d.len()) {
        Grad::F32(s) => fuse_dispatch(s, d, scale, acc),
        Grad::Bf16(s) => fuse_dispatch(s, d, scale, acc),
    }))
}

// ---- kernels: one generic body, compiled per instruction set ----

#[inline(always)]
fn sumsq_body<T: GradElem>(x: &[T]) -> f64 {
    // 16 independent f64 accumulators: enough to hide the add latency once vectorised.
    let mut acc = [0f64; 16];
    let mut it = x.chunks_exact(16);
    for c in &mut it {
        for k in 0..16 {
            let v = c[k].to_f32() as f64;
            acc[k] += v * v;
        }
    }
    let mut tail = 0f64;
    for v in it.remainder() {
        let v = v.to_f32() as f64;
        tail += v * v;
    }
    acc.iter().sum::<f64>() + tail
}

#[inline(always)]
fn fuse_body<T: GradElem>(s: &[T], d: &mut [f32], scale: f32, acc_mode: bool) -> f64 {
    let mut acc = [0f64; 16];
    let mut dc = d.chunks_exact_mut(16);
    let mut sc = s.chunks_exact(16);
    for (dd, ss) in (&mut dc).zip(&mut sc) {
        for k in 0..16 {
            let g = ss[k].to_f32() * scale;
            let v = if acc_mode { dd[k] + g } else { g };
            dd[k] = v;
            acc[k] += v as f64 * v as f64;
        }
    }
    let mut tail = 0f64;
    for (dd, ss) in dc.into_remainder().iter_mut().zip(sc.remainder()) {
        let g = ss.to_f32() * scale;
        let v = if acc_mode { *dd + g } else { g };
        *dd = v;
        tail += v as f64 * v as f64;
    }
    acc.iter().sum::<f64>() + tail
}

/// `d = s` with -0 as +0, returning `sum(d^2)` in [`fuse_body`]'s lanes and order (so the same bits as
/// widening `s` into zeros there).
#[inline(always)]
fn land_body(s: &[bf16], d: &mut [bf16]) -> f64 {
    // -0 (0x8000) becomes +0, as `+0 + -0` does in fp32; every other value keeps its bits.
    let canon = |b: u16| if b == 0x8000 { 0 } else { b };
    let mut acc = [0f64; 16];
    let mut dc = d.chunks_exact_mut(16);
    let mut sc = s.chunks_exact(16);
    for (dd, ss) in (&mut dc).zip(&mut sc) {
        for k in 0..16 {
            dd[k] = bf16::from_bits(canon(ss[k].to_bits()));
            let v = GradElem::to_f32(dd[k]);
            acc[k] += v as f64 * v as f64;
        }
    }
    let mut tail = 0f64;
    for (dd, ss) in dc.into_remainder().iter_mut().zip(sc.remainder()) {
        *dd = bf16::from_bits(canon(ss.to_bits()));
        let v = GradElem::to_f32(*dd);
        tail += v as f64 * v as f64;
    }
    acc.iter().sum::<f64>() + tail
}

fn land_dispatch(s: &[bf16], d: &mut [bf16]) -> f64 {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `sumsq_dispatch`.
        SimdLevel::Avx512 => unsafe { x86::land_avx512(s, d) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `sumsq_dispatch`.
        SimdLevel::Avx2 => unsafe { x86::land_avx2(s, d) },
        _ => land_body(s, d),
    }
}

fn sumsq_dispatch<T: GradElem>(x: &[T]) -> f64 {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `simd_level` reports AVX-512F only when the CPU has it.
        SimdLevel::Avx512 => unsafe { x86::sumsq_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `simd_level` reports AVX2 only when the CPU has AVX2 and FMA.
        SimdLevel::Avx2 => unsafe { x86::sumsq_avx2(x) },
        _ => sumsq_body(x),
    }
}

fn fuse_dispatch<T: GradElem>(s: &[T], d: &mut [f32], scale: f32, acc: bool) -> f64 {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `sumsq_dispatch`.
        SimdLevel::Avx512 => unsafe { x86::fuse_avx512(s, d, scale, acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `sumsq_dispatch`.
        SimdLevel::Avx2 => unsafe { x86::fuse_avx2(s, d, scale, acc) },
        _ => fuse_body(s, d, scale, acc),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{GradElem, bf16, fuse_body, land_body, sumsq_body};

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn land_avx512(s: &[bf16], d: &mut [bf16]) -> f64 {
        land_body(s, d)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn land_avx2(s: &[bf16], d: &mut [bf16]) -> f64 {
        land_body(s, d)
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sumsq_avx512<T: GradElem>(x: &[T]) -> f64 {
        sumsq_body(x)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sumsq_avx2<T: GradElem>(x: &[T]) -> f64 {
        sumsq_body(x)
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fuse_avx512<T: GradElem>(s: &[T], d: &mut [f32], scale: f32, acc: bool) -> f64 {
        fuse_body(s, d, scale, acc)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fuse_avx2<T: GradElem>(s: &[T], d: &mut [f32], scale: f32, acc: bool) -> f64 {
        fuse_body(s, d, scale, acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::SplitMix64;

    fn exact_sumsq(x: &[f32]) -> f64 {
        x.iter().map(|&v| v as f64 * v as f64).sum()
    }

    #[test]
    fn bf16_copy_widens_exactly_and_returns_sum_of_squares() {
        let pool = ThreadPool::new(2).unwrap();
        let mut rng = SplitMix64::new(3);
        let n = 300_001; // several chunks, a ragged tail, above the parallel threshold
        let src: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.uniform() * 3.0)).collect();
        let mut dst = vec![0f32; n];
        let s = copy_into(Grad::Bf16(&src), &mut dst, 1.0, &pool).unwrap();
        assert!(dst.iter().zip(&src).all(|(d, s)| *d == s.to_f32()));
        // f64 sums of f32 squares: the only error is the f64 summation order, ~n * 2^-53 relative.
        let want = exact_sumsq(&dst);
        assert!((s - want).abs() <= want * 1e-12, "{s} vs {want}");
        assert_eq!(sum_squares(Grad::Bf16(&src), &pool).to_bits(), s.to_bits());
    }

    #[test]
    fn accumulate_scales_adds_and_is_thread_count_independent() {
        let mut rng = SplitMix64::new(4);
        let n = 200_000;
        let a = rng.uniform_vec(n);
        let b = rng.uniform_vec(n);
        let mut sums = Vec::new();
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            let mut dst = a.clone();
            let s = accumulate_into(Grad::F32(&b), &mut dst, 0.5, &pool).unwrap();
            for i in 0..n {
                assert_eq!(dst[i], a[i] + b[i] * 0.5);
            }
            sums.push(s.to_bits());
            let want = exact_sumsq(&dst);
            assert!((s - want).abs() <= want * 1e-12);
        }
        assert!(sums.windows(2).all(|w| w[0] == w[1]), "sum depends on thread count");
    }

    #[test]
    fn nan_or_inf_gradient_makes_norm_non_finite() {
        let pool = ThreadPool::new(1).unwrap();
        let mut g = vec![1.0f32; 1000];
        g[500] = f32::NAN;
        let mut norm = GradNorm::new();
        norm.add(sum_squares(Grad::F32(&g), &pool));
        assert!(!norm.norm().is_finite());
        g[500] = f32::INFINITY;
        let mut norm = GradNorm::new();
        norm.add(sum_squares(Grad::F32(&g), &pool));
        assert!(!norm.norm().is_finite());
        // The largest finite f32 squared is finite in f64: no false skip.
        g[500] = f32::MAX;
        let mut norm = GradNorm::new();
        norm.add(sum_squares(Grad::F32(&g), &pool));
        assert!(norm.norm().is_finite());
    }

    /// Kept as bf16, a gradient is what accumulating it into zeroed f32 gives, widened, bit for bit
    /// (signed zeros, subnormals, infinities and NaN included), with the same sum of squares, for
    /// any thread count.
    #[test]
    fn a_landed_bf16_gradient_equals_its_f32_accumulation_into_zero() {
        let mut rng = SplitMix64::new(5);
        let n = 300_001;
        let mut src: Vec<bf16> = (0..n).map(|_| bf16::from_f32((rng.uniform() - 0.5) * 1e-3)).collect();
        let specials = [-0.0, 0.0, f32::MIN_POSITIVE / 4.0, -f32::MIN_POSITIVE / 8.0, f32::INFINITY, f32::NAN];
        for (k, &x) in specials.iter().enumerate() {
            src[k * 7919] = bf16::from_f32(x);
        }
        for threads in [1, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            let mut kept = vec![bf16::from_f32(9.0); n];
            let s = land_bf16(&src, &mut kept, &pool).unwrap();
            let mut wide = vec![0f32; n];
            let w = accumulate_into(Grad::Bf16(&src), &mut wide, 1.0, &pool).unwrap();
            assert!(
                kept.iter().zip(&wide).all(|(k, w)| k.to_f32().to_bits() == w.to_bits() || w.is_nan() && k.is_nan())
            );
            assert!(kept.iter().all(|k| k.to_bits() != 0x8000), "-0 is stored as +0");
            assert!(s.is_nan() && w.is_nan(), "a NaN makes both sums NaN");
        }
        // Without the infinity (special 4) and the NaN (special 5), the sums are finite and equal.
        src[4 * 7919] = bf16::from_f32(1.0);
        src[5 * 7919] = bf16::from_f32(2.0);
        let pool = ThreadPool::new(2).unwrap();
        let (mut kept, mut wide) = (vec![bf16::ZERO; n], vec![0f32; n]);
        let s = land_bf16(&src, &mut kept, &pool).unwrap();
        let w = accumulate_into(Grad::Bf16(&src), &mut wide, 1.0, &pool).unwrap();
        assert!(s.is_finite());
        assert_eq!(s.to_bits(), w.to_bits());
        assert!(land_bf16(&src, &mut kept[1..], &pool).is_err());
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let pool = ThreadPool::new(1).unwrap();
        let mut dst = vec![0f32; 3];
        assert!(copy_into(Grad::F32(&[1.0, 2.0]), &mut dst, 1.0, &pool).is_err());
    }
}
