//! The training step: micro-batches through the executor, global-norm clipping, and the host
//! optimizer update overlapped with the next step's forward.
//!
//! **Which overlap, and why.** The clip scale needs the global gradient norm, which is known only
//! after the last layer's backward; updating layer `i` during backward would require either no
//! clipping or a second pass. So the update of step `k` runs on an optimizer thread *after*
//! backward, in forward order (head, layer 0, layer 1, ...), while step `k + 1`'s forward is already
//! running: the upload of layer `i` waits only for layer `i`'s update (per-layer versions in
//! [`SharedModel`]). With a fast optimizer the forward never waits; the trace shows when it does.
//! The same thread zeroes each layer's gradient right after using it, so no separate pass is needed.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use lt_model::host::HostModel;
use lt_model::model::Batch;
use lt_optim::{AdamW, AdamWConfig, Grad, OptimizerKind, StepOutcome, ThreadPool};
use serde::Serialize;

use crate::error::ExecError;
use crate::executor::Executor;
use crate::grads::HostGrads;
use crate::state::{HEAD, SharedModel, layer_slot};
use crate::trace::{StepTiming, Stream, Trace};
pub use lt_sched::cost::HostBytes;

/// Learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// Constant.
    Constant,
    /// Cosine decay to 0 at the last step.
    Cosine,
}

/// Optimizer and schedule settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOptions {
    /// AdamW hyper-parameters (peak learning rate, betas, eps, weight decay, clipping).
    pub adamw: AdamWConfig,
    /// fp32 or 8-bit state.
    pub optimizer: OptimizerKind,
    /// Linear warmup steps (HF semantics: the first step runs at lr 0).
    pub warmup_steps: u64,
    /// Schedule after warmup.
    pub schedule: LrSchedule,
    /// Total steps (for the cosine schedule).
    pub total_steps: u64,
    /// Overlap the update with the next step's forward (otherwise serial after backward).
    pub overlap_optimizer: bool,
    /// Optimizer threads.
    pub threads: usize,
}

/// HF's `get_{constant,cosine}_schedule_with_warmup`, as a function of completed steps.
pub fn lr_at(opts: &TrainOptions, completed: u64) -> f64 {
    let peak = opts.adamw.lr;
    if completed < opts.warmup_steps {
        return peak * completed as f64 / opts.warmup_steps.max(1) as f64;
    }
    match opts.schedule {
        LrSchedule::Constant => peak,
        LrSchedule::Cosine => {
            let span = opts.total_steps.saturating_sub(opts.warmup_steps).max(1) as f64;
            let progress = (completed - opts.warmup_steps) as f64 / span;
            peak * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
        }
    }
}

/// What one step did (one line of metrics.jsonl).
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    /// 1-based step.
    pub step: u64,
    /// Mean loss over the step's loss tokens.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Real (non-padding) input tokens.
    pub tokens: usize,
    /// Tokens that contributed to the loss.
    pub loss_tokens: usize,
    /// Wall time of the step (forward + backward + optimizer if serial).
    pub step_seconds: f64,
    /// Whether the update was skipped (non-finite norm).
    pub skipped: bool,
    /// The predicted device peak of the step (lt-sched's memory model; not a measurement).
    pub peak_device_bytes: u64,
    /// Measured per-stream timing (busy, exposed).
    pub timing: StepTiming,
}

/// A trainer over a shared host model.
pub struct Trainer<B: AutodiffBackend> {
    /// fp32 masters.
    pub model: Arc<SharedModel>,
    /// Gradient buffers.
    pub grads: Arc<HostGrads>,
    /// The executor.
    pub executor: Executor<B>,
    optim: Arc<Mutex<AdamW>>,
    pool: Arc<ThreadPool>,
    opts: TrainOptions,
    completed: u64,
    pending: Option<JoinHandle<Result<(), lt_optim::OptimError>>>,
}

fn group_names(model: &SharedModel) -> Vec<(String, Vec<(String, usize)>)> {
    let cfg = &model.config;
    let mut out = vec![(
        "head".to_string(),
        cfg.outer_params().into_iter().map(|p| (p.name.clone(), p.numel())).collect::<Vec<_>>(),
    )];
    for i in 0..cfg.num_layers() {
        out.push((
            format!("layers.{i}"),
            cfg.layer_params(i).into_iter().map(|p| (p.name.clone(), p.numel())).collect(),
        ));
    }
    out
}

