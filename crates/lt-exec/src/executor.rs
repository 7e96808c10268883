//! The streamed executor: forward and backward of one micro-batch, layer by layer, exactly as the
//! plan says, with uploads and downloads on their own threads and every operation traced.
//!
//! Streams (threads here; CUDA streams on GPU):
//! - **h2d** walks the upload schedule (forward layers, then per backward segment: the segment's
//!   start boundary if it lives off-device, the recompute layers, the backward layers) and hands
//!   each item over a channel of capacity 1: one buffer in use, one in flight (double buffering).
//! - **d2h** receives activation offloads (host tier or NVMe) and weight gradients, converts them to
//!   fp32 host buffers and accumulates them, computing the sum of squares in the same pass.
//! - **compute** (the calling thread) runs layers; every time it blocks on another stream, the wait is
//!   recorded as that stream's measured exposure.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex};

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};
use crossbeam::channel;
use lt_core::{ByteSize, ModelConfig};
use lt_model::layer::{SeqCtx, layer_backward, layer_forward};
use lt_model::model::{Batch, embed, shifted_targets, to_vec};
use lt_model::ops;
use lt_model::weights::{HeadWeights, LayerWeights};
use lt_optim::ThreadPool;

use crate::budget::DeviceBudget;
use crate::error::ExecError;
use crate::grads::{HostGrads, accumulate_data};
use crate::plan::{ExecPlan, Placement};
use crate::state::{HEAD, SharedModel, layer_slot};
use crate::trace::{Stream, Trace};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;
type Dev<B> = <Inner<B> as burn::tensor::backend::BackendTypes>::Device;

/// A block store for spilled activations (implemented over lt-storage's NVMe spill engines).
pub trait ActivationSpill: Send + Sync {
    /// Store `data` under `key` (replacing any previous value).
    fn put(&self, key: u64, data: &[u8]) -> Result<(), lt_storage::StorageError>;
    /// Read the value of `key` into `out` (whose length is the stored length).
    fn get(&self, key: u64, out: &mut [u8]) -> Result<(), lt_storage::StorageError>;
    /// Free `key`'s space for reuse.
    fn free(&self, key: u64);
}

/// An offloaded boundary, in the device's dtype (bf16 on CUDA: host memory and NVMe hold 2 bytes
/// per element, as the planner counts them).
enum Held {
    Host(TensorData),
    Nvme(DType),
    Failed(String),
}

/// Offloaded boundaries, handed from the d2h stream to the h2d stream.
#[derive(Default)]
struct ActStore {
    map: Mutex<HashMap<usize, Held>>,
    cv: Condvar,
}

impl ActStore {
    fn put(&self, boundary: usize, held: Held) {
        if let Ok(mut m) = self.map.lock() {
            m.insert(boundary, held);
        }
        self.cv.notify_all();
    }

    fn take(&self, boundary: usize) -> Held {
        let Ok(mut m) = self.map.lock() else { return Held::Failed("activation store poisoned".into()) };
        loop {
            if let Some(h) = m.remove(&boundary) {
                return h;
            }
            m = match self.cv.wait(m) {
                Ok(m) => m,
                Err(_) => return Held::Failed("activation store poisoned".into()),
            };
        }
    }
}

enum Up {
    Layer(usize),
    Act(usize),
}

enum Uploaded<B: Backend> {
    Layer(usize, LayerWeights<B>),
    Act(usize, Tensor<B, 3>),
}

enum Down<B: Backend> {
    Offload(usize, Tensor<B, 3>),
    Layer(usize, Vec<(String, Tensor<B, 1>)>),
    Head { norm: Tensor<B, 1>, out: Tensor<B, 2> },
    Embed(Tensor<B, 3>),
}

/// What one micro-batch produced.
#[derive(Debug, Clone, Default)]
pub struct MicroBatchResult {
    /// This micro-batch's share of the step loss (`sum CE / step loss tokens`).
    pub loss: f64,
    /// Sum of squares of the accumulated gradients, when this was the step's last micro-batch.
    pub grad_sq_sum: Option<f64>,
    /// Peak of the device budget during the micro-batch.
    pub peak_device_bytes: u64,
}

