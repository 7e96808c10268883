//! The streamed executor: forward and backward of one micro-batch, layer by layer, exactly as the
//! plan says, with uploads and downloads on their own threads and every operation traced.
//!
//! Streams (threads here; device streams on a GPU):
//! - **h2d** walks the plan's upload schedule ([`Step::uploads`]: the embedded tokens, gathered
//!   from the host embedding; the forward layers; the head once per step, during the last forward
//!   layer; then per backward segment the segment's start boundary if it lives off-device, the
//!   recompute layers and the backward layers) and hands each item over a rendezvous channel: one
//!   buffer in use, the next one bound (double buffering, as lt-sched's memory model counts it).
//! - **d2h** receives activation offloads (host tier or NVMe) and weight gradients over a rendezvous
//!   (one set being produced, one being downloaded) and lands them in the host buffers
//!   (`crate::grads::GradBuf`: kept as bf16 from a bf16 device in a step's only micro-batch, else
//!   widened and accumulated in fp32), computing the sum of squares in the same pass.
//!
//! Before any compute, the micro-batch is checked against lt-sched's memory model
//! (`lt_sched::window::gpu_live`, the function the planner plans with) on the executor's hardware
//! profile: a plan the planner finds feasible runs, and one it does not is refused.
//! - **compute** (the calling thread) runs layers; every time it blocks on another stream, the wait is
//!   recorded as that stream's measured exposure.
//!
//! The h2d and d2h threads are started once, with the executor's first micro-batch, and live as long
//! as it does: on a device runtime every thread is a stream with its own memory pools. How their
//! device calls map onto the runtime's streams is [`lt_model::device::StreamMode`]'s business (one
//! stream on wgpu, where cubecl has no cross-stream memory guard; their own on CUDA).

use std::collections::{BTreeSet, HashMap};
use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex};

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};
use crossbeam::channel;
use lt_core::{ByteSize, ModelConfig};
use lt_model::device::StreamMode;
use lt_model::layer::{SeqCtx, layer_backward, layer_forward};
use lt_model::model::{Batch, shifted_targets, to_vec};
use lt_model::ops;
use lt_model::upload::{host_data, shared_bf16_data};
use lt_model::weights::{LayerWeights, PreparedLayer};
use lt_optim::grad::sum_squares;
use lt_optim::{Grad, ThreadPool};

use crate::error::ExecError;
use crate::grads::{HostGrads, accumulate_data};
use crate::plan::{Placement, Step, Upload};
use crate::state::{HEAD, HeadHost, SharedModel, layer_slot};
use crate::trace::{Stream, Trace};
use lt_core::hardware::HardwareProfile;
use lt_sched::cost::{CostOptions, Instance};
use lt_sched::window::GpuPoint;

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

/// What compute receives from the h2d stream, in [`Step::uploads`] order.
enum Uploaded<B: Backend> {
    Embed(Tensor<B, 3>),
    Layer(usize, LayerWeights<B>),
    Head(DeviceHead<B>),
    Act(usize, Tensor<B, 3>),
}

/// The host half of an upload: data already in the device dtype, not yet on the device.
enum Prepared {
    Embed(TensorData),
    Layer(usize, PreparedLayer),
    Head { norm: TensorData, out: TensorData },
    Act(usize, TensorData),
}

impl Prepared {
    /// The device half: create the tensors on `device`, on the calling thread's stream.
    fn bind<B: Backend>(self, device: &B::Device) -> Uploaded<B> {
        match self {
            Prepared::Embed(d) => Uploaded::Embed(lt_model::upload::upload_data(d, device)),
            Prepared::Layer(i, l) => Uploaded::Layer(i, l.bind(device)),
            Prepared::Head { norm, out } => Uploaded::Head(DeviceHead {
                norm: lt_model::upload::upload_data(norm, device),
                out: lt_model::upload::upload_data(out, device),
            }),
            Prepared::Act(s, d) => Uploaded::Act(s, lt_model::upload::upload_data(d, device)),
        }
    }

    fn what(&self) -> String {
        match self {
            Prepared::Embed(_) => "embed".into(),
            Prepared::Layer(i, _) => format!("L{i}"),
            Prepared::Head { .. } => "head".into(),
            Prepared::Act(s, _) => format!("B{s}"),
        }
    }
}

/// An h2d item as it crosses to compute: bound by the h2d thread on its own stream
/// ([`StreamMode::Separate`]), or host data that compute binds ([`StreamMode::Shared`]).
enum Handoff<B: Backend> {
    Device(Uploaded<B>),
    Host(Prepared),
}

