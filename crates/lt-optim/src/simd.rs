//! Which instruction set the kernels use, detected once at run time.

use std::sync::OnceLock;

/// The widest kernel family usable on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Portable Rust (still auto-vectorised for the build's baseline target).
    Scalar,
    /// x86-64 AVX2 + FMA: auto-vectorised fp32 kernels and a hand-written 8-lane 8-bit kernel.
    Avx2,
    /// x86-64 AVX-512F + DQ: hand-written 8-bit kernel and auto-vectorised fp32 kernels.
    Avx512,
}

impl SimdLevel {
    /// Lower-case name, as accepted by `LT_OPTIM_SIMD`.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }
}

/// The kernel family in use: the best the CPU supports, lowered (never raised) by the environment
/// variable `LT_OPTIM_SIMD=scalar|avx2|avx512` so benchmarks can compare paths. Both the fp32 and
/// the 8-bit kernels give bit-identical results on every path, see `kernels`.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = detect();
        let wanted = match std::env::var("LT_OPTIM_SIMD").ok().as_deref() {
            Some("scalar") => SimdLevel::Scalar,
            Some("avx2") => SimdLevel::Avx2,
            _ => SimdLevel::Avx512,
        };
        best.min(wanted)
    })
}

fn detect() -> SimdLevel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512dq") {
            return SimdLevel::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return SimdLevel::Avx2;
        }
    }
    SimdLevel::Scalar
}

/// Whether the CPU has AVX-512 VBMI + BW (byte permutes), used to dequantize without gathers.
pub(crate) fn has_vbmi() -> bool {
    static VBMI: OnceLock<bool> = OnceLock::new();
    *VBMI.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512vbmi") && std::arch::is_x86_feature_detected!("avx512bw")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}
