//! The window model: the planner's analytic step time and memory bounds.
//!
//! # Time
//! A micro-batch is a sequence of compute ops: forward `F_0..F_{L-1}`, the head `H`, then per segment
//! (top first) recompute ops `R_s..R_{e-2}` and backward ops `B_{e-1}..B_s`. Each op opens a *window*:
//! while it computes, the H2D stream uploads what the next op needs (its weights, and the segment's
//! start boundary when the next op opens a segment whose start is off the GPU), and the D2H stream
//! downloads what the previous op produced (a backward op's weight gradients, the head's gradient, or
//! in forward the boundary being offloaded). A window lasts
//! `max(compute, h2d traffic / bw, d2h traffic / bw)`: whatever exceeds the compute is exposed time (the
//! published model's slack). NVMe traffic rides on the same windows: an offload is a D2H into a staging
//! buffer followed by the NVMe write, a reload an NVMe read overlapped with the window's weight upload
//! followed by the H2D.
//!
//! The step time is the sum of all windows of all micro-batches plus the *gap* between the end of the
//! last backward op and the start of the next step's first forward op (the tail downloads, the
//! optimizer as [`OptimizerOverlap`] schedules it, the first uploads). Between micro-batches the
//! previous one's last downloads (layer 0's gradients and `dx_0`) block no op, but the first offload
//! queues behind them, so the forward windows before the first kept boundary last at least as long.
//!
//! NVMe traffic is held to its window: the forward op after next waits until an NVMe-kept boundary is
//! written (one write in flight), and a reload's read starts with its window. The executor must follow
//! the same rules for the predictions to hold.
//!
//! Because every window's traffic is fixed by exactly one edge `(s, e, tier)` of the path of kept
//! boundaries, the window times add up per edge ([`edge_cost`]): the MILP is a resource-constrained
//! shortest path, and each window's slack is folded into its edge cost — at every integer point that is
//! the published slack formulation, with the tightest linear relaxation. [`step_time`] computes the same
//! total op by op, independently, and the tests check they agree.
//!
//! The optimizer's overlap is bounded with placement-independent lower bounds on the windows (their
//! compute, and in backward the upload of some lower layer's weights), so the gap is an upper bound that
//! does not depend on the placements; the simulator replays the real interplay. The window model is
//! therefore an upper bound on the replay (see `planner::SIM_TOLERANCE` for how close).
//!
//! # Memory
//! All GPU rows are counted in whole boundary slots (the unit `A` = one boundary activation), with each
//! row's working set subtracted from the capacity first ([`MemoryModel`]). While layer `k`'s backward (or
//! the recompute producing boundary `k`) runs inside segment `[s, e)`, the GPU holds the GPU-kept
//! boundaries below `s`, boundaries `s..=k`, the fixed memory (static buffers and one prefetch slot) and
//! the op's working set; the first op of the top segment also holds the head gradient waiting for its
//! download. At the end of forward the GPU holds every GPU-kept boundary plus the head's working set.

use serde::{Deserialize, Serialize};

use crate::cost::Instance;
use crate::plan::{OptimizerOverlap, Placement, Tier, segments};

/// One window's traffic besides its compute.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Win {
    /// Compute seconds of the op.
    pub compute: f64,
    /// Plain H2D bytes (weights, boundary 0).
    pub h2d_bytes: f64,
    /// Reload of a boundary from this tier (after the plain bytes).
    pub reload: Option<Tier>,
    /// Plain D2H bytes (gradients, `dx_0`).
    pub d2h_bytes: f64,
    /// Offload of a boundary to this tier.
    pub offload: Option<Tier>,
}

/// Length of a window in seconds.
pub(crate) fn window_seconds(inst: &Instance, w: &Win) -> f64 {
    let a = inst.boundary_bytes;
    let h2d = match w.reload {
        Some(Tier::Nvme) => (w.h2d_bytes / inst.h2d).max(a / inst.nvme_read) + a / inst.h2d,
        Some(Tier::Host) => (w.h2d_bytes + a) / inst.h2d,
        _ => w.h2d_bytes / inst.h2d,
    };
    let d2h = match w.offload {
        Some(Tier::Nvme) => (w.d2h_bytes + a) / inst.d2h + a / inst.nvme_write,
        Some(Tier::Host) => (w.d2h_bytes + a) / inst.d2h,
        _ => w.d2h_bytes / inst.d2h,
    };
    w.compute.max(h2d).max(d2h)
}

/// A compute op of a micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Forward of a layer.
    Fwd(usize),
    /// Head and loss (forward and backward, chunked).
    Head,
    /// Recompute forward of a layer.
    Rec(usize),
    /// Backward of a layer (graph-recording forward + backward).
    Bwd(usize),
}

