//! [`Run`]: one training run, from data to exported model.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::tensor::backend::{AutodiffBackend, Backend};
use lt_data::{
    Accuracy, BatchMode, Batcher, BatcherConfig, BatcherState, ChatEncoder, EvalExample, Prepared, TokenizedDataset,
};
use lt_exec::persist;
use lt_exec::state::SharedModel;
use lt_exec::train::{StepMetrics, TrainOptions, Trainer};
use lt_model::host::HostModel;
use lt_model::stream::{ForwardWeights, Streamed};
use lt_storage::checkpoint::{CheckpointStore, Retention, Verify};
use lt_storage::export::ExportDtype;
use serde::Serialize;

use crate::checkpointing::{AutoInterval, SaveSchedule, human_seconds};
use crate::config::{RunConfig, RunSettings, SaveEvery};
use crate::data::{Inputs, to_micro_batches};
use crate::device::DeviceChoice;
use crate::observe::{Event, MetricsFile, Observer, Pictures};
use crate::plan::{ChosenPlan, choose_plan, executor_for};

/// What a finished run did and wrote.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Optimizer steps completed (a resumed run counts the steps before it too).
    pub steps: u64,
    /// Wall time of this process's run, seconds.
    pub seconds: f64,
    /// `(step, loss)` of every step this process trained.
    pub losses: Vec<(u64, f64)>,
    /// The last step's figures (measured exposed transfer time; the predicted device peak, ...).
    pub last_step: Option<StepMetrics>,
    /// The planner's predicted step time, seconds, when a plan was solved or loaded.
    pub predicted_step_seconds: Option<f64>,
    /// The final held-out exact match, when there is a held-out split.
    pub exact_match: Option<Accuracy>,
    /// The output folder.
    pub out: PathBuf,
    /// The exported model (safetensors, config.json, tokenizer).
    pub model_dir: PathBuf,
    /// The metrics file (written by the default `MetricsFile` observer; absent after
    /// `without_default_outputs()` unless an observer of yours writes it).
    pub metrics: PathBuf,
    /// The Chrome trace of the last step.
    pub trace: PathBuf,
    /// Other files the observers wrote (the pictures).
    pub files: Vec<PathBuf>,
}

/// Builds a [`Run`] from a [`RunConfig`]: `Run::builder(config).observer(o).build()?`.
pub struct RunBuilder {
    config: RunConfig,
    observers: Vec<Box<dyn Observer>>,
    default_outputs: bool,
}

impl RunBuilder {
    /// Add an observer; observers see every event in the order they were added, after the
    /// built-in metrics file and pictures.
    #[must_use]
    pub fn observer(mut self, observer: impl Observer + 'static) -> Self {
        self.observers.push(Box::new(observer));
        self
    }

    /// Leave out the built-in `metrics.jsonl` and pictures observers.
    #[must_use]
    pub fn without_default_outputs(mut self) -> Self {
        self.default_outputs = false;
        self
    }

    /// Validate the config and fill its defaults; nothing is loaded yet.
    pub fn build(self) -> Result<Run> {
        let settings = RunSettings::resolve(&self.config)?;
        let mut observers: Vec<Box<dyn Observer>> = Vec::new();
        if self.default_outputs {
            observers.push(Box::new(MetricsFile::new(&settings.metrics)));
            observers.push(Box::new(Pictures::new(
                &settings.out,
                &settings.metrics,
                &settings.hw.spec(lt_core::hardware::BuiltinProfile::Cpu).to_string(),
            )));
        }
        observers.extend(self.observers);
        Ok(Run { settings, observers: Observers(observers) })
    }
}

/// One training run: data -> plan -> streamed execution -> evaluation -> export.
///
/// ```no_run
/// use lt_run::{Run, RunConfig};
///
/// // The built-in demo (no model, no data), 20 steps, into a folder of its own.
/// let report = Run::builder(RunConfig::default().steps(20).out("runs/demo")).build()?.execute()?;
/// println!("loss {:?} -> {:?}", report.losses.first(), report.losses.last());
/// # Ok::<(), anyhow::Error>(())
/// ```
pub struct Run {
    settings: RunSettings,
    observers: Observers,
}

