//! `--device`: the compute backends a command can run on, and what is needed to reach each one.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// Compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceChoice {
    /// ndarray on the CPU; "GPU memory" is a budget the executor enforces.
    Cpu,
    /// burn-cuda, bf16 (binary built with `--features cuda`).
    Cuda,
    /// burn-wgpu, f32: Vulkan, Metal or DX12 GPUs (AMD, Intel, Apple), or lavapipe on a CPU
    /// (binary built with `--features wgpu`). Slower than CUDA; not yet measured on a GPU.
    Wgpu,
}

impl DeviceChoice {
    /// Bytes of the executor's float on this device (f32 on ndarray and wgpu, bf16 on CUDA): what the
    /// planner must count activations and uploads in, so that its plan is the step the executor runs.
    pub fn float_bytes(self) -> u32 {
        match self {
            DeviceChoice::Cpu | DeviceChoice::Wgpu => 4,
            DeviceChoice::Cuda => 2,
        }
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Cuda => "cuda",
            DeviceChoice::Wgpu => "wgpu",
        }
    }

    /// The float dtype the backend computes in.
    pub fn dtype(self) -> &'static str {
        match self {
            DeviceChoice::Cpu | DeviceChoice::Wgpu => "f32",
            DeviceChoice::Cuda => "bf16",
        }
    }
}

/// The built-in hardware profile a benchmark on `device` predicts for when none is given: `h200` on
/// CUDA, `cpu` otherwise (wgpu has no built-in profile: `lt profile --device wgpu` measures one).
pub fn default_profile(device: DeviceChoice) -> lt_core::hardware::BuiltinProfile {
    match device {
        DeviceChoice::Cuda => lt_core::hardware::BuiltinProfile::H200,
        DeviceChoice::Cpu | DeviceChoice::Wgpu => lt_core::hardware::BuiltinProfile::Cpu,
    }
}

/// The error for a backend this binary was built without.
pub fn not_built(device: DeviceChoice) -> anyhow::Error {
    let d = device.name();
    anyhow::anyhow!(
        "--device {d}: this `lt` was built without {d}; rebuild with `cargo build --release --features {d} -p lt-cli`"
    )
}

/// The CUDA device (device 0), after the set-up Burn leaves to the application (the on-disk kernel
/// cache and page-locked upload copies: `lt_model::device::cuda::setup`), reported once on stderr;
/// one line saying what is missing when there is no driver or device.
#[cfg(feature = "cuda")]
pub fn cuda() -> anyhow::Result<<lt_model::CudaBackend as burn::tensor::backend::BackendTypes>::Device> {
    static SAID: std::sync::Once = std::sync::Once::new();
    let s =
        lt_model::device::cuda::setup().map_err(|e| anyhow::anyhow!("--device cuda: cannot initialise CUDA: {e}"))?;
    SAID.call_once(|| {
        let cache = match &s.kernel_cache {
            Some(d) => format!("compiled kernels cached in {} (LT_KERNEL_CACHE to move, =off to disable)", d.display()),
            None => "no kernel cache (LT_KERNEL_CACHE=off, or set by a cubecl.toml)".into(),
        };
        let pin = if s.pinning { "upload copies page-locked" } else { "upload copies pageable (LT_PIN_COPY=0)" };
        let gemm = if s.gemm == "cublas" { "GEMMs by cuBLAS (LT_GEMM=cublas)" } else { "GEMMs by cubecl's kernels" };
        eprintln!(
            "cuda: device 0, compute capability {}.{}; {cache}; {pin}; {gemm}",
            s.compute_capability.0, s.compute_capability.1
        );
    });
    Ok(Default::default())
}

/// The wgpu device, its runtime initialised; one line saying how to get an adapter when there is none.
#[cfg(feature = "wgpu")]
pub fn wgpu() -> anyhow::Result<<lt_model::WgpuBackend as burn::tensor::backend::BackendTypes>::Device> {
    lt_model::device::wgpu_device().map_err(|e| anyhow::anyhow!("--device wgpu: {e}"))
}
