//! `lt plan`: choose where each boundary activation lives, the micro-batching, the loss chunk and the
//! optimizer overlap for a model on a machine, and predict the step time against the MegaTrain
//! baseline, replayed in the same simulator.
//!
//! Every figure printed is a prediction of the cost model (`lt-sched`), never a measurement.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::ValueEnum;
use lt_core::ModelConfig;
use lt_core::hardware::HardwareProfile;
use lt_sched::cost::{AttentionKernel, CostOptions};
use lt_sched::planner::{self, PlanOutcome, PlanRequest, Policy};
use lt_sched::{OptimizerOverlap, Placement, Plan, SchedError};

/// Arguments of `lt plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The model: a Hugging Face config.json, or a folder holding one.
    #[arg(long, value_name = "CONFIG.json|MODEL_DIR")]
    pub model_config: PathBuf,
    #[command(flatten)]
    pub hw: lt_run::config::HardwareArgs,
    /// Sequences per optimizer step [default: the largest that fits in one micro-batch (predicted),
    /// or --micro-batch-size when that is given].
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Tokens per sequence (the default is `lt train`'s).
    #[arg(long, default_value_t = 1024)]
    pub seq_len: usize,
    /// Also report the largest batch that fits in one micro-batch, for the plan and for MegaTrain
    /// (predicted).
    #[arg(long)]
    pub max_batch: bool,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
    /// Write the plan file (JSON, version 1) that `lt train --plan` executes.
    #[arg(long, value_name = "plan.json")]
    pub out: Option<PathBuf>,
    /// Write the predicted timeline of one step (Chrome trace JSON).
    #[arg(long, value_name = "trace.json")]
    pub trace: Option<PathBuf>,
    /// When the host optimizer runs; `auto` picks the fastest mode that keeps global-norm clipping
    /// exact (add --no-grad-clip to allow `backward`).
    #[arg(long, value_enum, default_value_t = OverlapArg::Auto)]
    pub optimizer_overlap: OverlapArg,
    /// Training runs without gradient clipping: lets `auto` overlap the optimizer with backward
    /// (predicted only: the executor does not implement `backward`, so `lt train --plan` refuses it).
    #[arg(long)]
    pub no_grad_clip: bool,
    /// Force the micro-batch size (must divide --batch-size); default: chosen by the planner.
    #[arg(long)]
    pub micro_batch_size: Option<usize>,
    /// Force the loss chunk in tokens; default: chosen by the planner.
    #[arg(long)]
    pub loss_chunk_tokens: Option<usize>,
    /// Attention kernel (changes attention FLOPs and memory). The executor materialises the scores,
    /// so `lt train --plan` runs only `materialized` plans; `flash` predicts a fused kernel, for comparison.
    #[arg(long, value_enum, default_value_t = AttentionArg::Materialized)]
    pub attention: AttentionArg,
    /// Longest recomputed segment the planner considers.
    #[arg(long, default_value_t = planner::DEFAULT_MAX_SEGMENT_LEN)]
    pub max_segment_len: usize,
    /// Optimizer-state precision, for host memory (as `lt train --optimizer`).
    #[arg(long, value_enum, default_value_t = lt_run::OptimizerChoice::DEFAULT)]
    pub optimizer: lt_run::OptimizerChoice,
}

/// `--optimizer-overlap` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OverlapArg {
    /// Let the planner choose.
    Auto,
    /// After backward, then the next step (MegaTrain).
    Serial,
    /// Each layer as its gradient arrives in backward (inexact with global-norm clipping; predicted
    /// only, the executor does not implement it).
    Backward,
    /// In forward order while the next step's forward runs.
    NextForward,
}

/// `--attention` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AttentionArg {
    /// Scores materialised, as Burn's autodiff does (what the executor runs).
    Materialized,
    /// Fused attention (flash): causal blocks skipped, scores never stored (predicted only).
    Flash,
}

/// The validated request: flags turned into runtime objects.
struct Setup {
    model: ModelConfig,
    model_name: String,
    hw: HardwareProfile,
    req: PlanRequest,
    /// The batch was not given: the planner's largest single micro-batch was taken.
    batch_chosen: bool,
}