/// The ops of one micro-batch in order, with, for each op that opens a backward segment, the
/// segment's start boundary.
pub(crate) fn micro_batch_ops(placements: &[Placement]) -> Vec<(Op, Option<usize>)> {
    let l = placements.len().saturating_sub(1);
    let mut ops: Vec<(Op, Option<usize>)> = (0..l).map(|i| (Op::Fwd(i), None)).collect();
    ops.push((Op::Head, None));
    for (s, e) in segments(placements).into_iter().rev() {
        let mut first = Some(s);
        for j in s..e.saturating_sub(1) {
            ops.push((Op::Rec(j), first.take()));
        }
        for j in (s..e).rev() {
            ops.push((Op::Bwd(j), first.take()));
        }
    }
    ops
}

/// Weight bytes an op uploads.
fn op_weights(inst: &Instance, op: Op) -> f64 {
    match op {
        Op::Fwd(i) | Op::Rec(i) | Op::Bwd(i) => inst.layers[i].weight_bytes,
        Op::Head => inst.head.weight_bytes,
    }
}

/// Gradient bytes an op leaves for download.
fn op_grads(inst: &Instance, op: Op) -> f64 {
    match op {
        Op::Bwd(i) => inst.layers[i].grad_bytes,
        Op::Head => inst.head.grad_bytes,
        _ => 0.0,
    }
}

fn op_compute(inst: &Instance, op: Op) -> f64 {
    match op {
        Op::Fwd(i) | Op::Rec(i) => inst.layers[i].fwd_seconds,
        Op::Bwd(i) => inst.layers[i].bwd_seconds,
        Op::Head => inst.head.seconds,
    }
}

/// The windows of micro-batch `m` (0-based) of a step, op by op.
pub(crate) fn micro_batch_windows(inst: &Instance, placements: &[Placement], m: usize) -> Vec<(Op, Win)> {
    let k = inst.grad_accum_steps;
    let a = inst.boundary_bytes;
    let ops = micro_batch_ops(placements);
    let mut out = Vec::with_capacity(ops.len());
    for (q, &(op, _)) in ops.iter().enumerate() {
        let next = ops.get(q + 1).copied();
        let mut w = Win { compute: op_compute(inst, op), ..Win::default() };
        match op {
            Op::Fwd(i) => {
                // The head is uploaded once per step, during the first micro-batch's last forward op.
                w.h2d_bytes = next.map_or(0.0, |(n, _)| if n == Op::Head && m > 0 { 0.0 } else { op_weights(inst, n) });
                if i >= 1 && placements[i].is_offloaded() {
                    w.offload = placements[i].tier();
                }
            }
            _ => {
                match next {
                    Some((n, start)) => {
                        w.h2d_bytes = op_weights(inst, n);
                        if let Some(s) = start
                            && placements[s].is_offloaded()
                        {
                            w.reload = placements[s].tier();
                        }
                    }
                    // The last op prefetches the next micro-batch's first layer and boundary 0.
                    None if m + 1 < k => w.h2d_bytes = inst.layers[0].weight_bytes + a,
                    None => {}
                }
                if q > 0 {
                    w.d2h_bytes = op_grads(inst, ops[q - 1].0);
                }
            }
        }
        out.push((op, w));
    }
    out
}

/// The gap between the end of the last backward op of a step and the start of the next step's first
/// forward op, plus any stretch of the next forward by the optimizer, seconds (an upper bound that holds
/// for every placement).
pub fn gap_seconds(inst: &Instance, overlap: OptimizerOverlap) -> f64 {
    let l = inst.num_layers();
    let a = inst.boundary_bytes;
    let tail = (inst.layers[0].grad_bytes + a) / inst.d2h;
    let w0 = inst.layers[0].weight_bytes / inst.h2d;
    match overlap {
        OptimizerOverlap::Serial => tail + inst.optimizer_seconds() + w0 + a / inst.h2d,
        OptimizerOverlap::OverlapBackward => {
            // Release time of each gradient relative to the end of the last backward op: the
            // gradient of B_j is downloaded in the next window, after which at least the windows of
            // B_{j-2}..B_0 remain. Each B_i window (i >= 1) lasts at least its compute and the upload
            // of the next op's weights, which belong to some layer below i; B_0 of the last
            // micro-batch uploads nothing. That bounds the time left from below for every placement.
            let mut prefix = vec![0.0; l + 1];
            let mut w_min_below = f64::INFINITY;
            for i in 0..l {
                let lb = if i == 0 {
                    inst.layers[0].bwd_seconds
                } else {
                    inst.layers[i].bwd_seconds.max(w_min_below / inst.h2d)
                };
                w_min_below = w_min_below.min(inst.layers[i].weight_bytes);
                prefix[i + 1] = prefix[i] + lb;
            }
            let left = |j: usize| if j >= 2 { prefix[j - 1] } else { 0.0 };
            let mut f = f64::NEG_INFINITY;
            f = f.max(-left(l)) + inst.opt_head_seconds;
            for j in (1..l).rev() {
                f = f.max(-left(j)) + inst.layers[j].optimizer_seconds;
            }
            f = f.max(inst.layers[0].grad_bytes / inst.d2h) + inst.layers[0].optimizer_seconds;
            let f0 = f;
            let f_emb = f.max(tail) + inst.opt_embed_seconds;
            let t_w = f0 + w0;
            t_w.max(f_emb) + a / inst.h2d
        }
        OptimizerOverlap::OverlapNextForward => {
            // Every gradient (and the global norm) is in after the tail; updates then run in forward
            // order and each upload waits for its layer's update.
            let mut f = tail + inst.opt_embed_seconds;
            let f_emb = f;
            let mut fin = Vec::with_capacity(l);
            for layer in &inst.layers {
                f += layer.optimizer_seconds;
                fin.push(f);
            }
            let f_head = f + inst.opt_head_seconds;
            let next_w = |i: usize| if i + 1 < l { inst.layers[i + 1].weight_bytes } else { inst.head.weight_bytes };
            let w0_win = |i: usize| inst.layers[i].fwd_seconds.max(next_w(i) / inst.h2d);
            let start0 = (fin[0] + w0).max(f_emb) + a / inst.h2d;
            let mut end = start0 + w0_win(0);
            let mut sum = w0_win(0);
            for (i, fi) in fin.iter().enumerate().skip(1) {
                let ready = fi + inst.layers[i].weight_bytes / inst.h2d;
                end = end.max(ready) + w0_win(i);
                sum += w0_win(i);
            }
            let ready_h = f_head + inst.head.weight_bytes / inst.h2d;
            let end_h = end.max(ready_h) + inst.head.seconds;
            end_h - sum - inst.head.seconds
        }
    }
}

