//! `lt selftest`: the device test suite carried inside the binary, so a GPU machine that has only
//! the `lt` binary (no cargo, no Python) can check the backend.
//!
//! For every tiny fixture model (`tools/fixtures/models/*`, from `tools/fixtures/gen_models.py`) the
//! device backend is compared with the CPU ndarray backend (f32, itself checked against transformers
//! in CI): whole-model logits, the loss, and every parameter gradient grouped per layer. Then, for
//! every fixture with a training batch (`tools/fixtures/train/*`), two streamed AdamW steps per policy
//! (keep-all, recompute-all, MegaTrain with two micro-batches, all-NVMe with two micro-batches) are
//! compared with the CPU keep-all run step by step.
//!
//! **Tolerances** (every measured value is printed next to its bound):
//! - `cpu` vs `cpu`: the same kernels on the same data. Logits, loss and gradients must agree to
//!   1e-6 (they are bit-identical in practice); streamed losses to 1e-5 relative, because plans that
//!   recompute or accumulate change the f32 summation order.
//! - `cuda-f32` (burn-cuda in f32) and `wgpu-f32` (burn-wgpu): only summation order differs, so the bars of the transformers
//!   parity tests apply: logits and gradients 1e-3 relative to the tensor's largest entry, loss 1e-5,
//!   streamed losses 1e-4 (the train-parity bar).
//! - `cuda-bf16` (what `lt train --device cuda` runs): weights and activations are rounded to bf16
//!   (8-bit mantissa, relative rounding error 2^-9 ~ 2e-3 per operation) and errors compound over a
//!   few dozen operations per layer. Logits 5e-2 and gradients 1e-1 relative to the largest entry,
//!   loss 2e-2 relative, streamed losses 3e-2 relative: about 10-25x the single-rounding error,
//!   loose enough for accumulated bf16 noise and tight enough to catch a wrong kernel (a wrong
//!   result is off by O(1)).
//!
//! Prints a table (stderr with `--json`, stdout otherwise) and, with `--json`, one JSON object
//! `{"passed": bool, "checks": [...]}` as the last stdout line. Exits 1 when a check fails.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::{AutodiffBackend, BackendTypes};
use lt_core::ByteSize;
use lt_exec::executor::{ActivationSpill, Executor};
use lt_exec::plan::{Placement, Step};
use lt_exec::state::SharedModel;
use lt_exec::train::{LrSchedule, TrainOptions, Trainer};
use lt_model::host::HostModel;
use lt_model::model::{Batch, forward_logits, full_graph_grads, to_vec};
use lt_model::weights::DeviceModel;
use lt_optim::{AdamWConfig, OptimizerKind};

use crate::failure::{Failure, catch_panics};
use lt_run::DeviceChoice;

/// Arguments of `lt selftest`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Examples:\n  lt selftest --device cuda\n  lt selftest --device cpu --json --fixtures tools/fixtures"
)]
pub struct SelftestArgs {
    /// Backend under test: `cuda` (bf16, and f32 unless --no-f32), `wgpu` (f32), or `cpu`, which
    /// compares ndarray with itself (proves the harness runs anywhere).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceChoice,
    /// The fixtures folder (holding `models/` and `train/`).
    #[arg(long, value_name = "DIR", default_value = "tools/fixtures")]
    pub fixtures: PathBuf,
    /// Streamed training steps per policy.
    #[arg(long, default_value_t = 2)]
    pub train_steps: usize,
    /// Run only these fixture models (repeatable; names of folders under FIXTURES/models) [default: all].
    #[arg(long, value_name = "NAME")]
    pub only: Vec<String>,
    /// On --device cuda, skip the f32 CUDA backend and test only bf16 (what `lt train` runs).
    #[arg(long)]
    pub no_f32: bool,
    /// Print one JSON object {"passed", "checks"} as the last stdout line (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
}

/// Tolerances of one backend (see the module docs for why).
#[derive(Debug, Clone, Copy)]
struct Tol {
    logits: f64,
    loss: f64,
    grads: f64,
    train_loss: f64,
}