fn setup(args: &PlanArgs) -> Result<Setup> {
    let model = ModelConfig::from_path(&args.model_config)?;
    let hw = args.hw.profile(lt_core::hardware::BuiltinProfile::Cpu)?;
    let mut req = PlanRequest::new(args.batch_size.or(args.micro_batch_size).unwrap_or(1), args.seq_len);
    req.optimizer_overlap = match args.optimizer_overlap {
        OverlapArg::Auto => None,
        OverlapArg::Serial => Some(OptimizerOverlap::Serial),
        OverlapArg::Backward => Some(OptimizerOverlap::OverlapBackward),
        OverlapArg::NextForward => Some(OptimizerOverlap::OverlapNextForward),
    };
    req.grad_clipping = !args.no_grad_clip;
    req.micro_batch_size = args.micro_batch_size;
    req.loss_chunk_tokens = args.loss_chunk_tokens;
    req.max_segment_len = args.max_segment_len;
    req.trace = args.trace.is_some();
    req.cost = CostOptions {
        attention: match args.attention {
            AttentionArg::Flash => AttentionKernel::Flash,
            AttentionArg::Materialized => AttentionKernel::Materialized,
        },
        optimizer: args.optimizer.state(),
    };
    let model_name = model_name(&args.model_config);
    let batch_chosen = args.batch_size.is_none() && args.micro_batch_size.is_none();
    if batch_chosen {
        // No batch given: the largest that runs as one micro-batch, so that no one has to guess. When
        // not even one sequence fits, batch 1 stays and the planner's infeasibility error (with the
        // smallest memory that would work, and its JSON line) says so.
        if let Some(b) = planner::max_batch(&model, &hw, &req, Policy::Auto)? {
            req.batch_size = b;
        }
    }
    Ok(Setup { model, model_name, hw, req, batch_chosen })
}

fn model_name(path: &Path) -> String {
    let p = if path.file_name().is_some_and(|n| n == "config.json") { path.parent().unwrap_or(path) } else { path };
    p.file_stem().map_or_else(|| p.display().to_string(), |s| s.to_string_lossy().into_owned())
}

/// Run the command.
pub fn run(args: &PlanArgs) -> Result<()> {
    let started = Instant::now();
    let s = setup(args)?;
    let outcome = match planner::plan(&s.model, &s.hw, &s.req) {
        Ok(o) => o,
        Err(e) => {
            if args.json {
                println!("{}", infeasible_json(&e));
            }
            return Err(e.into());
        }
    };
    let mut baselines = Vec::new();
    for b in Policy::FIXED {
        baselines.push((b, planner::baseline(&s.model, &s.hw, &s.req, b)?.map(|(p, _)| p)));
    }
    let max_batch = if args.max_batch {
        Some((
            planner::max_batch(&s.model, &s.hw, &s.req, Policy::Auto)?,
            planner::max_batch(&s.model, &s.hw, &s.req, Policy::Megatrain)?,
        ))
    } else {
        None
    };
    if let Some(path) = &args.out {
        outcome.plan.save(path)?;
    }
    if let Some(path) = &args.trace {
        let text = serde_json::to_string(&outcome.sim.trace)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    print_text(&s, &outcome, &baselines, max_batch, args);
    if args.json {
        let total = started.elapsed().as_secs_f64();
        println!("{}", summary_json(&s, &outcome, &baselines, max_batch, total));
    }
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

/// What the trainer keeps in host memory for the parameters of plan `p` on this profile's device dtype.
fn param_host_bytes(s: &Setup, p: &Plan) -> lt_sched::cost::HostBytes {
    let accum = p.step.shape.grad_accum_steps;
    lt_sched::cost::host_param_bytes(&s.model, s.hw.compute_dtype_bytes as usize, s.req.cost.optimizer, accum)
}

/// What `lt train --save-every auto` is predicted to do with this plan.
struct CheckpointPrediction {
    /// fp32 masters + optimizer state.
    bytes: u64,
    /// One save at the profile's disk write speed.
    save_seconds: f64,
    /// The interval auto would choose against the predicted step.
    every: u64,
}

fn checkpoint_prediction(s: &Setup, p: &Plan, b: &lt_sched::cost::HostBytes) -> CheckpointPrediction {
    let bytes = b.masters + b.optimizer_state;
    let save_seconds = bytes as f64 / s.hw.nvme_write_bytes_per_s().max(1.0);
    let every = lt_run::checkpointing::auto_interval(save_seconds, p.predicted.step_seconds);
    CheckpointPrediction { bytes, save_seconds, every }
}

fn tier_name(p: Placement) -> &'static str {
    match p {
        Placement::Gpu => "gpu",
        Placement::Host => "host",
        Placement::Nvme => "nvme",
        Placement::Recompute => "recompute",
    }
}

fn overlap_name(o: OptimizerOverlap) -> &'static str {
    match o {
        OptimizerOverlap::Serial => "serial after backward",
        OptimizerOverlap::OverlapBackward => "overlapped with backward",
        OptimizerOverlap::OverlapNextForward => "overlapped with the next step's forward",
    }
}

