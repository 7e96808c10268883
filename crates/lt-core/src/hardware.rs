//! Hardware profiles: the figures about a machine that the planner's cost model and the executor share.
//!
//! A profile is plain data. It comes from one of the built-in profiles ([`BuiltinProfile`]), from a TOML
//! file (parsed and validated by `lt_sched::hardware`), or later from measurement (`lt profile`). Sizes
//! accept both bytes and human strings in files (`gpu_memory = "80GB"`); bandwidths are decimal GB/s and
//! compute is dense TFLOPS in the compute dtype.
//!
//! Every number of a built-in profile names its source below. Numbers marked *assumption* are not
//! published or measured figures: they are our best estimate, and a measured profile should replace them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize};

use crate::ByteSize;

/// What the cost model needs to know about one machine (one GPU, its host and its NVMe drive).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareProfile {
    /// Short name (`h800`, `rtx3090`, ... or the file's own).
    pub name: String,
    /// One line describing the machine and where its figures come from.
    #[serde(default)]
    pub description: String,
    /// GPU memory the plan may use (for the `cpu` profile: the budget the CPU executor enforces).
    #[serde(deserialize_with = "size_from_int_or_str")]
    pub gpu_memory: ByteSize,
    /// Host memory the run may use (fp32 master weights, optimizer state, pinned buffers, activations).
    #[serde(deserialize_with = "size_from_int_or_str")]
    pub host_memory: ByteSize,
    /// NVMe space the run may use for spilled activations (0 disables the tier).
    #[serde(deserialize_with = "size_from_int_or_str")]
    pub nvme_capacity: ByteSize,
    /// Host-to-device bandwidth from pinned memory, decimal GB/s.
    pub h2d_gb_per_s: f64,
    /// Device-to-host bandwidth into pinned memory, decimal GB/s.
    pub d2h_gb_per_s: f64,
    /// NVMe sequential read bandwidth, decimal GB/s.
    pub nvme_read_gb_per_s: f64,
    /// NVMe sequential write bandwidth, decimal GB/s.
    pub nvme_write_gb_per_s: f64,
    /// Dense peak throughput of the compute dtype (bf16 on GPUs, f32 on the CPU), TFLOPS.
    pub peak_tflops: f64,
    /// Fraction of `peak_tflops` that a decoder layer achieves on large inputs (0, 1].
    pub efficiency: f64,
    /// The same for a Gated DeltaNet (linear-attention) layer, whose chunked delta rule runs many
    /// small `64 x 64` matmuls; absent: `efficiency` (not calibrated for hybrid models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_efficiency: Option<f64>,
    /// Host optimizer (fp32 AdamW) throughput, billions of parameters per second.
    pub optimizer_gparams_per_s: f64,
    /// GPU memory held outside the plan: CUDA context, allocator slack.
    #[serde(default = "default_gpu_reserved", deserialize_with = "size_from_int_or_str")]
    pub gpu_reserved: ByteSize,
    /// Rows of a GEMM at which it reaches half of `efficiency` (efficiency scales as `m / (m + this)`).
    #[serde(default = "default_gemm_half_rows")]
    pub gemm_half_efficiency_rows: f64,
    /// Bytes per element of weights and activations on the device (2 for bf16, 4 for f32).
    #[serde(default = "default_dtype_bytes")]
    pub compute_dtype_bytes: u32,
}

/// 1.5 GiB: a CUDA context with cuBLAS/NVRTC handles takes about 0.5-1 GiB, plus allocator slack
/// (assumption; measure with `lt profile`).
fn default_gpu_reserved() -> ByteSize {
    ByteSize::mib(1536)
}

/// 64 rows: tensor-core GEMMs tile M in 64-128 row blocks, so a GEMM with few rows leaves most of a tile
/// idle (assumption; fits the usual shape of GEMM efficiency versus M).
fn default_gemm_half_rows() -> f64 {
    64.0
}

/// bf16.
fn default_dtype_bytes() -> u32 {
    2
}

/// Accept `80000000000` or `"80GB"` for a size field.
fn size_from_int_or_str<'de, D: Deserializer<'de>>(d: D) -> Result<ByteSize, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Int(u64),
        Str(String),
    }
    match Raw::deserialize(d)? {
        Raw::Int(n) => Ok(ByteSize(n)),
        Raw::Str(s) => s.parse::<ByteSize>().map_err(serde::de::Error::custom),
    }
}

const GB: f64 = 1e9;