/// A device-to-host copy as it crosses to the d2h stream: already issued by compute
/// ([`StreamMode::Shared`]), or a tensor the d2h thread reads on its own stream.
enum Fetch {
    Issued(lt_model::device::PendingRead),
    Deferred(Box<dyn FnOnce() -> Result<TensorData, String> + Send>),
}

impl Fetch {
    fn new<B: Backend, const D: usize>(t: Tensor<B, D>, mode: StreamMode) -> Self {
        match mode {
            StreamMode::Shared => Fetch::Issued(lt_model::device::start_read(t)),
            StreamMode::Separate => Fetch::Deferred(Box::new(move || t.try_into_data().map_err(|e| format!("{e:?}")))),
        }
    }

    fn wait(self, what: &str) -> Result<TensorData, ExecError> {
        match self {
            Fetch::Issued(p) => p.wait(),
            Fetch::Deferred(f) => f(),
        }
        .map_err(|reason| ExecError::DeviceRead { what: what.to_string(), reason })
    }
}

enum Down {
    Offload(usize, Fetch),
    Layer(usize, Vec<Fetch>),
    Head { norm: Fetch, out: Fetch },
    Embed(Fetch),
}

/// The head on the device: final norm and output projection (`lm_head`, or the embedding matrix
/// when tied). Uploaded once per step and kept for all its micro-batches.
struct DeviceHead<B: Backend> {
    norm: Tensor<B, 1>,
    out: Tensor<B, 2>,
}

impl<B: Backend> Clone for DeviceHead<B> {
    fn clone(&self) -> Self {
        Self { norm: self.norm.clone(), out: self.out.clone() }
    }
}

/// What one micro-batch produced.
#[derive(Debug, Clone, Default)]
pub struct MicroBatchResult {
    /// This micro-batch's share of the step loss (`sum CE / step loss tokens`).
    pub loss: f64,
    /// Sum of squares of the accumulated gradients, when this was the step's last micro-batch.
    pub grad_sq_sum: Option<f64>,
    /// The predicted device peak of the micro-batch (lt-sched's memory model, what the budget is
    /// checked against; a prediction, not a measurement).
    pub peak_device_bytes: u64,
}

type Job = Box<dyn FnOnce() + Send + 'static>;

/// One long-lived thread that runs jobs in order: a stream of the executor. It lives as long as the
/// executor, because on a device runtime a thread is a stream with its own memory pools (see
/// `lt_model::device`): a thread per micro-batch would be a new stream per micro-batch.
struct Worker {
    tx: Option<channel::Sender<Job>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    fn spawn(name: &'static str) -> Result<Self, ExecError> {
        let (tx, rx) = channel::unbounded::<Job>();
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(|_| ExecError::Worker(name))?;
        Ok(Self { tx: Some(tx), handle: Some(handle) })
    }

    /// Run `f` on this thread; its result (or its panic) arrives on the returned channel.
    fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> channel::Receiver<std::thread::Result<T>> {
        let (tx, rx) = channel::bounded(1);
        let job: Job = Box::new(move || {
            let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        });
        if let Some(s) = &self.tx {
            // A send fails only if the thread is gone; the dropped result sender then reports it.
            let _ = s.send(job);
        }
        rx
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The executor's h2d and d2h streams, created with its first micro-batch and kept until it drops.
struct Streams {
    h2d: Worker,
    d2h: Worker,
    mode: StreamMode,
    /// Device-runtime streams the executor's device calls have been issued on.
    used: Arc<Mutex<BTreeSet<u64>>>,
}

impl Streams {
    fn new(mode: StreamMode) -> Result<Self, ExecError> {
        Ok(Self {
            h2d: Worker::spawn("lt-h2d")?,
            d2h: Worker::spawn("lt-d2h")?,
            mode,
            used: Arc::new(Mutex::new(BTreeSet::new())),
        })
    }

    /// Run `f` on `worker` with its device calls on the right stream: the caller's (compute's) in
    /// [`StreamMode::Shared`], the worker's own in [`StreamMode::Separate`]. The stream used is recorded.
    fn run<T: Send + 'static>(
        &self,
        worker: &Worker,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> channel::Receiver<std::thread::Result<T>> {
        let compute = lt_model::device::current_stream();
        let mode = self.mode;
        let used = Arc::clone(&self.used);
        worker.run(move || {
            let go = move || {
                if let Ok(mut u) = used.lock() {
                    u.insert(lt_model::device::current_stream());
                }
                f()
            };
            match mode {
                StreamMode::Shared => lt_model::device::on_stream(compute, go),
                StreamMode::Separate => go(),
            }
        })
    }
}

/// Wait for a worker's result; a panic or a vanished worker becomes [`ExecError::Worker`].
fn joined<T>(rx: channel::Receiver<std::thread::Result<T>>, who: &'static str) -> Result<T, ExecError> {
    match rx.recv() {
        Ok(Ok(v)) => Ok(v),
        _ => Err(ExecError::Worker(who)),
    }
}

/// The streamed executor for one model and plan.
pub struct Executor<B: AutodiffBackend> {
    plan: Step,
    device: Dev<B>,
    /// The machine the memory model counts for: its `gpu_memory` is the device budget, its
    /// `compute_dtype_bytes` this backend's float size.
    hardware: HardwareProfile,
    trace: Arc<Trace>,
    spill: Option<Arc<dyn ActivationSpill>>,
    /// Threads that help the d2h stream widen and accumulate downloaded gradients.
    d2h_pool: Arc<ThreadPool>,
    step: u64,
    streams: Option<Streams>,
    /// The step's head: (model, version) it was uploaded from, and the tensors.
    head: Option<(usize, u64, DeviceHead<Inner<B>>)>,
    /// The float dtype of uploads: the backend's own unless set ([`Self::with_upload_dtype`]).
    upload_dtype: DType,
    /// Whether bf16 uploads read the optimizer-written copies ([`Self::with_optimizer_copy`]).
    optimizer_copy: bool,
    /// Whether layer gradients land in bf16 on a bf16 device ([`Self::with_bf16_gradients`]).
    bf16_grads: bool,
    _b: PhantomData<B>,
}

/// Threads for the d2h stream's gradient accumulation: a quarter of the cores, 1 to 4 (the optimizer
/// and the upload conversion want the rest).
fn d2h_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |c| c.get() / 4).clamp(1, 4)
}

