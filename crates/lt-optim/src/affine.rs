//! Finding the nearest code without a table read per element: an affine estimate per map run,
//! corrected by one exact threshold compare.
//!
//! bitsandbytes' dynamic maps are runs of evenly spaced values, one run per decade (`n` values
//! `10^d * (1 + 9 * (j + 1/2) / n)` for `j < n`), so within a run the position of a magnitude `y` on
//! the run's lattice is affine in `y`, and the nearest-code transitions sit (to a few ulp) on the
//! lattice's integer points. In *magnitude index* form (`u` = code for the unsigned map; for the
//! signed map `u = code - 127` on the positive side and `127 - code` on the negative side, whose
//! values mirror the positive ones) a lane's index is found as:
//! 1. the run: by the binade of `y` (its f32 exponent, a 32-entry table whose entry holds the run
//!    at the binade's start in its low 4 bits) and one compare with that entry, which is the
//!    decade edge `10^d` (to 16 ulp) where the next run takes over inside that binade;
//! 2. an estimate `est = floor(fma(y, a_run, b_run))`, chosen so that `est` is the true index or
//!    one below it (switching runs at the decade edge, half a lattice step from either run's
//!    transitions, leaves that margin on both sides);
//! 3. one compare of the lane's key with the exact transition to `est + 1` (a 128- or 255-entry
//!    table of keys, small enough for byte-permute lookups held in registers):
//!    `u = est + (key >= thr[est])`.
//!
//! The key is the magnitude's bits for the unsigned map. For the signed map it is
//! `bits.rotate_left(1)` = `2 * magnitude + sign`, so that one table serves both sides although
//! ties go to the lower *code* (the smaller magnitude on the positive side, the larger on the
//! negative side): where a tie moves the negative transition one ulp below the positive one, the
//! key threshold is `2 * t - 1`, else `2 * t`.
//!
//! [`Rounded`] is the kernels' fast form of the same finder: a fixed-point estimate whose integer
//! part is the index away from transitions, with this exact form as the fallback near them.
//!
//! [`AffineCodes::build`] derives the parameters from the map's values and exact transitions and
//! then *proves* them against those transitions: the estimate is monotone in the magnitude between
//! breakpoints (transitions, run switches, binade starts), so checking both ends of every interval
//! between breakpoints checks every f32. A map that fails (another rule, another layout) gets no
//! affine form and the kernels use the bucket table; the result is identical either way.

#[cfg(test)]
use crate::qmap::MAG_MASK;
use crate::qmap::{NEVER, ONE_BITS};

/// Smallest magnitude the estimate distinguishes (2^-31): smaller ones are raised to it, so the
/// binade index `bits >> 23` is 96..=127 and fits a 32-entry table (`& 31`).
pub(crate) const AFFINE_LO_BITS: u32 = 0x3000_0000;

/// The parameters of the affine code finder for one map (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AffineCodes {
    /// Signed map (magnitude index `u` in 0..=128, code `127 +- u`) or unsigned (`u` = code).
    pub(crate) signed: bool,
    /// Per binade (`(bits >> 23) & 31`): the magnitude bits at which the next run takes over
    /// inside it (`0xffff_fff0` if none does), with the low 4 bits replaced by the run in force at
    /// the binade's start: `run = (entry & 15) + (bits >= entry)`, one table read for both.
    pub(crate) switch: [u32; 32],
    /// Per run (run 0 is the zero code): `est = floor(fma(y, a, b))`.
    pub(crate) a: [f32; 16],
    pub(crate) b: [f32; 16],
    /// Byte planes of the key thresholds: `thr[est]` is the smallest key whose index is
    /// `>= est + 1` (`u32::MAX` past the last index).
    pub(crate) planes: Box<[[u8; 256]; 4]>,
    /// The rounding form with an ambiguity band (`Rounded`), when it verifies: the kernels' fast
    /// path, with this struct's exact form as the fallback for the lanes it cannot decide.
    pub(crate) rounded: Option<Rounded>,
}

