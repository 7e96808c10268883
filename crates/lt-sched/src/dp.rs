//! Exact dynamic programs over the path formulation: the cross-check, warm start and fallback of the
//! MILP, and the feasibility test behind `--max-batch` and the "smallest GPU memory" answer.
//!
//! The state after reaching kept boundary `s` is `(g, c)`: how many boundaries below `s` are kept on the
//! GPU and in host memory. Every GPU row of an edge `(s, e)` depends only on `g`
//! ([`Formulation::gmax`]), the forward row on the final `g`, the host row on the final `c`, so the DP
//! is exact for GPU and host capacities. NVMe capacity is not tracked: the result is exact when it
//! respects it ([`DpSolution::exact`]), otherwise it is a lower bound and the MILP decides. When host
//! memory cannot bind (room for every boundary) the `c` dimension is dropped, which makes the DP
//! `O(L x S x L)`.

use crate::plan::{Placement, Tier};
use crate::window::Formulation;

/// A DP optimum.
#[derive(Debug, Clone, PartialEq)]
pub struct DpSolution {
    /// Placements of boundaries `0..=L`.
    pub placements: Vec<Placement>,
    /// Model step time: edge costs plus the constant, seconds (predicted).
    pub cost: f64,
    /// Whether the plan also respects the NVMe capacity; then `cost` is the exact optimum.
    pub exact: bool,
}

/// Minimum model step time over all plans whose segments are at most `f.max_segment_len` long.
/// `None` when no plan fits the GPU and host.
pub fn solve(f: &Formulation) -> Option<DpSolution> {
    let l = f.num_layers;
    // First without tracking host memory; if the optimum fits the host it is optimal with it too.
    let free = run(f, false)?;
    let hosts = free.iter().filter(|&&p| p == Placement::Host).count() as i64;
    let placements = if hosts <= f.mem.cap_host || f.mem.cap_host >= l as i64 { free } else { run(f, true)? };
    let nvme = placements.iter().filter(|&&p| p == Placement::Nvme).count() as i64;
    let cost = f.path_cost(&placements);
    Some(DpSolution { placements, cost, exact: nvme <= f.mem.cap_nvme })
}

fn run(f: &Formulation, track_host: bool) -> Option<Vec<Placement>> {
    let l = f.num_layers;
    let gdim = (f.mem.cap_fwd.clamp(0, l as i64) + 1) as usize;
    let cdim = if track_host { (f.mem.cap_host.clamp(0, l as i64) + 1) as usize } else { 1 };
    let idx = |s: usize, g: usize, c: usize| (s * gdim + g) * cdim + c;
    let n = (l + 1) * gdim * cdim;
    let mut val = vec![f64::INFINITY; n];
    // Parent: (previous state index, tier index).
    let mut parent: Vec<(u32, u8)> = vec![(u32::MAX, 0); n];
    val[idx(0, 0, 0)] = 0.0;
    for s in 0..l {
        for g in 0..gdim {
            for c in 0..cdim {
                let here = val[idx(s, g, c)];
                if !here.is_finite() {
                    continue;
                }
                for e in s + 1..=(s + f.max_segment_len).min(l) {
                    let Some(gm) = f.gmax(s, e) else { continue };
                    if g as i64 > gm {
                        continue;
                    }
                    for t in Tier::ALL {
                        let cost = f.cost(s, e, t);
                        if !cost.is_finite() {
                            continue;
                        }
                        let ng = g + usize::from(t == Tier::Gpu);
                        let nc = c + usize::from(track_host && t == Tier::Host);
                        if ng >= gdim || nc >= cdim {
                            continue;
                        }
                        let to = idx(e, ng, nc);
                        // Strict improvement keeps the faster tier on ties (tiers are tried fastest first).
                        if here + cost < val[to] {
                            val[to] = here + cost;
                            parent[to] = (idx(s, g, c) as u32, t.index() as u8);
                        }
                    }
                }
            }
        }
    }
    let mut best = None;
    for g in 0..gdim {
        for c in 0..cdim {
            let i = idx(l, g, c);
            if val[i].is_finite() && best.is_none_or(|b: usize| val[i] < val[b]) {
                best = Some(i);
            }
        }
    }
    let mut at = best?;
    let mut placements = vec![Placement::Recompute; l + 1];
    placements[l] = Placement::Gpu;
    while at / (gdim * cdim) != 0 {
        let (prev, tier) = parent[at];
        let s = prev as usize / (gdim * cdim);
        placements[s] = Tier::ALL[tier as usize].into();
        at = prev as usize;
    }
    Some(placements)
}

