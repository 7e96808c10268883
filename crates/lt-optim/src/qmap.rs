//! Block-wise dynamic 8-bit quantization (Dettmers et al. 2022) with bitsandbytes' maps.
//!
//! A block of `B` floats is stored as one f32 `absmax` (the largest magnitude in the block) and `B`
//! one-byte indices into a fixed 256-entry map of values in `[-1, 1]` ([`QuantMap::signed`] for Adam's
//! first moment, [`QuantMap::unsigned`] for the second). Dequantization is `map[code] * absmax`.
//!
//! # Which code is chosen
//! The code of `x` is the nearest map entry to `x * (1 / absmax)` (the f32 reciprocal, rounded once,
//! times `x`: the normalisation of bitsandbytes' CUDA `kQuantizeBlockwise`), ties to the lower
//! index: [`QuantMap::quantize_reference`] binary-searches the largest entry `<= x` and moves one right
//! iff the right neighbour is *strictly* nearer, both distances in f32. This is the rule bitsandbytes'
//! CPU kernel (`quantize_block` in `csrc/common.cpp`) is written to implement; a normalised NaN (an
//! all-zero block gives `0/0`) yields code 0, as there. That kernel divides by absmax instead of
//! multiplying by its reciprocal; the two normalised values differ by at most an ulp, which changes a
//! code only for a value within that ulp of a decision point.
//!
//! ## How bitsandbytes' CPU path actually differs (0.50.2, measured by `tools/fixtures/gen_optim.py`)
//! Its binary search (`BinAlgo<Scalar, float, Direct2>`) indexes a bucket grid that is far coarser
//! than the map's smallest gaps (0 vs 5.5e-7 in the signed map), and the follow-up nearest check only
//! looks one entry to the right, so near zero it returns entries that are not the nearest:
//! - normalised `0` (any zero moment in a non-zero block) becomes code 131 (+2.125e-5) of the signed
//!   map and code 7 (+1.5625e-5) of the unsigned map instead of the 0.0 entry;
//! - every normalised value with `|x| < 1e-5` is off, by up to 4 (signed) / 7 (unsigned) entries;
//! - above that, values within about a bucket of a decision boundary are off (by one entry, two for
//!   a few unsigned values below 1e-4): 30% / 56% of values in `[1e-5, 1e-4)`, 4% / 14% in
//!   `[1e-4, 1e-3)`, 1.6% / 2.8% in
//!   `[1e-3, 1e-2)`, 0.26% / 0.5% in `[1e-2, 0.1)` and 0.04% / 0.1% in `[0.1, 1]` (signed / unsigned,
//!   log-uniform samples);
//! - it is still monotone, and its code is never nearer to `x` than ours.
//!
//! We keep the nearest rule: it is what the algorithm specifies and what the CUDA kernels
//! approximate, and it never stores a zero moment as non-zero. The tests also rebuild
//! bitsandbytes' CPU rule exactly (its transition points, extracted from bitsandbytes itself, are in
//! the fixture) and run the whole 8-bit optimizer with it, so the rest of the update is checked
//! against bitsandbytes to rounding level independently of this choice.
//!
//! # How it is made fast without changing the answer
//! Any such rule is a monotone step function of the input's bits on each side of zero, so it is fully
//! described by, for every code `j`, the smallest magnitude whose code is `>= j` (positive side) or
//! `<= j` (negative side). For the nearest rule these are found once by bisection over the f32 bit
//! patterns using [`QuantMap::quantize_reference`] itself, tie-breaking included. The hot path then
//! indexes a small table by the float's exponent and top mantissa bits (a "bucket"); the builder picks
//! the bucket size so that no bucket holds two distinct transition points, and each entry stores the
//! code at the bucket's start, the transition's offset inside the bucket and the code step there.
//! One table read and one integer compare replace the binary search, and the result is *identical* to
//! the rule for every f32 input (tested around every transition, on random inputs, and against
//! bitsandbytes' output).

use std::sync::OnceLock;

use crate::affine::AffineCodes;
use crate::qmap_tables::{SIGNED_MAP_BITS, UNSIGNED_MAP_BITS};

pub(crate) const ONE_BITS: u32 = 0x3f80_0000;
pub(crate) const MAG_MASK: u32 = 0x7fff_ffff;
/// "Never reached" in a transition table.
pub(crate) const NEVER: u32 = u32::MAX;

