//! The MILP (microlp): which boundaries to keep, in which tier, which segments to recompute.
//!
//! # Formulation
//! - `x[s,e,t]` (binary): boundaries `s` and `e` are consecutive kept boundaries and `s` lives in tier
//!   `t`; the layers between them are recomputed. Only edges with `e - s <= max_segment_len` that fit
//!   some GPU row exist. Cost: the windows the edge carries ([`crate::window::edge_cost`]), whose
//!   exposed transfer time is the published model's PCIe/NVMe slack, folded per edge.
//! - Flow: the chosen edges form one path from boundary 0 to boundary L. Boundary 0's edge is on the
//!   GPU; boundary L is always on the GPU (it has no outgoing edge).
//! - `n[b]` (continuous, implied integer): GPU-kept boundaries below `b`,
//!   `n[b] = n[b-1] + sum of x[s,b,GPU]`.
//! - GPU memory at every point of backward (running sum, in whole slots): for each layer `k`,
//!   `n[k] + sum over edges (s,e) covering k of (k - s + 1 [+ head gradient slots on the top
//!   segment's first op]) x[s,e,*] <= cap_row[k]`.
//! - GPU memory at the end of forward and in the head: `n[L] <= cap_fwd`.
//! - Host and NVMe capacity: `sum x[.,.,Host] <= cap_host`, `sum x[.,.,Nvme] <= cap_nvme`.
//! - Objective: predicted step time minus a constant, plus tie-breaks of `1e-9` of the constant per
//!   host-kept boundary and twice that per NVMe-kept one (prefer the GPU when transfers hide).
//!
//! Following the microlp findings (shared/REFERENCE.md §6): memory rows are in integer slot units,
//! `mip_gap >= 1e-6`, the search is warm-started from the exact DP, and it runs under a time limit.

use std::time::{Duration, Instant};

use microlp::{ComparisonOp, OptimizationDirection, Problem, SolutionStatus, SolveOptions, SolveOutcome, Variable};

use crate::SchedError;
use crate::plan::{Placement, Tier};
use crate::window::{Formulation, MemoryModel};

/// Smallest MIP gap the planner uses: with 0, microlp stalls on floating-point noise (REFERENCE §6).
pub const MIN_MIP_GAP: f64 = 1e-6;

/// Tie-break per host-kept boundary, relative to the objective's constant part.
const TIE_BREAK: f64 = 1e-9;

/// Solver settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MilpOptions {
    /// Wall-clock limit of one solve.
    pub time_limit: Duration,
    /// Relative gap at which the search stops (raised to [`MIN_MIP_GAP`]).
    pub mip_gap: f64,
}

impl Default for MilpOptions {
    fn default() -> Self {
        // Half a second leaves room in `lt plan`'s one-second budget for the DP, the simulator and
        // the baselines.
        Self { time_limit: Duration::from_millis(500), mip_gap: MIN_MIP_GAP }
    }
}

/// A MILP solution.
#[derive(Debug, Clone, PartialEq)]
pub struct MilpSolution {
    /// Placements of boundaries `0..=L`.
    pub placements: Vec<Placement>,
    /// Model step time of the placements (edge costs plus constant, no tie-breaks), seconds
    /// (predicted).
    pub cost: f64,
    /// Proven optimal within the gap.
    pub optimal: bool,
    /// Relative gap when the search stopped.
    pub gap: Option<f64>,
    /// Branch-and-bound nodes.
    pub nodes: u64,
    /// Solver wall time, seconds.
    pub seconds: f64,
}

/// How a solve ended.
#[derive(Debug, Clone, PartialEq)]
pub enum MilpOutcome {
    /// A plan, optimal or the best incumbent.
    Solved(MilpSolution),
    /// Proven infeasible: no plan fits.
    Infeasible,
    /// The time limit ran out before any plan was found.
    NoIncumbent,
}

struct Edge {
    s: usize,
    e: usize,
    tier: Tier,
    var: Variable,
}