impl HardwareProfile {
    /// Host-to-device bandwidth in bytes per second.
    pub fn h2d_bytes_per_s(&self) -> f64 {
        self.h2d_gb_per_s * GB
    }
    /// Device-to-host bandwidth in bytes per second.
    pub fn d2h_bytes_per_s(&self) -> f64 {
        self.d2h_gb_per_s * GB
    }
    /// NVMe read bandwidth in bytes per second.
    pub fn nvme_read_bytes_per_s(&self) -> f64 {
        self.nvme_read_gb_per_s * GB
    }
    /// NVMe write bandwidth in bytes per second.
    pub fn nvme_write_bytes_per_s(&self) -> f64 {
        self.nvme_write_gb_per_s * GB
    }
    /// Achievable FLOP/s of a GEMM with `rows` rows (`peak * efficiency * rows / (rows + half)`).
    pub fn flops_per_s(&self, rows: f64) -> f64 {
        let shape = if rows > 0.0 { rows / (rows + self.gemm_half_efficiency_rows.max(0.0)) } else { 0.0 };
        self.peak_tflops * 1e12 * self.efficiency * shape
    }
    /// [`HardwareProfile::flops_per_s`] of a linear-attention layer: with `linear_efficiency` when the
    /// profile has it.
    pub fn linear_flops_per_s(&self, rows: f64) -> f64 {
        match self.linear_efficiency {
            Some(e) if self.efficiency > 0.0 => self.flops_per_s(rows) * e / self.efficiency,
            _ => self.flops_per_s(rows),
        }
    }
    /// Optimizer throughput in parameters per second.
    pub fn optimizer_params_per_s(&self) -> f64 {
        self.optimizer_gparams_per_s * 1e9
    }
}

/// The built-in profiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BuiltinProfile {
    /// NVIDIA H800 80 GB on PCIe Gen5, the machine of the published results.
    H800,
    /// NVIDIA RTX 3090 24 GB on PCIe Gen4.
    Rtx3090,
    /// NVIDIA H200 141 GB: the project's device machine (16 cores, 128 GiB host).
    H200,
    /// The 2-core development box; "GPU memory" is a budget that the CPU executor enforces.
    Cpu,
}

/// Error for an unknown built-in profile name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown hardware profile {name:?} (built-in: h800, rtx3090, h200, cpu; or a .toml file)")]
pub struct UnknownProfile {
    /// The name asked for.
    pub name: String,
}

impl BuiltinProfile {
    /// Every built-in profile.
    pub const ALL: [BuiltinProfile; 4] = [Self::H800, Self::Rtx3090, Self::H200, Self::Cpu];

    /// The profile's name as users type it.
    pub fn name(self) -> &'static str {
        match self {
            Self::H800 => "h800",
            Self::Rtx3090 => "rtx3090",
            Self::H200 => "h200",
            Self::Cpu => "cpu",
        }
    }

    /// The profile's figures.
    pub fn profile(self) -> HardwareProfile {
        match self {
            Self::H800 => h800(),
            Self::Rtx3090 => rtx3090(),
            Self::H200 => h200(),
            Self::Cpu => cpu(),
        }
    }
}

impl FromStr for BuiltinProfile {
    type Err = UnknownProfile;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownProfile { name: s.to_string() })
    }
}

impl fmt::Display for BuiltinProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Layer-level efficiency of a layer-streaming trainer, fitted to the published H800 runs
/// (shared/REFERENCE.md §1): with this efficiency and a 6.5 Gparam/s host optimizer, the cost model
/// predicts 220.3 TFLOPS for LazyTrain and 176.0 for MegaTrain on Qwen3.6-27B at batch 72 x 1024
/// (published: 219.95 and 176.90, within 0.5%), and 209-227 TFLOPS for Qwen2.5-3B/7B/14B (published
/// 176-212). A bare GEMM reaches far more (790 of 989 TFLOPS, 0.80, measured on an H200): the gap is the
/// non-GEMM work, kernel launches and framework overhead of a real step.
const FITTED_LAYER_EFFICIENCY: f64 = 0.285;