impl AffineCodes {
    /// Derives and verifies the affine form of the map with values `code` and exact transition
    /// tables `pos` / `neg` (as in `QuantMap`); `None` if the map does not have the run layout or
    /// the check fails.
    pub(crate) fn build(code: &[f32; 256], pos: &[u32; 256], neg: &[u32; 256]) -> Option<AffineCodes> {
        let (signed, w, tp, tn) = by_index(code, pos, neg)?;
        let top = w.len() - 1; // the largest index (K); the table holds thr[0..K]
        if !w.windows(2).all(|p| p[0] < p[1]) || tp[1..].iter().any(|&t| t == NEVER || t > ONE_BITS) {
            return None;
        }
        // Key thresholds.
        let mut thr = [NEVER; 256];
        for k in 1..=top {
            thr[k - 1] = if !signed {
                tp[k]
            } else if tn[k] == NEVER || tn[k] == tp[k] {
                // k = 128 (1.0) has no negative counterpart: a negative lane reaching it saturates
                // to code 0, its correct code (see `code`).
                if tn[k] == NEVER && k != top {
                    return None;
                }
                2 * tp[k]
            } else if tn[k] + 1 == tp[k] {
                2 * tp[k] - 1
            } else {
                return None;
            };
        }
        // Runs: maximal index ranges within one decade (the top value 1.0 joins the run below).
        let decade = |u: usize| (w[u].min(0.999_999).log10()).floor() as i32;
        let mut runs: Vec<(usize, usize, i32)> = Vec::new(); // (first index, count, decade)
        for u in 1..=top {
            let d = decade(u);
            match runs.last_mut() {
                Some(r) if r.2 == d => r.1 += 1,
                _ => runs.push((u, 1, d)),
            }
        }
        if runs.len() + 1 > 16 {
            return None;
        }
        let mut a = [0f32; 16];
        let mut b = [0f32; 16];
        let mut starts = Vec::new(); // (switch bits, run number), increasing
        for (i, &(first, count, d)) in runs.iter().enumerate() {
            // The top value 1.0 is not on the lattice: count only the evenly spaced ones.
            let n = if w[first + count - 1] >= 1.0 { count - 1 } else { count };
            if n == 0 {
                return None;
            }
            let edge = 10f64.powi(d);
            let step = 9.0 * edge / n as f64;
            a[i + 1] = (1.0 / step) as f32;
            b[i + 1] = (first as f64 - 0.5 - edge / step) as f32;
            // The low 4 bits carry the binade's first run (below): 16 ulp, far inside the half
            // lattice step of margin the switch has on either side.
            starts.push(((edge as f32).to_bits() & !15, i as u32 + 1));
        }
        let mut switch = [NEVER & !15; 32];
        for e in 96u32..=127 {
            let (lo, hi) = (e << 23, (e + 1) << 23);
            let slot = (e & 31) as usize;
            let run_lo = starts.iter().filter(|s| s.0 <= lo).map(|s| s.1).next_back().unwrap_or(0);
            let mut inside = starts.iter().filter(|s| s.0 > lo && s.0 < hi);
            if let Some(s) = inside.next() {
                switch[slot] = s.0;
            }
            if inside.next().is_some() || run_lo > 15 {
                return None;
            }
            switch[slot] |= run_lo;
        }
        let mut planes = Box::new([[0u8; 256]; 4]);
        for (j, t) in thr.iter().enumerate() {
            for (p, byte) in planes.iter_mut().zip(t.to_le_bytes()) {
                p[j] = byte;
            }
        }
        let mut aff = AffineCodes { signed, switch, a, b, planes, rounded: None };
        if !aff.verify(top, &tp, &tn) {
            return None;
        }
        aff.rounded = Rounded::build(signed, &w, &tp, &tn, &thr, &runs);
        Some(aff)
    }

    /// The estimate for magnitude bits `m` (before the threshold compare), as the SIMD kernel
    /// computes it.
    fn estimate(&self, m: u32) -> i32 {
        let m = m.max(AFFINE_LO_BITS);
        let slot = ((m >> 23) & 31) as usize;
        let entry = self.switch[slot];
        let run = ((entry & 15) + u32::from(m >= entry)) as usize & 15;
        f32::from_bits(m).mul_add(self.a[run], self.b[run]).floor() as i32
    }

    /// `thr[i]` (see the field docs).
    #[cfg(test)]
    pub(crate) fn threshold(&self, i: usize) -> u32 {
        let i = i & 255;
        u32::from_le_bytes([self.planes[0][i], self.planes[1][i], self.planes[2][i], self.planes[3][i]])
    }

    /// The code of a normalised value `x` (not NaN, `|x|` at most a few ulp above 1), computed the
    /// way the SIMD kernel does; equal to the map's rule (checked at build time). It is the
    /// kernel's specification, tested against the rule in `qmap::tests`.
    #[cfg(test)]
    pub(crate) fn code(&self, x: f32) -> u8 {
        let bits = x.to_bits();
        let est = self.estimate(bits & MAG_MASK);
        let key = if self.signed { bits.rotate_left(1) } else { bits };
        let u = est + i32::from(key >= self.threshold(est.clamp(0, 255) as usize));
        let c = match (self.signed, bits >> 31 == 1) {
            (false, _) => u,
            (true, false) => 127 + u,
            (true, true) => 127 - u,
        };
        c.clamp(0, 255) as u8
    }