/// A 256-entry quantization map with a fast, exact nearest-code lookup.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantMap {
    code: [f32; 256],
    /// `pos[j]`: smallest magnitude bits whose positive value gets a code `>= j` (`NEVER` if none).
    pos: Box<[u32; 256]>,
    /// `neg[j]`: smallest magnitude bits whose negative value gets a code `<= j` (`NEVER` if none).
    neg: Box<[u32; 256]>,
    /// Per-bucket entries for non-negative inputs, then for negative inputs (`2 * buckets` in all).
    /// Entry = code at the bucket start (bits 0..8) | transition offset << 8 (`1 << shift` when the
    /// bucket holds no transition; 19 bits) | code step at the transition << 27 (4 bits).
    lut: Vec<u32>,
    /// The same table in the SIMD kernels' format, built when every transition steps by one code
    /// (true for nearest-code maps): `(thr << up) - 512 + base` (mod 2^32, `up = 32 - shift`),
    /// where a lane's code is `base + hit` (`- hit` on the negative side) truncated to 8 bits and
    /// `hit = (offset << up) > entry` (unsigned). `up >= 9`, so the low 9 bits hold `base` and the
    /// compare is exactly `offset >= thr`; a bucket without a transition stores `thr = 1 << shift`,
    /// which wraps to `0xffff_fe00 + base`, above every shifted offset (never hit).
    unit_lut: Vec<u32>,
    /// `planes[b][j]` = byte `b` of `code[j]`'s bits: dequantization by byte shuffles (SIMD).
    planes: Box<[[u8; 256]; 4]>,
    /// The affine code finder of the SIMD kernels (`crate::affine`), when the map has its layout.
    affine: Option<AffineCodes>,
    /// Magnitude bits are clamped to `[lo, ONE_BITS]`; everything below `lo` quantizes like `lo`.
    lo: u32,
    lo_key: u32,
    shift: u32,
    buckets: u32,
}