impl Run {
    /// Start building a run from `config`.
    pub fn builder(config: RunConfig) -> RunBuilder {
        RunBuilder { config, observers: Vec::new(), default_outputs: true }
    }

    /// The validated settings the run will use.
    pub fn settings(&self) -> &RunSettings {
        &self.settings
    }

    /// Run on the device the settings name.
    pub fn execute(self) -> Result<RunReport> {
        match self.settings.device {
            DeviceChoice::Cpu => self.execute_on::<lt_model::CpuAutodiff>(Default::default()),
            #[cfg(feature = "cuda")]
            DeviceChoice::Cuda => {
                let device = crate::device::cuda()?;
                self.execute_on::<lt_model::CudaAutodiff>(device)
            }
            #[cfg(feature = "wgpu")]
            DeviceChoice::Wgpu => {
                let device = crate::device::wgpu()?;
                self.execute_on::<lt_model::WgpuAutodiff>(device)
            }
            #[allow(unreachable_patterns)]
            d => Err(crate::device::not_built(d)),
        }
    }

    /// Run on backend `B`'s `device`.
    pub fn execute_on<B: AutodiffBackend>(
        mut self,
        device: <B::InnerBackend as burn::tensor::backend::BackendTypes>::Device,
    ) -> Result<RunReport> {
        let started = Instant::now();
        let s = &self.settings;
        let obs = &mut self.observers;
        std::fs::create_dir_all(&s.out)
            .with_context(|| format!("{}: cannot create the output folder", s.out.display()))?;
        let inputs = crate::data::load(s)?;
        obs.emit(&Event::Data { summary: &inputs.prepared.report.summary() })?;
        obs.emit(&Event::Note(&s.optimizer_line()))?;
        anyhow::ensure!(!inputs.prepared.train.is_empty(), "no training examples left after preparing the data");
        crate::data::write_demo_eval_set(s, &inputs, &s.out.join("eval.json"))?;
        let cfg = inputs.host.config.clone();
        let chosen = choose_plan(s, &cfg)?;
        obs.emit(&Event::Planned { plan: &chosen })?;
        let (executor, note) = executor_for::<B>(&chosen, &cfg, s.seq_len, device.clone(), &s.spill_dir)?;
        if let Some(note) = note {
            obs.emit(&Event::Note(&note))?;
        }
        let Inputs { host, encoder, source_dir, config_json, demo_tokenizer, prepared, .. } = inputs;
        let resumed = resume(s, host, obs)?;
        let Prepared { train, eval, eval_examples, .. } = prepared;
        let batcher = batcher(s, &encoder, train, resumed.batcher)?;
        let model = Arc::new(SharedModel::new(resumed.host, resumed.completed));
        let trainer = Trainer::new(model, executor, train_options(s, &chosen), resumed.optim, resumed.completed)?;
        let (checkpoint_bytes, master_bytes) = {
            let o = trainer.optimizer();
            (persist::checkpoint_bytes(&o), 4 * o.numel() as u64)
        };
        check_disk(s, &resumed.store, checkpoint_bytes, master_bytes, resumed.completed)?;
        let mut steps = Steps {
            s,
            chosen: &chosen,
            store: &resumed.store,
            trainer,
            batcher,
            losses: Vec::new(),
            schedule: SaveSchedule::new(s.save_every),
            checkpoint_bytes,
            device: &device,
        };
        let eval = Evaluator::new(s, &encoder, &eval, &eval_examples);
        let last = steps.train(obs, &eval)?;
        steps.save(obs)?;
        let Steps { trainer, losses, .. } = steps;
        let last_step = trainer.completed();
        let trace = Arc::clone(trainer.trace());
        // The masters alone from here: gradients, optimizer state and the executor are freed, and
        // the masters are moved out rather than copied (a copy would raise the run's peak at its end).
        let snap = trainer.into_host()?;
        let model_dir = s.out.join("model");
        persist::export_model(&snap, &model_dir, source_dir.as_deref(), config_json, ExportDtype::F32)?;
        if let Some(files) = &demo_tokenizer {
            files.write_to(&model_dir)?;
        }
        let trace_path = s.out.join("trace.json");
        crate::fsutil::write_atomic(
            &trace_path,
            trace.chrome_json(last_step.saturating_sub(1)..=last_step).as_bytes(),
        )?;
        // `snap` holds the weights the final save wrote: score them.
        let exact_match = eval.final_scores::<B::InnerBackend>(&snap, &device, last_step, obs)?;
        let mut report = RunReport {
            steps: last_step,
            seconds: started.elapsed().as_secs_f64(),
            losses,
            last_step: last,
            predicted_step_seconds: chosen.predicted_step_seconds,
            exact_match,
            out: s.out.clone(),
            model_dir,
            metrics: s.metrics.clone(),
            trace: trace_path,
            files: Vec::new(),
        };
        obs.emit(&Event::Finished { report: &report, trace: &trace, plan: &chosen })?;
        report.files = obs.0.iter().flat_map(|o| o.files()).filter(|p| *p != report.metrics).collect();
        Ok(report)
    }
}