/// Prints the plan as text: the header, the per-layer table, the comparison with the baselines and
/// the files written.
fn print_text(
    s: &Setup,
    o: &PlanOutcome,
    baselines: &[(Policy, Option<Plan>)],
    max_batch: Option<(Option<usize>, Option<usize>)>,
    args: &PlanArgs,
) {
    print_header(s, o);
    println!();
    print_layers(o);
    println!();
    print_comparison(&o.plan, baselines);
    let b = param_host_bytes(s, &o.plan);
    println!(
        "host memory for the parameters (predicted): {:.2} GiB = fp32 masters {:.2} + gradients {:.2} + optimizer \
state {:.2} + upload copies {:.2}; boundaries kept in host memory and staging buffers come on top",
        b.total() as f64 / GIB,
        b.masters as f64 / GIB,
        b.grads as f64 / GIB,
        b.optimizer_state as f64 / GIB,
        b.upload_copies as f64 / GIB
    );
    let c = checkpoint_prediction(s, &o.plan, &b);
    println!(
        "checkpoints (predicted): {:.2} GiB each (fp32 masters + optimizer state), a save {:.1} s at the profile's \
{:.2} GB/s disk write; `lt train --save-every auto` would save every {} step(s) ({:.1}% of the time), a kill -9 \
losing at most about {} of training",
        c.bytes as f64 / GIB,
        c.save_seconds,
        s.hw.nvme_write_gb_per_s,
        c.every,
        100.0 * c.save_seconds / (c.every as f64 * o.plan.predicted.step_seconds).max(f64::MIN_POSITIVE),
        lt_run::checkpointing::human_seconds(c.every as f64 * o.plan.predicted.step_seconds)
    );
    if let Some((ours, theirs)) = max_batch {
        let show = |b: Option<usize>| b.map_or("none fits".to_string(), |b| b.to_string());
        println!();
        println!("largest batch in one micro-batch (predicted): lazytrain {}, megatrain {}", show(ours), show(theirs));
    }
    if let Some(path) = &args.out {
        println!("plan written to {}", path.display());
    }
    if let Some(path) = &args.trace {
        println!("predicted timeline written to {} (chrome://tracing, Perfetto)", path.display());
    }
}

/// Prints the model and machine, the solver's summary and warnings, and the chosen step shape.
fn print_header(s: &Setup, o: &PlanOutcome) {
    let p = &o.plan;
    let sv = &p.solver;
    println!(
        "lt plan: {} ({:.2}B params, {} layers) on {} — batch {} x seq {}{}",
        s.model_name,
        s.model.total_params() as f64 / 1e9,
        s.model.num_layers(),
        s.hw.name,
        p.batch_size,
        p.seq_len,
        if s.batch_chosen {
            " (no --batch-size: the largest batch that fits in one micro-batch, predicted)"
        } else {
            ""
        }
    );
    println!(
        "solver: {:?}{}, {} step shapes evaluated, {:.3} s",
        sv.method,
        sv.mip_gap.map_or(String::new(), |g| format!(" (gap {g:.1e})")),
        o.shapes_evaluated,
        sv.solve_seconds
    );
    for w in &sv.warnings {
        println!("warning: {w}");
    }
    println!(
        "step shape: micro-batch {} x {} accumulation, loss chunk {} tokens, optimizer {}",
        p.step.shape.micro_batch_size,
        p.step.shape.grad_accum_steps,
        p.step.shape.loss_chunk_tokens,
        overlap_name(p.step.shape.optimizer_overlap)
    );
}