/// Bytes per float element on the device: the backend's float dtype (f32 on ndarray and wgpu, bf16
/// on CUDA), as the planner's `compute_dtype_bytes`.
fn elem_bytes<B: Backend>() -> u64 {
    std::mem::size_of::<<B as burn::tensor::backend::BackendTypes>::FloatElem>() as u64
}

/// The CPU profile with `device_memory` of GPU memory and backend `B`'s float size.
fn default_hardware<B: Backend>(device_memory: ByteSize) -> HardwareProfile {
    let cpu = lt_core::hardware::BuiltinProfile::Cpu.profile();
    HardwareProfile { gpu_memory: device_memory, compute_dtype_bytes: elem_bytes::<B>() as u32, ..cpu }
}

/// Spill-file bytes for one micro-batch `[b, t]` under `plan`: every NVMe boundary in the device
/// dtype ([`elem_bytes`]), each rounded up to whole 4 MiB requests; 0 when nothing goes to NVMe.
pub fn spill_capacity<B: Backend>(plan: &Step, cfg: &ModelConfig, b: usize, t: usize) -> u64 {
    let nvme = plan.boundaries.iter().filter(|p| **p == Placement::Nvme).count() as u64;
    let act = (b * t * cfg.hidden_size) as u64 * elem_bytes::<B>();
    nvme * act.div_ceil(4 << 20).max(1) * (4 << 20)
}

impl<B: AutodiffBackend> Executor<B> {
    /// An executor that runs `plan` within `device_memory` on `device`. Its h2d and d2h threads start
    /// with the first micro-batch and live until the executor is dropped.
    pub fn new(plan: Step, device_memory: ByteSize, device: Dev<B>, spill: Option<Arc<dyn ActivationSpill>>) -> Self {
        let d2h_pool = Arc::new(ThreadPool::new_or_calling_thread(d2h_threads()));
        Self {
            plan,
            device,
            hardware: default_hardware::<Inner<B>>(device_memory),
            trace: Arc::new(Trace::new()),
            spill,
            d2h_pool,
            step: 0,
            streams: None,
            head: None,
            upload_dtype:
                <<Inner<B> as burn::tensor::backend::BackendTypes>::FloatElem as burn::tensor::Element>::dtype(),
            optimizer_copy: lt_model::upload::upload_copy(),
            bf16_grads: lt_model::upload::bf16_grads(),
            _b: PhantomData,
        }
    }

    /// Count memory for `hardware` (the plan's profile: its reserved memory and GPU memory), with this
    /// backend's float size. The default is the CPU profile with the `device_memory` given to
    /// [`Self::new`] as its GPU memory.
    pub fn with_hardware(mut self, hardware: HardwareProfile) -> Self {
        self.hardware = HardwareProfile { compute_dtype_bytes: elem_bytes::<Inner<B>>() as u32, ..hardware };
        self
    }

    /// The profile the memory model counts for ([`Self::with_hardware`]).
    pub fn hardware(&self) -> &HardwareProfile {
        &self.hardware
    }