/// The streamed executor for one model and plan.
pub struct Executor<B: AutodiffBackend> {
    plan: ExecPlan,
    device: Dev<B>,
    device_memory: ByteSize,
    trace: Arc<Trace>,
    spill: Option<Arc<dyn ActivationSpill>>,
    /// Threads that help the d2h stream widen and accumulate downloaded gradients.
    d2h_pool: Arc<ThreadPool>,
    step: u64,
    _b: PhantomData<B>,
}

/// Threads for the d2h stream's gradient accumulation: a quarter of the cores, 1 to 4 (the optimizer
/// and the upload conversion want the rest).
fn d2h_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |c| c.get() / 4).clamp(1, 4)
}

/// Bytes per float element on the device: the backend's float dtype (f32 on ndarray, bf16 on CUDA),
/// as the planner's `compute_dtype_bytes`.
fn elem_bytes<B: Backend>() -> u64 {
    std::mem::size_of::<<B as burn::tensor::backend::BackendTypes>::FloatElem>() as u64
}

/// Spill-file bytes for one micro-batch `[b, t]` under `plan`: every NVMe boundary in the device
/// dtype ([`elem_bytes`]), each rounded up to whole 4 MiB requests; 0 when nothing goes to NVMe.
pub fn spill_capacity<B: Backend>(plan: &ExecPlan, cfg: &ModelConfig, b: usize, t: usize) -> u64 {
    let nvme = plan.boundaries.iter().filter(|p| **p == Placement::Nvme).count() as u64;
    let act = (b * t * cfg.hidden_size) as u64 * elem_bytes::<B>();
    nvme * act.div_ceil(4 << 20).max(1) * (4 << 20)
}

/// Estimated extra device bytes one layer's forward+backward needs beyond its input and output
/// (autodiff intermediates and the attention scores) with `elem`-byte floats. Kept deliberately
/// simple and conservative.
pub fn layer_working_bytes(cfg: &ModelConfig, b: usize, t: usize, elem: u64) -> u64 {
    let tok = (b * t) as u64;
    let h = cfg.hidden_size as u64;
    let i = cfg.intermediate_size as u64;
    let q = (cfg.num_heads * cfg.head_dim * 2) as u64;
    let kv = (cfg.num_kv_heads * cfg.head_dim) as u64 * 2;
    let lin = cfg.linear.map_or(0, |l| (l.conv_dim() + 2 * l.value_dim()) as u64);
    let per_token = 8 * h + 4 * i + 2 * q + 2 * kv + 3 * lin;
    let scores = (b * cfg.num_heads * t * t) as u64 * 3;
    elem * (tok * per_token + scores)
}

/// Bytes the head needs per loss chunk (logits, log-softmax and their gradient).
pub fn head_chunk_bytes(cfg: &ModelConfig, chunk_tokens: usize) -> u64 {
    4 * 3 * (chunk_tokens * cfg.vocab_size) as u64
}

impl<B: AutodiffBackend> Executor<B> {
    /// An executor that runs `plan` within `device_memory` on `device`.
    pub fn new(
        plan: ExecPlan,
        device_memory: ByteSize,
        device: Dev<B>,
        spill: Option<Arc<dyn ActivationSpill>>,
    ) -> Self {
        let d2h_pool = Arc::new(ThreadPool::new_or_calling_thread(d2h_threads()));
        Self { plan, device, device_memory, trace: Arc::new(Trace::new()), spill, d2h_pool, step: 0, _b: PhantomData }
    }

    /// The plan being executed.
    pub fn plan(&self) -> &ExecPlan {
        &self.plan
    }

    /// The trace of everything run so far.
    pub fn trace(&self) -> &Arc<Trace> {
        &self.trace
    }

    /// Set the step number used to tag trace events.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Peak device bytes one micro-batch of shape `[b, t]` needs under this plan (the budget check
    /// run before training; the same accounting the step enforces).
    pub fn required_device_bytes(&self, cfg: &ModelConfig, b: usize, t: usize) -> u64 {
        let mut budget = DeviceBudget::new(ByteSize(u64::MAX));
        // Errors cannot happen with an unlimited budget.
        let _ = self.account(&mut budget, cfg, b, t);
        budget.peak()
    }