/// A plan that fits every capacity if any does, found by keeping as few boundaries off the GPU as
/// possible (host first, then NVMe). Ignores time. `None` when nothing fits.
pub fn feasible(f: &Formulation) -> Option<Vec<Placement>> {
    let l = f.num_layers;
    let gdim = (f.mem.cap_fwd.clamp(0, l as i64) + 1) as usize;
    let idx = |s: usize, g: usize| s * gdim + g;
    let mut val = vec![u32::MAX; (l + 1) * gdim];
    let mut parent: Vec<(u32, bool)> = vec![(u32::MAX, false); (l + 1) * gdim];
    val[idx(0, 0)] = 0;
    for s in 0..l {
        for g in 0..gdim {
            let here = val[idx(s, g)];
            if here == u32::MAX {
                continue;
            }
            for e in s + 1..=(s + f.max_segment_len).min(l) {
                let Some(gm) = f.gmax(s, e) else { continue };
                if g as i64 > gm {
                    continue;
                }
                if f.cost(s, e, Tier::Gpu).is_finite() && g + 1 < gdim && here < val[idx(e, g + 1)] {
                    val[idx(e, g + 1)] = here;
                    parent[idx(e, g + 1)] = (idx(s, g) as u32, true);
                }
                let off = f.cost(s, e, Tier::Host).is_finite() || f.cost(s, e, Tier::Nvme).is_finite();
                if off && here + 1 < val[idx(e, g)] {
                    val[idx(e, g)] = here + 1;
                    parent[idx(e, g)] = (idx(s, g) as u32, false);
                }
            }
        }
    }
    let best = (0..gdim).map(|g| idx(l, g)).filter(|&i| val[i] != u32::MAX).min_by_key(|&i| val[i])?;
    let room = f.mem.cap_host.max(0) + f.mem.cap_nvme.max(0);
    if val[best] as i64 > room {
        return None;
    }
    let mut placements = vec![Placement::Recompute; l + 1];
    placements[l] = Placement::Gpu;
    let mut offloaded = Vec::new();
    let mut at = best;
    while at / gdim != 0 {
        let (prev, on_gpu) = parent[at];
        let s = prev as usize / gdim;
        if on_gpu {
            placements[s] = Placement::Gpu;
        } else {
            offloaded.push(s);
        }
        at = prev as usize;
    }
    offloaded.sort_unstable();
    let host_room = f.mem.cap_host.max(0) as usize;
    for (n, s) in offloaded.into_iter().enumerate() {
        // Either tier fits every GPU row equally; the host is faster.
        placements[s] = if n < host_room { Placement::Host } else { Placement::Nvme };
    }
    Some(placements)
}

/// Exhaustive search over every placement (4^(L-1) plans), using the op-by-op window model and the
/// direct memory check: the ground truth of the optimality tests.
#[cfg(test)]
pub(crate) fn exhaustive(
    inst: &crate::cost::Instance,
    overlap: crate::plan::OptimizerOverlap,
    max_segment_len: usize,
) -> Option<(Vec<Placement>, f64)> {
    use crate::window::{MemoryModel, step_time};
    let l = inst.num_layers();
    let mem = MemoryModel::new(inst);
    let choices = [Placement::Gpu, Placement::Host, Placement::Nvme, Placement::Recompute];
    let mut best: Option<(Vec<Placement>, f64)> = None;
    for code in 0..4usize.pow((l - 1) as u32) {
        let mut p = vec![Placement::Gpu; l + 1];
        let mut c = code;
        for slot in p.iter_mut().take(l).skip(1) {
            *slot = choices[c % 4];
            c /= 4;
        }
        if crate::plan::segments(&p).iter().any(|&(s, e)| e - s > max_segment_len) || mem.check(&p).is_err() {
            continue;
        }
        let t = step_time(inst, &p, overlap);
        if best.as_ref().is_none_or(|(_, b)| t < *b) {
            best = Some((p, t));
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::OptimizerOverlap;
    use crate::window::tests::synthetic;
    use crate::window::{MemoryModel, step_time};

    #[test]
    fn dp_equals_exhaustive_when_exact() {
        // The DP's optimum must equal brute force whenever it is exact (NVMe not binding); 1e-9
        // relative covers summation order.
        let mut exact_seen = 0;
        for seed in 0..40 {
            let inst = synthetic(6, seed, 1 + (seed % 2) as usize);
            let overlap = OptimizerOverlap::ALL[(seed % 3) as usize];
            let f = Formulation::new(&inst, overlap, 6);
            let brute = exhaustive(&inst, overlap, 6);
            let dp = solve(&f);
            match (brute, dp) {
                (None, None) => {}
                (Some((_, b)), Some(d)) => {
                    assert!(d.cost >= b - 1e-9 * b, "seed {seed}: DP {} below brute force {b}", d.cost);
                    if d.exact {
                        exact_seen += 1;
                        assert!((d.cost - b).abs() <= 1e-9 * b, "seed {seed}: {} vs {b}", d.cost);
                        let m = MemoryModel::new(&inst);
                        assert_eq!(m.check(&d.placements), Ok(()));
                        assert!((step_time(&inst, &d.placements, overlap) - d.cost).abs() <= 1e-9 * b);
                    }
                }
                (b, d) => panic!("seed {seed}: brute force {b:?} vs DP {d:?}"),
            }
        }
        assert!(exact_seen >= 20, "too few exact instances: {exact_seen}");
    }

    #[test]
    fn feasible_plan_fits_whenever_any_plan_fits() {
        for seed in 0..40 {
            let inst = synthetic(6, 100 + seed, 1);
            let f = Formulation::new(&inst, OptimizerOverlap::Serial, 6);
            let brute = exhaustive(&inst, OptimizerOverlap::Serial, 6);
            let feas = feasible(&f);
            assert_eq!(brute.is_some(), feas.is_some(), "seed {seed}");
            if let Some(p) = feas {
                assert_eq!(MemoryModel::new(&inst).check(&p), Ok(()), "seed {seed}: {p:?}");
            }
        }
    }
}