    /// Upload floats in `dtype` (bf16, f16 or f32) instead of the backend's own float dtype; the
    /// backend converts them on arrival. With bf16 on an f32 backend, the CPU runs the bf16 upload
    /// path of a GPU, copies included, which is how the tests check it.
    pub fn with_upload_dtype(mut self, dtype: DType) -> Self {
        self.upload_dtype = dtype;
        self
    }

    /// Whether bf16 uploads read the bf16 copy that the optimizer writes with the masters (`true`,
    /// the default unless `LT_UPLOAD_COPY=0`) or convert the fp32 masters at every upload (`false`:
    /// the older path, kept to compare against and as a fallback).
    pub fn with_optimizer_copy(mut self, on: bool) -> Self {
        self.optimizer_copy = on;
        self
    }

    /// Whether, with bf16 uploads, decoder-layer gradients are kept on the host in bf16 as they
    /// land (`true`, the default unless `LT_BF16_GRADS=0`; see `crate::grads::GradBuf`), or widened
    /// into fp32 buffers (`false`). Either way, with bf16 uploads on an f32 backend (the CPU's
    /// stand-in for a GPU) they are rounded to bf16 before they land, as a bf16 device computes them.
    pub fn with_bf16_gradients(mut self, on: bool) -> Self {
        self.bf16_grads = on;
        self
    }

    /// Whether decoder-layer gradients land in bf16 ([`Self::with_bf16_gradients`]).
    pub fn lands_bf16_gradients(&self) -> bool {
        self.bf16_grads && self.upload_dtype == DType::BF16
    }

    /// The float dtype uploads are made in.
    pub fn upload_dtype(&self) -> DType {
        self.upload_dtype
    }

    /// Whether uploads want the model's bf16 copies ([`SharedModel::fill_upload_copies`]): bf16
    /// uploads with the optimizer copy on. f32 uploads read the masters themselves.
    pub fn wants_upload_copies(&self) -> bool {
        self.optimizer_copy && self.upload_dtype == DType::BF16
    }

