//! `lt bench optimizer`: host optimizer update throughput (AdamW fp32 or 8-bit).
//!
//! Allocates `--params` fp32 master weights, one gradient buffer (f32 or bf16) and the optimizer
//! state as a single parameter group, runs `--warmup` untimed steps and `--steps` timed steps
//! (each one `begin_step` + one group update, clipping active), and reports throughput. The last
//! stdout line is JSON when `--json` is given.
//!
//! Memory-traffic accounting (`bytes_per_param`), per parameter per step: fp32 weight read + write
//! (8), the gradient read (4 or 2), and the state read + write: fp32 `m` and `v` (16) for
//! `adamw`; for `adamw8bit`, one code byte each for `m` and `v` read and written (4) plus the
//! per-block absmax floats read and written (16 / block size). `state_bytes_per_param` is the
//! state actually allocated divided by the parameter count.
//!
//! `--write-copy bf16` times the update that also writes the bf16 copy of the weights which
//! streaming uploads (`ParamGroup::update_with_copy`; the copy is filled once before the warm-up
//! with `lt_optim::fill_bf16`); it adds 2 bytes/param of stores to `bytes_per_param` and reports
//! `"write_copy": "bf16"` in the JSON (`"none"` otherwise).
//!
//! `--turns IN,OUT` makes the timed steps take turns with another benchmark process (the PyTorch
//! baseline in `tools/bench_optimizer_vs_torch.sh`) through two named pipes: after its warm-up,
//! each process passes one token round the ring without stepping (so that neither times a step
//! while the other is still starting up), then runs `--turn-steps` timed steps each time it holds
//! the token, and passes it on. The two processes' timed steps then alternate every fraction of a
//! second and see the same background load, which on a shared machine moves both medians alike
//! instead of whichever process happened to run during a burst.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::ValueEnum;
use lt_core::HostCpu;
use lt_core::hostmem::huge_collect;
use lt_model::upload::CopyBuf;
use lt_optim::{
    AdamW, AdamWConfig, Grad, OptimizerKind, Q8Codes, Quant8Config, StepOutcome, ThreadPool, bf16,
    copy_stores_name_for, fill_bf16, q8_kernel_name_for, simd_level,
};

/// Which optimizer to benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchOptimizer {
    /// fp32 moments (PyTorch's AdamW arithmetic).
    Adamw,
    /// 8-bit block-wise moments, bitsandbytes' dynamic maps.
    Adamw8bit,
    /// 8-bit block-wise moments, the f8 codes (small floats found by integer rounding).
    #[value(name = "adamw8bit-f8")]
    Adamw8bitF8,
}

/// Gradient element type handed to the optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GradDtype {
    /// 4-byte gradients.
    F32,
    /// 2-byte gradients, as downloaded from the GPU.
    Bf16,
}

/// Whether the update also writes a low-precision copy of the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WriteCopy {
    /// Only the fp32 master weights.
    None,
    /// Also the bf16 copy that streaming uploads, in the same pass.
    Bf16,
}

/// Arguments of `lt bench optimizer`.
#[derive(Debug, clap::Args)]
pub struct BenchOptimizerArgs {
    /// Optimizer to run.
    #[arg(long, value_enum, default_value = "adamw8bit")]
    pub optimizer: BenchOptimizer,
    /// Number of parameters (a plain count, or with a K/M/G suffix meaning 10^3/10^6/10^9).
    #[arg(long, default_value = "64M", value_parser = parse_count)]
    pub params: usize,
    /// Threads updating (the caller plus workers).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Gradient dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    pub grad_dtype: GradDtype,
    /// Timed steps.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Untimed warm-up steps (first-touch page faults, caches, worker wake-up).
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Quantization block size for adamw8bit.
    #[arg(long, default_value_t = 256)]
    pub block: usize,
    /// Also write this copy of the updated weights (the upload copy) in the same pass.
    #[arg(long, value_enum, default_value = "none")]
    pub write_copy: WriteCopy,
    /// Print a JSON summary as the last stdout line (human-readable lines go to stderr).
    #[arg(long)]
    pub json: bool,
    /// Take turns with another benchmark process through two named pipes (`mkfifo`): wait for a
    /// byte on IN before each --turn-steps timed steps, write one to OUT after them. The partner
    /// gets the same pipes the other way round; one byte written to the first process's IN
    /// starts the ring. Both processes must time the same number of turns; the one that finishes
    /// last leaves the token in the other's pipe, so a ring serves one pair of runs.
    #[arg(long, value_name = "IN,OUT", value_parser = parse_turns)]
    pub turns: Option<Turns>,
    /// Timed steps per turn with --turns.
    #[arg(long, default_value_t = 5, requires = "turns")]
    pub turn_steps: usize,
    /// With --turns, milliseconds to wait after taking the token before the turn's first timed
    /// step, so that the partner's threads have gone idle (an OpenMP runtime's workers spin for
    /// milliseconds after their last parallel region and took a core from this side's first step).
    #[arg(long, default_value_t = 0, requires = "turns")]
    pub turn_settle_ms: u64,
}