/// The observers of a run, in order.
struct Observers(Vec<Box<dyn Observer>>);

impl Observers {
    fn emit(&mut self, event: &Event<'_>) -> Result<()> {
        self.0.iter_mut().try_for_each(|o| o.event(event))
    }
}

/// Where training starts: a fresh model, or the newest valid checkpoint when resuming.
struct Resumed {
    store: CheckpointStore,
    host: HostModel,
    optim: Option<lt_optim::AdamW>,
    completed: u64,
    batcher: Option<BatcherState>,
}

fn resume(s: &RunSettings, mut host: HostModel, obs: &mut Observers) -> Result<Resumed> {
    let store = CheckpointStore::new(
        s.out.join("checkpoints"),
        Retention::KeepLast(s.keep_checkpoints.try_into().unwrap_or(std::num::NonZeroUsize::MIN)),
    );
    let (mut optim, mut completed, mut batcher) = (None, 0u64, None);
    // A run killed before its first save has no checkpoint folder yet: that is "no checkpoint".
    let found = if s.resume && store.root().exists() { Some(store.find_latest(Verify::Full)?) } else { None };
    for sk in found.iter().flat_map(|f| &f.skipped) {
        obs.emit(&Event::Warning(&format!("skipping checkpoint {}: {}", sk.path.display(), sk.error)))?;
    }
    match found.and_then(|f| f.checkpoint) {
        Some(ck) => {
            let opt = persist::load_checkpoint(&ck, &mut host)?;
            // The state decides: its moments are in the checkpoint's format.
            if opt.kind().name() != s.optimizer.name() {
                obs.emit(&Event::Warning(&format!(
                    "{}: the checkpoint's optimizer state is {}; training continues with it, not with {}",
                    ck.path().display(),
                    opt.kind().name(),
                    s.optimizer.name()
                )))?;
            }
            optim = Some(opt);
            completed = ck.step();
            batcher = ck.meta().get("batcher").cloned().map(serde_json::from_value).transpose()?;
            obs.emit(&Event::Note(&format!("resumed from {} (step {completed})", ck.path().display())))?;
        }
        None if s.resume => obs.emit(&Event::Note(&format!(
            "--resume: no checkpoint in {}; starting from step 0",
            store.root().display()
        )))?,
        None => {}
    }
    obs.emit(&Event::Training { first_step: completed, total_steps: s.steps })?;
    Ok(Resumed { store, host, optim, completed, batcher })
}

fn batcher(
    s: &RunSettings,
    encoder: &ChatEncoder,
    train: lt_data::TokenizedDataset,
    state: Option<BatcherState>,
) -> Result<Batcher> {
    let bcfg = BatcherConfig {
        batch_size: s.batch_size,
        seq_len: s.seq_len,
        mode: if s.packing { BatchMode::Pack } else { BatchMode::PadMax },
        seed: s.seed,
        shuffle: s.shuffle,
        pad_id: encoder.tokenizer().pad_id().unwrap_or(0),
    };
    let train = Arc::new(train);
    Ok(match state {
        Some(st) => Batcher::restore(train, bcfg, st)?,
        None => Batcher::new(train, bcfg)?,
    })
}

