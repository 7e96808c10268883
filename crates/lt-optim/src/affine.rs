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
        let aff = AffineCodes { signed, switch, a, b, planes };
        aff.verify(top, &tp, &tn).then_some(aff)
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