/// The two named pipes of `--turns`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turns {
    /// Where this process waits for the token.
    pub input: PathBuf,
    /// Where it passes the token on.
    pub output: PathBuf,
}

fn parse_turns(s: &str) -> Result<Turns, String> {
    match s.split_once(',') {
        Some((i, o)) if !i.is_empty() && !o.is_empty() => Ok(Turns { input: i.into(), output: o.into() }),
        _ => Err(format!("expected IN,OUT (two pipe paths separated by a comma), got {s:?}")),
    }
}

/// One end of the token ring (`--turns`).
struct Baton<R, W> {
    input: R,
    output: W,
    /// The pipe paths, for error messages.
    names: (String, String),
}

impl Baton<File, File> {
    /// Opens both pipes read-write, which on Linux never blocks on a FIFO and keeps it open (no
    /// end-of-file, no broken pipe) whatever the partner does.
    fn open(t: &Turns) -> anyhow::Result<Self> {
        let open = |p: &Path| {
            OpenOptions::new().read(true).write(true).open(p).with_context(|| format!("opening {}", p.display()))
        };
        Ok(Baton {
            input: open(&t.input)?,
            output: open(&t.output)?,
            names: (t.input.display().to_string(), t.output.display().to_string()),
        })
    }
}

impl<R: Read, W: Write> Baton<R, W> {
    /// Blocks until the token arrives.
    fn wait(&mut self) -> anyhow::Result<()> {
        let mut b = [0u8; 1];
        match self.input.read(&mut b) {
            Ok(1) => Ok(()),
            Ok(_) => bail!(
                "{}: closed before the token came (is it a named pipe, and is the partner running?)",
                self.names.0
            ),
            Err(e) => Err(e).with_context(|| format!("waiting for the token on {}", self.names.0)),
        }
    }

    /// Passes the token on.
    fn pass(&mut self) -> anyhow::Result<()> {
        self.output.write_all(b"t").with_context(|| format!("passing the token on {}", self.names.1))
    }
}

fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('G') => (&t[..t.len() - 1], 1e9),
        _ => (t, 1.0),
    };
    let v: f64 = num.trim().parse().map_err(|_| format!("invalid count {s:?} (examples: 67108864, 64M, 1.5G)"))?;
    let n = v * mult;
    if !(n.is_finite() && (1.0..=1e12).contains(&n)) {
        return Err(format!("count {s:?} out of range (1 ..= 1e12)"));
    }
    Ok(n.round() as usize)
}