impl QuantMap {
    /// bitsandbytes' signed dynamic map (`create_dynamic_map(signed=True)`), used for Adam's `m`.
    pub fn signed() -> &'static QuantMap {
        static MAP: OnceLock<QuantMap> = OnceLock::new();
        MAP.get_or_init(|| QuantMap::nearest(SIGNED_MAP_BITS.map(f32::from_bits)))
    }

    /// bitsandbytes' unsigned dynamic map (`create_dynamic_map(signed=False)`), used for Adam's `v`.
    pub fn unsigned() -> &'static QuantMap {
        static MAP: OnceLock<QuantMap> = OnceLock::new();
        MAP.get_or_init(|| QuantMap::nearest(UNSIGNED_MAP_BITS.map(f32::from_bits)))
    }

    /// A map quantizing by the nearest-code rule ([`quantize_reference`](Self::quantize_reference)).
    fn nearest(code: [f32; 256]) -> QuantMap {
        let rule = |x: f32| nearest_code(&code, x) as usize;
        let mut pos = Box::new([NEVER; 256]);
        let mut neg = Box::new([NEVER; 256]);
        for j in 0..256 {
            pos[j] = first_true(|b| rule(f32::from_bits(b)) >= j);
            neg[j] = first_true(|b| rule(-f32::from_bits(b)) <= j);
        }
        QuantMap::from_transitions(code, pos, neg)
    }

    /// A map whose rule is given by its transition tables (see the field docs); used by the tests to
    /// rebuild bitsandbytes' CPU rule. The tables must be monotone (`pos` non-decreasing, `neg`
    /// non-increasing in `j`), which a rule that is monotone in `x` always gives.
    pub(crate) fn from_transitions(code: [f32; 256], pos: Box<[u32; 256]>, neg: Box<[u32; 256]>) -> QuantMap {
        let mut planes = Box::new([[0u8; 256]; 4]);
        for (j, c) in code.iter().enumerate() {
            for (b, plane) in planes.iter_mut().enumerate() {
                plane[j] = c.to_bits().to_le_bytes()[b];
            }
        }
        let affine = AffineCodes::build(&code, &pos, &neg);
        let mut map = QuantMap {
            code,
            pos,
            neg,
            affine,
            lut: Vec::new(),
            unit_lut: Vec::new(),
            planes,
            lo: 0,
            lo_key: 0,
            shift: 23,
            buckets: 0,
        };
        map.build_lut();
        map
    }

    /// The 256 map values, sorted ascending.
    pub fn code(&self) -> &[f32; 256] {
        &self.code
    }

    /// Mantissa bits used to form a bucket (how fine the lookup table is).
    pub fn lut_mantissa_bits(&self) -> u32 {
        23 - self.shift
    }

    /// Size of the lookup table in bytes.
    pub fn lut_bytes(&self) -> usize {
        self.lut.len() * 4
    }

    /// The nearest code to an already normalised value, ties to the lower index, NaN to 0 (see the
    /// module docs). This is the specification the fast path is tested against.
    pub fn quantize_reference(&self, x: f32) -> u8 {
        nearest_code(&self.code, x)
    }

    /// The code given by the transition tables (linear scan; the definition the table encodes).
    pub(crate) fn quantize_by_transitions(&self, x: f32) -> u8 {
        if x.is_nan() {
            return 0;
        }
        let m = x.abs().to_bits().min(ONE_BITS);
        if x.is_sign_negative() {
            self.neg.iter().filter(|&&t| t > m).count().min(255) as u8
        } else {
            self.pos.iter().skip(1).filter(|&&t| t <= m).count() as u8
        }
    }

    /// The code of an already normalised value; identical to the map's rule for every f32, but a
    /// table read instead of a search.
    #[inline]
    pub fn quantize(&self, x: f32) -> u8 {
        if x.is_nan() {
            return 0;
        }
        if self.lut.is_empty() {
            return self.quantize_by_transitions(x);
        }
        let bits = x.to_bits();
        let neg = bits >> 31;
        let mag = (bits & MAG_MASK).clamp(self.lo, ONE_BITS);
        let bucket = ((mag >> self.shift) - self.lo_key + neg * self.buckets) as usize;
        let entry = self.lut.get(bucket).copied().unwrap_or(0);
        let hit = (mag & ((1 << self.shift) - 1)) >= ((entry >> 8) & 0x7_ffff);
        let base = entry & 0xff;
        let step = if hit { entry >> 27 } else { 0 };
        (if neg == 1 { base.wrapping_sub(step) } else { base + step }) as u8
    }

    /// Builds the bucket table. See the module docs for why this is exact.
    fn build_lut(&mut self) {
        let points = |t: &[u32; 256]| {
            let mut v: Vec<u32> = t.iter().copied().filter(|&b| b != 0 && b != NEVER).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let (pp, np) = (points(&self.pos), points(&self.neg));
        let min_t = pp.iter().chain(&np).copied().min().unwrap_or(ONE_BITS);
        // The coarsest table in which no bucket holds two transition points (5 bits at least, so
        // the offset fits its 19-bit field).
        for mbits in 5..=16 {
            let shift = 23 - mbits;
            let lo_key = (min_t - 1) >> shift;
            let buckets = (ONE_BITS >> shift) - lo_key + 1;
            let mut lut = Vec::with_capacity(2 * buckets as usize);
            let mut unit = Vec::with_capacity(2 * buckets as usize);
            let mut unit_ok = true;
            let mut ok = true;
            for (neg, pts) in [(false, &pp), (true, &np)] {
                for b in 0..buckets {
                    let start = (lo_key + b) << shift;
                    let end = start + (1 << shift);
                    let mut inside = pts.iter().copied().filter(|&t| t > start && t < end);
                    let (first, second) = (inside.next(), inside.next());
                    let code_at = |m: u32| {
                        self.quantize_by_transitions(if neg { -f32::from_bits(m) } else { f32::from_bits(m) }) as u32
                    };
                    let base = code_at(start);
                    let (thr, step) = match first {
                        Some(t) => (t - start, code_at(t).abs_diff(base)),
                        None => (1 << shift, 0),
                    };
                    if second.is_some() || step > 15 {
                        ok = false;
                        break;
                    }
                    lut.push(base | (thr << 8) | (step << 27));
                    unit_ok &= step <= 1;
                    // `thr` is `1 << shift` without a transition: the shift wraps it to 0 (never hit).
                    unit.push(((thr as u64) << (32 - shift)).wrapping_sub(512).wrapping_add(base as u64) as u32);
                }
            }
            if ok {
                self.lut = lut;
                if unit_ok {
                    self.unit_lut = unit;
                }
                self.lo = lo_key << shift;
                self.lo_key = lo_key;
                self.shift = shift;
                self.buckets = buckets;
                return;
            }
        }
        // Unreachable for maps whose transitions are at least 2^-16 apart relative to their size
        // (all maps here are); an empty table makes `fast_lut()` false and callers fall back to the
        // exact scan, so this is a slow path rather than a wrong answer.
    }

    /// Whether the fast table was built (always, for the maps of this crate).
    #[cfg(test)]
    pub(crate) fn fast_lut(&self) -> bool {
        !self.lut.is_empty()
    }

    /// Parameters of the table for the SIMD kernel; `None` when the map has multi-code steps.
    pub(crate) fn lut_params(&self) -> Option<LutParams<'_>> {
        (!self.unit_lut.is_empty()).then_some(LutParams {
            lut: &self.unit_lut,
            lo: self.lo,
            lo_key: self.lo_key,
            shift: self.shift,
            buckets: self.buckets,
        })
    }

    /// The affine code finder (`crate::affine`), built and verified for maps with bitsandbytes'
    /// run layout and a nearest-code rule; `None` otherwise.
    pub(crate) fn affine(&self) -> Option<&AffineCodes> {
        self.affine.as_ref()
    }

    /// The code table as four byte planes (for the SIMD dequantization).
    pub(crate) fn planes(&self) -> &[[u8; 256]; 4] {
        &self.planes
    }

    /// Quantizes one block: `absmax = max |x|`, codes of `x * (1 / absmax)` (see
    /// `quantize_block_with`). Returns `absmax`.
    /// Elements beyond the shorter of `x` and `out` are ignored.
    pub fn quantize_block(&self, x: &[f32], out: &mut [u8]) -> f32 {
        let absmax = block_absmax(x);
        self.quantize_block_with(x, absmax, out);
        absmax
    }

    /// Codes of the normalised block for a given absmax: `x * (1 / absmax)`, the reciprocal rounded
    /// once (what bitsandbytes' CUDA `kQuantizeBlockwise` does; one multiply per element instead of
    /// a division). When the reciprocal is not finite (absmax zero, subnormal or NaN) it is
    /// `x / absmax`, so an all-zero block still normalises to `0 / 0` and takes code 0.
    pub(crate) fn quantize_block_with(&self, x: &[f32], absmax: f32, out: &mut [u8]) {
        let r = 1.0 / absmax;
        if r.is_finite() {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = self.quantize(v * r);
            }
        } else {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = self.quantize(v / absmax);
            }
        }
    }

    /// `out[i] = map[codes[i]] * absmax`.
    pub fn dequantize_block(&self, codes: &[u8], absmax: f32, out: &mut [f32]) {
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = self.code[c as usize] * absmax;
        }
    }
}