fn train_options(s: &RunSettings, chosen: &ChosenPlan) -> TrainOptions {
    TrainOptions {
        adamw: s.adamw,
        optimizer: s.optimizer.kind(),
        warmup_steps: s.warmup_steps,
        schedule: s.schedule,
        total_steps: s.steps,
        overlap_optimizer: chosen.overlap_optimizer(),
        threads: s.threads,
    }
}

/// The training loop's state.
struct Steps<'a, B: AutodiffBackend> {
    s: &'a RunSettings,
    chosen: &'a ChosenPlan,
    store: &'a CheckpointStore,
    trainer: Trainer<B>,
    batcher: Batcher,
    losses: Vec<(u64, f64)>,
    schedule: SaveSchedule,
    /// About what one checkpoint writes (for the progress line while saving).
    checkpoint_bytes: u64,
    /// The training device, where evaluations run.
    device: &'a <B::InnerBackend as burn::tensor::backend::BackendTypes>::Device,
}

impl<B: AutodiffBackend> Steps<'_, B> {
    /// Train to the last step, saving and evaluating on the way; returns the last step's metrics.
    fn train(&mut self, obs: &mut Observers, eval: &Evaluator<'_>) -> Result<Option<StepMetrics>> {
        let s = self.s;
        let mut last = None;
        let mut tokens_done = 0usize;
        let loop_start = Instant::now();
        while self.trainer.completed() < s.steps {
            let batch = self.batcher.next_batch();
            let m = self.trainer.step(&to_micro_batches(&batch, self.chosen.micro_batch_size()))?;
            tokens_done += m.tokens;
            self.losses.push((m.step, m.loss));
            let tokens_per_second = tokens_done as f64 / loop_start.elapsed().as_secs_f64().max(1e-9);
            obs.emit(&Event::Step { metrics: &m, epoch: self.batcher.epoch(), tokens_per_second })?;
            let before_end = m.step < s.steps;
            if self.schedule.step_done(m.step, m.step_seconds) && before_end {
                let seconds = self.save(obs)?;
                if let Some(a) = self.schedule.saved(seconds) {
                    obs.emit(&Event::Note(&auto_save_line(&a)))?;
                }
            }
            let loss_now = eval.loss_wanted() && m.step % s.eval_loss_every == 0 && before_end;
            let em_now = eval.em_wanted() && s.eval_every > 0 && m.step % s.eval_every == 0 && before_end;
            if loss_now || em_now {
                self.trainer.flush()?;
                // Streamed from the masters onto the training device, one layer at a time: no copy
                // of the model, on host or device.
                let mut dm = Streamed::<B::InnerBackend, SharedModel>::new(&self.trainer.model, self.device);
                if loss_now && let Some(loss) = eval.loss(&mut dm)? {
                    obs.emit(&Event::EvalLoss { step: m.step, loss })?;
                }
                if em_now {
                    let acc = eval.exact_match(&mut dm, "eval", obs)?;
                    obs.emit(&Event::ExactMatch { step: m.step, accuracy: &acc, is_final: false })?;
                }
            }
            last = Some(m);
        }
        Ok(last)
    }

    /// A checkpoint of the current step: weights, optimizer state, data position, plan and settings.
    /// Returns the seconds it took, the wait for the overlapped optimizer included.
    fn save(&mut self, obs: &mut Observers) -> Result<f64> {
        obs.emit(&Event::Saving { step: self.trainer.completed(), bytes: self.checkpoint_bytes })?;
        let started = Instant::now();
        self.trainer.flush()?;
        let meta =
            serde_json::json!({"batcher": self.batcher.state(), "plan": self.chosen.plan_json, "settings": self.s});
        let c = persist::save_shared_checkpoint(
            self.store,
            self.trainer.completed(),
            &self.trainer.model,
            &self.trainer.optimizer(),
            meta,
        )?;
        let seconds = started.elapsed().as_secs_f64();
        for e in &c.prune_errors {
            obs.emit(&Event::Warning(&format!("pruning old checkpoints: {e}")))?;
        }
        let bytes = crate::fsutil::dir_bytes(&c.path);
        obs.emit(&Event::Saved { step: self.trainer.completed(), seconds, bytes })?;
        Ok(seconds)
    }
}