/// Prints the per-layer table (placement of each boundary, recomputation, predicted times) and the
/// boundary counts per tier.
fn print_layers(o: &PlanOutcome) {
    let p = &o.plan;
    println!("per layer (times predicted, one micro-batch):");
    println!(
        "{:>5}  {:<7}  {:<10}  {:<10}  {:>10}  {:>10}",
        "layer", "kind", "input in", "recomputed", "fwd ms", "bwd ms"
    );
    let rec = lt_sched::plan::recomputed_layers(&p.step.boundaries);
    for (i, l) in o.instance.layers.iter().enumerate() {
        let kind = match l.kind {
            lt_core::LayerKind::FullAttention => "full",
            lt_core::LayerKind::LinearAttention => "linear",
        };
        println!(
            "{:>5}  {:<7}  {:<10}  {:<10}  {:>10.2}  {:>10.2}",
            i,
            kind,
            tier_name(p.step.boundaries[i]),
            if rec[i] { "yes" } else { "no" },
            l.fwd_seconds * 1e3,
            l.bwd_seconds * 1e3
        );
    }
    println!("{:>5}  {:<7}  {:<10}", "head", "", tier_name(p.step.boundaries[p.step.boundaries.len() - 1]));
    let kept = |t: Placement| p.step.boundaries.iter().filter(|&&b| b == t).count();
    println!(
        "boundaries: {} on GPU, {} in host memory, {} on NVMe, {} recomputed",
        kept(Placement::Gpu),
        kept(Placement::Host),
        kept(Placement::Nvme),
        kept(Placement::Recompute)
    );
}

/// Prints the predicted figures of the plan beside each baseline, one column per plan.
fn print_comparison(p: &Plan, baselines: &[(Policy, Option<Plan>)]) {
    let mut cols: Vec<(&str, Option<&Plan>)> = vec![("lazytrain", Some(p))];
    for (b, bp) in baselines {
        cols.push((b.name(), bp.as_ref()));
    }
    print!("{:<36}", "predicted (cost model, not measured)");
    for (name, _) in &cols {
        print!("{name:>15}");
    }
    println!();
    let mt_step = baselines
        .iter()
        .find(|(b, _)| *b == Policy::Megatrain)
        .and_then(|(_, p)| p.as_ref())
        .map(|p| p.predicted.step_seconds);
    type Row<'a> = (&'a str, Box<dyn Fn(&Plan) -> String>);
    let rows: Vec<Row<'_>> = vec![
        ("step seconds (predicted)", Box::new(|q: &Plan| format!("{:.3}", q.predicted.step_seconds))),
        ("tokens/s (predicted)", Box::new(|q: &Plan| format!("{:.0}", q.predicted.tokens_per_second))),
        ("TFLOPS, 6*params*tokens (predicted)", Box::new(|q: &Plan| format!("{:.1}", q.predicted.tflops))),
        ("TFLOPS, executed (predicted)", Box::new(|q: &Plan| format!("{:.1}", q.predicted.hardware_tflops))),
        (
            "speedup vs megatrain (predicted)",
            Box::new(move |q: &Plan| mt_step.map_or("-".into(), |m| format!("{:.3}x", m / q.predicted.step_seconds))),
        ),
        ("peak GPU GiB (predicted)", Box::new(|q: &Plan| format!("{:.2}", q.predicted.peak_gpu_bytes as f64 / GIB))),
        ("peak host GiB (predicted)", Box::new(|q: &Plan| format!("{:.2}", q.predicted.peak_host_bytes as f64 / GIB))),
        ("peak NVMe GiB (predicted)", Box::new(|q: &Plan| format!("{:.2}", q.predicted.peak_nvme_bytes as f64 / GIB))),
        ("exposed H2D s (predicted)", Box::new(|q: &Plan| format!("{:.3}", q.predicted.exposed_seconds.h2d))),
        ("exposed D2H s (predicted)", Box::new(|q: &Plan| format!("{:.3}", q.predicted.exposed_seconds.d2h))),
        ("exposed NVMe s (predicted)", Box::new(|q: &Plan| format!("{:.3}", q.predicted.exposed_seconds.nvme))),
        ("exposed optimizer s (predicted)", Box::new(|q: &Plan| format!("{:.3}", q.predicted.exposed_seconds.cpu))),
        (
            "micro-batch x accumulation",
            Box::new(|q: &Plan| format!("{}x{}", q.step.shape.micro_batch_size, q.step.shape.grad_accum_steps)),
        ),
    ];
    for (label, f) in &rows {
        print!("{label:<36}");
        for (_, q) in &cols {
            print!("{:>15}", q.map_or("does not fit".into(), f));
        }
        println!();
    }
}