const TOL_CPU: Tol = Tol { logits: 1e-6, loss: 1e-6, grads: 1e-6, train_loss: 1e-5 };
#[cfg(any(feature = "cuda", feature = "wgpu"))]
const TOL_F32: Tol = Tol { logits: 1e-3, loss: 1e-5, grads: 1e-3, train_loss: 1e-4 };
#[cfg(feature = "cuda")]
const TOL_BF16: Tol = Tol { logits: 5e-2, loss: 2e-2, grads: 1e-1, train_loss: 3e-2 };

/// One comparison.
#[derive(Debug, Clone, serde::Serialize)]
struct Check {
    /// `fixture/what`.
    check: String,
    /// Backend under test.
    backend: String,
    /// How `value` is computed.
    metric: &'static str,
    /// The measured difference.
    value: f64,
    /// Its bound.
    tolerance: f64,
    /// `value <= tolerance` (and finite).
    passed: bool,
    /// Why a check could not run, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl Check {
    /// `ERROR` (it could not be computed), `ok` or `FAIL`.
    fn verdict(&self) -> &'static str {
        match (&self.error, self.passed) {
            (Some(_), _) => "ERROR",
            (None, true) => "ok",
            (None, false) => "FAIL",
        }
    }

    fn new(check: String, backend: &str, metric: &'static str, value: f64, tolerance: f64) -> Self {
        Self {
            check,
            backend: backend.into(),
            metric,
            value,
            tolerance,
            passed: value.is_finite() && value <= tolerance,
            error: None,
        }
    }

    fn failed(check: String, backend: &str, error: String) -> Self {
        Self {
            check,
            backend: backend.into(),
            metric: "error",
            value: f64::NAN,
            tolerance: 0.0,
            passed: false,
            error: Some(error),
        }
    }
}

/// `max |a - b| / max |want|` (so near-zero entries do not dominate), NaN on a length mismatch.
fn rel_to_max(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
    let scale = want.iter().map(|x| f64::from(x.abs())).fold(0.0, f64::max).max(1e-12);
    let diff = got.iter().zip(want).map(|(a, b)| f64::from((a - b).abs())).fold(0.0, nan_max);
    diff / scale
}

/// `max` that keeps a NaN (a NaN difference is a failure, never ignored).
fn nan_max(m: f64, d: f64) -> f64 {
    if m.is_nan() || d.is_nan() { f64::NAN } else { m.max(d) }
}

fn rel(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs().max(1e-12)
}

/// CPU reference of one fixture: logits, loss, named gradients.
struct Reference {
    logits: Vec<f32>,
    loss: f64,
    grads: Vec<(String, Vec<f32>)>,
}

fn reference(host: &HostModel, batch: &Batch) -> Reference {
    let model = DeviceModel::<lt_model::CpuBackend>::from_host(host, &Default::default());
    let logits = to_vec(forward_logits(&model, &batch.input_ids));
    let (loss, grads) = full_graph_grads::<lt_model::CpuAutodiff>(&model, batch);
    Reference { logits, loss: f64::from(loss), grads }
}

/// The group a gradient belongs to: `layers.3` for layer tensors, `head` for the rest.
fn group_of(name: &str) -> String {
    match name.strip_prefix("layers.").and_then(|r| r.split('.').next()) {
        Some(i) => format!("layers.{i}"),
        None => "head".into(),
    }
}