    /// The plan being executed.
    pub fn plan(&self) -> &Step {
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

    /// The device-runtime streams (cubecl stream ids) the executor's device calls have used so far:
    /// the calling (compute) thread's, plus the h2d and d2h threads' own in
    /// [`StreamMode::Separate`]. A long run must not add any after its first micro-batch.
    pub fn streams_used(&self) -> Vec<u64> {
        self.streams
            .as_ref()
            .map_or_else(Vec::new, |s| s.used.lock().map(|u| u.iter().copied().collect()).unwrap_or_default())
    }

    /// Device memory the runtime has reserved over every stream the executor uses (the memory pools'
    /// size, in use or free), or `None` on a CPU backend. Call from the compute thread between steps.
    pub fn device_reserved_bytes(&self) -> Option<u64> {
        let mut per_stream = std::collections::BTreeMap::new();
        let here = lt_model::device::current_stream();
        per_stream.insert(here, lt_model::device::reserved_bytes(&self.device)?);
        if let Some(s) = &self.streams {
            for w in [&s.h2d, &s.d2h] {
                let device = self.device.clone();
                let r =
                    s.run(w, move || (lt_model::device::current_stream(), lt_model::device::reserved_bytes(&device)));
                if let Ok(Ok((id, Some(bytes)))) = r.recv() {
                    per_stream.insert(id, bytes);
                }
            }
        }
        Some(per_stream.values().sum())
    }

    /// What lt-sched's memory model counts live on the device at every point of one micro-batch of
    /// shape `[b, t]` under this plan, on this executor's hardware profile (`window::gpu_live`: the
    /// planner's rows, in bytes). The same function decides whether `lt plan` finds the plan feasible.
    pub fn device_live_bytes(&self, cfg: &ModelConfig, b: usize, t: usize) -> Result<Vec<(GpuPoint, f64)>, ExecError> {
        let mut shape = self.plan.shape;
        shape.micro_batch_size = b;
        let opts = CostOptions { attention: self.plan.attention, ..CostOptions::default() };
        let inst = Instance::from_model(cfg, &self.hardware, t, &shape, opts)
            .map_err(|e| ExecError::PlanMismatch { reason: e.to_string() })?;
        Ok(lt_sched::window::gpu_live(&inst, &self.plan.boundaries))
    }

    /// Peak device bytes one micro-batch of shape `[b, t]` needs under this plan: the largest of
    /// [`Self::device_live_bytes`] (the plan's predicted peak), 0 for an empty shape.
    pub fn required_device_bytes(&self, cfg: &ModelConfig, b: usize, t: usize) -> u64 {
        self.device_live_bytes(cfg, b, t).map_or(0, |rows| rows.iter().map(|r| r.1).fold(0.0, f64::max).ceil() as u64)
    }

    /// Forward and backward of one micro-batch, adding its gradients into `grads`.
    ///
    /// Every weight is uploaded only once its version in `model` reaches `want_version` (the
    /// optimizer may still be updating later layers of the previous step). The head is uploaded with
    /// the step's first micro-batch and kept for the next one of the same model and version, until the
    /// head op of the step's last micro-batch (`last`) is done.
    ///
    /// `denom` is the number of loss tokens in the whole step, so that accumulating micro-batches
    /// gives exactly the full-batch mean loss and gradient. When `last` is set, the returned
    /// [`MicroBatchResult::grad_sq_sum`] holds the sum of squares of the accumulated gradients,
    /// computed in the same pass that adds this micro-batch's contribution.
    pub fn micro_batch(
        &mut self,
        model: &Arc<SharedModel>,
        batch: &Batch,
        denom: usize,
        last: bool,
        grads: &Arc<HostGrads>,
        want_version: u64,
    ) -> Result<MicroBatchResult, ExecError> {
        let cfg = &model.config;
        let nl = cfg.num_layers();
        self.plan.validate(nl).map_err(|e| ExecError::PlanMismatch { reason: e.to_string() })?;
        let (b, t) = batch.validate(cfg.vocab_size, "batch")?;
        // The memory model is checked up front, so a plan that cannot fit fails before any compute,
        // with the peak it would need and where.
        let limit = self.hardware.gpu_memory;
        let rows = self.device_live_bytes(cfg, b, t)?;
        let peak = rows.iter().map(|r| r.1).fold(0.0, f64::max).ceil() as u64;
        if let Some((at, _)) = rows.iter().find(|r| r.1 > limit.as_f64()) {
            return Err(ExecError::OutOfDeviceMemory {
                budget: limit,
                what: at.to_string(),
                needed: ByteSize(peak),
                needed_round: crate::budget::round_up(peak),
            });
        }
        for (i, p) in self.plan.boundaries.iter().enumerate() {
            if *p == Placement::Nvme && self.spill.is_none() {
                return Err(ExecError::NoSpillStore { boundary: i });
            }
        }
        if self.streams.is_none() {
            self.streams = Some(Streams::new(lt_model::device::stream_mode(&self.device))?);
        }
        if let Some(s) = &self.streams
            && let Ok(mut u) = s.used.lock()
        {
            u.insert(lt_model::device::current_stream());
        }
        let model_key = Arc::as_ptr(model) as usize;
        // The step's head, if an earlier micro-batch of this step uploaded it (same model, same version).
        let cached = match self.head.take() {
            Some((m, v, h)) if m == model_key && v == want_version => Some(h),
            _ => None,
        };
        let step = self.step;
        let plan = Arc::new(self.plan.clone());
        let sched = plan.uploads(cached.is_none());
        let acts = Arc::new(ActStore::default());
        let hidden = cfg.hidden_size;
        // A rendezvous: the h2d thread binds the next transfer while compute runs the current one and
        // hands it over when compute asks, so at most two layers' weights are on the device (the double
        // buffering lt-sched's memory model counts). A one-slot queue would let a third one be bound
        // while the second waits in it (measured on CPU: `tests/memory_truth.rs`).
        let (up_tx, up_rx) = channel::bounded::<Result<Handoff<Inner<B>>, ExecError>>(0);
        // Also a rendezvous: compute hands a download over when the d2h thread has finished the previous
        // one, so at most two layers' gradients exist on the device (the one being produced and the
        // one being downloaded: lt-sched's two gradient buffers). Waiting for it is exposed d2h time.
        let (down_tx, down_rx) = channel::bounded::<Down>(0);
        let Some(streams) = self.streams.as_ref() else { return Err(ExecError::Worker("streams")) };
        let mode = streams.mode;
        let float = self.upload_dtype;
        let bf16_device = float == DType::BF16;

        // --- h2d stream ---
        let up = {
            let (model, trace, device, acts, spill) = (
                Arc::clone(model),
                Arc::clone(&self.trace),
                self.device.clone(),
                Arc::clone(&acts),
                self.spill.clone(),
            );
            let ids = batch.input_ids.clone();
            streams.run(&streams.h2d, move || {
                let cfg = &model.config;
                for item in sched {
                    let prepared = match item {
                        Upload::Embed | Upload::Head => {
                            trace.wait_as(Stream::H2d, Stream::Optimizer, step, "wait update head", || {
                                model.wait_version(HEAD, want_version)
                            });
                            trace.span(Stream::H2d, step, format!("prepare {}", &item.to_string()[7..]), || {
                                let h = model.head.read().unwrap_or_else(|e| e.into_inner());
                                if item == Upload::Embed {
                                    // Only the micro-batch's rows cross the bus, never the embedding matrix (the
                                    // planner's contract); ids are validated before any upload.
                                    let rows = lt_model::stream::gather_rows(&h.embed_tokens.data, hidden, &ids, float);
                                    return Ok(Prepared::Embed(rows));
                                }
                                let out = h.lm_head.as_ref().unwrap_or(&h.embed_tokens);
                                match bf16_copy(&model, HEAD, float) {
                                    Some(c) => {
                                        let shared = |k: usize, t: &lt_model::host::HostTensor| {
                                            c.get(k)
                                                .and_then(Option::as_ref)
                                                .and_then(|c| shared_bf16_data(c, &t.shape))
                                        };
                                        match (shared(HeadHost::NORM, &h.norm), shared(h.out_index(), out)) {
                                            (Some(norm), Some(out)) => Ok(Prepared::Head { norm, out }),
                                            _ => Err(ExecError::UploadCopy { what: "the head".into() }),
                                        }
                                    }
                                    None => Ok(Prepared::Head {
                                        norm: host_data(&h.norm.data, &h.norm.shape, float),
                                        out: host_data(&out.data, &out.shape, float),
                                    }),
                                }
                            })
                        }
                        Upload::Layer(i) => {
                            trace.wait_as(Stream::H2d, Stream::Optimizer, step, format!("wait update L{i}"), || {
                                model.wait_version(layer_slot(i), want_version)
                            });
                            trace.span(Stream::H2d, step, format!("prepare L{i}"), || {
                                let l = model.layers[i].read().unwrap_or_else(|e| e.into_inner());
                                let kind = cfg.layer_types[i];
                                match bf16_copy(&model, layer_slot(i), float) {
                                    Some(c) => c
                                        .into_iter()
                                        .collect::<Option<Vec<_>>>()
                                        .and_then(|c| PreparedLayer::from_copies(&l, kind, &c))
                                        .map(|p| Prepared::Layer(i, p))
                                        .ok_or_else(|| ExecError::UploadCopy { what: format!("layer {i}") }),
                                    None => Ok(Prepared::Layer(i, PreparedLayer::converted(&l, kind, float))),
                                }
                            })
                        }
                        Upload::Boundary(s) => fetch_act(&acts, spill.as_deref(), &trace, step, s, [b, t, hidden])
                            .map(|d| Prepared::Act(s, d)),
                    };
                    let msg = prepared.map(|p| match mode {
                        // The device half here, on this thread's own stream: the copy overlaps compute.
                        StreamMode::Separate => {
                            Handoff::Device(trace.span(Stream::H2d, step, item.to_string(), || p.bind(&device)))
                        }
                        StreamMode::Shared => Handoff::Host(p),
                    });
                    let failed = msg.is_err();
                    if up_tx.send(msg).is_err() || failed {
                        return;
                    }
                }
            })
        };
        // --- d2h stream ---
        let down = {
            let (trace, acts, spill, plan, pool, grads) = (
                Arc::clone(&self.trace),
                Arc::clone(&acts),
                self.spill.clone(),
                Arc::clone(&plan),
                Arc::clone(&self.d2h_pool),
                Arc::clone(grads),
            );
            let ids = batch.input_ids.clone();
            streams.run(&streams.d2h, move || -> Result<Option<f64>, ExecError> {
                let mut sq = 0.0f64;
                for msg in down_rx {
                    match msg {
                        Down::Offload(s, x) => {
                            let what = format!("offload B{s}");
                            let data = trace.span(Stream::D2h, step, what.clone(), || x.wait(&what))?;
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
                                let what = format!("gradients of layer {j}");
                                let host = params.into_iter().map(|g| g.wait(&what)).collect::<Result<Vec<_>, _>>()?;
                                let mut dst = grads.layer(j);
                                for (k, g) in host.into_iter().enumerate() {
                                    // A bf16 device's gradients already are bf16 (no conversion); an
                                    // f32 backend standing in for one rounds them as it would.
                                    let g = if bf16_device { g.convert_dtype(DType::BF16) } else { g };
                                    sq += dst[k].land(&g, &pool)?;
                                }
                                Ok(())
                            })?
                        }
                        Down::Head { norm, out } => {
                            trace.span(Stream::D2h, step, "grads head", || -> Result<(), ExecError> {
                                let (norm, out) = (norm.wait("head gradients")?, out.wait("head gradients")?);
                                let mut hg = grads.head();
                                sq += accumulate_data(&mut hg.norm, &norm, &pool)?;
                                match &mut hg.lm_head {
                                    Some(h) => sq += accumulate_data(h, &out, &pool)?,
                                    None => {
                                        accumulate_data(&mut hg.embed_tokens, &out, &pool)?;
                                    }
                                }
                                Ok(())
                            })?
                        }
                        Down::Embed(g0) => {
                            trace.span(Stream::D2h, step, "grads embed", || -> Result<(), ExecError> {
                                let g0 = g0.wait("the embedding gradient")?;
                                let g0 = g0.convert::<f32>().to_vec::<f32>().unwrap_or_default();
                                let mut hg = grads.head();
                                let e = &mut hg.embed_tokens;
                                scatter_rows(e, &ids, &g0, hidden);
                                // The embedding is complete only now (a tied head added to it earlier), and
                                // only the step's last micro-batch needs its norm: one parallel pass per step.
                                if last {
                                    sq += sum_squares(Grad::F32(e), &pool);
                                }
                                Ok(())
                            })?
                        }
                    }
                }
                Ok(if last { Some(sq) } else { None })
            })
        };

