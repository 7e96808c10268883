//! Discrete-event replay of a plan: five in-order streams (compute, H2D, D2H, NVMe, host CPU) with
//! dependencies between their operations, as an executor with CUDA streams and events would run it.
//!
//! Every operation starts when its stream is free and all its dependencies have finished. The program
//! follows the plan semantics (crate::plan) and the executor contract of [`crate::cost`]:
//! - two device weight buffers: the upload of a layer waits for the op two layer-ops earlier to finish;
//! - two device gradient buffers: a backward op waits for the download that last drained its buffer;
//! - a forward op waits until the boundary before its input is safe in its tier (one offload in
//!   flight: the D2H copy for the host, the D2H copy and the NVMe write for NVMe);
//! - an NVMe reload's read starts with the window that uploads its segment's first weights;
//! - the second backward op of a micro-batch waits for the head gradient's download;
//! - NVMe traffic goes through two pinned staging buffers;
//! - the optimizer runs on the CPU stream as the plan's [`OptimizerOverlap`] says, and the next step's
//!   uploads wait for the updates they need.
//!
//! Three steps are simulated and the second is reported: the step time is the distance between the
//! first forward ops of steps 2 and 3, so the optimizer's overlap with the next step is in it. Peak
//! memory is over all three. Compute idle time is attributed to the stream whose operation the compute
//! waited for, following the chain of critical dependencies.
//!
//! The replay drops the window barriers that the analytic model imposes (a transfer may start as soon
//! as its buffer is free) and uses the real optimizer interplay instead of a bound, so it is never
//! slower than the model ([`crate::window`]), and its memory never exceeds the model's rows.

use serde::{Deserialize, Serialize};

use crate::cost::Instance;
use crate::plan::{OptimizerOverlap, Placement, StreamTimes, Tier};
use crate::window::{Op, micro_batch_ops};

/// An execution stream: of the replay here, of the executor's measured trace in lt-exec (a thread
/// on CPU; a CUDA stream on GPU). One type for both, so predicted and measured timelines line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    /// Layer forward/backward and the head (GPU kernels).
    Compute,
    /// Host-to-device: weight uploads and activation reloads.
    H2d,
    /// Device-to-host: gradient downloads and activation offloads.
    D2h,
    /// NVMe spill reads and writes.
    Nvme,
    /// Host optimizer updates.
    Optimizer,
}

impl Stream {
    /// All streams, in display order.
    pub const ALL: [Stream; 5] = [Stream::Compute, Stream::H2d, Stream::D2h, Stream::Nvme, Stream::Optimizer];

    /// Position in [`Stream::ALL`] (the Chrome trace's thread id).
    pub fn index(self) -> usize {
        match self {
            Stream::Compute => 0,
            Stream::H2d => 1,
            Stream::D2h => 2,
            Stream::Nvme => 3,
            Stream::Optimizer => 4,
        }
    }

    /// The lane's name (`compute`, `h2d`, `d2h`, `nvme`, `optimizer`).
    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::H2d => "h2d",
            Stream::D2h => "d2h",
            Stream::Nvme => "nvme",
            Stream::Optimizer => "optimizer",
        }
    }
}

/// One event of a Chrome trace (`chrome://tracing`, Perfetto).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// Operation name.
    pub name: String,
    /// `X` (complete event) or `M` (metadata).
    pub ph: String,
    /// Start, microseconds from the start of the reported step (predicted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ts: Option<f64>,
    /// Duration, microseconds (predicted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    /// Process id (always 0).
    pub pid: u32,
    /// Thread id: the stream.
    pub tid: u32,
    /// Metadata (thread names).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub args: Option<serde_json::Value>,
}

/// A Chrome trace: `{"traceEvents": [...]}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Trace {
    /// The events.
    #[serde(rename = "traceEvents")]
    pub trace_events: Vec<TraceEvent>,
}