    /// Checks, for every magnitude up to a few ulp above 1.0, that the estimate is a valid table
    /// index and is the true index or one below it, on each side (which makes `code` exact, see
    /// the module docs). Between consecutive breakpoints the true index and the run are constant
    /// and the estimate is monotone, so the two ends of each interval decide it.
    pub(crate) fn verify(&self, top: usize, tp: &[u32], tn: &[u32]) -> bool {
        let end = ONE_BITS + 64;
        let mut points: Vec<u32> = vec![0, AFFINE_LO_BITS, end];
        points.extend(tp[1..].iter().chain(&tn[1..]).copied().filter(|&t| t <= end));
        points.extend(self.switch.iter().copied().filter(|&t| t <= end));
        points.extend((96u32..=127).map(|e| e << 23));
        points.sort_unstable();
        points.dedup();
        let index = |t: &[u32], m: u32| t[1..].iter().filter(|&&x| x <= m.min(ONE_BITS)).count() as i32;
        let ok = |m: u32| {
            let est = self.estimate(m);
            let up = index(tp, m);
            let lo = if self.signed { index(tn, m).min(127) } else { up };
            (0..top as i32).contains(&est) && est >= up.max(lo) - 1 && est <= up.min(lo)
        };
        points.windows(2).all(|p| ok(p[0]) && ok(p[1] - 1))
    }
}

/// The map by magnitude index: whether it is signed, the magnitudes `w[u]`, and the positive and
/// negative transitions to each index `k >= 1` (`tp[k]`, `tn[k]`; entry 0 unused). `None` unless the
/// map is signed with mirrored values and 0.0 at code 127, or unsigned from 0.0.
#[allow(clippy::type_complexity)]
pub(crate) fn by_index(
    code: &[f32; 256],
    pos: &[u32; 256],
    neg: &[u32; 256],
) -> Option<(bool, Vec<f64>, Vec<u32>, Vec<u32>)> {
    let signed = code[127] == 0.0 && code[0] < 0.0;
    if signed {
        if (1..=127).any(|u| code[127 - u].to_bits() != (-code[127 + u]).to_bits()) {
            return None;
        }
        let w = (0..=128).map(|u| code[127 + u] as f64).collect();
        let tp = (0..=128).map(|k| if k == 0 { 0 } else { pos[127 + k] }).collect();
        let tn = (0..=128).map(|k| if k == 0 || k == 128 { NEVER } else { neg[127 - k] }).collect();
        Some((true, w, tp, tn))
    } else {
        if code[0] != 0.0 || code.iter().any(|&c| c.is_sign_negative() && c != 0.0) {
            return None;
        }
        let w = code.iter().map(|&c| c as f64).collect();
        let tp = (0..256).map(|k| if k == 0 { 0 } else { pos[k] }).collect();
        Some((false, w, tp, vec![NEVER; 256]))
    }
}