        // --- compute stream (this thread) ---
        let trace = &self.trace;
        let device = &self.device;
        let run = || -> ComputeOutcome<B> {
            let recv = |what: &str| -> Result<Uploaded<Inner<B>>, ExecError> {
                let h = trace
                    .wait(Stream::H2d, step, format!("wait {what}"), || up_rx.recv())
                    .map_err(|_| ExecError::Worker("h2d"))??;
                Ok(match h {
                    Handoff::Device(u) => u,
                    // Compute binds host-prepared data itself (one stream, one thread issuing device calls):
                    // the time it takes is upload time that compute waits for.
                    Handoff::Host(p) => trace.wait(Stream::H2d, step, format!("bind {}", p.what()), || p.bind(device)),
                })
            };
            let fetch = |t| Fetch::new(t, mode);
            let send_down = |what: &str, d: Down| match down_tx.try_send(d) {
                Err(channel::TrySendError::Full(d)) => {
                    // A closed channel means the d2h thread failed; its error is reported when it is joined.
                    let _ = trace.wait(Stream::D2h, step, format!("wait d2h ({what})"), || down_tx.send(d));
                }
                Ok(()) | Err(channel::TrySendError::Disconnected(_)) => {}
            };
            let out_of_order = || ExecError::Worker("h2d (schedule out of order)");
            let layer = |i: usize| -> Result<LayerWeights<Inner<B>>, ExecError> {
                match recv(&format!("upload L{i}"))? {
                    Uploaded::Layer(j, w) if j == i => Ok(w),
                    _ => Err(out_of_order()),
                }
            };
            let ctx = batch.context::<Inner<B>>(cfg, device);
            let ctx_ad = SeqCtx::<B>::lift(&ctx);
            let mut kept: HashMap<usize, Tensor<Inner<B>, 3>> = HashMap::new();
            let mut x = match recv("upload embed")? {
                Uploaded::Embed(x) => x,
                _ => return Err(out_of_order()),
            };
            kept.insert(0, x.clone());
            for i in 0..nl {
                let w = layer(i)?;
                x = trace.span(Stream::Compute, step, format!("fwd L{i}"), || layer_forward(cfg, &w, x, &ctx));
                match plan.boundaries[i + 1] {
                    Placement::Gpu => {
                        kept.insert(i + 1, x.clone());
                    }
                    Placement::Host | Placement::Nvme => {
                        send_down("offload", Down::Offload(i + 1, Fetch::new(x.clone(), mode)));
                    }
                    Placement::Recompute => {}
                }
            }
            kept.remove(&nl);
            let head = match cached {
                Some(h) => h,
                None => match recv("upload head")? {
                    Uploaded::Head(h) => h,
                    _ => return Err(out_of_order()),
                },
            };
            let (loss, mut g, gnorm, gout) = trace.span(Stream::Compute, step, "head+loss", || {
                head_backward::<B>(cfg, &head, x, &batch.labels, denom, plan.shape.loss_chunk_tokens)
            });
            send_down("head gradient", Down::Head { norm: fetch(gnorm), out: Fetch::new(gout, mode) });
            // The step's last head op is done: free the head before the last backward.
            let head = if last { None } else { Some(head) };
            for (s, e) in plan.segments_backward() {
                let x0 = match plan.boundaries[s] {
                    Placement::Gpu => kept.remove(&s).ok_or(ExecError::Worker("compute (missing kept boundary)"))?,
                    _ => match recv(&format!("boundary B{s}"))? {
                        Uploaded::Act(j, x) if j == s => x,
                        _ => return Err(out_of_order()),
                    },
                };
                let mut xs = vec![x0];
                for j in s..e - 1 {
                    let w = layer(j)?;
                    let prev = xs[xs.len() - 1].clone();
                    xs.push(
                        trace.span(Stream::Compute, step, format!("recompute L{j}"), || {
                            layer_forward(cfg, &w, prev, &ctx)
                        }),
                    );
                }
                for j in (s..e).rev() {
                    let w = layer(j)?;
                    let xj = xs.pop().ok_or(ExecError::Worker("compute (segment inputs)"))?;
                    let lg = trace.span(Stream::Compute, step, format!("bwd L{j}"), || {
                        layer_backward::<B>(cfg, j, &w, xj, g.clone(), &ctx_ad)
                    });
                    send_down("gradients", Down::Layer(j, lg.params.into_iter().map(|(_, p)| fetch(p)).collect()));
                    g = lg.input;
                }
            }
            send_down("dx0", Down::Embed(Fetch::new(g, mode)));
            Ok((loss, head))
        };
        let result = run();
        drop(down_tx);
        drop(up_rx);
        let uploaded = joined(up, "h2d");
        let sq = trace.wait(Stream::D2h, step, "wait d2h drain", || joined(down, "d2h"));
        let (loss, head) = result?;
        self.head = head.map(|h| (model_key, want_version, h));
        uploaded?;
        let sq = sq??;
        Ok(MicroBatchResult { loss, grad_sq_sum: sq, peak_device_bytes: peak })
    }
}