/// Fail before training when the output folder's file system cannot take what the run will write:
/// the checkpoints at their peak (`--keep-checkpoints` kept plus the one being written, when the run
/// saves before its end; only the final one otherwise) of `checkpoint` bytes each, less what its
/// existing checkpoints already hold, plus the fp32 export (`masters` bytes). A full disk found hours
/// into a run would cost that run. `LT_DISK_CHECK=off` skips the check (compressing file systems
/// hold more than this counts).
fn check_disk(s: &RunSettings, store: &CheckpointStore, checkpoint: u64, masters: u64, completed: u64) -> Result<()> {
    if std::env::var("LT_DISK_CHECK").is_ok_and(|v| v == "off") {
        return Ok(());
    }
    let saves_before_end = s.save_every != SaveEvery::Steps(0) && s.steps.saturating_sub(completed) > 1;
    let copies = if saves_before_end { s.keep_checkpoints as u64 + 1 } else { 1 };
    // A fresh run has no checkpoint folder yet: nothing held.
    let held: u64 = store.list().unwrap_or_default().iter().map(|(_, dir)| crate::fsutil::dir_bytes(dir)).sum();
    let need = copies.saturating_mul(checkpoint).saturating_sub(held).max(checkpoint).saturating_add(masters);
    let free = lt_storage::disk::available_bytes(store.root())?;
    if free < need {
        let gb = |b: u64| lt_core::ByteSize(b).to_string();
        let kept =
            if copies > 1 { format!(" ({} kept + the one being written)", s.keep_checkpoints) } else { String::new() };
        anyhow::bail!(
            "{}: the run needs up to {} of disk and {} is free: {copies} checkpoint(s) of {}{kept}{} and the exported \
             model ({}); use --keep-checkpoints 1, --save-every 0 (only the final checkpoint), another --out, or \
             LT_DISK_CHECK=off to start anyway",
            s.out.display(),
            gb(need),
            gb(free),
            gb(checkpoint),
            if held > 0 { format!(", less the {} its checkpoints already hold", gb(held)) } else { String::new() },
            gb(masters)
        );
    }
    Ok(())
}

/// The line `--save-every auto` prints when it sets or changes its interval.
fn auto_save_line(a: &AutoInterval) -> String {
    let cost = format!(
        "checkpoints (--save-every auto): a save takes {:.3} s against {:.3} s per step",
        a.save_seconds, a.step_seconds
    );
    match a.every {
        1 => format!(
            "{cost}: saving after every step ({:.1}% of the time); a kill -9 loses at most the step in progress",
            100.0 * a.overhead()
        ),
        n => format!(
            "{cost}: saving every {n} steps ({:.1}% of the time); a kill -9 loses at most {n} steps, about {} of \
             training (--save-every 1 saves every step)",
            100.0 * a.overhead(),
            human_seconds(n as f64 * a.step_seconds)
        ),
    }
}

/// Most logits the held-out loss makes at once (2^28 values: 1 GiB in f32).
const LOGITS_CAP: usize = 1 << 28;

/// Held-out scoring on the training device, the layers streamed from host memory.
struct Evaluator<'a> {
    s: &'a RunSettings,
    encoder: &'a ChatEncoder,
    examples: &'a [EvalExample],
    /// A fixed subset for the held-out loss: each example its own row, with its labels.
    loss_rows: Vec<(Vec<u32>, Vec<i64>)>,
}

impl<'a> Evaluator<'a> {
    fn new(s: &'a RunSettings, encoder: &'a ChatEncoder, eval: &TokenizedDataset, examples: &'a [EvalExample]) -> Self {
        let loss_rows = (0..eval.len().min(128))
            .filter_map(|i| {
                let ids = eval.ids(i)?.to_vec();
                let mut labels = Vec::new();
                eval.extend_labels(i, &mut labels);
                Some((ids, labels))
            })
            .collect();
        Self { s, encoder, examples, loss_rows }
    }