/// Logits, loss and per-layer gradients of `B` against the CPU reference.
fn model_checks<B: AutodiffBackend>(
    fixture: &str,
    backend: &str,
    tol: Tol,
    host: &HostModel,
    batch: &Batch,
    r: &Reference,
    device: &<B::InnerBackend as BackendTypes>::Device,
) -> Vec<Check> {
    let model = DeviceModel::<B::InnerBackend>::from_host(host, device);
    let logits = to_vec(forward_logits(&model, &batch.input_ids));
    let mut out = vec![Check::new(
        format!("{fixture}/logits"),
        backend,
        "max-abs / max|ref|",
        rel_to_max(&logits, &r.logits),
        tol.logits,
    )];
    let (loss, grads) = full_graph_grads::<B>(&model, batch);
    out.push(Check::new(format!("{fixture}/loss"), backend, "relative", rel(f64::from(loss), r.loss), tol.loss));
    let mut groups: Vec<(String, f64)> = Vec::new();
    for (name, want) in &r.grads {
        let got = grads.iter().find(|(n, _)| n == name).map(|(_, g)| g.as_slice());
        let v = got.map_or(f64::NAN, |g| rel_to_max(g, want));
        let g = group_of(name);
        match groups.iter_mut().find(|(n, _)| *n == g) {
            Some((_, w)) => *w = nan_max(*w, v),
            None => groups.push((g, v)),
        }
    }
    for (g, v) in groups {
        out.push(Check::new(format!("{fixture}/grads {g}"), backend, "worst max-abs / max|ref|", v, tol.grads));
    }
    out
}

fn train_options() -> TrainOptions {
    TrainOptions {
        adamw: AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: Some(1.0),
        },
        optimizer: OptimizerKind::AdamW,
        warmup_steps: 0,
        schedule: LrSchedule::Constant,
        total_steps: 4,
        overlap_optimizer: true,
        threads: 2,
    }
}

/// Losses of `steps` streamed steps of `plan`, the batch cut into `micro` micro-batches.
fn train_losses<B: AutodiffBackend>(
    host: &HostModel,
    batch: &Batch,
    plan: Step,
    micro: usize,
    steps: usize,
    spill_dir: &Path,
    device: <B::InnerBackend as BackendTypes>::Device,
) -> Result<Vec<f64>> {
    let spill: Option<Arc<dyn ActivationSpill>> = if plan.boundaries.contains(&Placement::Nvme) {
        std::fs::create_dir_all(spill_dir).with_context(|| format!("{}: cannot create", spill_dir.display()))?;
        let cfg = lt_storage::spill::SpillConfig::new(spill_dir, 64 << 20);
        Some(Arc::new(lt_storage::spill::SpillStore::open(cfg)?))
    } else {
        None
    };
    let ex = Executor::<B>::new(plan, ByteSize::gib(4), device, spill);
    let mut tr = Trainer::new(Arc::new(SharedModel::new(host.clone(), 0)), ex, train_options(), None, 0)?;
    let rows = batch.input_ids.len();
    let per = rows.div_ceil(micro.max(1)).max(1);
    let mbs: Vec<Batch> = (0..rows)
        .step_by(per)
        .map(|s| {
            let e = (s + per).min(rows);
            Batch::new(batch.input_ids[s..e].to_vec(), batch.labels[s..e].to_vec())
        })
        .collect();
    let mut losses = Vec::with_capacity(steps);
    for _ in 0..steps {
        losses.push(tr.step(&mbs)?.loss);
    }
    tr.flush()?;
    Ok(losses)
}

/// The policies the streamed-training checks run: name, plan, micro-batches.
fn policies(layers: usize) -> Vec<(&'static str, Step, usize)> {
    vec![
        ("keep-all", Step::keep_all(layers), 1),
        ("recompute-all", Step::recompute_all(layers), 1),
        ("megatrain", Step::every(layers, 4, Placement::Gpu), 2),
        ("all-host", Step::all_in(layers, Placement::Host), 2),
        ("all-nvme", Step::all_in(layers, Placement::Nvme), 2),
    ]
}

/// Logits, loss and gradient checks of one fixture on a backend.
type ModelCheckFn<'a> = dyn Fn(&str, &HostModel, &Batch, &Reference) -> Vec<Check> + 'a;
/// Streamed training losses: model, batch, plan, micro-batches, steps, spill folder.
type TrainFn<'a> = dyn Fn(&HostModel, &Batch, Step, usize, usize, &Path) -> Result<Vec<f64>> + 'a;

/// One backend under test.
struct UnderTest<'a> {
    label: &'a str,
    tol: Tol,
    model: &'a ModelCheckFn<'a>,
    train: &'a TrainFn<'a>,
}