/// Slot `slot`'s optimizer-written copies when uploads are bf16 and the model keeps them. The copies
/// are bf16: an executor uploading another dtype (sharing a model with a bf16 one) converts the
/// masters instead.
fn bf16_copy(model: &SharedModel, slot: usize, upload: DType) -> Option<crate::state::UploadCopy> {
    if upload == DType::BF16 { model.upload_copy(slot) } else { None }
}

/// `e[id] += g[token]` for every token of `ids` (the embedding's backward).
fn scatter_rows(e: &mut [f32], ids: &[Vec<u32>], g: &[f32], hidden: usize) {
    for (k, &id) in ids.iter().flatten().enumerate() {
        let src = &g[k * hidden..(k + 1) * hidden];
        let dst = &mut e[id as usize * hidden..(id as usize + 1) * hidden];
        for (d, s) in dst.iter_mut().zip(src) {
            *d += *s;
        }
    }
}

/// Offloaded boundary `s` back in host memory, in the device dtype: taken from the host tier, or
/// read from NVMe.
fn fetch_act(
    acts: &ActStore,
    spill: Option<&dyn ActivationSpill>,
    trace: &Trace,
    step: u64,
    s: usize,
    shape: [usize; 3],
) -> Result<TensorData, ExecError> {
    match acts.take(s) {
        Held::Host(data) => Ok(data),
        Held::Nvme(dtype) => {
            let sp = spill.ok_or(ExecError::NoSpillStore { boundary: s })?;
            let n = shape.iter().product::<usize>();
            let mut bytes = vec![0u8; n * dtype.size()];
            trace.span(Stream::Nvme, step, format!("read B{s}"), || sp.get(s as u64, &mut bytes))?;
            sp.free(s as u64);
            Ok(TensorData::from_bytes_vec(bytes, shape, dtype))
        }
        Held::Failed(e) => Err(ExecError::Storage(lt_storage::StorageError::Io {
            path: format!("spill boundary {s}").into(),
            op: "write",
            source: std::io::Error::other(e),
        })),
    }
}