    /// Walk the plan's allocation sequence on `budget` (no compute). Mirrors `micro_batch`.
    fn account(&self, budget: &mut DeviceBudget, cfg: &ModelConfig, b: usize, t: usize) -> Result<(), ExecError> {
        let we = elem_bytes::<Inner<B>>();
        let act = (b * t * cfg.hidden_size) as u64 * we;
        let head = cfg.outer_params().iter().map(|p| p.numel() as u64).sum::<u64>() * we;
        let layer_max = (0..cfg.num_layers()).map(|i| cfg.layer_numel(i) as u64).max().unwrap_or(0) * we;
        budget.alloc(head, || "embedding, final norm and head weights".into())?;
        budget.alloc(2 * layer_max, || "two layer weight buffers (double buffering)".into())?;
        budget.alloc(layer_working_bytes(cfg, b, t, we), || "one layer's working set".into())?;
        budget.alloc(act, || "boundary 0".into())?;
        let l = cfg.num_layers();
        for i in 1..=l {
            if self.plan.boundaries[i] == Placement::Device {
                budget.alloc(act, || format!("boundary {i} kept on device"))?;
            }
        }
        budget.alloc(act, || "the layer output in flight".into())?;
        let chunk = self.plan.loss_chunk_tokens.min(b * t);
        budget.alloc(head_chunk_bytes(cfg, chunk) + act, || "one loss chunk and the head's input gradient".into())?;
        budget.free(head_chunk_bytes(cfg, chunk));
        for (s, e) in self.plan.segments_backward() {
            let recompute = (e - s).saturating_sub(1) as u64 * act;
            let fetched = if self.plan.boundaries[s] == Placement::Device { 0 } else { act };
            budget.alloc(recompute + fetched, || format!("recomputed inputs of layers {s}..{e}"))?;
            budget.free(
                recompute + fetched + if s > 0 && self.plan.boundaries[s] == Placement::Device { act } else { 0 },
            );
        }
        Ok(())
    }