/// Seconds the previous micro-batch's last downloads (layer 0's gradients and `dx_0`) keep the D2H
/// stream busy at the start of a micro-batch. No forward op waits for them, but the first offload
/// queues behind them: the forward windows before the first kept boundary last at least this long.
pub(crate) fn tail_seconds(inst: &Instance) -> f64 {
    (inst.layers[0].grad_bytes + inst.boundary_bytes) / inst.d2h
}

/// Step time of a plan by the window model, op by op (independent of the edge decomposition).
pub fn step_time(inst: &Instance, placements: &[Placement], overlap: OptimizerOverlap) -> f64 {
    let first_kept = (1..placements.len()).find(|&i| placements[i].is_kept()).unwrap_or(placements.len() - 1);
    let mut total = 0.0;
    for m in 0..inst.grad_accum_steps {
        let wins = micro_batch_windows(inst, placements, m);
        let lead: f64 = wins
            .iter()
            .filter(|(op, _)| matches!(op, Op::Fwd(i) if *i < first_kept))
            .map(|(_, w)| window_seconds(inst, w))
            .sum();
        let rest: f64 = wins
            .iter()
            .filter(|(op, _)| !matches!(op, Op::Fwd(i) if *i < first_kept))
            .map(|(_, w)| window_seconds(inst, w))
            .sum();
        total += rest + if m >= 1 { lead.max(tail_seconds(inst)) } else { lead };
    }
    total + gap_seconds(inst, overlap)
}

