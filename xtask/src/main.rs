//! `cargo xtask <command>`: developer and CI entry points of LazyTrain-rs.
//!
//! - `bench-h800`, `bench-3090`, `bench-h200`: the benchmark matrices of `xtask/matrices/*.toml`
//!   (the published H800 TFLOPS matrix, the published RTX 3090 max-batch matrix, and the project's
//!   H200 device machine). On the matching GPU, with a CUDA-built `lt`, each row is measured by
//!   `lt bench train`; anywhere else each row is lt-sched's prediction, labelled `predicted`.
//! - `bench --matrix FILE`: any other matrix file.
//!
//! Outputs: the table on stdout, `<out>/<matrix>.json` with every row and its `source`, and SVG plots
//! `<out>/<matrix>-tflops.svg` and `<out>/<matrix>-max-batch.svg`.
//!
//! ```text
//! cargo xtask bench-h800                  # predicted unless an H800 and target/release/lt are here
//! cargo xtask bench-3090 --predict        # always the simulator
//! LT_BIN=target-cuda/release/lt cargo xtask bench-h200 --force-measure
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

mod bench_train;
mod matrix;
mod measure;
mod predict;
mod report;
mod svg;

use bench_train::Lt;
use matrix::Matrix;
use report::{Report, Source, Status};

/// LazyTrain-rs developer tasks.
#[derive(Debug, Parser)]
#[command(name = "xtask", bin_name = "cargo xtask", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// The published H800 TFLOPS matrix (Qwen2.5-3B/7B/14B, Qwen3.6-27B; auto vs megatrain; seq 1024).
    #[command(name = "bench-h800")]
    BenchH800(BenchOpts),
    /// The published RTX 3090 max-batch matrix (largest batch in one micro-batch, auto vs megatrain).
    #[command(name = "bench-3090")]
    Bench3090(BenchOpts),
    /// The project's H200 device machine (141 GB GPU, 128 GiB host).
    #[command(name = "bench-h200")]
    BenchH200(BenchOpts),
    /// Any matrix file.
    Bench {
        /// The matrix TOML.
        #[arg(long, value_name = "FILE.toml")]
        matrix: PathBuf,
        #[command(flatten)]
        opts: BenchOpts,
    },
}

/// Options shared by the bench tasks.
#[derive(Debug, Clone, Args)]
struct BenchOpts {
    /// Print the simulator's prediction even when the matching GPU is present.
    #[arg(long, conflicts_with = "force_measure")]
    predict: bool,
    /// Run real steps even when no matching GPU is detected (needs a CUDA-built `lt`).
    #[arg(long)]
    force_measure: bool,
    /// The `lt` binary (built with `--features cuda`) [default: $LT_BIN, else target/release/lt].
    #[arg(long, value_name = "PATH")]
    lt: Option<PathBuf>,
    /// Output folder for the JSON and SVG files [default: target/bench].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Wall-clock limit of one `lt bench train` run, seconds.
    #[arg(long, default_value_t = 1800)]
    timeout_s: u64,
    /// Only these models (matrix names; repeatable).
    #[arg(long = "model", value_name = "NAME")]
    models: Vec<String>,
    /// Also print the rows of docs/benchmarks.md's tables, as markdown (a test checks the committed
    /// docs against the predicted ones).
    #[arg(long)]
    markdown: bool,
}

/// The workspace root (xtask lives one level below it).
fn root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli.command) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(task: Task) -> Result<()> {
    let root = root();
    let (path, opts) = match task {
        Task::BenchH800(o) => (root.join("xtask/matrices/h800.toml"), o),
        Task::Bench3090(o) => (root.join("xtask/matrices/rtx3090.toml"), o),
        Task::BenchH200(o) => (root.join("xtask/matrices/h200.toml"), o),
        Task::Bench { matrix, opts } => (matrix, opts),
    };
    bench(&path, &opts, &root)
}

/// GPU names from `nvidia-smi` (empty when it is missing or fails).
fn detect_gpus() -> Vec<String> {
    Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout).lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect()
        })
        .unwrap_or_default()
}

enum Mode {
    Predict(String),
    Measure(String, Lt),
}