/// Every transition of a map, both sides (magnitude bits), for tests around them.
#[cfg(test)]
pub(crate) fn transition_bits(map: &QuantMap) -> impl Iterator<Item = u32> + '_ {
    map.pos.iter().chain(map.neg.iter()).copied().filter(|&t| t != NEVER)
}

/// The nearest-code rule (see the module docs).
fn nearest_code(c: &[f32; 256], x: f32) -> u8 {
    if x.is_nan() {
        return 0;
    }
    // Largest k with c[k] <= x (0 if x is below the whole map).
    let k = c.partition_point(|&ck| ck <= x).saturating_sub(1);
    if k < 255 {
        let dist_left = (x - c[k]).abs();
        let dist_right = (x - c[k + 1]).abs();
        if dist_right < dist_left {
            return (k + 1) as u8;
        }
    }
    k as u8
}

/// Smallest magnitude bits `b` in `[0, ONE_BITS]` with `pred(b)`, for a predicate monotone in `b`
/// (false then true); `NEVER` if it is false at `ONE_BITS`.
fn first_true(pred: impl Fn(u32) -> bool) -> u32 {
    if pred(0) {
        return 0;
    }
    if !pred(ONE_BITS) {
        return NEVER;
    }
    let (mut lo, mut hi) = (0u32, ONE_BITS);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// The signed and unsigned map an 8-bit state is quantized with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct QuantMaps {
    pub(crate) signed: &'static QuantMap,
    pub(crate) unsigned: &'static QuantMap,
}

impl Default for QuantMaps {
    fn default() -> Self {
        QuantMaps { signed: QuantMap::signed(), unsigned: QuantMap::unsigned() }
    }
}

/// The table the SIMD kernel reads.
pub(crate) struct LutParams<'a> {
    pub(crate) lut: &'a [u32],
    pub(crate) lo: u32,
    pub(crate) lo_key: u32,
    pub(crate) shift: u32,
    pub(crate) buckets: u32,
}

/// Largest magnitude in a block, ignoring NaN (C's `fmax`, which bitsandbytes uses). Written as
/// `if a > acc` so that it matches the SIMD `max(a, acc)` lane by lane, NaN handling included.
#[inline]
pub(crate) fn block_absmax(x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for &v in x {
        let a = v.abs();
        if a > acc {
            acc = a;
        }
    }
    acc
}