/// What a replay reports. Every figure is a prediction of the cost model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// Steady-state step time, seconds (predicted).
    pub step_seconds: f64,
    /// Compute busy time in the step, seconds (predicted).
    pub compute_seconds: f64,
    /// Compute idle time attributed to each stream, seconds (predicted).
    pub exposed: StreamTimes,
    /// Busy time of each non-compute stream in the step, seconds (predicted).
    pub busy: StreamTimes,
    /// Peak GPU bytes (predicted).
    pub peak_gpu_bytes: f64,
    /// Peak host bytes (predicted).
    pub peak_host_bytes: f64,
    /// Peak NVMe bytes (predicted).
    pub peak_nvme_bytes: f64,
    /// Timeline of the reported step (empty unless asked for).
    pub trace: Trace,
}

#[derive(Debug, Clone, Copy)]
enum Label {
    Fwd(u32),
    Head,
    Rec(u32),
    Bwd(u32),
    UpW(u32),
    UpHead,
    UpX0,
    Reload(u32),
    NvmeRead(u32),
    Offload(u32),
    NvmeWrite(u32),
    DownGrad(u32),
    DownHeadGrad,
    DownDx0,
    Opt(u32),
    OptEmbed,
    OptHead,
}

impl Label {
    fn name(self, mb: u32) -> String {
        let s = match self {
            Label::Fwd(i) => format!("fwd L{i}"),
            Label::Head => "head+loss".into(),
            Label::Rec(i) => format!("recompute L{i}"),
            Label::Bwd(i) => format!("bwd L{i}"),
            Label::UpW(i) => format!("upload W{i}"),
            Label::UpHead => "upload head".into(),
            Label::UpX0 => "upload x0".into(),
            Label::Reload(i) => format!("reload B{i}"),
            Label::NvmeRead(i) => format!("nvme read B{i}"),
            Label::Offload(i) => format!("offload B{i}"),
            Label::NvmeWrite(i) => format!("nvme write B{i}"),
            Label::DownGrad(i) => format!("download dW{i}"),
            Label::DownHeadGrad => "download dW head".into(),
            Label::DownDx0 => "download dx0".into(),
            Label::Opt(i) => format!("adamw L{i}"),
            Label::OptEmbed => "adamw embed".into(),
            Label::OptHead => "adamw head".into(),
        };
        format!("{s} (mb {mb})")
    }
}

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct SOp {
    stream: Stream,
    label: Label,
    mb: u32,
    start: f64,
    end: f64,
    /// The op whose end set this op's start (a dependency or the stream predecessor).
    crit: u32,
}

/// A memory interval: `bytes` of `tier` from an op's start or end to the later of up to two op ends.
#[derive(Debug, Clone, Copy)]
struct MemIv {
    tier: usize,
    bytes: f64,
    from: u32,
    from_end: bool,
    /// Seconds after the `from` point (a phase inside an operation).
    offset: f64,
    to: [u32; 2],
    /// Ends this many seconds after the `from` point instead of with `to` (a phase inside an
    /// operation).
    until: Option<f64>,
}

#[derive(Default)]
struct Engine {
    ops: Vec<SOp>,
    last: [u32; 5],
    mem: Vec<MemIv>,
}

impl Engine {
    fn new() -> Self {
        Self { ops: Vec::new(), last: [NONE; 5], mem: Vec::new() }
    }

    fn add(&mut self, stream: Stream, dur: f64, deps: &[u32], label: Label, mb: u32) -> u32 {
        let mut start = 0.0;
        let mut crit = NONE;
        let prev = self.last[stream.index()];
        if prev != NONE {
            start = self.ops[prev as usize].end;
            crit = prev;
        }
        for &d in deps {
            if d != NONE && self.ops[d as usize].end > start {
                start = self.ops[d as usize].end;
                crit = d;
            }
        }
        let id = self.ops.len() as u32;
        self.ops.push(SOp { stream, label, mb, start, end: start + dur.max(0.0), crit });
        self.last[stream.index()] = id;
        id
    }

    fn hold(&mut self, tier: usize, bytes: f64, from: u32, from_end: bool, to: [u32; 2]) {
        self.hold_after(tier, bytes, from, from_end, 0.0, to);
    }

    /// [`Engine::hold`] starting `offset` seconds after the `from` point.
    fn hold_after(&mut self, tier: usize, bytes: f64, from: u32, from_end: bool, offset: f64, to: [u32; 2]) {
        if bytes > 0.0 {
            self.mem.push(MemIv { tier, bytes, from, from_end, offset, to, until: None });
        }
    }