/// H800 80 GB SXM on PCIe Gen5.
fn h800() -> HardwareProfile {
    HardwareProfile {
        name: "h800".into(),
        description: "NVIDIA H800 80 GB, PCIe Gen5 host link (published figures; host size assumed)".into(),
        // 80 GB as the card is sold; decimal, so the usable 79.6 GiB is not exceeded.
        gpu_memory: ByteSize(80_000_000_000),
        // Assumption: 1 TiB host (the published run used 361.58 GB of host memory for Qwen3.6-27B).
        host_memory: ByteSize::gib(1024),
        // Assumption: one 3.84 TB data-center NVMe drive.
        nvme_capacity: ByteSize(3_840_000_000_000),
        // Published: PCIe measured at about 12 GB/s each way.
        h2d_gb_per_s: 12.0,
        d2h_gb_per_s: 12.0,
        // Published: NVMe 2.83 GB/s read, 3.35 GB/s write.
        nvme_read_gb_per_s: 2.83,
        nvme_write_gb_per_s: 3.35,
        // Published: dense bf16 peak about 990 TFLOPS (989.4 on NVIDIA's H100/H800 SXM sheet).
        peak_tflops: 989.0,
        efficiency: FITTED_LAYER_EFFICIENCY,
        // Fitted together with the efficiency (see FITTED_LAYER_EFFICIENCY): MegaTrain's serial CPU
        // optimizer. At about 28 B/param (REFERENCE §5) that is 182 GB/s of host memory bandwidth,
        // plausible for a two-socket DDR5 server.
        optimizer_gparams_per_s: 6.5,
        gpu_reserved: default_gpu_reserved(),
        gemm_half_efficiency_rows: default_gemm_half_rows(),
        linear_efficiency: None,
        compute_dtype_bytes: 2,
    }
}

/// RTX 3090 24 GB on PCIe Gen4.
fn rtx3090() -> HardwareProfile {
    HardwareProfile {
        name: "rtx3090".into(),
        description: "NVIDIA RTX 3090 24 GB, PCIe Gen4 x16 workstation (published size; rates assumed)".into(),
        // Published: 24 GB; decimal, below the 24 GiB the card has.
        gpu_memory: ByteSize(24_000_000_000),
        // Assumption: a 512 GiB workstation, enough for Qwen3.6-27B's fp32 master weights and AdamW
        // state (about 16 B/param).
        host_memory: ByteSize::gib(512),
        // Assumption: one 2 TB consumer NVMe drive.
        nvme_capacity: ByteSize(2_000_000_000_000),
        // Assumption: PCIe Gen4 x16 is 31.5 GB/s raw; pinned cudaMemcpy typically reaches 20-26 GB/s.
        h2d_gb_per_s: 20.0,
        d2h_gb_per_s: 20.0,
        // Assumption: sustained rates of a consumer PCIe Gen4 drive.
        nvme_read_gb_per_s: 3.5,
        nvme_write_gb_per_s: 3.0,
        // NVIDIA Ampere GA102 whitepaper, RTX 3090: 71 TFLOPS dense BF16 tensor with FP32 accumulate.
        peak_tflops: 71.0,
        // Assumption: the layer-level fraction fitted on the H800 (0.285).
        efficiency: FITTED_LAYER_EFFICIENCY,
        // Assumption: a workstation with about 60 GB/s of memory bandwidth at 28 B/param.
        optimizer_gparams_per_s: 2.0,
        gpu_reserved: ByteSize::gib(1),
        gemm_half_efficiency_rows: default_gemm_half_rows(),
        linear_efficiency: None,
        compute_dtype_bytes: 2,
    }
}

/// H200 141 GB: the project's device machine.
fn h200() -> HardwareProfile {
    HardwareProfile {
        name: "h200".into(),
        description: "NVIDIA H200 141 GB on the project's device machine (16 cores, 128 GiB host)".into(),
        // NVIDIA's sheet: 141 GB HBM3e (decimal).
        gpu_memory: ByteSize(141_000_000_000),
        // The device machine has 128 GiB of host memory; 8 GiB is left to the OS (assumption).
        host_memory: ByteSize::gib(120),
        // Assumption: half of the device machine's 64 GiB disk.
        nvme_capacity: ByteSize::gib(32),
        // Assumption: PCIe Gen5 x16 raw is 63 GB/s; the H800 measured only 12 GB/s, so take a middle
        // figure until `lt profile` measures it.
        h2d_gb_per_s: 25.0,
        d2h_gb_per_s: 25.0,
        // Assumption: a virtual disk like the development box's (REFERENCE §5, 4 MiB requests).
        nvme_read_gb_per_s: 2.0,
        nvme_write_gb_per_s: 2.0,
        // Dense bf16 peak of GH100 SXM (989 TFLOPS); an 8192^3 GEMM measured 790 (REFERENCE §1).
        peak_tflops: 989.0,
        // The H800's fitted layer-level fraction: the same GH100 chip (assumption until measured).
        efficiency: FITTED_LAYER_EFFICIENCY,
        // Assumption: 16 cores of a server socket, about 84 GB/s at 28 B/param.
        optimizer_gparams_per_s: 3.0,
        gpu_reserved: default_gpu_reserved(),
        gemm_half_efficiency_rows: default_gemm_half_rows(),
        linear_efficiency: None,
        compute_dtype_bytes: 2,
    }
}