/// Run the command.
pub fn run(args: &BenchOptimizerArgs) -> anyhow::Result<()> {
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if args.threads == 0 {
        bail!("--threads must be at least 1");
    }
    if args.turn_steps == 0 {
        bail!("--turn-steps must be at least 1");
    }
    // Opened before the (long) set-up, so that a wrong path fails at once.
    let mut baton = args.turns.as_ref().map(Baton::open).transpose()?;
    let n = args.params;
    let kind = optimizer_kind(args);
    // Clipping on (scale < 1 every step) so the fused clip multiply is part of what is timed.
    let cfg = AdamWConfig { max_grad_norm: Some(1.0), ..Default::default() };
    let mut opt = AdamW::new(cfg, kind).context("creating the optimizer")?;
    opt.add_group("bench", &[("w", n)]).context("registering the parameter group")?;
    let pool = ThreadPool::new(args.threads).context("starting worker threads")?;

    let (mut params, g32) = synthetic_inputs(n);
    let g16: Vec<bf16>;
    let grad = match args.grad_dtype {
        GradDtype::F32 => Grad::F32(&g32),
        GradDtype::Bf16 => {
            g16 = huge_collect(n, g32.iter().map(|&x| bf16::from_f32(x)));
            Grad::Bf16(&g16)
        }
    };
    let norm = lt_optim::grad::sum_squares(grad, &pool).sqrt();
    // The copy as the trainer allocates its upload copies (`CopyBuf`: on whole pages of its own, so
    // 64-byte aligned, where the 8-bit kernels may stream it).
    let mut copy_buf = CopyBuf::zeroed(if args.write_copy == WriteCopy::Bf16 { n } else { 0 });
    let copy = copy_buf.as_mut_slice();
    if args.write_copy == WriteCopy::Bf16 {
        fill_bf16(&params, copy, &pool).context("filling the bf16 copy")?;
    }

    let times = time_steps(args, &mut opt, &mut params, copy, grad, norm, &pool, baton.as_mut())?;
    if !params.iter().all(|p| p.is_finite()) {
        bail!("weights became non-finite during the benchmark");
    }
    if copy.iter().zip(&params).any(|(c, &p)| c.to_bits() != bf16::from_f32(p).to_bits()) {
        bail!("the bf16 copy does not match the updated weights");
    }
    report(args, kind, &times, opt.state_bytes(), copy);
    Ok(())
}

/// The optimizer kind `--optimizer` (and `--block`) selects.
fn optimizer_kind(args: &BenchOptimizerArgs) -> OptimizerKind {
    match args.optimizer {
        BenchOptimizer::Adamw => OptimizerKind::AdamW,
        BenchOptimizer::Adamw8bit => {
            OptimizerKind::AdamW8bit(Quant8Config { block_size: args.block, ..Default::default() })
        }
        BenchOptimizer::Adamw8bitF8 => {
            OptimizerKind::AdamW8bit(Quant8Config { block_size: args.block, codes: Q8Codes::F8, ..Default::default() })
        }
    }
}