/// Build and solve the MILP of `f`, warm-started from `warm` when given.
///
/// # Errors
/// [`SchedError::Solver`] when microlp reports a numerical failure or invalid input.
pub fn solve(f: &Formulation, warm: Option<&[Placement]>, opts: &MilpOptions) -> Result<MilpOutcome, SchedError> {
    let started = Instant::now();
    let l = f.num_layers;
    let mem = &f.mem;
    let mut p = Problem::new(OptimizationDirection::Minimize);
    let tie = TIE_BREAK * f.constant.abs().max(1e-3);
    let mut edges: Vec<Edge> = Vec::new();
    for s in 0..l {
        for e in s + 1..=(s + f.max_segment_len).min(l) {
            for tier in Tier::ALL {
                let c = f.cost(s, e, tier);
                if !c.is_finite() {
                    continue;
                }
                let bias = tie * tier.index() as f64;
                edges.push(Edge { s, e, tier, var: p.add_binary_var(c + bias) });
            }
        }
    }
    // Flow: out - in = 1 at 0, -1 at L, 0 elsewhere.
    for b in 0..=l {
        let row: Vec<(Variable, f64)> = edges
            .iter()
            .filter_map(|x| {
                if x.s == b {
                    Some((x.var, 1.0))
                } else if x.e == b {
                    Some((x.var, -1.0))
                } else {
                    None
                }
            })
            .collect();
        let rhs = if b == 0 {
            1.0
        } else if b == l {
            -1.0
        } else {
            0.0
        };
        if row.is_empty() {
            if rhs != 0.0 {
                return Ok(MilpOutcome::Infeasible);
            }
            continue;
        }
        p.add_constraint(row, ComparisonOp::Eq, rhs);
    }
    // Running count of GPU-kept boundaries: n[b] for b = 1..=L (n[0] = 0).
    let counts: Vec<Variable> = (0..l).map(|_| p.add_var(0.0, (0.0, (l + 1) as f64))).collect();
    let count = |b: usize| if b == 0 { None } else { Some(counts[b - 1]) };
    for b in 1..=l {
        let mut row: Vec<(Variable, f64)> = vec![(counts[b - 1], 1.0)];
        if let Some(prev) = count(b - 1) {
            row.push((prev, -1.0));
        }
        row.extend(edges.iter().filter(|x| x.e == b && x.tier == Tier::Gpu).map(|x| (x.var, -1.0)));
        p.add_constraint(row, ComparisonOp::Eq, 0.0);
    }
    // GPU rows at every point of backward.
    for k in 0..l {
        let cap = mem.cap_row[k];
        if cap >= (k + 1) as i64 + mem.head_stage_slots {
            continue; // cannot bind
        }
        let mut row: Vec<(Variable, f64)> = Vec::new();
        if let Some(n) = count(k) {
            row.push((n, 1.0));
        }
        for x in edges.iter().filter(|x| x.s <= k && k < x.e) {
            let stage = if x.e == l && k == MemoryModel::top_first_position(x.s, l) { mem.head_stage_slots } else { 0 };
            row.push((x.var, ((k - x.s + 1) as i64 + stage) as f64));
        }
        p.add_constraint(row, ComparisonOp::Le, cap as f64);
    }
    if mem.cap_fwd < l as i64 {
        p.add_constraint([(counts[l - 1], 1.0)], ComparisonOp::Le, mem.cap_fwd as f64);
    }
    for (tier, cap) in [(Tier::Host, mem.cap_host), (Tier::Nvme, mem.cap_nvme)] {
        if cap < l as i64 - 1 {
            let row: Vec<(Variable, f64)> = edges.iter().filter(|x| x.tier == tier).map(|x| (x.var, 1.0)).collect();
            if !row.is_empty() {
                p.add_constraint(row, ComparisonOp::Le, cap.max(0) as f64);
            }
        }
    }

    let mut options = SolveOptions::default();
    options.time_limit = Some(opts.time_limit);
    options.mip_gap = opts.mip_gap.max(MIN_MIP_GAP);
    if let Some(w) = warm {
        let on: Vec<(usize, usize, Tier)> =
            crate::plan::segments(w).into_iter().filter_map(|(s, e)| w[s].tier().map(|t| (s, e, t))).collect();
        let hint = edges.iter().map(|x| (x.var, if on.contains(&(x.s, x.e, x.tier)) { 1.0 } else { 0.0 })).collect();
        options.warm_start = Some(hint);
    }
    let outcome = match p.solve_with(options) {
        Ok(o) => o,
        Err(microlp::Error::Infeasible) => return Ok(MilpOutcome::Infeasible),
        Err(e) => return Err(SchedError::Solver { reason: e.to_string() }),
    };
    let sol = match outcome {
        SolveOutcome::Solution(s) => s,
        SolveOutcome::Interrupted(_) => return Ok(MilpOutcome::NoIncumbent),
    };
    let mut placements = vec![Placement::Recompute; l + 1];
    placements[l] = Placement::Gpu;
    let mut at = 0;
    while at < l {
        let Some(x) = edges.iter().find(|x| x.s == at && sol.var_value(x.var) > 0.5) else {
            return Err(SchedError::Solver { reason: format!("solution has no edge leaving boundary {at}") });
        };
        placements[at] = x.tier.into();
        at = x.e;
    }
    let cost = f.path_cost(&placements);
    if !cost.is_finite() {
        return Err(SchedError::Solver { reason: "solution uses an edge outside the formulation".into() });
    }
    Ok(MilpOutcome::Solved(MilpSolution {
        placements,
        cost,
        optimal: sol.status() == SolutionStatus::Optimal || sol.gap().is_some_and(|g| g <= options_gap(opts)),
        gap: sol.gap(),
        nodes: sol.stats().nodes_solved,
        seconds: started.elapsed().as_secs_f64(),
    }))
}