fn generic_model<B: AutodiffBackend>(
    label: &'static str,
    tol: Tol,
) -> impl Fn(&str, &HostModel, &Batch, &Reference) -> Vec<Check>
where
    <B::InnerBackend as BackendTypes>::Device: Default,
{
    move |f, h, b, r| model_checks::<B>(f, label, tol, h, b, r, &Default::default())
}

fn generic_train<B: AutodiffBackend>() -> impl Fn(&HostModel, &Batch, Step, usize, usize, &Path) -> Result<Vec<f64>>
where
    <B::InnerBackend as BackendTypes>::Device: Default,
{
    |h, b, p, m, s, d| train_losses::<B>(h, b, p, m, s, d, Default::default())
}

/// Fixture model folders that have a `tokens.jsonl`, sorted.
fn fixture_models(root: &Path) -> Result<Vec<(String, PathBuf)>> {
    let dir = root.join("models");
    let entries = std::fs::read_dir(&dir).with_context(|| {
        format!(
            "{}: cannot read the fixture models (run from the repository root or pass --fixtures DIR)",
            dir.display()
        )
    })?;
    let mut out: Vec<(String, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("config.json").is_file() && p.join("tokens.jsonl").is_file())
        .map(|p| (p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(), p))
        .collect();
    out.sort();
    if out.is_empty() {
        bail!("{}: no fixture models (folders with config.json and tokens.jsonl)", dir.display());
    }
    Ok(out)
}

/// Run `f`, turning an error or a panic into one failed check.
fn guarded(check: &str, backend: &str, f: impl FnOnce() -> Result<Vec<Check>>) -> Vec<Check> {
    match catch_panics(|| f().map_err(|e| Failure::from_error(&e))) {
        Ok(v) => v,
        Err(e) => vec![Check::failed(check.into(), backend, e.to_string())],
    }
}

/// Run the command.
pub fn run(args: &SelftestArgs) -> Result<()> {
    if args.train_steps == 0 {
        bail!("--train-steps: must be > 0");
    }
    let models = selected_models(args)?;
    let cpu_model = generic_model::<lt_model::CpuAutodiff>("cpu", TOL_CPU);
    let cpu_train = generic_train::<lt_model::CpuAutodiff>();
    #[cfg(feature = "cuda")]
    let (bf16_model, bf16_train, f32_model, f32_train) = (
        generic_model::<lt_model::CudaAutodiff>("cuda-bf16", TOL_BF16),
        generic_train::<lt_model::CudaAutodiff>(),
        generic_model::<lt_model::CudaF32Autodiff>("cuda-f32", TOL_F32),
        generic_train::<lt_model::CudaF32Autodiff>(),
    );
    #[cfg(feature = "wgpu")]
    let (wgpu_model, wgpu_train) =
        (generic_model::<lt_model::WgpuAutodiff>("wgpu-f32", TOL_F32), generic_train::<lt_model::WgpuAutodiff>());
    let backends: Vec<UnderTest<'_>> = match args.device {
        DeviceChoice::Cpu => vec![UnderTest { label: "cpu", tol: TOL_CPU, model: &cpu_model, train: &cpu_train }],
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda => {
            // One clear line when there is no usable GPU or driver, instead of the same failure per check;
            // the set-up (kernel cache, page-locked upload copies) applies to every check below.
            let device = lt_run::device::cuda()?;
            catch_panics(|| {
                let t = burn::tensor::Tensor::<lt_model::CudaBackend, 1>::zeros([1], &device);
                Ok(t.into_data())
            })
            .map_err(|e| anyhow::anyhow!("--device cuda: cannot initialise CUDA: {e}"))?;
            let mut v = vec![UnderTest { label: "cuda-bf16", tol: TOL_BF16, model: &bf16_model, train: &bf16_train }];
            if !args.no_f32 {
                v.insert(0, UnderTest { label: "cuda-f32", tol: TOL_F32, model: &f32_model, train: &f32_train });
            }
            v
        }
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => {
            lt_run::device::wgpu()?;
            vec![UnderTest { label: "wgpu-f32", tol: TOL_F32, model: &wgpu_model, train: &wgpu_train }]
        }
        #[allow(unreachable_patterns)]
        d => return Err(lt_run::device::not_built(d)),
    };
    let spill_dir = std::env::temp_dir().join(format!("lt-selftest-spill-{}", std::process::id()));
    let started = std::time::Instant::now();
    let mut checks: Vec<Check> = Vec::new();
    let ctx = FixtureRun { args, backends: &backends, cpu_train: &cpu_train, spill_dir: &spill_dir, started };
    let pb = crate::progress::bar(models.len() as u64, "selftest");
    for (name, dir) in &models {
        pb.set_message(format!("selftest {name}"));
        pb.inc(1);
        fixture_checks(&ctx, name, dir, &mut checks);
    }
    pb.finish_and_clear();
    let _ = std::fs::remove_dir_all(&spill_dir);
    let passed = !checks.is_empty() && checks.iter().all(|c| c.passed);
    let table = render(&checks, passed, started.elapsed().as_secs_f64());
    if args.json {
        eprint!("{table}");
        let device = args.device.name();
        println!("{}", serde_json::json!({"passed": passed, "device": device, "checks": checks}));
    } else {
        print!("{table}");
    }
    if !passed {
        std::process::exit(1);
    }
    Ok(())
}