impl<B: AutodiffBackend> Trainer<B> {
    /// A trainer at step `completed` (0 for a fresh run). `optim` is a restored optimizer, or `None`
    /// for zero state.
    pub fn new(
        model: Arc<SharedModel>,
        executor: Executor<B>,
        opts: TrainOptions,
        optim: Option<AdamW>,
        completed: u64,
    ) -> Result<Self, ExecError> {
        let optim = match optim {
            Some(o) => o,
            None => {
                let mut o = AdamW::new(opts.adamw, opts.optimizer).map_err(ExecError::Optim)?;
                for (name, tensors) in group_names(&model) {
                    let refs: Vec<(&str, usize)> = tensors.iter().map(|(n, k)| (n.as_str(), *k)).collect();
                    o.add_group(&name, &refs).map_err(ExecError::Optim)?;
                }
                o
            }
        };
        let pool = ThreadPool::new(opts.threads.max(1)).map_err(ExecError::Optim)?;
        // A bf16 device uploads the bf16 copy that the optimizer keeps with the masters: made here,
        // once, from the masters as loaded or resumed.
        if executor.wants_upload_copies() && !model.has_upload_copies() {
            model.fill_upload_copies(&pool).map_err(ExecError::Optim)?;
        }
        // Shapes only: a snapshot would copy every master weight (4 bytes/param) just to size them.
        let grads = Arc::new(HostGrads::zeros_like_shared(&model, executor.lands_bf16_gradients()));
        Ok(Self {
            model,
            grads,
            executor,
            optim: Arc::new(Mutex::new(optim)),
            pool: Arc::new(pool),
            opts,
            completed,
            pending: None,
        })
    }

    /// The host bytes this trainer keeps for the parameters, by kind: what lt-sched's
    /// `host_param_bytes` predicts (a test holds the two together).
    pub fn host_bytes(&self) -> HostBytes {
        HostBytes {
            masters: self.model.master_bytes(),
            grads: self.grads.bytes(),
            optimizer_state: self.optimizer().state_bytes() as u64,
            upload_copies: self.model.upload_copy_bytes(),
        }
    }

    /// Completed steps.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// The trace.
    pub fn trace(&self) -> &Arc<Trace> {
        self.executor.trace()
    }

    /// Wait for the in-flight optimizer update (before checkpointing, exporting or evaluating).
    pub fn flush(&mut self) -> Result<(), ExecError> {
        if let Some(h) = self.pending.take() {
            h.join().map_err(|_| ExecError::Worker("optimizer"))?.map_err(ExecError::OptimizerFailed)?;
        }
        Ok(())
    }

    /// End training and keep only the masters: gradients, optimizer state, upload copies and the
    /// executor are freed first, and the masters are moved out rather than copied when nothing else
    /// holds the model (a [`SharedModel::snapshot`] would add 4 B/param to the run's peak at its end).
    pub fn into_host(mut self) -> Result<HostModel, ExecError> {
        self.flush()?;
        let model = Arc::clone(&self.model);
        drop(self);
        Ok(match Arc::try_unwrap(model) {
            Ok(m) => m.into_host(),
            Err(shared) => shared.snapshot(),
        })
    }

    /// The optimizer (flush first for a consistent view).
    pub fn optimizer(&self) -> std::sync::MutexGuard<'_, AdamW> {
        self.optim.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One training step over `micro_batches` (gradient accumulation); the loss is the mean over
    /// all their loss tokens, as if they were one batch.
    pub fn step(&mut self, micro_batches: &[Batch]) -> Result<StepMetrics, ExecError> {
        let step = self.completed + 1;
        self.executor.set_step(step);
        let started = Instant::now();
        let denom: usize = micro_batches.iter().map(Batch::loss_tokens).sum();
        let tokens: usize = micro_batches.iter().map(|b| b.input_ids.iter().map(Vec::len).sum::<usize>()).sum();
        let mut loss = 0.0;
        let mut sq = 0.0;
        let mut peak = 0;
        for (k, mb) in micro_batches.iter().enumerate() {
            let last = k + 1 == micro_batches.len();
            let r = self.executor.micro_batch(&self.model, mb, denom, last, &self.grads, self.completed)?;
            loss += r.loss;
            peak = peak.max(r.peak_device_bytes);
            if let Some(s) = r.grad_sq_sum {
                sq = s;
            }
        }
        // Every layer was uploaded at the version `completed`, so the previous update is done.
        self.flush()?;
        let grad_norm = sq.sqrt();
        let lr = lr_at(&self.opts, self.completed);
        let outcome = {
            let mut o = self.optimizer();
            o.set_lr(lr).map_err(ExecError::Optim)?;
            o.begin_step(grad_norm)
        };
        let (model, grads, optim, pool, trace) = (
            Arc::clone(&self.model),
            Arc::clone(&self.grads),
            Arc::clone(&self.optim),
            Arc::clone(&self.pool),
            Arc::clone(self.trace()),
        );
        let handle = std::thread::spawn(move || apply_update(&model, &grads, &optim, &pool, &trace, outcome, step));
        self.pending = Some(handle);
        if !self.opts.overlap_optimizer {
            let trace = Arc::clone(self.trace());
            trace.wait(Stream::Optimizer, step, "serial optimizer", || self.flush())?;
        }
        self.completed = step;
        let timing = self.trace().summary(step);
        Ok(StepMetrics {
            step,
            loss,
            grad_norm,
            lr,
            tokens,
            loss_tokens: denom,
            step_seconds: started.elapsed().as_secs_f64(),
            skipped: matches!(outcome, StepOutcome::Skipped { .. }),
            peak_device_bytes: peak,
            timing,
        })
    }
}