/// The rounding form of the code finder, in fixed point: `H = min(fma(y, A, B), C)` with the
/// parameters of the run in force at `y`, and `V = trunc(H)`, an integer whose top bits (`V >> 16`)
/// *are* the magnitude index wherever its low 16 bits are at least `2 * d`. The lanes where they
/// are not (an *ambiguity band* of about `2 * d / 65536` of a step at each transition, a few lanes
/// in 10^5) are left to the exact form (`AffineCodes`), which the kernels run for a whole block
/// (one moment's) when any of its lanes is ambiguous. The fast path reads no threshold table: a
/// running minimum of the low 16 bits (one word minimum per 16 lanes) decides for the block.
///
/// `H = 65536 * h + d`, where `h = min(fma(y, a, b), c)` is the lattice position: a run's values
/// sit at half-integers of `h` and its transitions at integers (`b` is the exact form's plus one
/// half), so `floor(h)` is the index away from transitions, and the shift by `d` puts the band at
/// the bottom of the low 16 bits. Scaling by 2^16 is exact in `fma` and `min`, so `H` has `h`'s
/// precision. Run 0 (the zero code, below the first transition `t1`) is the line
/// `1/2 + y / (2 * t1)`, which reaches 1 there (so that where the two sides' transitions differ
/// by a tie's ulp it is ambiguous, not wrong); the top value 1.0, which is not on the last run's
/// lattice, is the constant `K + 1/2` from its transition on; a lattice run is clamped at
/// `c = last + 1/2`, because between the decade edge and the transition into the next run its
/// lattice would claim one index too many.
///
/// Runs switch exactly at their first transition. Each binade holds at most one switch, so the run
/// is that of the binade's start or of the next binade's: the parameters are per binade, indexed
/// by `j = binade - (key < switch[binade])` (mod 32), i.e. entry `j` holds the run in force at the
/// start of binade `j + 1`. The kernels get `j` with one subtraction and a shift, no compare:
/// keys are magnitude bits (unsigned map) or `2 * magnitude + sign` (signed), so a binade's keys
/// are those whose bits above `S = 23` (or 24) equal the binade, and `j = (key - off[binade]) >> S`
/// where `off` is the switch key's offset from the binade's first key (`2^S` if none).
///
/// [`Rounded::build`] picks the smallest `d` (a power of two) for which [`Rounded::verify`] proves,
/// for every f32 magnitude up to a few ulp above 1.0 on both sides, that a lane outside the band
/// gets the map's own index.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rounded {
    pub(crate) signed: bool,
    /// Per binade (`(bits >> 23) & 31`): the offset of the key where a run starts inside it from
    /// the binade's first key, in `0..2^S`, or `2^S` if no run starts inside it. A lane's key is
    /// its magnitude bits (`S = 23`), or `2 * magnitude + sign` for the signed map (`S = 24`), so
    /// that where the negative side's transition is one ulp earlier (a tie) one entry serves both.
    pub(crate) off: [u32; 32],
    /// Per slot (see the type docs): `H = min(fma(y, a, b), c)`, already scaled and shifted.
    pub(crate) a: [f32; 32],
    pub(crate) b: [f32; 32],
    pub(crate) c: [f32; 32],
    /// The band: a lane is decided here iff `trunc(H) & 0xffff >= 2 * d`.
    pub(crate) d: u32,
}

/// Fixed-point scale of `H` (16 fraction bits: the index is byte 2 of `trunc(H)`).
const SCALE: f32 = 65536.0;

impl Rounded {
    /// Derives the rounding form from the exact form's key thresholds (`thr[k - 1]`: the key where
    /// index `k` starts) and runs (`(first index, count, decade)`) and proves it; `None` if the layout does not fit (two switches in a binade, one in the top
    /// binade) or no band up to `d = 256` verifies.
    fn build(
        signed: bool,
        w: &[f64],
        tp: &[u32],
        tn: &[u32],
        thr: &[u32; 256],
        runs: &[(usize, usize, i32)],
    ) -> Option<Rounded> {
        let top = w.len() - 1;
        // The first transition into index k, on either side.
        let into = |k: usize| if tn[k] == NEVER { tp[k] } else { tp[k].max(tn[k]) };
        // Its switch key: the exact form's threshold (the magnitude bits, or for the signed map
        // `2 * t`, or `2 * t - 1` where the negative side gets there one ulp earlier, a tie),
        // compared with the lane's key `2 * magnitude + sign`.
        let key = |k: usize| thr[k - 1];
        // (start bits, switch key, a, b, c) of each run in lattice units, run 0 first.
        let t1 = f32::from_bits(into(1)) as f64;
        let mut runs_h: Vec<(u32, u32, f32, f32, f32)> = vec![(0, 0, (0.5 / t1) as f32, 0.5, f32::INFINITY)];
        for &(first, count, d) in runs {
            let lattice = if w[first + count - 1] >= 1.0 { count - 1 } else { count };
            if lattice > 0 {
                let edge = 10f64.powi(d);
                let step = 9.0 * edge / lattice as f64;
                let (a, b) = ((1.0 / step) as f32, (first as f64 - edge / step) as f32);
                runs_h.push((into(first), key(first), a, b, (first + lattice) as f32 - 0.5));
            }
            if lattice < count {
                if first + count - 1 != top {
                    return None;
                }
                runs_h.push((into(top), key(top), 0.0, top as f32 + 0.5, f32::INFINITY));
            }
        }
        let run_at = |m: u32| runs_h.iter().rposition(|p| p.0 <= m).unwrap_or(0);
        let s = Rounded::key_shift(signed);
        let mut off = [1u32 << s; 32];
        let mut slots = [(0f32, 0f32, 0f32); 32];
        for e in 96u32..=127 {
            let (lo, hi) = (e << 23, (e + 1) << 23);
            let mut inside = runs_h.iter().filter(|p| p.0 > lo && p.0 < hi);
            if let Some(p) = inside.next() {
                if inside.next().is_some() || e == 127 {
                    return None;
                }
                off[(e & 31) as usize] = p.1.checked_sub(e << s).filter(|&o| o < 1 << s)?;
            }
            // Slot e - 1 (mod 32) serves binade e below its switch; slot e its part above (the
            // run at the start of binade e + 1).
            let p = runs_h[run_at(lo)];
            slots[((e + 31) & 31) as usize] = (p.2, p.3, p.4);
        }
        (0..=8).map(|k| 1u32 << k).find_map(|d| {
            let shift = d as f32;
            let r = Rounded {
                signed,
                off,
                a: slots.map(|s| s.0 * SCALE),
                b: slots.map(|s| s.1 * SCALE + shift),
                c: slots.map(|s| s.2 * SCALE + shift),
                d,
            };
            r.verify(top, tp, tn).then_some(r)
        })
    }