fn options_gap(opts: &MilpOptions) -> f64 {
    opts.mip_gap.max(MIN_MIP_GAP)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dp;
    use crate::plan::OptimizerOverlap;
    use crate::window::tests::synthetic;

    /// Tolerance of "equal optima": the MIP gap (1e-6 relative) plus the tie-breaks (at most L x 2e-9
    /// of the constant), rounded up.
    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 2e-6 * a.abs().max(b.abs())
    }

    #[test]
    fn milp_equals_exhaustive_search_up_to_8_layers() {
        let mut solved = 0;
        for seed in 0..36u64 {
            let l = 3 + (seed % 6) as usize; // 3..=8 layers
            // 8 layers means 4^7 = 16384 plans per instance: keep those few.
            if l == 8 && seed % 3 != 0 {
                continue;
            }
            let inst = synthetic(l, 1000 + seed, 1 + (seed % 2) as usize);
            let overlap = OptimizerOverlap::ALL[(seed % 3) as usize];
            let f = Formulation::new(&inst, overlap, l);
            let brute = dp::exhaustive(&inst, overlap, l);
            let milp =
                solve(&f, None, &MilpOptions { time_limit: Duration::from_secs(20), ..Default::default() }).unwrap();
            match (brute, milp) {
                (None, MilpOutcome::Infeasible) => {}
                (Some((_, b)), MilpOutcome::Solved(m)) => {
                    solved += 1;
                    assert!(m.optimal, "seed {seed}: not proven optimal");
                    assert!(close(m.cost, b), "seed {seed} L {l}: MILP {} vs exhaustive {b}", m.cost);
                    assert_eq!(f.mem.check(&m.placements), Ok(()), "seed {seed}");
                }
                (b, m) => panic!("seed {seed}: exhaustive {b:?} vs MILP {m:?}"),
            }
        }
        assert!(solved >= 15, "too few feasible instances: {solved}");
    }

    /// A large instance where GPU and host memory both bind: about a third of the boundaries fit on
    /// the GPU and a quarter in host memory, so the rest must be recomputed; NVMe has room for all, so
    /// the DP is exact.
    fn large(l: usize, seed: u64) -> crate::cost::Instance {
        let mut inst = synthetic(l, seed, 1 + (seed % 2) as usize);
        let a = inst.boundary_bytes;
        inst.gpu_capacity = a * (9.5 + l as f64 / 3.0);
        inst.host_capacity = inst.host_static_bytes + a * (l as f64 / 4.0 + (seed % 5) as f64);
        inst.nvme_capacity = a * l as f64;
        inst
    }

    #[test]
    fn milp_equals_dp_on_24_to_96_layers() {
        for (l, seed) in [(24, 1), (24, 2), (48, 3), (64, 4), (96, 5), (96, 6)] {
            let inst = large(l, seed);
            let overlap = OptimizerOverlap::ALL[(seed % 3) as usize];
            let f = Formulation::new(&inst, overlap, crate::planner::DEFAULT_MAX_SEGMENT_LEN);
            let d = dp::solve(&f).unwrap();
            assert!(d.exact, "L {l}: the DP must be exact on these instances");
            // Both memory tiers bind: the optimum recomputes and offloads.
            assert!(d.placements.contains(&Placement::Recompute) && d.placements.contains(&Placement::Host));
            // No warm start: the MILP must find the optimum on its own.
            let opts = MilpOptions { time_limit: Duration::from_secs(30), ..Default::default() };
            let MilpOutcome::Solved(m) = solve(&f, None, &opts).unwrap() else { panic!("L {l}: no solution") };
            assert!(m.optimal, "L {l}: not proven optimal in {} s", m.seconds);
            assert!(close(m.cost, d.cost), "L {l}: MILP {} vs DP {}", m.cost, d.cost);
            assert_eq!(f.mem.check(&m.placements), Ok(()));
        }
    }

    #[test]
    fn warm_start_from_dp_keeps_the_optimum() {
        let inst = synthetic(7, 77, 2);
        let f = Formulation::new(&inst, OptimizerOverlap::OverlapNextForward, 7);
        let d = dp::solve(&f).unwrap();
        let MilpOutcome::Solved(m) = solve(&f, Some(&d.placements), &MilpOptions::default()).unwrap() else {
            panic!("no solution")
        };
        assert!(close(m.cost, d.cost), "{} vs {}", m.cost, d.cost);
    }
}
