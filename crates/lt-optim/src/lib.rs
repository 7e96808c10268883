//! Host-side AdamW for LazyTrain-rs: fp32 and block-wise 8-bit state, with fused gradient clipping.
//!
//! `lt-optim` sits beside `lt-storage` and `lt-sched` on top of `lt-core`, and depends on no tensor
//! library: parameters, gradients and states are plain host slices, so the executor (`lt-exec`)
//! can update layer `i` on the CPU while the GPU is still running backward for other layers.
//!
//! - [`OptimizerKind::AdamW`]: fp32 moments, the same f32 arithmetic as `torch.optim.AdamW`.
//! - [`OptimizerKind::AdamW8bit`]: moments stored as one byte per element in blocks of 256 with one
//!   f32 absmax per block (bitsandbytes' dynamic maps, about 2.03 bytes of state per parameter);
//!   tensors under 4096 elements keep fp32 state. Codes are the exact nearest map entry (the rule
//!   bitsandbytes specifies; its CPU kernel deviates near zero, documented in [`qmap`]), found by
//!   one table read per element instead of a binary search. AVX-512 and AVX2 kernels (chosen at
//!   run time; [`q8_kernel_name`] says which) give results bit-identical to the portable one (see
//!   `kernels`).
//! - [`Q8Codes::F8`] (`adamw8bit-f8`): the same block layout with the codes as small floats (E4M3 for
//!   `m`, an E5M3 for `v`), found and read with a few integer operations instead of a table search:
//!   a faster update where the dynamic maps' search is the bottleneck, each value to 6.25%, `v`
//!   rounded with a deterministic dither (see `f8`).
//! - Fast clipping: [`grad`] returns each layer's sum of squares while converting or accumulating its
//!   gradients, [`GradNorm`] adds them, and the clip scale is applied inside the update kernel.
//! - The upload copy: [`ParamGroup::update_with_copy`] also writes each updated weight as bf16
//!   (`half::bf16::from_f32`, bit for bit) in the same pass, so streaming uploads need no
//!   conversion pass; [`fill_bf16`] makes the first copy on the pool's threads.
//! - [`AdamW::save`] / [`AdamW::load`]: versioned, checksummed checkpoints.
//!
//! ```
//! use lt_optim::{AdamW, AdamWConfig, Grad, GradNorm, OptimizerKind, StepOutcome, ThreadPool, grad};
//!
//! let pool = ThreadPool::new(2)?;
//! let cfg = AdamWConfig { lr: 1e-3, max_grad_norm: Some(1.0), ..Default::default() };
//! let mut opt = AdamW::new(cfg, OptimizerKind::adamw8bit())?;
//! let layer = opt.add_group("layers.0", &[("mlp.up_proj", 8192), ("input_layernorm", 64)])?;
//!
//! let (mut w, mut ln) = (vec![0.5f32; 8192], vec![1.0f32; 64]);
//! let (gw, gln) = (vec![lt_optim::bf16::from_f32(0.01); 8192], vec![0.02f32; 64]);
//!
//! // As the layer's gradients arrive: widen bf16 -> f32 and take the sum of squares in one pass.
//! let mut gw32 = vec![0f32; 8192];
//! let mut norm = GradNorm::new();
//! norm.add(grad::copy_into(Grad::Bf16(&gw), &mut gw32, 1.0, &pool)?);
//! norm.add(grad::sum_squares(Grad::F32(&gln), &pool));
//!
//! // Once every layer has reported: one step number and clip scale for all groups.
//! if let StepOutcome::Apply(ctx) = opt.begin_step(norm.norm()) {
//!     opt.groups_mut()[layer].update(&mut [&mut w, &mut ln], &[Grad::F32(&gw32), Grad::F32(&gln)], &ctx, &pool)?;
//! }
//! assert_eq!(opt.step_count(), 1);
//! assert!(w[0] < 0.5);
//! # Ok::<(), lt_optim::OptimError>(())
//! ```
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod affine;
mod checkpoint;
mod config;
mod copy;
mod error;
mod f8;
pub mod grad;
mod kernels;
mod optimizer;
mod pool;
pub mod qmap;
mod qmap_tables;
mod simd;
#[cfg(test)]
mod testutil;

pub use checkpoint::{FORMAT_VERSION, MAGIC};
pub use config::{AdamWConfig, OptimizerKind, Q8Codes, Quant8Config};
pub use copy::fill_bf16;
pub use error::{OptimError, Result};
pub use grad::{Grad, GradNorm};
/// The bf16 type of [`Grad::Bf16`] (re-exported so callers need not depend on `half`).
pub use half::bf16;
pub use optimizer::{AdamW, ParamGroup, StepCtx, StepOutcome, TensorState};
pub use pool::ThreadPool;
pub use qmap::QuantMap;
pub use simd::{SimdLevel, copy_stores_name_for, q8_kernel_name, q8_kernel_name_for, simd_level};