    /// Held for the first `secs` seconds of operation `op`.
    fn hold_first(&mut self, tier: usize, bytes: f64, op: u32, secs: f64) {
        if bytes > 0.0 {
            self.mem.push(MemIv {
                tier,
                bytes,
                from: op,
                from_end: false,
                offset: 0.0,
                to: [op, NONE],
                until: Some(secs),
            });
        }
    }

    fn end(&self, id: u32) -> f64 {
        self.ops[id as usize].end
    }
}

const GPU: usize = 0;
const HOST: usize = 1;
const NVME: usize = 2;

/// Replay `placements` with optimizer mode `overlap` on `inst`; `trace` asks for the timeline.
///
/// # Panics
/// If `placements` does not have `inst.num_layers() + 1` entries (a programmer error: validate plans
/// first with [`crate::plan::check_boundaries`]).
pub fn simulate(inst: &Instance, placements: &[Placement], overlap: OptimizerOverlap, trace: bool) -> SimReport {
    let l = inst.num_layers();
    assert_eq!(placements.len(), l + 1, "placements must cover boundaries 0..=L");
    let k = inst.grad_accum_steps;
    let a = inst.boundary_bytes;
    let steps = 3;
    let ops_of_mb = micro_batch_ops(placements);
    let mut g = Engine::new();

    // Buffers and cross-step state.
    let mut layer_ops: u64 = 0; // layer ops issued so far: buffer = count % 2
    let mut wbuf_user = [NONE; 2];
    let mut gbuf_drain = [NONE; 2];
    let mut gb = 0usize;
    let mut staging = [NONE; 2];
    let mut st_next = 0usize;
    let mut prev_head = NONE;
    let mut step_up_head = NONE;
    let mut opt_layer = vec![NONE; l];
    let mut opt_embed = NONE;
    let mut opt_head = NONE;
    let mut serial_gate = NONE;
    let mut first_fwd = Vec::with_capacity(steps);
    // Prefetched by the previous micro-batch's last op: (weights of layer 0, boundary 0).
    let mut prefetched: Option<(u32, u32)> = None;

    let gate = |i: Option<usize>, opt_layer: &[u32], opt_embed: u32, opt_head: u32, serial: u32| -> u32 {
        if serial != NONE {
            return serial;
        }
        match i {
            Some(i) if i < l => opt_layer[i],
            Some(_) => opt_head,
            None => opt_embed,
        }
    };

    for _ in 0..steps {
        for m in 0..k {
            let mbu = m as u32;
            let gated = m == 0; // the first micro-batch waits for the previous step's updates
            let (mut gate_layer, mut gate_embed, mut gate_head, mut gate_serial) =
                (opt_layer.clone(), opt_embed, opt_head, serial_gate);
            if !gated {
                gate_layer.iter_mut().for_each(|x| *x = NONE);
                gate_embed = NONE;
                gate_head = NONE;
                gate_serial = NONE;
            }
            // ---- forward ----
            let (mut w_op, x0) = match prefetched.take() {
                Some(p) => p,
                None => {
                    let buf = (layer_ops % 2) as usize;
                    let gw = gate(Some(0), &gate_layer, gate_embed, gate_head, gate_serial);
                    let w = g.add(
                        Stream::H2d,
                        inst.layers[0].weight_bytes / inst.h2d,
                        &[wbuf_user[buf], gw],
                        Label::UpW(0),
                        mbu,
                    );
                    let ge = gate(None, &gate_layer, gate_embed, gate_head, gate_serial);
                    let x = g.add(Stream::H2d, a / inst.h2d, &[ge], Label::UpX0, mbu);
                    (w, x)
                }
            };
            // The D2H copy of an offloaded boundary (frees its GPU copy), and the op after which the
            // boundary is safe (the D2H, or the NVMe write): the forward op after next waits for it.
            let mut offload_of = vec![NONE; l + 1];
            let mut offload_done = vec![NONE; l + 1];
            // Where each boundary's device copy started (op, at end?) for freeing later.
            let mut live: Vec<(u32, bool)> = vec![(NONE, false); l + 1];
            live[0] = (x0, false);
            let mut host_copy: Vec<u32> = vec![NONE; l + 1];
            let mut nvme_write: Vec<u32> = vec![NONE; l + 1];
            let mut last_fwd = NONE;
            let mut up_head = NONE;
            for i in 0..l {
                let prev_off = if i >= 1 { offload_done[i - 1] } else { NONE };
                let deps = [w_op, if i == 0 { x0 } else { NONE }, prev_off];
                let f = g.add(Stream::Compute, inst.layers[i].fwd_seconds, &deps, Label::Fwd(i as u32), mbu);
                if i == 0 && m == 0 {
                    first_fwd.push(f);
                }
                wbuf_user[(layer_ops % 2) as usize] = f;
                layer_ops += 1;
                g.hold(GPU, inst.layers[i].fwd_workspace_bytes, f, false, [f, NONE]);
                live[i + 1] = (f, false);
                // Free the input unless it stays on the GPU until backward.
                match placements[i] {
                    Placement::Recompute => g.hold(GPU, a, live[i].0, live[i].1, [f, NONE]),
                    Placement::Host | Placement::Nvme => g.hold(GPU, a, live[i].0, live[i].1, [f, offload_of[i]]),
                    Placement::Gpu => {}
                }
                // Upload what the next op needs.
                if i + 1 < l {
                    let buf = (layer_ops % 2) as usize;
                    let gw = gate(Some(i + 1), &gate_layer, gate_embed, gate_head, gate_serial);
                    w_op = g.add(
                        Stream::H2d,
                        inst.layers[i + 1].weight_bytes / inst.h2d,
                        &[wbuf_user[buf], gw],
                        Label::UpW(i as u32 + 1),
                        mbu,
                    );
                } else if m == 0 {
                    // The head is uploaded once per step, with the first micro-batch: the upload waits
                    // for the previous step's last head and for the op before the last forward layer,
                    // so it overlaps that layer only. Later micro-batches reuse it.
                    let gh = gate(Some(l), &gate_layer, gate_embed, gate_head, gate_serial);
                    let before_last = wbuf_user[(layer_ops % 2) as usize];
                    up_head = g.add(
                        Stream::H2d,
                        inst.head.weight_bytes / inst.h2d,
                        &[prev_head, gh, before_last],
                        Label::UpHead,
                        mbu,
                    );
                    step_up_head = up_head;
                } else {
                    up_head = step_up_head;
                }
                // Offload the boundary this op produced.
                let j = i + 1;
                if j < l && placements[j].is_offloaded() {
                    let tier = placements[j].tier();
                    let stage_dep = if tier == Some(Tier::Nvme) { staging[st_next] } else { NONE };
                    let d = g.add(Stream::D2h, a / inst.d2h, &[f, stage_dep], Label::Offload(j as u32), mbu);
                    offload_of[j] = d;
                    offload_done[j] = d;
                    if tier == Some(Tier::Nvme) {
                        let w = g.add(Stream::Nvme, a / inst.nvme_write, &[d], Label::NvmeWrite(j as u32), mbu);
                        staging[st_next] = w;
                        st_next ^= 1;
                        nvme_write[j] = w;
                        offload_done[j] = w;
                    } else {
                        host_copy[j] = d;
                    }
                }
                last_fwd = f;
            }
            // ---- head ----
            let head = g.add(Stream::Compute, inst.head.seconds, &[up_head, offload_done[l - 1]], Label::Head, mbu);
            // The head's weights stay on the device from their upload to the step's last head op:
            // one hold per micro-batch, each from where the previous one ended.
            if m == 0 {
                g.hold(GPU, inst.head.weight_bytes, up_head, false, [head, NONE]);
            } else {
                g.hold(GPU, inst.head.weight_bytes, prev_head, true, [head, NONE]);
            }
            prev_head = head;
            g.hold(GPU, (inst.head.workspace_bytes - inst.head.weight_bytes).max(0.0), head, false, [head, NONE]);
            g.hold(GPU, a, last_fwd, false, [head, NONE]); // boundary L
            let _ = last_fwd;

            // ---- backward ----
            let bwd_ops: Vec<(Op, Option<usize>)> = ops_of_mb[l + 1..].to_vec();
            let mut prev_compute = head;
            let mut up_next: (u32, u32) = (NONE, NONE); // (weights, reload) of the next op
            // Uploads for the first backward op are issued during the head.
            let issue_uploads = |g: &mut Engine,
                                 layer_ops: u64,
                                 wbuf_user: &[u32; 2],
                                 staging: &mut [u32; 2],
                                 st_next: &mut usize,
                                 op: (Op, Option<usize>),
                                 mbu: u32,
                                 host_copy: &[u32],
                                 nvme_write: &[u32],
                                 reload_live: &mut Vec<(u32, bool)>|
             -> (u32, u32) {
                let (o, start) = op;
                let layer = match o {
                    Op::Rec(j) | Op::Bwd(j) | Op::Fwd(j) => j,
                    Op::Head => 0,
                };
                let buf = (layer_ops % 2) as usize;
                let w = g.add(
                    Stream::H2d,
                    inst.layers[layer].weight_bytes / inst.h2d,
                    &[wbuf_user[buf]],
                    Label::UpW(layer as u32),
                    mbu,
                );
                let mut r = NONE;
                if let Some(s) = start {
                    match placements[s] {
                        Placement::Host => {
                            r = g.add(Stream::H2d, a / inst.h2d, &[host_copy[s]], Label::Reload(s as u32), mbu);
                            g.hold(HOST, a, host_copy[s], false, [r, NONE]);
                        }
                        Placement::Nvme => {
                            // The read starts with the window that uploads the segment's first weights.
                            let deps = [staging[*st_next], nvme_write[s], wbuf_user[buf]];
                            let nr = g.add(Stream::Nvme, a / inst.nvme_read, &deps, Label::NvmeRead(s as u32), mbu);
                            r = g.add(Stream::H2d, a / inst.h2d, &[nr], Label::Reload(s as u32), mbu);
                            staging[*st_next] = r;
                            *st_next ^= 1;
                            g.hold(NVME, a, nvme_write[s], false, [nr, NONE]);
                        }
                        _ => {}
                    }
                    if r != NONE {
                        reload_live[s] = (r, false);
                    }
                }
                (w, r)
            };
            if let Some(&first) = bwd_ops.first() {
                up_next = issue_uploads(
                    &mut g,
                    layer_ops,
                    &wbuf_user,
                    &mut staging,
                    &mut st_next,
                    first,
                    mbu,
                    &host_copy,
                    &nvme_write,
                    &mut live,
                );
            }
            let down_head = g.add(Stream::D2h, inst.head.grad_bytes / inst.d2h, &[head], Label::DownHeadGrad, mbu);
            g.hold(GPU, inst.head.stage_bytes, head, true, [down_head, NONE]);
            let last_mb = m + 1 == k;
            if last_mb && overlap == OptimizerOverlap::OverlapBackward {
                opt_head = g.add(Stream::Optimizer, inst.opt_head_seconds, &[down_head], Label::OptHead, mbu);
            }
            let mut last_bwd = NONE;
            for (q, &(op, _)) in bwd_ops.iter().enumerate() {
                let (w, r) = up_next;
                let barrier = if q == 1 { down_head } else { NONE };
                let id = match op {
                    Op::Rec(j) => {
                        let c = g.add(
                            Stream::Compute,
                            inst.layers[j].fwd_seconds,
                            &[w, r, barrier],
                            Label::Rec(j as u32),
                            mbu,
                        );
                        g.hold(GPU, inst.layers[j].fwd_workspace_bytes, c, false, [c, NONE]);
                        live[j + 1] = (c, false);
                        c
                    }
                    Op::Bwd(j) => {
                        let c = g.add(
                            Stream::Compute,
                            inst.layers[j].bwd_seconds,
                            &[w, r, barrier, gbuf_drain[gb]],
                            Label::Bwd(j as u32),
                            mbu,
                        );
                        // The recording forward holds a forward's working set; the backward's
                        // peaks once the graph is complete (`window::row_workspace`).
                        let rec = inst.layers[j].fwd_seconds;
                        g.hold_first(GPU, inst.layers[j].fwd_workspace_bytes, c, rec);
                        g.hold_after(GPU, inst.layers[j].bwd_workspace_bytes, c, false, rec, [c, NONE]);
                        // Boundary j (kept, reloaded or recomputed) dies with its backward.
                        g.hold(GPU, a, live[j].0, live[j].1, [c, NONE]);
                        c
                    }
                    // `micro_batch_ops` lists forward ops and the head before index L + 1 only.
                    Op::Fwd(_) | Op::Head => unreachable!("backward ops are recompute or backward"),
                };
                wbuf_user[(layer_ops % 2) as usize] = id;
                layer_ops += 1;
                prev_compute = id;
                // Uploads for the next op, or the next micro-batch's first layer and boundary 0.
                if let Some(&next) = bwd_ops.get(q + 1) {
                    up_next = issue_uploads(
                        &mut g,
                        layer_ops,
                        &wbuf_user,
                        &mut staging,
                        &mut st_next,
                        next,
                        mbu,
                        &host_copy,
                        &nvme_write,
                        &mut live,
                    );
                } else if m + 1 < k {
                    let buf = (layer_ops % 2) as usize;
                    let w0 = g.add(
                        Stream::H2d,
                        inst.layers[0].weight_bytes / inst.h2d,
                        &[wbuf_user[buf]],
                        Label::UpW(0),
                        mbu + 1,
                    );
                    let x = g.add(Stream::H2d, a / inst.h2d, &[], Label::UpX0, mbu + 1);
                    prefetched = Some((w0, x));
                }
                if let Op::Bwd(j) = op {
                    let dg =
                        g.add(Stream::D2h, inst.layers[j].grad_bytes / inst.d2h, &[id], Label::DownGrad(j as u32), mbu);
                    // The fixed memory holds the running backward's gradients; once it ends they
                    // stay until downloaded.
                    g.hold(GPU, inst.layers[j].grad_bytes, id, true, [dg, NONE]);
                    gbuf_drain[gb] = dg;
                    gb ^= 1;
                    if last_mb && overlap == OptimizerOverlap::OverlapBackward {
                        opt_layer[j] = g.add(
                            Stream::Optimizer,
                            inst.layers[j].optimizer_seconds,
                            &[dg],
                            Label::Opt(j as u32),
                            mbu,
                        );
                    }
                    last_bwd = id;
                }
            }
            let _ = prev_compute;
            let dx0 = g.add(Stream::D2h, a / inst.d2h, &[last_bwd], Label::DownDx0, mbu);
            g.hold(GPU, a, last_bwd, true, [dx0, NONE]);
            if last_mb {
                match overlap {
                    OptimizerOverlap::OverlapBackward => {
                        opt_embed = g.add(Stream::Optimizer, inst.opt_embed_seconds, &[dx0], Label::OptEmbed, mbu);
                        serial_gate = NONE;
                    }
                    OptimizerOverlap::Serial | OptimizerOverlap::OverlapNextForward => {
                        opt_embed = g.add(Stream::Optimizer, inst.opt_embed_seconds, &[dx0], Label::OptEmbed, mbu);
                        for (i, slot) in opt_layer.iter_mut().enumerate() {
                            *slot = g.add(
                                Stream::Optimizer,
                                inst.layers[i].optimizer_seconds,
                                &[dx0],
                                Label::Opt(i as u32),
                                mbu,
                            );
                        }
                        opt_head = g.add(Stream::Optimizer, inst.opt_head_seconds, &[dx0], Label::OptHead, mbu);
                        serial_gate = if overlap == OptimizerOverlap::Serial { opt_head } else { NONE };
                    }
                }
            }
        }
    }

    report(inst, &g, &first_fwd, trace)
}