/// Seconds of the windows attributed to the path edge `(s, e)` with boundary `s` in `tier`, summed
/// over the micro-batches of a step: the forward windows of layers `s..e`, the segment's recompute
/// and backward windows except `B_s`, and the window that precedes the segment in backward (`B_e`, or
/// the head when `e = L`), whose uploads are the segment's first weights and its reload.
pub fn edge_cost(inst: &Instance, s: usize, e: usize, tier: Tier) -> f64 {
    let l = inst.num_layers();
    let k = inst.grad_accum_steps as f64;
    let lay = &inst.layers;
    let w = |i: usize| lay[i].weight_bytes;
    // Weights uploaded during forward window i: the next layer's, or after the last the head's, which
    // only the step's first micro-batch uploads.
    let fwd_next = |i: usize, first: bool| {
        if i + 1 < l {
            w(i + 1)
        } else if first {
            inst.head.weight_bytes
        } else {
            0.0
        }
    };
    // Gradients downloaded during B_j: those of the op before it, B_{j+1} or the head.
    let grads_during_b = |j: usize| if j + 1 < l { lay[j + 1].grad_bytes } else { inst.head.grad_bytes };
    let offload = if tier == Tier::Gpu { None } else { Some(tier) };

    let fwd = |i: usize, off: Option<Tier>, first: bool| {
        let win = Win {
            compute: lay[i].fwd_seconds,
            h2d_bytes: fwd_next(i, first),
            d2h_bytes: 0.0,
            offload: off,
            reload: None,
        };
        window_seconds(inst, &win)
    };
    // Forward windows: identical in every micro-batch but for the head's upload in the first, and from
    // the second micro-batch on the first segment's windows last at least as long as the previous
    // micro-batch's tail downloads.
    let off_s = if s >= 1 { offload } else { None };
    let fwd_sum = |first: bool| (s + 1..e).map(|i| fwd(i, None, first)).sum::<f64>() + fwd(s, off_s, first);
    let (first, rest) = (fwd_sum(true), fwd_sum(false));
    let total = if s == 0 { first + (k - 1.0) * rest.max(tail_seconds(inst)) } else { first + (k - 1.0) * rest };

    let mut bwd = 0.0;
    // Recompute windows R_s..R_{e-2}: upload the next op's layer (j + 1); R_s downloads the gradients
    // of the op before the segment (B_e or the head).
    for (j, layer) in lay.iter().enumerate().take(e.saturating_sub(1)).skip(s) {
        let d2h = if j == s { grads_during_b(e - 1) } else { 0.0 };
        let win = Win { compute: layer.fwd_seconds, h2d_bytes: w(j + 1), d2h_bytes: d2h, ..Win::default() };
        bwd += window_seconds(inst, &win);
    }
    // Backward windows B_{e-1}..B_{s+1}: upload layer j - 1; download B_{j+1}'s gradients, except
    // B_{e-1}, which follows a recompute op.
    for j in (s + 1..e).rev() {
        let d2h = if j == e - 1 { 0.0 } else { lay[j + 1].grad_bytes };
        let win = Win { compute: lay[j].bwd_seconds, h2d_bytes: w(j - 1), d2h_bytes: d2h, ..Win::default() };
        bwd += window_seconds(inst, &win);
    }
    // The window before the segment uploads its first op's weights (layer s) and its reload.
    let reload = if tier == Tier::Gpu { None } else { Some(tier) };
    let before = if e < l {
        Win { compute: lay[e].bwd_seconds, h2d_bytes: w(s), reload, d2h_bytes: grads_during_b(e), offload: None }
    } else {
        Win { compute: inst.head.seconds, h2d_bytes: w(s), reload, d2h_bytes: 0.0, offload: None }
    };
    bwd += window_seconds(inst, &before);
    total + k * bwd
}

/// Seconds that no edge carries: every micro-batch's `B_0` window and the step gap.
pub fn constant_seconds(inst: &Instance, overlap: OptimizerOverlap) -> f64 {
    let l = inst.num_layers();
    let a = inst.boundary_bytes;
    let d2h = if l > 1 { inst.layers[1].grad_bytes } else { inst.head.grad_bytes };
    let mut total = 0.0;
    for m in 0..inst.grad_accum_steps {
        let h2d = if m + 1 < inst.grad_accum_steps { inst.layers[0].weight_bytes + a } else { 0.0 };
        let win = Win { compute: inst.layers[0].bwd_seconds, h2d_bytes: h2d, d2h_bytes: d2h, ..Win::default() };
        total += window_seconds(inst, &win);
    }
    total + gap_seconds(inst, overlap)
}

/// Capacities in whole boundary slots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryModel {
    /// Bytes of one slot (one boundary activation).
    pub slot_bytes: f64,
    /// Per layer `k`: slots available to boundaries while `B_k` (or the recompute producing boundary
    /// `k`) runs.
    pub cap_row: Vec<i64>,
    /// Slots available to GPU-kept boundaries `0..L` at the end of forward and during the head.
    pub cap_fwd: i64,
    /// Slots taken by the head gradient waiting for download during the first backward op.
    pub head_stage_slots: i64,
    /// Slots of host memory for host-kept boundaries; negative when the static host state alone does
    /// not fit (then no plan fits).
    pub cap_host: i64,
    /// Slots of NVMe for NVMe-kept boundaries.
    pub cap_nvme: i64,
}

/// Which capacity a plan breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryViolation {
    /// GPU memory during the backward of (or the recompute producing) boundary `k`.
    GpuBackward(usize),
    /// GPU memory at the end of forward or during the head.
    GpuForward,
    /// Host memory.
    Host,
    /// NVMe capacity.
    Nvme,
    /// Boundaries 0 and L must be on the GPU and there must be `L + 1` of them.
    Rules,
}

fn slots(bytes: f64, slot: f64) -> i64 {
    if slot.is_nan() || slot <= 0.0 {
        return -1;
    }
    // Clamp: capacities far beyond any plan behave like "unbounded".
    (bytes / slot).floor().clamp(-1.0, 1e12) as i64
}

/// Head weights that stay on the GPU through the whole step: with gradient accumulation the head is
/// uploaded once per step (during the first micro-batch's last forward layer) and lives to the step's
/// last head op, through every op of the earlier micro-batches. Alone, they live only from the last
/// forward layer to the head ([`forward_need`]).
fn resident_head(inst: &Instance) -> f64 {
    if inst.grad_accum_steps > 1 { inst.head.weight_bytes } else { 0.0 }
}

/// A backward op's working set peaks after its graph-recording forward, once the graph is complete.
/// The previous backward's gradients, downloading since that op ended, are counted at the peak
/// unless their download (predicted) takes at most this fraction of the recording forward (predicted):
/// a margin of 2x on both predictions.
const DOWNLOAD_HIDDEN_FRACTION: f64 = 0.5;