impl<B: AutodiffBackend> Drop for Trainer<B> {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// Update head then layers in forward order, zero each gradient after use, and publish versions.
fn apply_update(
    model: &SharedModel,
    grads: &HostGrads,
    optim: &Mutex<AdamW>,
    pool: &ThreadPool,
    trace: &Trace,
    outcome: StepOutcome,
    version: u64,
) -> Result<(), lt_optim::OptimError> {
    let mut o = optim.lock().unwrap_or_else(|e| e.into_inner());
    let groups = o.groups_mut();
    let mut result = Ok(());
    // Head group (index 0).
    trace.span(Stream::Optimizer, version, "update head", || {
        let mut h = model.head.write().unwrap_or_else(|e| e.into_inner());
        let mut g = grads.head();
        if let StepOutcome::Apply(ctx) = &outcome {
            let h = &mut *h;
            let mut params: Vec<&mut [f32]> = vec![&mut h.embed_tokens.data, &mut h.norm.data];
            if let Some(l) = &mut h.lm_head {
                params.push(&mut l.data);
            }
            let mut gs: Vec<Grad<'_>> = vec![Grad::F32(&g.embed_tokens), Grad::F32(&g.norm)];
            if let Some(l) = &g.lm_head {
                gs.push(Grad::F32(l));
            }
            if let Err(e) = update(model, &mut groups[0], &mut params, &mut model.copy_slot(HEAD), &gs, ctx, pool) {
                result = Err(e);
            }
        }
        g.embed_tokens.fill(0.0);
        g.norm.fill(0.0);
        if let Some(l) = &mut g.lm_head {
            l.fill(0.0);
        }
    });
    model.set_version(HEAD, version);
    for i in 0..model.layers.len() {
        trace.span(Stream::Optimizer, version, format!("update L{i}"), || {
            let mut l = model.layers[i].write().unwrap_or_else(|e| e.into_inner());
            let mut g = grads.layer(i);
            if let StepOutcome::Apply(ctx) = &outcome
                && result.is_ok()
            {
                let mut params: Vec<&mut [f32]> = l.tensors.iter_mut().map(|t| t.data.as_mut_slice()).collect();
                let gs: Vec<Grad<'_>> = g.iter_mut().map(|x| x.grad()).collect();
                let mut copy = model.copy_slot(layer_slot(i));
                if let Err(e) = update(model, &mut groups[i + 1], &mut params, &mut copy, &gs, ctx, pool) {
                    result = Err(e);
                }
            }
            for p in g.iter_mut() {
                p.zero();
            }
        });
        model.set_version(layer_slot(i), version);
    }
    result
}

/// One group's update, writing its bf16 upload copy in the same pass when it has one.
///
/// An upload still holding a copy gets to keep it: `Arc::make_mut` then gives the optimizer a fresh
/// buffer to write. By the step's order that does not happen (a layer is updated only after its
/// backward, which consumed its last upload), so each one is counted
/// ([`SharedModel::upload_copy_clones`]).
fn update(
    model: &SharedModel,
    group: &mut lt_optim::ParamGroup,
    params: &mut [&mut [f32]],
    copy: &mut Option<crate::state::UploadCopy>,
    grads: &[Grad<'_>],
    ctx: &lt_optim::StepCtx,
    pool: &ThreadPool,
) -> Result<(), lt_optim::OptimError> {
    let Some(copy) = copy.as_mut() else { return group.update(params, grads, ctx, pool) };
    let mut copies: Vec<Option<&mut [lt_optim::bf16]>> = copy
        .iter_mut()
        .map(|c| {
            c.as_mut().map(|c| {
                if std::sync::Arc::get_mut(c).is_none() {
                    model.count_copy_clone();
                }
                std::sync::Arc::make_mut(c).as_mut_slice()
            })
        })
        .collect();
    group.update_with_copies(params, &mut copies, grads, ctx, pool)
}