/// The fixture models to run: all of them, or those `--only` names (each of which must exist).
fn selected_models(args: &SelftestArgs) -> Result<Vec<(String, PathBuf)>> {
    let mut models = fixture_models(&args.fixtures)?;
    if !args.only.is_empty() {
        for want in &args.only {
            if !models.iter().any(|(n, _)| n == want) {
                let names: Vec<&str> = models.iter().map(|(n, _)| n.as_str()).collect();
                bail!("--only {want}: no such fixture model (have: {})", names.join(", "));
            }
        }
        models.retain(|(n, _)| args.only.contains(n));
    }
    Ok(models)
}

/// What every fixture's checks share: the flags, the backends under test, the CPU training
/// reference and the spill folder.
struct FixtureRun<'a> {
    args: &'a SelftestArgs,
    backends: &'a [UnderTest<'a>],
    cpu_train: &'a TrainFn<'a>,
    spill_dir: &'a Path,
    /// When the selftest started: each check's progress line gives the seconds since.
    started: std::time::Instant,
}

impl FixtureRun<'_> {
    /// One stderr line per finished check when stderr is not a terminal (a log, a CI job, a
    /// device run under `timeout`), where the progress bar is hidden: the first run on a GPU
    /// compiles every kernel, and a run that is stopped must still say how far it got.
    fn progress(&self, done: &[Check]) {
        if !crate::progress::as_lines() {
            return;
        }
        for c in done {
            eprintln!(
                "selftest [{:7.1} s] {} {}: {} ({:.3e}, tolerance {:.1e})",
                self.started.elapsed().as_secs_f64(),
                c.check,
                c.backend,
                c.verdict(),
                c.value,
                c.tolerance
            );
        }
    }
}

/// Loads fixture `name` from `dir` and appends its model checks, then its streamed-training checks
/// when it has a training batch, to `checks` (a failure to load or to compute a reference becomes
/// one failed check).
fn fixture_checks(ctx: &FixtureRun<'_>, name: &str, dir: &Path, checks: &mut Vec<Check>) {
    let loaded = HostModel::load(dir)
        .map_err(anyhow::Error::from)
        .and_then(|h| Batch::read_jsonl(&dir.join("tokens.jsonl")).map_err(anyhow::Error::from).map(|b| (h, b)));
    let (host, batch) = match loaded {
        Ok(x) => x,
        Err(e) => {
            checks.push(Check::failed(format!("{name}/load"), "cpu", format!("{e:#}")));
            return;
        }
    };
    let r = match catch_panics(|| Ok::<_, Failure>(reference(&host, &batch))) {
        Ok(r) => r,
        Err(e) => {
            checks.push(Check::failed(format!("{name}/reference"), "cpu", e.to_string()));
            return;
        }
    };
    for b in ctx.backends {
        let from = checks.len();
        checks.extend(guarded(&format!("{name}/model"), b.label, || Ok((b.model)(name, &host, &batch, &r))));
        ctx.progress(&checks[from..]);
    }
    // Streamed training, when the fixture has a training batch.
    let train_file = ctx.args.fixtures.join("train").join(name).join("train.jsonl");
    if train_file.is_file() {
        train_checks(ctx, name, &host, &train_file, checks);
    }
}