/// Whether the gradients of layer `k + 1` may still be downloading when the backward of layer `k`
/// reaches its working-set peak (see [`DOWNLOAD_HIDDEN_FRACTION`]). The replay ([`crate::sim`])
/// places that peak the same way, after the recording forward, and holds each layer's gradients
/// until their download ends.
fn download_outlasts_recording(inst: &Instance, k: usize) -> bool {
    inst.layers
        .get(k + 1)
        .is_some_and(|prev| prev.grad_bytes / inst.d2h > DOWNLOAD_HIDDEN_FRACTION * inst.layers[k].fwd_seconds)
}

/// Working set of backward row `k` beyond the fixed memory (which holds the gradients the running
/// backward produces): the largest of
/// - the backward of layer `k` after its recording forward: its working set, plus layer `k + 1`'s
///   gradients if their download outlasts the recording forward;
/// - its recording forward: a forward's working set plus layer `k + 1`'s gradients, downloading;
/// - the recompute producing boundary `k`: its working set plus the gradients of the backward that
///   ran before it (some layer above `k`), downloading.
///
/// The top layer's predecessor is the head, whose gradient is counted as the staged head
/// ([`gpu_live`]).
fn row_workspace(inst: &Instance, k: usize) -> f64 {
    let l = &inst.layers;
    let prev = l.get(k + 1).map_or(0.0, |x| x.grad_bytes);
    let above = l.iter().skip(k + 1).map(|x| x.grad_bytes).fold(0.0, f64::max);
    let ws_rec = if k >= 1 { l[k - 1].fwd_workspace_bytes + above } else { 0.0 };
    let downloading = if download_outlasts_recording(inst, k) { prev } else { 0.0 };
    (l[k].bwd_workspace_bytes + downloading).max(l[k].fwd_workspace_bytes + prev).max(ws_rec)
}

/// What the forward row needs beyond the fixed memory and the GPU-kept boundaries: the forward of
/// layer `k` holds its input and output plus its working set (plus the head weights being prefetched
/// during the last layer); the head holds boundary L plus its working set.
fn forward_need(inst: &Instance) -> f64 {
    let a = inst.boundary_bytes;
    let resident = resident_head(inst);
    let fwd_ws = inst.layers.iter().map(|x| x.fwd_workspace_bytes).fold(0.0, f64::max);
    let last_fwd = inst.layers.last().map_or(0.0, |x| x.fwd_workspace_bytes);
    (fwd_ws + 2.0 * a)
        .max(last_fwd + 2.0 * a + inst.head.weight_bytes - resident)
        .max(inst.head.workspace_bytes - resident + a)
}

/// A point of the step at which the memory model counts what is live on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuPoint {
    /// The backward of layer `k`, or the recompute producing boundary `k`.
    Backward(usize),
    /// The end of forward and the head.
    Forward,
}

impl std::fmt::Display for GpuPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuPoint::Backward(k) => write!(f, "the backward of layer {k}"),
            GpuPoint::Forward => write!(f, "the end of forward and the head"),
        }
    }
}

/// The memory model, in bytes: what is live on the GPU at every point of one micro-batch of
/// `placements` — the static buffers and one prefetch slot, the resident head, the op's working set,
/// the GPU-kept boundaries and the segment's live boundaries. [`MemoryModel::check`] compares the same
/// sums with the capacity in whole slots; lt-exec checks its device budget with [`gpu_peak`] and the
/// plan's predicted peak is [`gpu_peak`]. Placements must satisfy [`crate::plan::check_boundaries`].
pub fn gpu_live(inst: &Instance, placements: &[Placement]) -> Vec<(GpuPoint, f64)> {
    let a = inst.boundary_bytes;
    let l = inst.num_layers();
    let base = inst.gpu_fixed_bytes() + resident_head(inst);
    let stage = (inst.head.stage_bytes / a).ceil().max(0.0) * a;
    let mut out = Vec::with_capacity(l + 1);
    let mut gpu_below = 0.0;
    for (s, e) in segments(placements) {
        let first = MemoryModel::top_first_position(s, l);
        for k in s..e {
            let staged = if e == l && k == first { stage } else { 0.0 };
            let live = base + row_workspace(inst, k) + (gpu_below + (k - s + 1) as f64) * a + staged;
            out.push((GpuPoint::Backward(k), live));
        }
        if placements[s] == Placement::Gpu {
            gpu_below += 1.0;
        }
    }
    out.push((GpuPoint::Forward, base + forward_need(inst) + gpu_below * a));
    out
}

/// The largest of [`gpu_live`]: the predicted GPU peak of one micro-batch, and where it occurs.
pub fn gpu_peak(inst: &Instance, placements: &[Placement]) -> (GpuPoint, f64) {
    gpu_live(inst, placements).into_iter().fold((GpuPoint::Forward, 0.0), |m, x| if x.1 > m.1 { x } else { m })
}