fn summary_json(
    s: &Setup,
    o: &PlanOutcome,
    baselines: &[(Policy, Option<Plan>)],
    max_batch: Option<(Option<usize>, Option<usize>)>,
    total_seconds: f64,
) -> serde_json::Value {
    let p = &o.plan;
    let pr = &p.predicted;
    let base = |b: Policy| baselines.iter().find(|(x, _)| *x == b).and_then(|(_, p)| p.as_ref());
    let mt = base(Policy::Megatrain);
    let rec = lt_sched::plan::recomputed_layers(&p.step.boundaries);
    let layers: Vec<serde_json::Value> = o
        .instance
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            serde_json::json!({
                "index": i,
                "kind": l.kind,
                "input": tier_name(p.step.boundaries[i]),
                "recomputed": rec[i],
                "predicted_fwd_seconds": l.fwd_seconds,
                "predicted_bwd_seconds": l.bwd_seconds,
            })
        })
        .collect();
    let baseline_summary = |q: Option<&Plan>| {
        q.map(|q| {
            serde_json::json!({
                "predicted_step_seconds": q.predicted.step_seconds,
                "tflops": q.predicted.tflops,
                "hardware_tflops": q.predicted.hardware_tflops,
                "peak_gpu_bytes": q.predicted.peak_gpu_bytes,
                "peak_host_bytes": q.predicted.peak_host_bytes,
                "micro_batch_size": q.step.shape.micro_batch_size,
                "grad_accum_steps": q.step.shape.grad_accum_steps,
            })
        })
    };
    let host_bytes = param_host_bytes(s, p);
    let c = checkpoint_prediction(s, p, &host_bytes);
    let ckpt = serde_json::json!({"bytes": c.bytes, "save_seconds": c.save_seconds, "auto_save_every": c.every});
    let mut v = serde_json::json!({
        "feasible": true,
        "predicted": true,
        "model": s.model_name,
        "hardware": s.hw.name,
        "batch_size": p.batch_size,
        "batch_size_chosen": s.batch_chosen,
        "seq_len": p.seq_len,
        "solve_seconds": p.solver.solve_seconds,
        "total_seconds": total_seconds,
        "solver_method": p.solver.method,
        "mip_gap": p.solver.mip_gap,
        "warnings": p.solver.warnings,
        "predicted_step_seconds": pr.step_seconds,
        "model_step_seconds": pr.model_step_seconds,
        "baseline_step_seconds": mt.map(|q| q.predicted.step_seconds),
        "speedup": mt.map(|q| q.predicted.step_seconds / pr.step_seconds),
        "tokens_per_second": pr.tokens_per_second,
        "tflops": pr.tflops,
        "hardware_tflops": pr.hardware_tflops,
        "baseline_tflops": mt.map(|q| q.predicted.tflops),
        "peak_gpu_bytes": pr.peak_gpu_bytes,
        "peak_host_bytes": pr.peak_host_bytes,
        "host_param_bytes": host_bytes,
        "checkpoint": ckpt,
        "peak_nvme_bytes": pr.peak_nvme_bytes,
        "exposed_seconds": pr.exposed_seconds,
        "micro_batch_size": p.step.shape.micro_batch_size,
        "grad_accum_steps": p.step.shape.grad_accum_steps,
        "loss_chunk_tokens": p.step.shape.loss_chunk_tokens,
        "optimizer_overlap": p.step.shape.optimizer_overlap,
        "layers": layers,
        "baselines": {
            "megatrain": baseline_summary(mt),
            "keep-all": baseline_summary(base(Policy::KeepAll)),
            "recompute-all": baseline_summary(base(Policy::RecomputeAll)),
        },
    });
    if let (Some((ours, theirs)), Some(obj)) = (max_batch, v.as_object_mut()) {
        obj.insert("max_batch_size".into(), serde_json::json!(ours));
        obj.insert("baseline_max_batch_size".into(), serde_json::json!(theirs));
    }
    v
}