fn report(inst: &Instance, g: &Engine, first_fwd: &[u32], trace: bool) -> SimReport {
    let (t1, t2) = match first_fwd {
        [.., x, y] => (g.ops[*x as usize].start, g.ops[*y as usize].start),
        _ => (0.0, 0.0),
    };
    let mut compute = 0.0;
    let mut exposed = [0.0f64; 5];
    let mut busy = [0.0f64; 5];
    let mut prev_end: Option<f64> = None;
    for op in &g.ops {
        if op.start >= t1 && op.start < t2 {
            busy[op.stream.index()] += op.end - op.start;
        }
        if op.stream != Stream::Compute {
            continue;
        }
        if op.start > t1 && op.start <= t2 {
            let lo = prev_end.unwrap_or(t1).max(t1);
            attribute(g, op, lo, &mut exposed);
        }
        if op.start >= t1 && op.start < t2 {
            compute += op.end - op.start;
        }
        prev_end = Some(op.end);
    }

    // Memory: sweep allocation and free events; frees first at equal times.
    let mut events: [Vec<(f64, f64)>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for iv in &g.mem {
        let from = if iv.from == NONE {
            0.0
        } else if iv.from_end {
            g.end(iv.from)
        } else {
            g.ops[iv.from as usize].start
        } + iv.offset;
        let to = match iv.until {
            Some(secs) => from + secs,
            None => iv.to.iter().filter(|&&x| x != NONE).map(|&x| g.end(x)).fold(from, f64::max),
        };
        events[iv.tier].push((from, iv.bytes));
        events[iv.tier].push((to, -iv.bytes));
    }
    let peak = |ev: &mut Vec<(f64, f64)>, base: f64| {
        ev.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.total_cmp(&y.1)));
        let mut cur = base;
        let mut best = base;
        for &(_, d) in ev.iter() {
            cur += d;
            best = best.max(cur);
        }
        best
    };
    let [mut eg, mut eh, mut en] = events;
    let peak_gpu = peak(&mut eg, inst.gpu_static_bytes);
    let peak_host = peak(&mut eh, inst.host_static_bytes);
    let peak_nvme = peak(&mut en, 0.0);

    let mut tr = Trace::default();
    if trace {
        for s in Stream::ALL {
            tr.trace_events.push(TraceEvent {
                name: "thread_name".into(),
                ph: "M".into(),
                ts: None,
                dur: None,
                pid: 0,
                tid: s.index() as u32,
                args: Some(serde_json::json!({ "name": s.name() })),
            });
        }
        for op in g.ops.iter().filter(|o| o.start >= t1 && o.start < t2) {
            tr.trace_events.push(TraceEvent {
                name: op.label.name(op.mb),
                ph: "X".into(),
                ts: Some((op.start - t1) * 1e6),
                dur: Some((op.end - op.start) * 1e6),
                pid: 0,
                tid: op.stream.index() as u32,
                args: None,
            });
        }
    }
    let times = |x: [f64; 5]| StreamTimes { h2d: x[1], d2h: x[2], nvme: x[3], cpu: x[4] };
    SimReport {
        step_seconds: t2 - t1,
        compute_seconds: compute,
        exposed: times(exposed),
        busy: times(busy),
        peak_gpu_bytes: peak_gpu,
        peak_host_bytes: peak_host,
        peak_nvme_bytes: peak_nvme,
        trace: tr,
    }
}