impl MemoryModel {
    /// The rows of `inst`: [`gpu_live`]'s sums, solved for the number of boundary slots that fit.
    pub fn new(inst: &Instance) -> Self {
        let a = inst.boundary_bytes;
        let l = inst.num_layers();
        let free = inst.gpu_capacity - inst.gpu_fixed_bytes() - resident_head(inst);
        let cap_row = (0..l).map(|k| slots(free - row_workspace(inst, k), a)).collect();
        MemoryModel {
            slot_bytes: a,
            cap_row,
            cap_fwd: slots(free - forward_need(inst), a),
            head_stage_slots: (inst.head.stage_bytes / a).ceil().max(0.0) as i64,
            cap_host: slots(inst.host_capacity - inst.host_static_bytes, a),
            cap_nvme: slots(inst.nvme_capacity, a),
        }
    }

    /// Position of the first backward op of the top segment `(s, L)`: the recompute producing
    /// boundary `s + 1`, or `B_s` when the segment has one layer.
    pub fn top_first_position(s: usize, l: usize) -> usize {
        if l - s >= 2 { s + 1 } else { s }
    }

    /// Check a plan against every capacity, directly from its placements.
    ///
    /// # Errors
    /// The first capacity it breaks.
    pub fn check(&self, placements: &[Placement]) -> Result<(), MemoryViolation> {
        let l = self.cap_row.len();
        if placements.len() != l + 1 || placements[0] != Placement::Gpu || placements[l] != Placement::Gpu {
            return Err(MemoryViolation::Rules);
        }
        if self.cap_host < 0 {
            // The static host state (master weights, optimizer state, buffers) alone does not fit.
            return Err(MemoryViolation::Host);
        }
        let mut gpu_below = 0i64;
        for (s, e) in segments(placements) {
            let first = Self::top_first_position(s, l);
            for k in s..e {
                let stage = if e == l && k == first { self.head_stage_slots } else { 0 };
                if gpu_below + (k - s + 1) as i64 + stage > self.cap_row[k] {
                    return Err(MemoryViolation::GpuBackward(k));
                }
            }
            if placements[s] == Placement::Gpu {
                gpu_below += 1;
            }
        }
        if gpu_below > self.cap_fwd {
            return Err(MemoryViolation::GpuForward);
        }
        let count = |p: Placement| placements.iter().filter(|&&x| x == p).count() as i64;
        if count(Placement::Host) > self.cap_host {
            return Err(MemoryViolation::Host);
        }
        if count(Placement::Nvme) > self.cap_nvme {
            return Err(MemoryViolation::Nvme);
        }
        Ok(())
    }
}

/// The path formulation shared by the DP and the MILP: per edge `(s, e)` with `e - s <= max_len`, the
/// cost of each tier of `s` and the largest number of GPU-kept boundaries below `s` with which the
/// edge fits in every GPU row.
#[derive(Debug, Clone)]
pub struct Formulation {
    /// Decoder layers.
    pub num_layers: usize,
    /// Longest segment considered.
    pub max_segment_len: usize,
    /// Capacities.
    pub mem: MemoryModel,
    /// Seconds no edge carries ([`constant_seconds`]).
    pub constant: f64,
    cost: Vec<[f64; 3]>,
    gmax: Vec<i64>,
}

impl Formulation {
    /// Build the formulation of `inst` with optimizer mode `overlap`.
    pub fn new(inst: &Instance, overlap: OptimizerOverlap, max_segment_len: usize) -> Self {
        let l = inst.num_layers();
        let sm = max_segment_len.clamp(1, l.max(1));
        let mem = MemoryModel::new(inst);
        let mut cost = vec![[f64::INFINITY; 3]; l * sm];
        let mut gmax = vec![i64::MIN; l * sm];
        for s in 0..l {
            for len in 1..=sm.min(l - s) {
                let e = s + len;
                let first = MemoryModel::top_first_position(s, l);
                let g = (s..e)
                    .map(|k| {
                        let stage = if e == l && k == first { mem.head_stage_slots } else { 0 };
                        mem.cap_row[k] - (k - s + 1) as i64 - stage
                    })
                    .min()
                    .unwrap_or(i64::MIN);
                let idx = s * sm + len - 1;
                // No edge exists when the static host state does not fit: every plan is infeasible.
                gmax[idx] = if mem.cap_host < 0 { i64::MIN } else { g };
                if gmax[idx] < 0 {
                    continue;
                }
                for t in Tier::ALL {
                    let allowed = match t {
                        Tier::Gpu => mem.cap_fwd >= 1,
                        Tier::Host => s > 0 && mem.cap_host >= 1,
                        Tier::Nvme => s > 0 && mem.cap_nvme >= 1,
                    };
                    if allowed {
                        cost[idx][t.index()] = edge_cost(inst, s, e, t);
                    }
                }
            }
        }
        Formulation { num_layers: l, max_segment_len: sm, mem, constant: constant_seconds(inst, overlap), cost, gmax }
    }

