//! The streamed layer executor of LazyTrain-rs.
//!
//! `lt-exec` composes the model (`lt-model`), storage (`lt-storage`), planner (`lt-sched`) and host
//! optimizer (`lt-optim`). It runs one training step exactly as an [`plan::Step`] says: each
//! layer's weights are streamed to the device, boundary activations are kept on the device, in host
//! memory or on NVMe (or dropped and recomputed), gradients stream back to host buffers (fp32, or
//! bf16 as downloaded from a bf16 device: `grads::GradBuf`), and every operation is traced per
//! stream so exposure is measured, not estimated.
//!
//! ```no_run
//! use lt_exec::{executor::Executor, grads::HostGrads, plan::Step, state::SharedModel};
//! use lt_model::{CpuAutodiff, host::HostModel, model::Batch};
//! let host = HostModel::load(std::path::Path::new("tools/fixtures/models/qwen3-tied-mqa")).unwrap();
//! let plan = Step::every(host.config.num_layers(), 4, lt_exec::plan::Placement::Gpu);
//! let mut ex = Executor::<CpuAutodiff>::new(plan, lt_core::ByteSize::gib(1), Default::default(), None);
//! let batch = Batch::from_ids(vec![vec![1, 2, 3, 4]]);
//! let grads = std::sync::Arc::new(HostGrads::zeros_like(&host));
//! let model = std::sync::Arc::new(SharedModel::new(host, 0));
//! let r = ex.micro_batch(&model, &batch, batch.loss_tokens(), true, &grads, 0).unwrap();
//! println!("loss {}", r.loss);
//! ```
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod budget;
pub mod error;
pub mod executor;
pub mod grads;
pub mod persist;
pub mod plan;
pub mod state;
pub mod trace;
pub mod train;

pub use error::ExecError;