/// What the compute stream of one micro-batch returns: its loss share, and the head it uploaded
/// (kept for the step's next micro-batch).
type ComputeOutcome<B> = Result<(f64, Option<DeviceHead<Inner<B>>>), ExecError>;

/// What [`head_backward`] returns: the chunk-summed loss, `d x`, and the gradients of the final norm
/// and of the output projection.
type HeadBackward<B> = (f64, Tensor<B, 3>, Tensor<B, 1>, Tensor<B, 2>);

/// Chunked head and loss with backward: returns the loss share, d loss / d x_L, and the gradients of
/// the final norm and the output projection. Logits exist for at most `chunk` tokens at a time and
/// each chunk's graph is dropped before the next (the anchor kept every chunk alive).
fn head_backward<B: AutodiffBackend>(
    cfg: &ModelConfig,
    head: &DeviceHead<Inner<B>>,
    x: Tensor<Inner<B>, 3>,
    labels: &[Vec<i64>],
    denom: usize,
    chunk: usize,
) -> HeadBackward<Inner<B>> {
    let [b, t, h] = x.dims();
    let n = b * t;
    let device = x.device();
    let flat = x.reshape([n, h]);
    let (targets, weights) = shifted_targets(labels, denom);
    let mut gnorm = Tensor::<Inner<B>, 1>::zeros([h], &device);
    let mut gout = Tensor::<Inner<B>, 2>::zeros(head.out.dims(), &device);
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
        let ow: Tensor<B, 2> = Tensor::from_inner(head.out.clone()).require_grad();
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
