//! A whole LazyTrain-rs training run as a library: prepare the data, choose the plan, run it on the
//! streamed executor, evaluate held-out exact match, export the model — what `lt train` does,
//! callable from any Rust project.
//!
//! A run is built from a [`RunConfig`] (the same keys as `lt train`'s flags and its TOML run file)
//! and reports through [`Observer`]s; it returns a [`RunReport`].
//!
//! ```no_run
//! use lt_run::{Event, Run, RunConfig};
//!
//! let config = RunConfig::default() // no model and no data: the built-in demo
//!     .steps(40)
//!     .batch_size(4)
//!     .out("runs/demo");
//! let report = Run::builder(config)
//!     .observer(|e: &Event<'_>| {
//!         if let Event::Step { metrics, .. } = e {
//!             println!("step {} loss {:.4}", metrics.step, metrics.loss);
//!         }
//!         Ok(())
//!     })
//!     .build()?
//!     .execute()?;
//! println!("exact match {:?}, model in {}", report.exact_match.map(|a| a.rate()), report.model_dir.display());
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! On the CPU backend, a program that owns its process should call
//! `lt_core::hostmem::tune_malloc()` first, as `lt` does: with glibc's default thresholds the
//! backend's per-operation tensors are mapped and unmapped every step (the demo ran 1.25x slower,
//! most of the difference in the kernel). A library does not change that process-wide policy for
//! you.
//!
//! Lower layers, for a project that needs only part of this: `lt-exec` (the streamed executor and
//! trainer), `lt-sched` (the planner), `lt-optim` (the 8-bit AdamW), `lt-model` (Qwen layers).

pub mod checkpointing;
pub mod config;
pub mod data;
pub mod device;
pub mod evaluate;
pub mod fsutil;
pub mod observe;
pub mod plan;
pub mod plot;
pub mod run;
pub mod spill;

pub use config::{OptimizerChoice, Policy, RunConfig, RunSettings, SaveEvery};
pub use device::DeviceChoice;
pub use observe::{Event, MetricsFile, Observer, Pictures};
pub use plan::{BudgetTooSmall, ChosenPlan, choose_plan, executor_for};
pub use run::{Run, RunBuilder, RunReport};
