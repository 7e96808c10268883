//! `lt-sched`: the planner of LazyTrain-rs — cost model, MILP, exact DP, simulator and baselines.
//!
//! It sits on `lt-core` (model shapes, hardware profiles) and nothing heavy: no Burn, no I/O engines.
//! `lt-exec` reads the [`Plan`] it produces and `lt plan` prints it.
//!
//! - [`cost`]: per-layer FLOPs, times, bytes and working sets ([`Instance`]) for a model, a step
//!   shape and a [`HardwareProfile`](lt_core::hardware::HardwareProfile).
//! - [`window`]: the analytic step time (PCIe/NVMe windows with exposed slack) and the memory rows in
//!   whole boundary slots; the decomposition of both into path edges.
//! - [`milp`]: the MILP over boundary placements (microlp), warm-started from [`dp`].
//! - [`dp`]: exact dynamic programs (cross-check, warm start, fallback, feasibility).
//! - [`sim`]: discrete-event replay with compute, H2D, D2H, NVMe and CPU streams, Chrome traces.
//! - [`planner`]: the search over step shapes, the baselines, max-batch and min-memory answers.
//! - [`plan`]: the versioned plan file the executor runs.
//!
//! Every time, FLOP rate and memory figure these modules produce is a prediction of the cost model.
//!
//! ```
//! use lt_core::{ModelConfig, hardware::BuiltinProfile};
//! use lt_sched::planner::{PlanRequest, plan};
//! let json = r#"{"model_type":"qwen2","vocab_size":1000,"hidden_size":256,"intermediate_size":1024,
//!   "num_hidden_layers":8,"num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-6,
//!   "rope_theta":1e6,"tie_word_embeddings":true}"#;
//! let model = ModelConfig::from_json_str(json).unwrap();
//! let out = plan(&model, &BuiltinProfile::Rtx3090.profile(), &PlanRequest::new(8, 512)).unwrap();
//! assert_eq!(out.plan.step.boundaries.len(), 9);
//! assert!(out.plan.predicted.step_seconds > 0.0);
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod cost;
pub mod dp;
mod error;
pub mod hardware;
pub mod milp;
pub mod plan;
pub mod planner;
pub mod sim;
pub mod window;
pub mod working_set;

pub use cost::{CostOptions, ExecConfig, Instance, OptimizerState};
pub use error::SchedError;
pub use plan::{OptimizerOverlap, Placement, Plan, Step, Tier, Upload};
pub use planner::Policy;
pub use sim::{SimReport, simulate};