    /// Forward and backward of one micro-batch, adding its gradients into `grads`.
    ///
    /// Every weight is uploaded only once its version in `model` reaches `want_version` (the
    /// optimizer may still be updating later layers of the previous step).
    ///
    /// `denom` is the number of loss tokens in the whole step, so that accumulating micro-batches
    /// gives exactly the full-batch mean loss and gradient. When `last` is set, the returned
    /// [`MicroBatchResult::grad_sq_sum`] holds the sum of squares of the accumulated gradients,
    /// computed in the same pass that adds this micro-batch's contribution.
    pub fn micro_batch(
        &mut self,
        model: &SharedModel,
        batch: &Batch,
        denom: usize,
        last: bool,
        grads: &HostGrads,
        want_version: u64,
    ) -> Result<MicroBatchResult, ExecError> {
        let cfg = &model.config;
        let nl = cfg.num_layers();
        self.plan.validate(nl)?;
        let (b, t) = batch.validate(cfg.vocab_size, "batch")?;
        let mut budget = DeviceBudget::new(self.device_memory);
        // The whole allocation sequence is checked up front, so a plan that cannot fit fails before
        // any compute, with the peak it would need.
        if let Err(ExecError::OutOfDeviceMemory { budget: bud, what, .. }) = self.account(&mut budget, cfg, b, t) {
            let needed = self.required_device_bytes(cfg, b, t);
            return Err(ExecError::OutOfDeviceMemory {
                budget: bud,
                what,
                needed: ByteSize(needed),
                needed_round: crate::budget::round_up(needed),
            });
        }
        let peak = budget.peak();
        let step = self.step;
        let trace = Arc::clone(&self.trace);
        let device = self.device.clone();
        let plan = self.plan.clone();
        let spill = self.spill.clone();
        for (i, p) in plan.boundaries.iter().enumerate() {
            if *p == Placement::Nvme && spill.is_none() {
                return Err(ExecError::NoSpillStore { boundary: i });
            }
        }

        // The upload schedule, in the exact order compute consumes it.
        let mut sched = Vec::new();
        sched.extend((0..nl).map(Up::Layer));
        for (s, e) in plan.segments_backward() {
            if matches!(plan.boundaries[s], Placement::Host | Placement::Nvme) {
                sched.push(Up::Act(s));
            }
            sched.extend((s..e.saturating_sub(1)).map(Up::Layer));
            sched.extend((s..e).rev().map(Up::Layer));
        }

        let acts = ActStore::default();
        let hidden = cfg.hidden_size;
        let ids = &batch.input_ids;
        let (up_tx, up_rx) = channel::bounded::<Result<Uploaded<Inner<B>>, ExecError>>(1);
        let (down_tx, down_rx) = channel::unbounded::<Down<Inner<B>>>();

        let out = std::thread::scope(|scope| -> Result<(f64, Option<f64>), ExecError> {
            // --- h2d stream ---
            let up = {
                let (trace, device, acts, spill) = (&trace, &device, &acts, &spill);
                scope.spawn(move || {
                    for item in sched {
                        let msg = match item {
                            Up::Layer(i) => {
                                trace.wait_as(
                                    Stream::H2d,
                                    Stream::Optimizer,
                                    step,
                                    format!("wait update L{i}"),
                                    || model.wait_version(layer_slot(i), want_version),
                                );
                                Ok(trace.span(Stream::H2d, step, format!("upload L{i}"), || {
                                    let l = model.layers[i].read().unwrap_or_else(|e| e.into_inner());
                                    Uploaded::Layer(i, LayerWeights::from_host(&l, cfg.layer_types[i], device))
                                }))
                            }
                            Up::Act(s) => {
                                fetch_act::<Inner<B>>(acts, spill.as_deref(), trace, step, s, [b, t, hidden], device)
                                    .map(|x| Uploaded::Act(s, x))
                            }
                        };
                        let failed = msg.is_err();
                        if up_tx.send(msg).is_err() || failed {
                            return;
                        }
                    }
                })
            };
            // --- d2h stream ---
            let down = {
                let (trace, acts, spill, plan, pool) = (&trace, &acts, &spill, &plan, &*self.d2h_pool);
                scope.spawn(move || -> Result<Option<f64>, ExecError> {
                    let mut sq = 0.0f64;
                    for msg in down_rx {
                        match msg {
                            Down::Offload(s, x) => {
                                let data = trace.span(Stream::D2h, step, format!("offload B{s}"), || x.into_data());
                                match plan.boundaries[s] {
                                    Placement::Nvme => {
                                        let r = match spill.as_deref() {
                                            Some(sp) => trace.span(Stream::Nvme, step, format!("spill B{s}"), || {
                                                sp.put(s as u64, data.as_bytes())
                                            }),
                                            None => Ok(()),
                                        };
                                        acts.put(
                                            s,
                                            match r {
                                                Ok(()) => Held::Nvme(data.dtype),
                                                Err(e) => Held::Failed(e.to_string()),
                                            },
                                        );
                                    }
                                    _ => acts.put(s, Held::Host(data)),
                                }
                            }
                            Down::Layer(j, params) => {
                                trace.span(Stream::D2h, step, format!("grads L{j}"), || -> Result<(), ExecError> {
                                    let host: Vec<TensorData> =
                                        params.into_iter().map(|(_, g)| g.into_data()).collect();
                                    let mut dst = grads.layer(j);
                                    for (k, g) in host.iter().enumerate() {
                                        sq += accumulate_data(&mut dst[k], g, pool)?;
                                    }
                                    Ok(())
                                })?
                            }
                            Down::Head { norm, out } => {
                                trace.span(Stream::D2h, step, "grads head", || -> Result<(), ExecError> {
                                    let (norm, out) = (norm.into_data(), out.into_data());
                                    let mut hg = grads.head();
                                    sq += accumulate_data(&mut hg.norm, &norm, pool)?;
                                    match &mut hg.lm_head {
                                        Some(h) => sq += accumulate_data(h, &out, pool)?,
                                        None => {
                                            accumulate_data(&mut hg.embed_tokens, &out, pool)?;
                                        }
                                    }
                                    Ok(())
                                })?
                            }
                            Down::Embed(g0) => trace.span(Stream::D2h, step, "grads embed", || {
                                let g0 = to_vec(g0);
                                let mut hg = grads.head();
                                let e = &mut hg.embed_tokens;
                                for (r, row) in ids.iter().enumerate() {
                                    for (c, &id) in row.iter().enumerate() {
                                        let src = &g0[(r * t + c) * hidden..(r * t + c + 1) * hidden];
                                        let dst = &mut e[id as usize * hidden..(id as usize + 1) * hidden];
                                        for (d, s) in dst.iter_mut().zip(src) {
                                            *d += *s;
                                        }
                                    }
                                }
                                // The embedding is complete only now (tied heads added earlier).
                                sq += e.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>();
                            }),
                        }
                    }
                    Ok(if last { Some(sq) } else { None })
                })
            };

            // --- compute stream ---
            let run = || -> Result<f64, ExecError> {
                let recv = |what: &str| -> Result<Uploaded<Inner<B>>, ExecError> {
                    trace
                        .wait(Stream::H2d, step, format!("wait {what}"), || up_rx.recv())
                        .map_err(|_| ExecError::Worker("h2d"))?
                };
                let layer = |i: usize| -> Result<LayerWeights<Inner<B>>, ExecError> {
                    match recv(&format!("upload L{i}"))? {
                        Uploaded::Layer(j, w) if j == i => Ok(w),
                        _ => Err(ExecError::Worker("h2d (schedule out of order)")),
                    }
                };
                let ctx = batch.context::<Inner<B>>(cfg, &device);
                let ctx_ad = SeqCtx::<B>::lift(&ctx);
                trace.wait(Stream::Optimizer, step, "wait update head", || model.wait_version(HEAD, want_version));
                let head = trace.span(Stream::H2d, step, "upload head", || {
                    let h = model.head.read().unwrap_or_else(|e| e.into_inner());
                    HeadWeights::<Inner<B>>::from_host_parts(&h.embed_tokens, &h.norm, h.lm_head.as_ref(), &device)
                });
                let mut kept: HashMap<usize, Tensor<Inner<B>, 3>> = HashMap::new();
                let mut x = trace.span(Stream::Compute, step, "embed", || embed(&head, ids));
                kept.insert(0, x.clone());
                for i in 0..nl {
                    let w = layer(i)?;
                    x = trace.span(Stream::Compute, step, format!("fwd L{i}"), || layer_forward(cfg, &w, x, &ctx));
                    match plan.boundaries[i + 1] {
                        Placement::Device => {
                            kept.insert(i + 1, x.clone());
                        }
                        Placement::Host | Placement::Nvme => {
                            let _ = down_tx.send(Down::Offload(i + 1, x.clone()));
                        }
                        Placement::Recompute => {}
                    }
                }
                kept.remove(&nl);
                let (loss, mut g, gnorm, gout) = trace.span(Stream::Compute, step, "head+loss", || {
                    head_backward::<B>(cfg, &head, x, &batch.labels, denom, plan.loss_chunk_tokens)
                });
                let _ = down_tx.send(Down::Head { norm: gnorm, out: gout });
                for (s, e) in plan.segments_backward() {
                    let x0 = match plan.boundaries[s] {
                        Placement::Device => {
                            kept.remove(&s).ok_or(ExecError::Worker("compute (missing kept boundary)"))?
                        }
                        _ => match recv(&format!("boundary B{s}"))? {
                            Uploaded::Act(j, x) if j == s => x,
                            _ => return Err(ExecError::Worker("h2d (schedule out of order)")),
                        },
                    };
                    let mut xs = vec![x0];
                    for j in s..e - 1 {
                        let w = layer(j)?;
                        let prev = xs[xs.len() - 1].clone();
                        xs.push(trace.span(Stream::Compute, step, format!("recompute L{j}"), || {
                            layer_forward(cfg, &w, prev, &ctx)
                        }));
                    }
                    for j in (s..e).rev() {
                        let w = layer(j)?;
                        let xj = xs.pop().ok_or(ExecError::Worker("compute (segment inputs)"))?;
                        let lg = trace.span(Stream::Compute, step, format!("bwd L{j}"), || {
                            layer_backward::<B>(cfg, j, &w, xj, g.clone(), &ctx_ad)
                        });
                        let _ = down_tx.send(Down::Layer(j, lg.params));
                        g = lg.input;
                    }
                }
                let _ = down_tx.send(Down::Embed(g));
                Ok(loss)
            };
            let result = run();
            drop(down_tx);
            drop(up_rx);
            let _ = up.join();
            let sq = trace
                .wait(Stream::D2h, step, "wait d2h drain", || down.join())
                .map_err(|_| ExecError::Worker("d2h"))??;
            result.map(|l| (l, sq))
        });
        let (loss, sq) = out?;
        Ok(MicroBatchResult { loss, grad_sq_sum: sq, peak_device_bytes: peak })
    }
}