/// Quantizes `x` block-wise into `codes` and one `absmax` per block (the last block may be short).
///
/// Returns [`OptimError::LengthMismatch`](crate::OptimError::LengthMismatch) when the output lengths
/// do not fit `x` and `block`.
pub fn quantize_blockwise(
    map: &QuantMap,
    x: &[f32],
    block: usize,
    codes: &mut [u8],
    absmax: &mut [f32],
) -> Result<(), crate::OptimError> {
    check_blockwise(x.len(), block, codes.len(), absmax.len())?;
    for ((xb, cb), a) in x.chunks(block).zip(codes.chunks_mut(block)).zip(absmax.iter_mut()) {
        *a = map.quantize_block(xb, cb);
    }
    Ok(())
}

/// Inverse of [`quantize_blockwise`]: `out[i] = map[codes[i]] * absmax[i / block]`.
pub fn dequantize_blockwise(
    map: &QuantMap,
    codes: &[u8],
    absmax: &[f32],
    block: usize,
    out: &mut [f32],
) -> Result<(), crate::OptimError> {
    check_blockwise(out.len(), block, codes.len(), absmax.len())?;
    for ((ob, cb), &a) in out.chunks_mut(block).zip(codes.chunks(block)).zip(absmax) {
        map.dequantize_block(cb, a, ob);
    }
    Ok(())
}

