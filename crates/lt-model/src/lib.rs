//! Qwen decoder layers in Burn, stateless over streamed weights.
//!
//! `lt-model` sits above `lt-core` and `lt-storage` and below `lt-exec`. A layer's forward takes the
//! weights the executor has just streamed in ([`weights::LayerWeights`]), so any host buffer can be
//! bound to any layer without rebuilding a module tree. One set of functions serves every family:
//! `qwen2`, `qwen3` and the hybrid `qwen3_5` differ only by config flags.
//!
//! ```no_run
//! use lt_model::{CpuBackend, host::HostModel, weights::DeviceModel, model::forward_logits};
//! let host = HostModel::load(std::path::Path::new("tools/fixtures/models/qwen3-tied-mqa")).unwrap();
//! let device = Default::default();
//! let model = DeviceModel::<CpuBackend>::from_host(&host, &device);
//! let logits = forward_logits(&model, &[vec![1, 2, 3]]);
//! assert_eq!(logits.dims(), [1, 3, host.config.vocab_size]);
//! ```

pub mod delta;
pub mod device;
pub mod error;
pub mod gemm;
pub mod generate;
pub mod host;
pub mod layer;
pub mod model;
pub mod ops;
pub mod stream;
pub mod upload;
pub mod weights;

pub use delta::DeltaForm;
pub use error::ModelError;

/// The CPU backend (ndarray, f32).
pub type CpuBackend = burn::backend::NdArray<f32>;
/// The CPU backend with autodiff.
pub type CpuAutodiff = burn::backend::Autodiff<CpuBackend>;

/// The CUDA backend: bf16 compute on the GPU (fp32 masters stay on the host).
#[cfg(feature = "cuda")]
pub type CudaBackend = burn_cuda::Cuda<half::bf16, i32>;
/// The CUDA backend with autodiff.
#[cfg(feature = "cuda")]
pub type CudaAutodiff = burn::backend::Autodiff<CudaBackend>;

/// The CUDA backend in f32: tight numerical checks against the CPU backend (`lt selftest`).
#[cfg(feature = "cuda")]
pub type CudaF32Backend = burn_cuda::Cuda<f32, i32>;
/// The f32 CUDA backend with autodiff.
#[cfg(feature = "cuda")]
pub type CudaF32Autodiff = burn::backend::Autodiff<CudaF32Backend>;

/// The device runtime crates, for code that works on burn-cubecl's tensors (the matmul hook's tests).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub use {burn_cubecl, cubecl};

/// The wgpu backend (Vulkan, Metal, DX12; lavapipe in CI), in f32: WGSL has no bf16, so weights are
/// uploaded and computed in f32 (4 bytes per element on the device, which the budget counts).
#[cfg(feature = "wgpu")]
pub type WgpuBackend = burn_wgpu::Wgpu<f32, i32>;
/// The wgpu backend with autodiff.
#[cfg(feature = "wgpu")]
pub type WgpuAutodiff = burn::backend::Autodiff<WgpuBackend>;