    /// `trunc(H)` for magnitude bits `m` on the negative side or not, as the SIMD kernel computes
    /// it (`H` is below 2^24, so the conversion is exact).
    pub(crate) fn fixed(&self, m: u32, neg: bool) -> u32 {
        let s = Rounded::key_shift(self.signed);
        // The key raised to that of 2^-31 (then `key >> s` is the binade of `max(m, 2^-31)`).
        let key = if self.signed { 2 * m + u32::from(neg) } else { m }.max(AFFINE_LO_BITS << (s - 23));
        let j = ((key - self.off[((key >> s) & 31) as usize]) >> s & 31) as usize;
        f32::from_bits(m.max(AFFINE_LO_BITS)).mul_add(self.a[j], self.b[j]).min(self.c[j]) as u32
    }

    /// `S`: keys are magnitude bits (23) or `2 * magnitude + sign` (24).
    fn key_shift(signed: bool) -> u32 {
        if signed { 24 } else { 23 }
    }

    /// The magnitude index of magnitude bits `m` (on the negative side or not), or `None` inside
    /// the ambiguity band, as the kernel decides.
    #[cfg(test)]
    pub(crate) fn index(&self, m: u32, neg: bool) -> Option<u32> {
        let v = self.fixed(m, neg);
        (v & 0xffff >= 2 * self.d).then_some(v >> 16)
    }

    /// Proves that every lane outside the band gets the map's index, on both sides, for every
    /// magnitude up to 1.0 + 64 ulp. Between breakpoints (transitions, switches, binade starts) the
    /// true index and the slot are constant and `trunc(H)` is monotone, so it stays within
    /// `[V(start), V(end)]`; every index `k` whose decided values `k * 2^16 + [2d, 2^16)` meet that
    /// range must be the true one.
    pub(crate) fn verify(&self, top: usize, tp: &[u32], tn: &[u32]) -> bool {
        let end = ONE_BITS + 64;
        let mut points: Vec<u32> = vec![0, AFFINE_LO_BITS, end];
        // Signed switch keys are 2 * magnitude (+ 1): their magnitudes are breakpoints.
        let s = Rounded::key_shift(self.signed);
        let sw = (96u32..=127)
            .filter(|e| self.off[(e & 31) as usize] < 1 << s)
            .map(|e| ((e << s) + self.off[(e & 31) as usize]) >> (s - 23));
        points.extend(
            tp[1..].iter().chain(&tn[1..]).copied().chain(sw.clone()).chain(sw.map(|t| t + 1)).filter(|&t| t <= end),
        );
        points.extend((96u32..=127).map(|e| e << 23));
        points.sort_unstable();
        points.dedup();
        let index = |t: &[u32], m: u32| t[1..].iter().filter(|&&x| x <= m.min(ONE_BITS)).count() as u64;
        let ok = |m0: u32, m1: u32, neg: bool| {
            let want = if neg { index(tn, m0).min(127) } else { index(tp, m0) };
            let (v0, v1) = (self.fixed(m0, neg) as u64, self.fixed(m1, neg) as u64);
            if v0 > v1 || v1 >> 16 > top as u64 {
                return false;
            }
            (v0 >> 16..=v1 >> 16).all(|k| {
                let decided = v1 >= (k << 16) + 2 * self.d as u64 && v0 <= (k << 16) + 0xffff;
                // A negative lane's index is clamped to 127 (its code saturates at 0).
                !decided || (if neg { k.min(127) } else { k }) == want
            })
        };
        points.windows(2).all(|p| ok(p[0], p[1] - 1, false) && (!self.signed || ok(p[0], p[1] - 1, true)))
    }
}