/// Appends the streamed-training checks of fixture `name` (every policy on every backend against
/// the CPU keep-all losses) to `checks`.
fn train_checks(ctx: &FixtureRun<'_>, name: &str, host: &HostModel, train_file: &Path, checks: &mut Vec<Check>) {
    let (args, spill_dir) = (ctx.args, ctx.spill_dir);
    let tb = match Batch::read_jsonl(train_file) {
        Ok(tb) => tb,
        Err(e) => {
            checks.push(Check::failed(format!("{name}/train data"), "cpu", format!("{e:#}")));
            return;
        }
    };
    let layers = host.config.num_layers();
    let cpu_run = || (ctx.cpu_train)(host, &tb, Step::keep_all(layers), 1, args.train_steps, spill_dir);
    let want = match catch_panics(|| cpu_run().map_err(|e| Failure::from_error(&e))) {
        Ok(l) if l.len() == args.train_steps && l.iter().all(|x| x.is_finite()) => l,
        Ok(l) => {
            let msg = format!("CPU reference losses are not usable: {l:?}");
            checks.push(Check::failed(format!("{name}/train reference"), "cpu", msg));
            return;
        }
        Err(e) => {
            checks.push(Check::failed(format!("{name}/train reference"), "cpu", e.to_string()));
            return;
        }
    };
    for b in ctx.backends {
        for (policy, plan, micro) in policies(layers) {
            let check = format!("{name}/train {policy}");
            let from = checks.len();
            checks.extend(guarded(&check, b.label, || {
                let got = (b.train)(host, &tb, plan, micro, args.train_steps, spill_dir)?;
                let worst = got.iter().zip(&want).map(|(g, w)| rel(*g, *w)).fold(0.0, nan_max);
                Ok(vec![Check::new(
                    format!("{check} ({} steps)", args.train_steps),
                    b.label,
                    "worst relative loss",
                    if got.len() == want.len() { worst } else { f64::NAN },
                    b.tol.train_loss,
                )])
            }));
            ctx.progress(&checks[from..]);
        }
    }
}

fn render(checks: &[Check], passed: bool, seconds: f64) -> String {
    let mut s = format!("{:<48} {:<10} {:>12} {:>10}  {}\n", "check", "backend", "value", "tolerance", "result");
    for c in checks {
        let result = match &c.error {
            Some(e) => format!("{} {e}", c.verdict()),
            None => c.verdict().to_string(),
        };
        s += &format!("{:<48} {:<10} {:>12.3e} {:>10.1e}  {result}\n", c.check, c.backend, c.value, c.tolerance);
    }
    let failed = checks.iter().filter(|c| !c.passed).count();
    s += &format!(
        "selftest {}: {} checks, {failed} failed, {seconds:.1} s\n",
        if passed { "passed" } else { "FAILED" },
        checks.len()
    );
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn rel_to_max_scales_by_the_reference_and_flags_mismatches() {
        assert_eq!(rel_to_max(&[1.0, 2.0], &[1.0, 4.0]), 0.5);
        assert!(rel_to_max(&[1.0], &[1.0, 2.0]).is_nan());
        assert!(rel_to_max(&[f32::NAN], &[1.0]).is_nan());
        assert!(!Check::new("x".into(), "cpu", "m", f64::NAN, 1.0).passed);
    }

    #[test]
    fn gradient_groups_are_layers_or_head() {
        assert_eq!(group_of("layers.12.mlp.up_proj.weight"), "layers.12");
        assert_eq!(group_of("embed_tokens.weight"), "head");
    }
}