/// Deterministic pseudo-random weights and fp32 gradients with a spread of magnitudes, so that
/// absmax and codes vary across blocks as in training.
fn synthetic_inputs(n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        ((rng >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    // On huge pages, as the trainer's masters and gradients are (`lt_core::hostmem`).
    let params: Vec<f32> = huge_collect(n, (0..n).map(|_| 0.05 * next()));
    let g32: Vec<f32> = huge_collect(n, (0..n).map(|i| next() * 10f32.powi(-((i / 4096) as i32 % 4))));
    (params, g32)
}

/// Runs the warm-up and timed steps, the timed ones in turns when `baton` is given (see the module
/// docs); returns the timed steps' durations in seconds.
#[allow(clippy::too_many_arguments)]
fn time_steps<R: Read, W: Write>(
    args: &BenchOptimizerArgs,
    opt: &mut AdamW,
    params: &mut [f32],
    copy: &mut [bf16],
    grad: Grad<'_>,
    norm: f64,
    pool: &ThreadPool,
    mut baton: Option<&mut Baton<R, W>>,
) -> anyhow::Result<Vec<f64>> {
    let mut times = Vec::with_capacity(args.steps);
    let end = args.warmup + args.steps;
    for s in 0..end {
        if let Some(b) = baton.as_deref_mut()
            && s >= args.warmup
            && (s - args.warmup).is_multiple_of(args.turn_steps)
        {
            if s == args.warmup {
                // The start-up lap: the token goes round once, so both processes are set up.
                b.wait()?;
                b.pass()?;
            }
            b.wait()?;
            std::thread::sleep(std::time::Duration::from_millis(args.turn_settle_ms));
        }
        let t0 = Instant::now();
        let StepOutcome::Apply(ctx) = opt.begin_step(norm) else {
            bail!("benchmark gradient norm is not finite");
        };
        let group = &mut opt.groups_mut()[0];
        match args.write_copy {
            WriteCopy::None => group.update(&mut [&mut *params], &[grad], &ctx, pool),
            WriteCopy::Bf16 => group.update_with_copy(&mut [&mut *params], &mut [&mut *copy], &[grad], &ctx, pool),
        }
        .context("optimizer update")?;
        if s >= args.warmup {
            times.push(t0.elapsed().as_secs_f64());
            if let Some(b) = baton.as_deref_mut()
                && ((s + 1 - args.warmup).is_multiple_of(args.turn_steps) || s + 1 == end)
            {
                b.pass()?;
            }
        }
    }
    Ok(times)
}

/// Prints the human-readable summary and, with `--json`, the JSON line (median and best step
/// seconds, every timed step's seconds in run order, optimizer state bytes allocated).
fn report(args: &BenchOptimizerArgs, kind: OptimizerKind, times: &[f64], state_bytes: usize, copy: &[bf16]) {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    let (median, best) = (sorted[sorted.len() / 2], sorted[0]);
    let n = args.params;
    let grad_bytes = if args.grad_dtype == GradDtype::F32 { 4.0 } else { 2.0 };
    let state_traffic = match kind {
        OptimizerKind::AdamW => 16.0,
        OptimizerKind::AdamW8bit(q) => 4.0 + 16.0 / q.block_size as f64,
    };
    let copy_bytes = if args.write_copy == WriteCopy::Bf16 { 2.0 } else { 0.0 };
    let bytes_per_param = 8.0 + grad_bytes + state_traffic + copy_bytes;
    let gparams = n as f64 / median / 1e9;
    let state_bytes_per_param = state_bytes as f64 / n as f64;
    let name = kind.name();
    let dtype = match args.grad_dtype {
        GradDtype::F32 => "f32",
        GradDtype::Bf16 => "bf16",
    };
    let write_copy = match args.write_copy {
        WriteCopy::None => "none",
        WriteCopy::Bf16 => "bf16",
    };
    // How the copy was stored (the fp32 kernels never stream it).
    let copy_stores = (args.write_copy == WriteCopy::Bf16).then(|| match kind {
        OptimizerKind::AdamW8bit(q) => copy_stores_name_for(&q, copy),
        _ => "cached",
    });
    let stores = copy_stores.map(|s| format!(" ({s} stores)")).unwrap_or_default();
    // The 8-bit kernel family (the fp32 kernels are auto-vectorised at the same SIMD level).
    let kernel = match kind {
        OptimizerKind::AdamW8bit(q) => q8_kernel_name_for(&q),
        _ => simd_level().name(),
    };
    // A host speed: it holds for this CPU only, so the CPU is named next to it.
    let host = HostCpu::detect();
    let turns = if args.turns.is_some() { format!(", in turns of {} steps", args.turn_steps) } else { String::new() };
    let human = format!(
        "{name}: {n} params, {} threads, {dtype} grads, copy {write_copy}{stores}, kernel {kernel}{turns}: median {:.3} \
         ms/step (best {:.3}), {gparams:.3} Gparam/s, {:.1} GB/s at {bytes_per_param:.2} B/param, state \
         {state_bytes_per_param:.3} B/param; host {host}",
        args.threads,
        median * 1e3,
        best * 1e3,
        gparams * bytes_per_param,
    );
    if args.json {
        eprintln!("{human}");
        let j = serde_json::json!({
            "optimizer": name,
            "params": n,
            "threads": args.threads,
            "grad_dtype": dtype,
            "block": if matches!(kind, OptimizerKind::AdamW8bit(_)) { Some(args.block) } else { None },
            "simd": simd_level().name(),
            "kernel": kernel,
            "host_cpu": host,
            "write_copy": write_copy,
            "copy_stores": copy_stores,
            "warmup": args.warmup,
            "steps": args.steps,
            "turn_steps": args.turns.as_ref().map(|_| args.turn_steps),
            "seconds_per_step_median": median,
            "seconds_per_step_best": best,
            // In run order: with --turns, each turn's first step shows what the hand-over cost.
            "seconds_per_step": times,
            "gparams_per_s": gparams,
            "gparams_per_s_best": n as f64 / best / 1e9,
            "bytes_per_param": bytes_per_param,
            "gbytes_per_s": gparams * bytes_per_param,
            "state_bytes_per_param": state_bytes_per_param,
        });
        println!("{j}");
    } else {
        println!("{human}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_parse_with_suffixes_and_reject_garbage() {
        assert_eq!(parse_count("64M"), Ok(64_000_000));
        assert_eq!(parse_count("67108864"), Ok(67_108_864));
        assert_eq!(parse_count("1.5k"), Ok(1500));
        assert!(parse_count("0").is_err());
        assert!(parse_count("many").is_err());
        assert!(parse_count("-3M").is_err());
    }

    /// A tiny run of each optimizer with the bf16 copy (the run itself checks that the copy
    /// matches the updated weights).
    #[test]
    fn runs_with_the_bf16_copy() {
        for optimizer in [BenchOptimizer::Adamw, BenchOptimizer::Adamw8bit] {
            let args = BenchOptimizerArgs {
                optimizer,
                params: 70_000,
                threads: 2,
                grad_dtype: GradDtype::Bf16,
                steps: 2,
                warmup: 1,
                block: 256,
                write_copy: WriteCopy::Bf16,
                json: false,
                turns: None,
                turn_steps: 5,
                turn_settle_ms: 0,
            };
            if let Err(e) = run(&args) {
                panic!("{optimizer:?} with --write-copy bf16: {e:#}");
            }
        }
    }

    #[test]
    fn turns_parse_as_two_paths() {
        assert_eq!(parse_turns("/tmp/a,/tmp/b"), Ok(Turns { input: "/tmp/a".into(), output: "/tmp/b".into() }));
        assert!(parse_turns("/tmp/a").is_err());
        assert!(parse_turns(",/tmp/b").is_err());
    }

    /// Two batons on a ring of pipes hand the token back and forth: each side's turns strictly
    /// alternate with the other's, starting where the token was written.
    #[test]
    fn batons_alternate() {
        let (ra, wa) = std::io::pipe().unwrap();
        let (rb, wb) = std::io::pipe().unwrap();
        let mut start = wa.try_clone().unwrap();
        let log = std::sync::Mutex::new(Vec::new());
        let names = || ("in".to_string(), "out".to_string());
        let mut a = Baton { input: ra, output: wb, names: names() };
        let mut b = Baton { input: rb, output: wa, names: names() };
        std::thread::scope(|s| {
            for (id, baton) in [(0, &mut a), (1, &mut b)] {
                let log = &log;
                s.spawn(move || {
                    for _ in 0..5 {
                        baton.wait().unwrap();
                        log.lock().unwrap().push(id);
                        baton.pass().unwrap();
                    }
                });
            }
            start.write_all(b"t").unwrap();
        });
        assert_eq!(log.into_inner().unwrap(), [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]);
    }

    /// A closed input is an error that names the pipe, not a hang or a panic.
    #[test]
    fn a_closed_pipe_is_a_clear_error() {
        let (r, w) = std::io::pipe().unwrap();
        let (_r2, w2) = std::io::pipe().unwrap();
        drop(w);
        let mut baton = Baton { input: r, output: w2, names: ("/tmp/lt-in".into(), "/tmp/lt-out".into()) };
        let e = baton.wait().unwrap_err().to_string();
        assert!(e.contains("/tmp/lt-in") && e.contains("closed"), "{e}");
    }

    /// Two benchmark runs on one ring of named pipes (as the acceptance script runs lt and
    /// PyTorch) both finish, with a last turn shorter than the others.
    #[cfg(unix)]
    #[test]
    fn two_runs_take_turns_through_named_pipes() {
        let dir = tempfile::tempdir().unwrap();
        let (x, y) = (dir.path().join("x"), dir.path().join("y"));
        for p in [&x, &y] {
            let ok = std::process::Command::new("mkfifo").arg(p).status().map(|s| s.success()).unwrap_or(false);
            if !ok {
                eprintln!("mkfifo is not available here; nothing to check");
                return;
            }
        }
        let args = |input: &Path, output: &Path| BenchOptimizerArgs {
            optimizer: BenchOptimizer::Adamw8bit,
            params: 20_000,
            threads: 1,
            grad_dtype: GradDtype::Bf16,
            steps: 7,
            warmup: 1,
            block: 256,
            write_copy: WriteCopy::Bf16,
            json: false,
            turns: Some(Turns { input: input.into(), output: output.into() }),
            turn_steps: 3,
            turn_settle_ms: 1,
        };
        let mut start = OpenOptions::new().read(true).write(true).open(&x).unwrap();
        // Detached threads and a deadline: a broken protocol fails the test instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        for a in [args(&x, &y), args(&y, &x)] {
            let tx = tx.clone();
            std::thread::spawn(move || tx.send(run(&a).map_err(|e| format!("{e:#}"))));
        }
        start.write_all(b"t").unwrap();
        for _ in 0..2 {
            let r = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("the two runs did not finish");
            r.unwrap();
        }
    }
}