    /// Cost of edge `(s, e)` with `s` in `tier`; infinite when the edge is not allowed.
    pub fn cost(&self, s: usize, e: usize, tier: Tier) -> f64 {
        match self.index(s, e) {
            Some(i) => self.cost[i][tier.index()],
            None => f64::INFINITY,
        }
    }

    /// Largest number of GPU-kept boundaries below `s` with which edge `(s, e)` fits; `None` when
    /// the edge is out of range or never fits.
    pub fn gmax(&self, s: usize, e: usize) -> Option<i64> {
        self.index(s, e).map(|i| self.gmax[i]).filter(|&g| g >= 0)
    }

    fn index(&self, s: usize, e: usize) -> Option<usize> {
        if e <= s || e > self.num_layers || e - s > self.max_segment_len {
            return None;
        }
        Some(s * self.max_segment_len + (e - s) - 1)
    }

    /// Model step time of a plan: its edge costs plus the constant; infinite if an edge is not
    /// allowed (segment too long, or never fits).
    pub fn path_cost(&self, placements: &[Placement]) -> f64 {
        let mut total = self.constant;
        for (s, e) in segments(placements) {
            match placements[s].tier() {
                Some(t) => total += self.cost(s, e, t),
                None => return f64::INFINITY,
            }
        }
        total
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cost::{HeadCost, LayerCost};
    use lt_core::config::LayerKind;

    /// A synthetic instance: `l` layers with varied costs, scaled by `seed`.
    pub(crate) fn synthetic(l: usize, seed: u64, k: usize) -> Instance {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut rnd = move || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) as f64) / ((1u64 << 31) as f64)
        };
        let a = 1e8;
        let layers = (0..l)
            .map(|_| {
                let f = 0.01 + 0.02 * rnd();
                LayerCost {
                    kind: LayerKind::FullAttention,
                    params: 100_000_000,
                    weight_bytes: 1e8 + 2e8 * rnd(),
                    grad_bytes: 1e8 + 2e8 * rnd(),
                    fwd_flops: f * 1e14,
                    bwd_flops: 2.0 * f * 1e14,
                    fwd_seconds: f,
                    bwd_seconds: 3.0 * f * (0.9 + 0.2 * rnd()),
                    fwd_workspace_bytes: a * (1.0 + rnd()),
                    bwd_workspace_bytes: a * (2.0 + 2.0 * rnd()),
                    optimizer_seconds: 0.02 * rnd(),
                }
            })
            .collect();
        Instance {
            layers,
            head: HeadCost {
                params: 1,
                flops: 1e13,
                seconds: 0.02 + 0.02 * rnd(),
                weight_bytes: 3e8,
                grad_bytes: 3e8,
                workspace_bytes: 2.5 * a,
                stage_bytes: 1.5 * a,
            },
            boundary_bytes: a,
            micro_batch_size: 1,
            grad_accum_steps: k,
            seq_len: 1,
            loss_chunk_tokens: 1,
            retain_all_logits: false,
            h2d: 1e10 + 1e10 * rnd(),
            d2h: 1e10 + 1e10 * rnd(),
            nvme_read: 3e9,
            nvme_write: 3e9,
            gpu_capacity: a * (14.0 + (l as f64) * rnd()),
            host_capacity: 1e9 + a * 3.0,
            nvme_capacity: a * 2.0,
            gpu_static_bytes: 2.0 * a,
            host_static_bytes: 1e9,
            opt_embed_seconds: 0.01,
            opt_head_seconds: 0.01,
            total_params: 1_000_000_000,
        }
    }

    fn all_plans(l: usize) -> Vec<Vec<Placement>> {
        let choices = [Placement::Gpu, Placement::Host, Placement::Nvme, Placement::Recompute];
        let mut out = Vec::new();
        let n = 4usize.pow((l - 1) as u32);
        for code in 0..n {
            let mut p = vec![Placement::Gpu; l + 1];
            let mut c = code;
            for slot in p.iter_mut().take(l).skip(1) {
                *slot = choices[c % 4];
                c /= 4;
            }
            out.push(p);
        }
        out
    }

    #[test]
    fn edge_decomposition_equals_op_by_op_windows() {
        // The MILP's objective (edge costs + constant) must equal the op-by-op window model for every
        // plan; 1e-9 relative covers summation order.
        let (mut compared, mut refused) = (0, 0);
        for seed in 0..6 {
            for k in [1, 3] {
                let inst = synthetic(5, seed, k);
                for overlap in OptimizerOverlap::ALL {
                    let f = Formulation::new(&inst, overlap, 5);
                    let mem = MemoryModel::new(&inst);
                    for p in all_plans(5) {
                        let b = f.path_cost(&p);
                        // A plan without a path is one the memory rows refuse.
                        if b.is_infinite() {
                            assert!(mem.check(&p).is_err(), "seed {seed} k {k} {overlap:?} {p:?}: fits, yet no path");
                            refused += 1;
                            continue;
                        }
                        compared += 1;
                        let a = step_time(&inst, &p, overlap);
                        assert!((a - b).abs() <= 1e-9 * a, "seed {seed} k {k} {overlap:?} {p:?}: {a} vs {b}");
                    }
                }
            }
        }
        // Most plans fit: the comparison is not vacuous.
        assert!(compared > 3 * refused, "{compared} plans compared, {refused} refused");
    }

    #[test]
    fn gap_bounds_are_ordered_sensibly() {
        let inst = synthetic(8, 3, 1);
        let serial = gap_seconds(&inst, OptimizerOverlap::Serial);
        let back = gap_seconds(&inst, OptimizerOverlap::OverlapBackward);
        let next = gap_seconds(&inst, OptimizerOverlap::OverlapNextForward);
        // Overlapping can only shorten the gap, and the serial gap holds the whole optimizer.
        assert!(back <= serial && next <= serial, "{serial} {back} {next}");
        assert!(serial >= inst.optimizer_seconds());
    }

    #[test]
    fn memory_check_counts_segment_boundaries() {
        use Placement::*;
        let mut inst = synthetic(4, 1, 1);
        for layer in &mut inst.layers {
            layer.bwd_workspace_bytes = 0.0;
            layer.fwd_workspace_bytes = 0.0;
            layer.grad_bytes = 0.0;
        }
        inst.head.workspace_bytes = 0.0;
        inst.head.stage_bytes = 0.0;
        inst.head.weight_bytes = 0.0;
        let a = inst.boundary_bytes;
        // Fixed memory is 3 slots (2 static + 1 prefetch); leave 3 more.
        inst.gpu_capacity = 6.0 * a;
        let mem = MemoryModel::new(&inst);
        assert_eq!(mem.cap_row, vec![3, 3, 3, 3]);
        // One segment of 4: at B_3 boundaries 0..=3 are alive: 4 > 3.
        assert_eq!(mem.check(&[Gpu, Recompute, Recompute, Recompute, Gpu]), Err(MemoryViolation::GpuBackward(3)));
        // Host-kept 2: segments (0,2),(2,4); at B_3: GPU below 2 = {0}, plus 2 and 3: 3 slots.
        assert_eq!(mem.check(&[Gpu, Recompute, Host, Recompute, Gpu]), Ok(()));
        // All on the GPU: at B_3, boundaries 0, 1, 2 stay below it plus 3 itself: 4 > 3.
        assert_eq!(mem.check(&[Gpu, Gpu, Gpu, Gpu, Gpu]), Err(MemoryViolation::GpuBackward(3)));
        // The forward row: need = 2 slots (input and output), so only 1 GPU-kept boundary fits.
        assert_eq!(mem.cap_fwd, 1);
        assert_eq!(mem.check(&[Gpu, Host, Recompute, Host, Gpu]), Ok(()));
        assert_eq!(mem.check(&[Gpu, Gpu, Recompute, Host, Gpu]), Err(MemoryViolation::GpuForward));
    }

    proptest::proptest! {
        /// The slot rows and the byte form are one memory model: a plan passes the GPU rows exactly
        /// when every point of [`gpu_live`] fits the capacity.
        #[test]
        fn slot_rows_and_live_bytes_agree(l in 1usize..9, seed in 0u64..1000, k in 1usize..3, code in 0u64..u64::MAX, cap in 0.0f64..1.0) {
            let mut inst = synthetic(l, seed, k);
            let lo = inst.gpu_fixed_bytes();
            let hi = gpu_peak(&inst, &vec![Placement::Gpu; l + 1]).1 * 1.2;
            inst.gpu_capacity = lo + cap * (hi - lo);
            inst.host_capacity = f64::INFINITY;
            inst.nvme_capacity = f64::INFINITY;
            let mut p: Vec<Placement> = (0..=l).map(|i| match (code >> (2 * i)) & 3 {
                0 => Placement::Gpu, 1 => Placement::Host, 2 => Placement::Nvme, _ => Placement::Recompute,
            }).collect();
            p[0] = Placement::Gpu;
            p[l] = Placement::Gpu;
            let rows_ok = !matches!(
                MemoryModel::new(&inst).check(&p),
                Err(MemoryViolation::GpuBackward(_) | MemoryViolation::GpuForward)
            );
            let peak = gpu_peak(&inst, &p).1;
            // Away from the exact boundary (floating-point slot division) the two must agree.
            if (peak - inst.gpu_capacity).abs() > 1e-6 * peak {
                proptest::prop_assert_eq!(rows_ok, peak <= inst.gpu_capacity, "peak {} cap {}", peak, inst.gpu_capacity);
            }
        }
    }
}