fn fetch_act<B: Backend>(
    acts: &ActStore,
    spill: Option<&dyn ActivationSpill>,
    trace: &Trace,
    step: u64,
    s: usize,
    shape: [usize; 3],
    device: &B::Device,
) -> Result<Tensor<B, 3>, ExecError> {
    let data = match acts.take(s) {
        Held::Host(data) => data,
        Held::Nvme(dtype) => {
            let sp = spill.ok_or(ExecError::NoSpillStore { boundary: s })?;
            let n = shape.iter().product::<usize>();
            let mut bytes = vec![0u8; n * dtype.size()];
            trace.span(Stream::Nvme, step, format!("read B{s}"), || sp.get(s as u64, &mut bytes))?;
            sp.free(s as u64);
            TensorData::from_bytes_vec(bytes, shape, dtype)
        }
        Held::Failed(e) => {
            return Err(ExecError::Storage(lt_storage::StorageError::Io {
                path: format!("spill boundary {s}").into(),
                op: "write",
                source: std::io::Error::other(e),
            }));
        }
    };
    Ok(trace.span(Stream::H2d, step, format!("reload B{s}"), || lt_model::upload::upload_data(data, device)))
}

/// Chunked head and loss with backward: returns the loss share, d loss / d x_L, and the gradients of
/// the final norm and the output projection. Logits exist for at most `chunk` tokens at a time and
/// each chunk's graph is dropped before the next (the anchor kept every chunk alive).
fn head_backward<B: AutodiffBackend>(
    cfg: &ModelConfig,
    head: &HeadWeights<Inner<B>>,
    x: Tensor<Inner<B>, 3>,
    labels: &[Vec<i64>],
    denom: usize,
    chunk: usize,
) -> (f64, Tensor<Inner<B>, 3>, Tensor<Inner<B>, 1>, Tensor<Inner<B>, 2>) {
    let [b, t, h] = x.dims();
    let n = b * t;
    let device = x.device();
    let flat = x.reshape([n, h]);
    let (targets, weights) = shifted_targets(labels, denom);
    let mut gnorm = Tensor::<Inner<B>, 1>::zeros([h], &device);
    let mut gout = Tensor::<Inner<B>, 2>::zeros(head.output_weight().dims(), &device);
    let mut gx = Vec::new();
    let mut loss = 0.0f64;
    let chunk = chunk.max(1);
    let mut a = 0;
    while a < n {
        let len = chunk.min(n - a);
        if weights[a..a + len].iter().all(|w| *w == 0.0) {
            // Nothing to learn here (prompt tokens): no logits needed at all.
            gx.push(Tensor::zeros([len, h], &device));
            a += len;
            continue;
        }
        let xc: Tensor<B, 2> = Tensor::from_inner(flat.clone().narrow(0, a, len)).require_grad();
        let nw: Tensor<B, 1> = Tensor::from_inner(head.norm.clone()).require_grad();
        let ow: Tensor<B, 2> = Tensor::from_inner(head.output_weight().clone()).require_grad();
        let hn = ops::rms_norm(xc.clone(), &nw, cfg.rms_norm_eps, cfg.zero_centered_norm);
        let logits = hn.matmul(ow.clone().transpose());
        let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(targets[a..a + len].to_vec(), [len, 1]), &device);
        let wt = Tensor::<B, 2>::from_data(TensorData::new(weights[a..a + len].to_vec(), [len, 1]), &device);
        let lc = (log_softmax(logits, 1).gather(1, idx) * wt).sum().neg();
        loss += f64::from(to_vec(lc.clone().inner()).first().copied().unwrap_or(f32::NAN));
        let grads = lc.backward();
        gx.push(xc.grad(&grads).unwrap_or_else(|| Tensor::zeros([len, h], &device)));
        if let Some(g) = nw.grad(&grads) {
            gnorm = gnorm + g;
        }
        if let Some(g) = ow.grad(&grads) {
            gout = gout + g;
        }
        a += len;
    }
    (loss, Tensor::cat(gx, 0).reshape([b, t, h]), gnorm, gout)
}

impl ActivationSpill for lt_storage::spill::SpillStore {
    fn put(&self, key: u64, data: &[u8]) -> Result<(), lt_storage::StorageError> {
        lt_storage::spill::SpillStore::put(self, key, data)
    }

    fn get(&self, key: u64, out: &mut [u8]) -> Result<(), lt_storage::StorageError> {
        let v = lt_storage::spill::SpillStore::get(self, key)?;
        if v.len() != out.len() {
            return Err(lt_storage::StorageError::SizeMismatch {
                path: format!("spill key {key}").into(),
                expected: out.len() as u64,
                found: v.len() as u64,
            });
        }
        out.copy_from_slice(&v);
        Ok(())
    }

    fn free(&self, key: u64) {
        let _ = self.remove(key);
    }
}