/// The 2-core development box running the CPU (burn-ndarray, f32) executor.
fn cpu() -> HardwareProfile {
    HardwareProfile {
        name: "cpu".into(),
        description: "2-core development box, CPU executor (f32); GPU memory is an enforced budget".into(),
        // Assumption: an 8 GiB activation/weight budget leaves room on the 24 GiB box for host state.
        gpu_memory: ByteSize::gib(8),
        // 24 GiB box less 8 GiB of "GPU" budget and OS headroom (assumption).
        host_memory: ByteSize::gib(14),
        // Assumption: 16 GiB of the virtual disk for spilled activations.
        nvme_capacity: ByteSize::gib(16),
        // Measured with `lt profile --device cpu` on this box, idle (2026-11-29): "transfers" are memcpy,
        // 9.95 GB/s on 256 MiB.
        h2d_gb_per_s: 10.0,
        d2h_gb_per_s: 10.0,
        // Measured (same run): the spill store, io_uring + O_DIRECT, 4 MiB requests, 1 GiB written then
        // read back: 2.59 GB/s write, 2.41 GB/s read.
        nvme_read_gb_per_s: 2.4,
        nvme_write_gb_per_s: 2.6,
        // Measured (same run): the best 1024^3 f32 matmul through Burn's ndarray backend on 2 threads,
        // 0.060 TFLOPS (the AVX-512 datasheet figure would be ~0.3; matrixmultiply's kernels are 8-wide).
        peak_tflops: 0.06,
        // Measured (same run): one 512-wide decoder layer at 256 tokens, forward 54 ms + backward 138 ms,
        // is 0.60 of that peak. Smaller layers do worse (the demo's 128-wide layers run at about half
        // the predicted speed): elementwise work does not shrink with the matmuls.
        efficiency: 0.6,
        // Measured (same run): lt-optim adamw8bit on 32M parameters, 2 threads, 1.26 Gparam/s; the
        // optimizer shares the two cores with the executor when it overlaps.
        optimizer_gparams_per_s: 1.26,
        // Fitted: what the compute thread holds beyond the tensors the memory model names (autodiff
        // graph nodes and the executor's bookkeeping, on the heap the CPU "device" shares): the
        // largest shortfall of the predicted peak over 300 random steps of lt-exec's
        // `tests/memory_truth.rs` was 57 KB (2026-12-02), rounded up.
        gpu_reserved: ByteSize(64 << 10),
        gemm_half_efficiency_rows: 16.0,
        linear_efficiency: None,
        compute_dtype_bytes: 4,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn builtin_names_round_trip() {
        for p in BuiltinProfile::ALL {
            assert_eq!(p.name().parse::<BuiltinProfile>().unwrap(), p);
            assert_eq!(p.profile().name, p.name());
        }
        assert!("a100".parse::<BuiltinProfile>().is_err());
    }

    #[test]
    fn sizes_accept_strings_and_integers() {
        let mut v = serde_json::to_value(BuiltinProfile::H800.profile()).unwrap();
        v["gpu_memory"] = "24GiB".into();
        v["host_memory"] = 1000.into();
        let p: HardwareProfile = serde_json::from_value(v).unwrap();
        assert_eq!(p.gpu_memory, ByteSize::gib(24));
        assert_eq!(p.host_memory, ByteSize(1000));
    }

    #[test]
    fn efficiency_curve_halves_at_the_knee() {
        let p = BuiltinProfile::H800.profile();
        let full = p.peak_tflops * 1e12 * p.efficiency;
        let half = p.flops_per_s(p.gemm_half_efficiency_rows);
        // Exactly half by construction of m / (m + half); 1e-12 relative covers rounding.
        assert!((half / full - 0.5).abs() < 1e-12);
        assert!(p.flops_per_s(1e6) / full > 0.999);
    }
}