fn choose_mode(m: &Matrix, opts: &BenchOpts, gpus: &[String], root: &Path) -> Result<Mode> {
    if opts.predict {
        return Ok(Mode::Predict("--predict given".into()));
    }
    let want = m.file.gpu_match.to_lowercase();
    let matching = gpus.iter().find(|g| g.to_lowercase().contains(&want));
    let lt_path = opts
        .lt
        .clone()
        .or_else(|| std::env::var_os("LT_BIN").map(PathBuf::from))
        .unwrap_or_else(|| root.join("target/release/lt"));
    let lt = Lt { path: lt_path, timeout: Duration::from_secs(opts.timeout_s) };
    let usable = lt.path.is_file() && lt.has_bench_train();
    if opts.force_measure {
        if !usable {
            bail!(
                "--force-measure: {} is missing or has no `bench train` (build it with \
                 `cargo build --release -p lt-cli --features cuda`, or pass --lt / LT_BIN)",
                lt.path.display()
            );
        }
        let on = matching.map_or_else(
            || format!("--force-measure without a matching {:?} GPU (nvidia-smi: {gpus:?})", m.file.gpu_match),
            Clone::clone,
        );
        return Ok(Mode::Measure(format!("lt bench train on {on}, {}", lt.path.display()), lt));
    }
    match matching {
        None if gpus.is_empty() => Ok(Mode::Predict("no matching GPU found: nvidia-smi lists none".into())),
        None => Ok(Mode::Predict(format!("no matching GPU found: no {:?} among {gpus:?}", m.file.gpu_match))),
        Some(g) if !usable => Ok(Mode::Predict(format!(
            "{g} found but no CUDA lt with `bench train` at {}; pass --lt or LT_BIN",
            lt.path.display()
        ))),
        Some(g) => Ok(Mode::Measure(format!("lt bench train on {g}, {}", lt.path.display()), lt)),
    }
}