fn check_blockwise(n: usize, block: usize, codes: usize, absmax: usize) -> Result<(), crate::OptimError> {
    use crate::OptimError::LengthMismatch;
    if block == 0 {
        return Err(crate::OptimError::InvalidBlockSize { block });
    }
    if codes != n {
        return Err(LengthMismatch { what: "codes".into(), expected: n, found: codes });
    }
    if absmax != n.div_ceil(block) {
        return Err(LengthMismatch { what: "absmax".into(), expected: n.div_ceil(block), found: absmax });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::testutil::{Fixture, SplitMix64};

    fn maps() -> [(&'static str, &'static QuantMap); 2] {
        [("signed", QuantMap::signed()), ("unsigned", QuantMap::unsigned())]
    }

    /// bitsandbytes' CPU quantization rule, rebuilt exactly from the transition tables that
    /// `gen_optim.py` extracted from bitsandbytes (see the module docs for how it differs).
    pub(crate) fn bnb_cpu_maps() -> QuantMaps {
        static MAPS: OnceLock<(QuantMap, QuantMap)> = OnceLock::new();
        let (s, u) = MAPS.get_or_init(|| {
            let fx = Fixture::load("quantize.ltfx");
            let build = |name: &str, code: &QuantMap| {
                let table = |side: &str| -> Box<[u32; 256]> {
                    let v = fx.u32(&format!("{name}.bnb_cpu.{side}"));
                    Box::new(v.try_into().expect("256 entries"))
                };
                QuantMap::from_transitions(*code.code(), table("pos"), table("neg"))
            };
            (build("signed", QuantMap::signed()), build("unsigned", QuantMap::unsigned()))
        });
        QuantMaps { signed: s, unsigned: u }
    }

    fn all_maps() -> Vec<(String, &'static QuantMap)> {
        let b = bnb_cpu_maps();
        let mut v: Vec<(String, &'static QuantMap)> = maps().iter().map(|(n, m)| (n.to_string(), *m)).collect();
        v.push(("signed/bnb_cpu".into(), b.signed));
        v.push(("unsigned/bnb_cpu".into(), b.unsigned));
        v
    }

    #[test]
    fn maps_match_bitsandbytes_fixture() {
        let fx = Fixture::load("qmaps.ltfx");
        for (name, map) in maps() {
            let want = fx.f32(name);
            assert_eq!(want.len(), 256);
            for (i, (&w, &c)) in want.iter().zip(map.code()).enumerate() {
                assert_eq!(w.to_bits(), c.to_bits(), "{name}[{i}]");
            }
        }
        assert_eq!(QuantMap::signed().code()[127], 0.0);
        assert_eq!(QuantMap::unsigned().code()[0], 0.0);
    }

    #[test]
    fn lut_is_built_and_small() {
        for (name, map) in all_maps() {
            assert!(map.fast_lut(), "{name}: no bucket size separates the transitions");
        }
        for (name, map) in maps() {
            // The SIMD table exists, and is small enough to stay in L1 (48 KiB here) next to the
            // streaming data.
            assert!(map.lut_params().is_some(), "{name}: not unit-step");
            assert!(map.lut_bytes() <= 24 * 1024, "{name}: {} bytes", map.lut_bytes());
        }
    }

    /// Floats probing every code, every midpoint, every transition point (+-64 ulp), the clamp
    /// bounds and specials, both signs.
    fn probes(map: &QuantMap) -> Vec<f32> {
        let mut bits: Vec<u32> = Vec::new();
        for w in map.code().windows(2) {
            for v in [(w[0] + w[1]) / 2.0, w[0], w[1]] {
                let b = v.abs().to_bits();
                bits.extend(b.saturating_sub(64)..=b + 64);
            }
        }
        for &t in map.pos.iter().chain(map.neg.iter()).filter(|&&t| t != NEVER) {
            bits.extend(t.saturating_sub(64)..=t.saturating_add(64));
        }
        bits.extend(0..4096u32); // zero and subnormals
        bits.extend([map.lo.saturating_sub(1), map.lo, map.lo + 1, ONE_BITS - 1, ONE_BITS, ONE_BITS + 1]);
        bits.extend([f32::INFINITY.to_bits(), f32::MAX.to_bits()]);
        bits.iter().flat_map(|&b| [f32::from_bits(b), -f32::from_bits(b)]).collect()
    }

    /// The nearest maps' transition tables encode exactly `quantize_reference`.
    #[test]
    fn transitions_encode_the_nearest_rule() {
        for (name, map) in maps() {
            for x in probes(map) {
                assert_eq!(map.quantize_by_transitions(x), map.quantize_reference(x), "{name}: x = {x:e}");
            }
        }
    }

    /// The bucket table equals the rule it encodes on every probe, for all four maps.
    #[test]
    fn lut_equals_rule_around_every_transition() {
        for (name, map) in all_maps() {
            for x in probes(map) {
                assert_eq!(map.quantize(x), map.quantize_by_transitions(x), "{name}: x = {x:e} ({:#x})", x.to_bits());
            }
            assert_eq!(map.quantize(f32::NAN), 0);
            assert_eq!(map.quantize_reference(f32::NAN), 0);
        }
    }

    /// The affine code finder exists for both default maps, and on every probe (every transition
    /// +-64 ulp on both sides, codes, midpoints, subnormals, the values a few ulp above 1.0 that a
    /// rounded reciprocal can give) and on random floats it gives the rule's code; the build-time
    /// proof (`AffineCodes::verify`) covers every other f32.
    #[test]
    fn affine_codes_equal_the_rule() {
        let mut rng = SplitMix64::new(12);
        for (name, map) in maps() {
            let aff = map.affine().unwrap_or_else(|| panic!("{name}: no affine form"));
            assert_eq!(aff.signed, name == "signed");
            let mut xs: Vec<f32> =
                probes(map).into_iter().filter(|x| x.abs() <= 1.0 || x.is_finite() && x.abs() < 1.00001).collect();
            for b in ONE_BITS..ONE_BITS + 8 {
                xs.extend([f32::from_bits(b), -f32::from_bits(b)]);
            }
            for _ in 0..200_000 {
                let e = (rng.next_u64() % 34) as i32;
                xs.push((rng.uniform() * 2f32.powi(-e)).clamp(-1.0, 1.0));
            }
            for x in xs {
                let x = if name == "unsigned" { x.abs() } else { x };
                assert_eq!(aff.code(x), map.quantize(x), "{name}: x = {x:e} ({:#x})", x.to_bits());
            }
        }
        // bitsandbytes' CPU rule is not nearest-code near zero: its maps get no affine form (and
        // the kernels use the bucket table for them).
        let b = bnb_cpu_maps();
        assert!(b.signed.affine().is_none() && b.unsigned.affine().is_none());
    }

    /// The rounding form exists for both default maps, and wherever it decides a lane (outside its
    /// ambiguity band) it gives the rule's code, on every probe: every transition +-64 ulp on both
    /// sides, codes, midpoints, values just above 1.0, and 400,000 log-uniform floats per map, of
    /// which at most 1 in 5,000 may be undecided (the kernels' fallback must stay rare).
    #[test]
    fn rounded_codes_equal_the_rule() {
        let mut rng = SplitMix64::new(13);
        for (name, map) in maps() {
            let r = map.affine().and_then(|a| a.rounded.as_ref()).unwrap_or_else(|| panic!("{name}: no rounded form"));
            let signed = name == "signed";
            let code = |x: f32| {
                r.index(x.to_bits() & MAG_MASK, x.is_sign_negative()).map(|u| match (signed, x.is_sign_negative()) {
                    (false, _) => u as u8,
                    (true, false) => (127 + u) as u8,
                    (true, true) => 127u32.saturating_sub(u) as u8,
                })
            };
            let mut probes: Vec<f32> =
                probes(map).into_iter().filter(|x| x.abs() <= 1.0 || x.is_finite() && x.abs() < 1.00001).collect();
            probes.extend((ONE_BITS..ONE_BITS + 8).flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)]));
            let mut decided = 0;
            for &x in &probes {
                let x = if signed { x } else { x.abs() };
                if let Some(c) = code(x) {
                    assert_eq!(c, map.quantize(x), "{name}: x = {x:e} ({:#x})", x.to_bits());
                    decided += 1;
                }
            }
            assert!(decided > probes.len() / 2, "{name}: only {decided} of {} probes decided", probes.len());
            let (mut undecided, n) = (0, 400_000);
            for _ in 0..n {
                let e = (rng.next_u64() % 24) as i32;
                let x = (rng.uniform() * 2f32.powi(-e)).clamp(-1.0, 1.0);
                let x = if signed { x } else { x.abs() };
                match code(x) {
                    Some(c) => assert_eq!(c, map.quantize(x), "{name}: x = {x:e} ({:#x})", x.to_bits()),
                    None => undecided += 1,
                }
            }
            assert!(undecided * 5000 < n, "{name}: {undecided} of {n} random values undecided");
        }
    }

    /// The proof in `Rounded::verify` rejects a form whose slopes are 0.1% off (which moves
    /// transitions by far more than the band) and accepts the built one.
    #[test]
    fn rounded_verification_rejects_a_wrong_slope() {
        for (name, map) in maps() {
            let good = map.affine().and_then(|a| a.rounded.as_ref()).unwrap_or_else(|| panic!("{name}"));
            let top = if good.signed { 128 } else { 255 };
            let (_, _, tp, tn) = crate::affine::by_index(map.code(), &map.pos, &map.neg).unwrap();
            assert!(good.verify(top, &tp, &tn), "{name}");
            let mut bad = good.clone();
            for a in bad.a.iter_mut() {
                *a *= 1.001;
            }
            assert!(!bad.verify(top, &tp, &tn), "{name}: a wrong slope passed");
            let mut narrow = good.clone();
            narrow.d = 0;
            assert!(!narrow.verify(top, &tp, &tn), "{name}: a band of zero passed");
        }
    }

    /// The proof in `AffineCodes::verify` rejects parameters that are off: slopes 2% too steep
    /// break the "true index or one below" bound near the top of a run, and must be refused.
    #[test]
    fn affine_verification_rejects_a_wrong_slope() {
        for (name, map) in maps() {
            let good = map.affine().unwrap_or_else(|| panic!("{name}"));
            let mut bad = good.clone();
            for a in bad.a.iter_mut() {
                *a *= 1.02;
            }
            let top = if good.signed { 128 } else { 255 };
            let (_, _, tp, tn) = crate::affine::by_index(map.code(), &map.pos, &map.neg).unwrap();
            assert!(good.verify(top, &tp, &tn), "{name}");
            assert!(!bad.verify(top, &tp, &tn), "{name}: a wrong slope passed");
        }
    }

    #[test]
    fn lut_equals_rule_on_random_floats() {
        let mut rng = SplitMix64::new(11);
        for (name, map) in all_maps() {
            for _ in 0..100_000 {
                // Log-uniform magnitudes over the maps' whole range, both signs.
                let e = (rng.next_u64() % 28) as i32;
                let x = (rng.uniform() * 2f32.powi(-e)).clamp(-1.0, 1.0);
                assert_eq!(map.quantize(x), map.quantize_by_transitions(x), "{name}: {x:e}");
                if !name.contains("bnb") {
                    assert_eq!(map.quantize(x), map.quantize_reference(x), "{name}: {x:e}");
                }
            }
        }
    }

    /// Against bitsandbytes' CPU `quantize_blockwise` output on values within 3 ulp of every
    /// decision threshold (blocks pinned to absmax 1) and on random blocks (division by absmax, an
    /// all-zero block, a subnormal-scale block, a partial last block): the rebuilt bitsandbytes rule
    /// matches code for code; the nearest rule differs only where bitsandbytes is not nearest, and
    /// is never farther from the value than bitsandbytes' code.
    #[test]
    fn quantize_vs_bitsandbytes_cpu() {
        let fx = Fixture::load("quantize.ltfx");
        let bnb = bnb_cpu_maps();
        for (name, map, bmap) in
            [("signed", QuantMap::signed(), bnb.signed), ("unsigned", QuantMap::unsigned(), bnb.unsigned)]
        {
            for set in ["exact", "random"] {
                let x = fx.f32(&format!("{name}.{set}.input"));
                let want = fx.u8(&format!("{name}.{set}.codes"));
                let nb = x.len().div_ceil(256);
                let (mut cb, mut ab) = (vec![0u8; x.len()], vec![0f32; nb]);
                let (mut cn, mut an) = (vec![0u8; x.len()], vec![0f32; nb]);
                quantize_blockwise(bmap, &x, 256, &mut cb, &mut ab).unwrap();
                quantize_blockwise(map, &x, 256, &mut cn, &mut an).unwrap();
                let bad: Vec<usize> = (0..x.len()).filter(|&i| cb[i] != want[i]).collect();
                assert!(
                    bad.is_empty(),
                    "{name}.{set}: {} mismatches, first {:?}",
                    bad.len(),
                    bad.first().map(|&i| (x[i], cb[i], want[i]))
                );
                assert_eq!(ab, an);
                if set == "random" {
                    assert_eq!(ab, fx.f32(&format!("{name}.random.absmax")));
                }
                let code = map.code();
                let mut differ = 0;
                for i in 0..x.len() {
                    let a = an[i / 256];
                    let v = x[i] / a;
                    if a == 0.0 {
                        assert_eq!(cn[i], 0, "0/0 -> code 0, as bitsandbytes");
                        continue;
                    }
                    let (dn, db) = ((v - code[cn[i] as usize]).abs(), (v - code[want[i] as usize]).abs());
                    assert!(dn <= db, "{name}.{set}[{i}]: {v:e} -> {} (bnb {})", cn[i], want[i]);
                    differ += (cn[i] != want[i]) as usize;
                }
                eprintln!("{name}.{set}: nearest differs from bitsandbytes CPU on {differ} of {}", x.len());
            }
        }
    }

    /// Round-trip error is bounded per block by half the largest gap between neighbouring codes,
    /// times absmax (plus f32 rounding of the final multiply): nearest-code quantization cannot do worse.
    #[test]
    fn dequantize_error_is_bounded_per_block() {
        let mut rng = SplitMix64::new(5);
        for (name, map) in maps() {
            let max_gap = map.code().windows(2).map(|w| w[1] - w[0]).fold(0.0f32, f32::max);
            for scale in [1e-6f32, 1e-2, 1.0, 3e3] {
                let x: Vec<f32> = (0..256 * 7 + 33)
                    .map(|_| {
                        let u = rng.uniform() * scale;
                        if name == "unsigned" { u.abs() } else { u }
                    })
                    .collect();
                let mut codes = vec![0u8; x.len()];
                let mut absmax = vec![0f32; x.len().div_ceil(256)];
                quantize_blockwise(map, &x, 256, &mut codes, &mut absmax).unwrap();
                let mut y = vec![0f32; x.len()];
                dequantize_blockwise(map, &codes, &absmax, 256, &mut y).unwrap();
                for (b, (xb, yb)) in x.chunks(256).zip(y.chunks(256)).enumerate() {
                    let a = absmax[b];
                    let bound = a * (max_gap / 2.0 + 2.0 * f32::EPSILON);
                    let err = xb.iter().zip(yb).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
                    assert!(err <= bound, "{name} scale {scale} block {b}: err {err:e} > {bound:e}");
                    // Zeros stay zero, and a positive block maximum maps to code 1.0 and comes back exactly.
                    for (p, q) in xb.iter().zip(yb) {
                        if *p == 0.0 {
                            assert_eq!(*q, 0.0);
                        }
                        if *p == a {
                            assert_eq!(*q, a, "{name}: +absmax not exact");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn blockwise_rejects_bad_lengths() {
        let map = QuantMap::signed();
        let x = [0.5f32; 300];
        let mut codes = [0u8; 300];
        let mut absmax = [0f32; 1];
        assert!(quantize_blockwise(map, &x, 256, &mut codes, &mut absmax).is_err());
        let mut absmax = [0f32; 2];
        assert!(quantize_blockwise(map, &x, 0, &mut codes, &mut absmax).is_err());
        assert!(quantize_blockwise(map, &x, 256, &mut codes[..10], &mut absmax).is_err());
    }
}