/// Attribute the compute idle time `[lo, op.start]` to the streams on op's critical chain.
fn attribute(g: &Engine, op: &SOp, lo: f64, exposed: &mut [f64; 5]) {
    let mut hi = op.start;
    let mut cur = op.crit;
    while hi > lo && cur != NONE {
        let p = &g.ops[cur as usize];
        if p.stream == Stream::Compute {
            break;
        }
        let from = p.start.max(lo);
        exposed[p.stream.index()] += (hi - from).max(0.0);
        hi = from;
        cur = p.crit;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::window::tests::synthetic;
    use crate::window::{Formulation, MemoryModel, step_time};
    use proptest::prelude::*;

    fn plan_from(code: &[u8], l: usize) -> Vec<Placement> {
        let choices = [Placement::Gpu, Placement::Host, Placement::Nvme, Placement::Recompute];
        let mut p = vec![Placement::Gpu; l + 1];
        for i in 1..l {
            p[i] = choices[(code[i % code.len()] % 4) as usize];
        }
        p
    }

    #[test]
    fn keep_all_compute_bound_step_is_the_sum_of_compute() {
        // With free transfers and a zero-cost optimizer, a keep-all step is exactly the compute of
        // forward, head and backward: 1e-12 relative covers summation order.
        let mut inst = synthetic(4, 9, 1);
        inst.h2d = 1e30;
        inst.d2h = 1e30;
        for x in &mut inst.layers {
            x.optimizer_seconds = 0.0;
        }
        inst.opt_embed_seconds = 0.0;
        inst.opt_head_seconds = 0.0;
        let p = vec![Placement::Gpu; 5];
        let r = simulate(&inst, &p, OptimizerOverlap::Serial, false);
        let expect: f64 = inst.layers.iter().map(|x| x.fwd_seconds + x.bwd_seconds).sum::<f64>() + inst.head.seconds;
        assert!((r.step_seconds - expect).abs() <= 1e-12 * expect, "{} vs {expect}", r.step_seconds);
        assert!(r.exposed.total() < 1e-12);
    }

    #[test]
    fn serial_optimizer_is_fully_exposed() {
        let inst = synthetic(5, 4, 1);
        let p = vec![Placement::Gpu; 6];
        let serial = simulate(&inst, &p, OptimizerOverlap::Serial, false);
        let next = simulate(&inst, &p, OptimizerOverlap::OverlapNextForward, false);
        // Serial: the CPU stream is exposed for at least the whole optimizer.
        assert!(serial.exposed.cpu >= inst.optimizer_seconds() * (1.0 - 1e-9));
        assert!(next.step_seconds <= serial.step_seconds);
    }

    #[test]
    fn trace_is_chrome_json() {
        let inst = synthetic(3, 2, 2);
        let p = vec![Placement::Gpu, Placement::Host, Placement::Recompute, Placement::Gpu];
        let r = simulate(&inst, &p, OptimizerOverlap::OverlapBackward, true);
        let v = serde_json::to_value(&r.trace).unwrap();
        let ev = v["traceEvents"].as_array().unwrap();
        let x: Vec<_> = ev.iter().filter(|e| e["ph"] == "X").collect();
        assert!(!x.is_empty());
        for e in x {
            for f in ["name", "ph", "ts", "dur", "pid", "tid"] {
                assert!(e.get(f).is_some(), "missing {f} in {e}");
            }
        }
        assert!(ev.iter().any(|e| e["name"].as_str().is_some_and(|n| n.starts_with("reload B1"))));
    }

    /// The replay may only be faster than the window model (it relaxes window barriers and uses the
    /// real optimizer overlap instead of a bound), and by at most the planner's stated tolerance.
    const SIM_BELOW_MODEL: f64 = crate::planner::SIM_TOLERANCE;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn no_plan_breaks_a_capacity_in_the_simulator(
            seed in 0u64..1000, l in 2usize..9, k in 1usize..4, code in proptest::collection::vec(0u8..4, 8),
            mode in 0usize..3,
        ) {
            let inst = synthetic(l, seed, k);
            let p = plan_from(&code, l);
            let overlap = OptimizerOverlap::ALL[mode];
            let mem = MemoryModel::new(&inst);
            prop_assume!(mem.check(&p).is_ok());
            let r = simulate(&inst, &p, overlap, false);
            // Memory: the simulator's exact peaks never exceed the capacities the rows enforce.
            prop_assert!(r.peak_gpu_bytes <= inst.gpu_capacity, "gpu {} > {}", r.peak_gpu_bytes, inst.gpu_capacity);
            prop_assert!(r.peak_host_bytes <= inst.host_capacity, "host {} > {}", r.peak_host_bytes, inst.host_capacity);
            prop_assert!(r.peak_nvme_bytes <= inst.nvme_capacity, "nvme {} > {}", r.peak_nvme_bytes, inst.nvme_capacity);
            // Time: never slower than the model (1e-9 relative for summation order), and close to it.
            let model = step_time(&inst, &p, overlap);
            prop_assert!(r.step_seconds <= model * (1.0 + 1e-9), "sim {} > model {}", r.step_seconds, model);
            prop_assert!(r.step_seconds >= model * (1.0 - SIM_BELOW_MODEL), "sim {} << model {}", r.step_seconds, model);
            // Step = compute + exposure, exactly (the attribution partitions idle time).
            let sum = r.compute_seconds + r.exposed.total();
            prop_assert!((sum - r.step_seconds).abs() <= 1e-9 * r.step_seconds, "{sum} vs {}", r.step_seconds);
            let f = Formulation::new(&inst, overlap, l);
            prop_assert!((f.path_cost(&p) - model).abs() <= 1e-9 * model);
        }
    }
}