    fn loss_wanted(&self) -> bool {
        self.s.eval_loss_every > 0 && !self.loss_rows.is_empty()
    }

    fn em_wanted(&self) -> bool {
        !self.examples.is_empty()
    }

    /// Greedy generation on every held-out question, scored by exact match.
    fn exact_match<B: Backend, W: ForwardWeights<B>>(
        &self,
        dm: &mut W,
        label: &str,
        obs: &mut Observers,
    ) -> Result<Accuracy> {
        let examples = self.examples;
        obs.emit(&Event::EvalStarted { label, total: examples.len() })?;
        let tok = self.encoder.tokenizer();
        let stop = self.encoder.stop_token_id();
        let (acc, _) = crate::evaluate::evaluate(
            dm,
            tok,
            stop,
            examples,
            self.s.max_new_tokens,
            self.s.eval_batch_size,
            |done| {
                // Progress only: an observer failing to draw a bar does not stop the evaluation.
                let _ = obs.emit(&Event::EvalProgress { done });
            },
        )?;
        Ok(acc)
    }

    /// The mean held-out token loss: each example its own right-padded row (causal attention never
    /// sees the padding), averaged over the shifted non-ignored tokens as in training. The layers run
    /// on 32 rows at a time; the head on as many rows as keep their logits within [`LOGITS_CAP`]
    /// values (152K-token vocabularies make `[32, 1024, vocab]` 20 GB in f32).
    fn loss<B: Backend, W: ForwardWeights<B>>(&self, dm: &mut W) -> Result<Option<f64>> {
        let (mut sum, mut count) = (0.0f64, 0usize);
        let pad = self.encoder.tokenizer().pad_id().unwrap_or(0);
        let vocab = dm.config().vocab_size;
        for rows in self.loss_rows.chunks(32) {
            let len = rows.iter().map(|(ids, _)| ids.len()).max().unwrap_or(0);
            let ids: Vec<Vec<u32>> = rows.iter().map(|(ids, _)| padded(ids, len, pad)).collect();
            let labels: Vec<Vec<i64>> = rows.iter().map(|(_, l)| padded(l, len, lt_data::IGNORE_INDEX)).collect();
            if lt_model::model::loss_token_count(&labels) == 0 {
                continue;
            }
            let x = lt_model::stream::hidden_states_with(dm, &ids);
            let per_head = (LOGITS_CAP / (len * vocab).max(1)).clamp(1, rows.len());
            for (k, labels) in labels.chunks(per_head).enumerate() {
                let n = lt_model::model::loss_token_count(labels);
                if n == 0 {
                    continue;
                }
                let logits = dm.logits(x.clone().narrow(0, k * per_head, labels.len()));
                let loss = lt_model::model::to_vec(lt_model::model::causal_lm_loss(logits, labels));
                sum += f64::from(loss.first().copied().unwrap_or(f32::NAN)) * n as f64;
                count += n;
            }
        }
        Ok((count > 0).then(|| sum / count as f64))
    }

    /// The end-of-run held-out loss and exact match of `snap`, streamed onto `device`.
    fn final_scores<B: Backend>(
        &self,
        snap: &HostModel,
        device: &B::Device,
        step: u64,
        obs: &mut Observers,
    ) -> Result<Option<Accuracy>> {
        if !self.loss_wanted() && !self.em_wanted() {
            return Ok(None);
        }
        let mut dm = Streamed::<B, HostModel>::new(snap, device);
        if self.loss_wanted()
            && let Some(loss) = self.loss(&mut dm)?
        {
            obs.emit(&Event::EvalLoss { step, loss })?;
        }
        if !self.em_wanted() {
            return Ok(None);
        }
        let acc = self.exact_match(&mut dm, "final eval", obs)?;
        obs.emit(&Event::ExactMatch { step, accuracy: &acc, is_final: true })?;
        Ok(Some(acc))
    }
}

fn padded<T: Copy>(v: &[T], len: usize, fill: T) -> Vec<T> {
    let mut out = v.to_vec();
    out.resize(len, fill);
    out
}