fn infeasible_json(e: &SchedError) -> serde_json::Value {
    match e {
        SchedError::Infeasible { min_gpu_memory, min_host_memory, .. } => serde_json::json!({
            "feasible": false,
            "predicted": true,
            "error": e.to_string(),
            "min_gpu_memory_bytes": min_gpu_memory,
            "min_host_memory_bytes": min_host_memory,
        }),
        _ => serde_json::json!({ "feasible": false, "error": e.to_string() }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: PlanArgs,
    }

    fn config_path(name: &str) -> String {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models").join(name).display().to_string()
    }

    #[test]
    fn flags_parse_into_a_request() {
        let cli = Cli::try_parse_from([
            "lt",
            "--model-config",
            &config_path("qwen2.5-3b.json"),
            "--hardware",
            "rtx3090",
            "--batch-size",
            "8",
            "--seq-len",
            "512",
            "--gpu-memory",
            "12GiB",
            "--optimizer-overlap",
            "next-forward",
        ])
        .unwrap();
        let s = setup(&cli.args).unwrap();
        assert_eq!(s.hw.gpu_memory, lt_core::ByteSize::gib(12));
        assert_eq!(s.req.optimizer_overlap, Some(OptimizerOverlap::OverlapNextForward));
        assert_eq!(s.model_name, "qwen2.5-3b");
    }

    #[test]
    fn unknown_hardware_is_refused_with_the_choices() {
        let parsed = Cli::try_parse_from([
            "lt",
            "--model-config",
            &config_path("qwen2.5-3b.json"),
            "--hardware",
            "a100",
            "--batch-size",
            "8",
            "--seq-len",
            "512",
        ]);
        // `--hardware` parses into a `HardwareSpec` at the flag: the error comes from clap.
        let e = parsed.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("h800, rtx3090, h200, cpu"), "{e}");
    }

    /// Without `--batch-size` the plan is for the largest batch that fits in one micro-batch, which is
    /// `max_batch`'s answer for the same request; when no sequence fits, the planner's error says so.
    #[test]
    fn no_batch_size_plans_the_largest_that_fits() {
        let parse = |extra: &[&str]| {
            let mut a = vec!["lt", "--model-config"];
            let cfg = config_path("qwen2.5-7b.json");
            a.push(&cfg);
            a.extend(["--hardware", "rtx3090"]);
            a.extend(extra);
            Cli::try_parse_from(a).unwrap().args
        };
        let s = setup(&parse(&["--seq-len", "1024"])).unwrap();
        assert!(s.batch_chosen);
        let given = setup(&parse(&["--seq-len", "1024", "--batch-size", "1"])).unwrap();
        assert!(!given.batch_chosen);
        let largest = planner::max_batch(&given.model, &given.hw, &given.req, Policy::Auto).unwrap().unwrap();
        assert_eq!(s.req.batch_size, largest);
        assert!(largest > 1, "a 7B model on a 24 GB card fits more than one sequence of 1024: {largest}");
        let o = planner::plan(&s.model, &s.hw, &s.req).unwrap();
        assert_eq!(o.plan.batch_size, largest);

        // The seq-len default is lt train's.
        assert_eq!(parse(&[]).seq_len, 1024);
        // Not even one sequence fits: the planner's own error, with the memory that would work.
        let s = setup(&parse(&["--seq-len", "65536"])).unwrap();
        assert_eq!(s.req.batch_size, 1);
        let e = planner::plan(&s.model, &s.hw, &s.req).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("batch 1 x seq 65536") && e.contains("smallest GPU memory"), "{e}");
    }

    #[test]
    fn json_summary_has_the_documented_fields() {
        let cli = Cli::try_parse_from([
            "lt",
            "--model-config",
            &config_path("qwen2.5-3b.json"),
            "--hardware",
            "h800",
            "--batch-size",
            "4",
            "--seq-len",
            "256",
        ])
        .unwrap();
        let s = setup(&cli.args).unwrap();
        let o = planner::plan(&s.model, &s.hw, &s.req).unwrap();
        let b: Vec<_> = Policy::FIXED
            .into_iter()
            .map(|b| (b, planner::baseline(&s.model, &s.hw, &s.req, b).unwrap().map(|(p, _)| p)))
            .collect();
        let v = summary_json(&s, &o, &b, Some((Some(10), Some(5))), 0.1);
        for f in [
            "feasible",
            "solve_seconds",
            "predicted_step_seconds",
            "baseline_step_seconds",
            "peak_gpu_bytes",
            "peak_host_bytes",
            "tflops",
            "baseline_tflops",
            "layers",
            "max_batch_size",
            "baseline_max_batch_size",
        ] {
            assert!(v.get(f).is_some_and(|x| !x.is_null()), "missing {f}");
        }
        assert_eq!(v["layers"].as_array().map(Vec::len), Some(36));
        // One line of JSON.
        assert!(!v.to_string().contains('\n'));
    }
}