fn bench(path: &Path, opts: &BenchOpts, root: &Path) -> Result<()> {
    let started = Instant::now();
    let mut m = Matrix::load(path, root)?;
    if !opts.models.is_empty() {
        for want in &opts.models {
            if !m.file.models.iter().any(|e| &e.name == want) {
                let names: Vec<&str> = m.file.models.iter().map(|e| e.name.as_str()).collect();
                bail!("--model {want}: not in {} (models: {})", path.display(), names.join(", "));
            }
        }
        let (models, paths): (Vec<_>, Vec<_>) = std::mem::take(&mut m.file.models)
            .into_iter()
            .zip(std::mem::take(&mut m.model_paths))
            .filter(|(e, _)| opts.models.contains(&e.name))
            .unzip();
        m.file.models = models;
        m.model_paths = paths;
    }
    let gpus = detect_gpus();
    let mode = choose_mode(&m, opts, &gpus, root)?;
    let hw = predict::profile(&m)?;
    let (source, reason, lt_binary, (mut rows, max_batch)) = match &mode {
        Mode::Predict(why) => {
            eprintln!("xtask: {}: PREDICTED ({why})", m.file.name);
            (Source::Predicted, why.clone(), None, predict::run(&m)?)
        }
        Mode::Measure(why, lt) => {
            eprintln!("xtask: {}: MEASURED ({why})", m.file.name);
            (Source::Measured, why.clone(), Some(lt.path.display().to_string()), measure::run(&m, lt)?)
        }
    };
    report::fill_speedups(&mut rows);
    let r = Report {
        matrix: m.file.name.clone(),
        description: m.file.description.clone(),
        matrix_file: path.strip_prefix(root).unwrap_or(path).display().to_string(),
        hardware: hw.name.clone(),
        source,
        mode_reason: reason,
        gpus,
        lt_binary,
        host_cpu: (source == Source::Measured).then(lt_core::HostCpu::detect),
        rows,
        max_batch,
        total_seconds: started.elapsed().as_secs_f64(),
    };
    print!("{}", report::render_text(&r));
    if opts.markdown {
        println!("\nmarkdown rows ({}):", r.source.name());
        let rows = report::markdown_step_rows(&r.rows).into_iter();
        for row in rows.chain(report::markdown_max_batch_rows(&r.max_batch)) {
            println!("{row}");
        }
    }

    let out = opts.out.clone().unwrap_or_else(|| root.join("target/bench"));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let json_path = out.join(format!("{}.json", r.matrix));
    let text = serde_json::to_string_pretty(&r)?;
    std::fs::write(&json_path, text + "\n").with_context(|| format!("writing {}", json_path.display()))?;
    let mut written = vec![json_path];
    for (name, svg) in plots(&r) {
        let p = out.join(name);
        std::fs::write(&p, svg).with_context(|| format!("writing {}", p.display()))?;
        written.push(p);
    }
    println!();
    for p in written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn missing_word(s: Status) -> String {
    match s {
        Status::Ok => String::new(),
        Status::Skipped => "skipped".into(),
        Status::Failed => "failed".into(),
    }
}

/// The SVG plots of a report: TFLOPS per model and policy, and max batch per model and policy.
fn plots(r: &Report) -> Vec<(String, String)> {
    let word = match r.source {
        Source::Predicted => "PREDICTED (simulator)",
        Source::Measured => "MEASURED (lt bench train)",
    };
    let mut out = Vec::new();
    if !r.rows.is_empty() {
        let batches: std::collections::BTreeSet<usize> = r.rows.iter().map(|x| x.batch_size).collect();
        let bars: Vec<svg::Bar> = r
            .rows
            .iter()
            .map(|x| svg::Bar {
                group: if batches.len() > 1 { format!("{}\nbatch {}", x.model, x.batch_size) } else { x.model.clone() },
                series: x.policy.name().to_string(),
                value: x.metrics.as_ref().and_then(|m| m.tflops_6pt).filter(|_| x.status == Status::Ok),
                missing: missing_word(x.status),
            })
            .collect();
        let seq = r.rows[0].seq_len;
        let b: Vec<String> = batches.iter().map(ToString::to_string).collect();
        let title = format!("{} TFLOPS (6 x params x tokens / step), {word}", r.hardware);
        let sub = format!("seq {seq}, batch {}; matrix {}", b.join("/"), r.matrix);
        out.push((format!("{}-tflops.svg", r.matrix), svg::bar_chart(&title, &sub, "TFLOPS", &bars)));
    }
    if !r.max_batch.is_empty() {
        let bars: Vec<svg::Bar> = r
            .max_batch
            .iter()
            .map(|x| svg::Bar {
                group: x.model.clone(),
                series: x.policy.name().to_string(),
                value: x.max_batch.filter(|_| x.status == Status::Ok).map(|b| b as f64),
                missing: missing_word(x.status),
            })
            .collect();
        let title = format!("{} largest batch in one micro-batch, {word}", r.hardware);
        let sub = format!("seq {}; matrix {}", r.max_batch[0].seq_len, r.matrix);
        out.push((format!("{}-max-batch.svg", r.matrix), svg::bar_chart(&title, &sub, "sequences", &bars)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/benchmarks.md's predicted tables are what lt-sched predicts now: a change to the cost
    /// model that moves a figure fails here until the docs say the new one.
    #[test]
    fn the_docs_predicted_tables_are_the_cost_models() {
        let root = root();
        let doc = std::fs::read_to_string(root.join("docs/benchmarks.md")).unwrap();
        // docs/benchmarks.md shows the H800 matrix's step rows and the RTX 3090's max batches.
        for (file, task, steps) in [("h800", "bench-h800", true), ("rtx3090", "bench-3090", false)] {
            let m = Matrix::load(&root.join(format!("xtask/matrices/{file}.toml")), &root).unwrap();
            let (mut rows, max_batch) = predict::run(&m).unwrap();
            report::fill_speedups(&mut rows);
            let want =
                if steps { report::markdown_step_rows(&rows) } else { report::markdown_max_batch_rows(&max_batch) };
            assert_eq!(want.len(), m.file.models.len(), "{file}: one row per model");
            let stale: Vec<&String> = want.iter().filter(|w| !doc.contains(w.as_str())).collect();
            assert!(
                stale.is_empty(),
                "docs/benchmarks.md lacks {stale:?}; `cargo xtask {task} --predict --markdown` prints:\n{}",
                want.join("\n")
            );
        }
    }
}
