//! Which instruction set the kernels use, detected once at run time.

use std::sync::OnceLock;

/// The widest kernel family usable on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Portable Rust (still auto-vectorised for the build's baseline target).
    Scalar,
    /// x86-64 AVX2 + FMA: auto-vectorised fp32 kernels and a hand-written 8-lane 8-bit kernel.
    Avx2,
    /// x86-64 AVX-512F + DQ + BW: hand-written 8-bit kernel and auto-vectorised fp32 kernels.
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
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            return SimdLevel::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return SimdLevel::Avx2;
        }
    }
    SimdLevel::Scalar
}

/// How the AVX-512 VBMI 8-bit kernel dequantizes the old codes. Both give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Q8Dequant {
    /// Each byte of the f32 map values is a 256-entry byte table read with `vpermi2b`: four
    /// planes, two permutes and a blend each, then interleaved back into f32 lanes.
    Permute,
    /// One 16-lane `vpgatherdd` from the 256-entry f32 table per moment and 16 elements.
    Gather,
}

/// The VBMI kernel's dequantization: `vpermi2b` is one uop on AMD Zen 4, where a 16-lane gather
/// took about 20 cycles, but three (2 cycles of throughput, on the one shuffle port that the code
/// finder's permutes also need) on Intel cores from Ice Lake to Emerald Rapids, where gathers run
/// on the load ports. Measured on Emerald Rapids (2026-12-03, bf16 copy, one process alternating
/// the two by step): 0.0177-0.0179 against 0.0198-0.0201 ms per step at 16K parameters on 1
/// thread, 42.3-45.3 against 47.8-50.6 ms median at 64M on 2 threads. So: permutes on AMD CPUs,
/// gathers elsewhere; `LT_OPTIM_Q8_DEQUANT=gather` or `=permute` overrides the choice. Read once per
/// process.
pub(crate) fn q8_dequant() -> Q8Dequant {
    static DEQUANT: OnceLock<Q8Dequant> = OnceLock::new();
    *DEQUANT.get_or_init(|| {
        if amd_unless_env("LT_OPTIM_Q8_DEQUANT", "gather", "permute") { Q8Dequant::Permute } else { Q8Dequant::Gather }
    })
}

/// How the AVX-512 VBMI kernel finds the new codes. All three give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Q8Quant {
    /// Gathers from the bucket table.
    Table,
    /// The exact affine code finder (`crate::affine::AffineCodes`): register permutes, an estimate
    /// and one exact threshold compare per lane.
    Affine,
    /// The fixed-point rounding form (`crate::affine::Rounded`), with the exact finder for the rare
    /// blocks that hold an ambiguous lane.
    Rounded,
}

/// The VBMI kernel's code finder: on AMD Zen 4 a 16-lane `vpgatherdd` took about 20 cycles, the
/// exact affine finder re-quantizes 16 lanes in about 16, and the rounding form, with no table
/// compare, makes the whole kernel another 14% faster in L2 (see `kernels`).
/// `LT_OPTIM_Q8_QUANT=table`, `=affine` or `=rounded` overrides the default (rounded). Read once per
/// process.
pub(crate) fn q8_quant() -> Q8Quant {
    static QUANT: OnceLock<Q8Quant> = OnceLock::new();
    *QUANT.get_or_init(|| match std::env::var("LT_OPTIM_Q8_QUANT").ok().as_deref().map(str::trim) {
        Some("table") => Q8Quant::Table,
        Some("affine") => Q8Quant::Affine,
        _ => Q8Quant::Rounded,
    })
}

/// Whether the AVX2 8-bit kernel reads its tables with scalar loads rather than gathers. Both give
/// the same bits; on AMD Zen 3 an 8-lane `vpgatherdd` measured 0.7-1.1 ns per lane against
/// 0.4-0.5 ns per scalar load + insert (the kernel does four table reads per parameter), while
/// Intel cores gather 8 lanes in about 5 cycles and have one shuffle port for the inserts. So:
/// loads on AMD CPUs, gathers elsewhere; `LT_OPTIM_Q8_LOOKUP=gather` or `=loads` overrides the
/// choice. Read once per process.
pub(crate) fn q8_avx2_loads() -> bool {
    static LOADS: OnceLock<bool> = OnceLock::new();
    *LOADS.get_or_init(|| amd_unless_env("LT_OPTIM_Q8_LOOKUP", "gather", "loads"))
}

/// Whether the AVX-512 8-bit kernels write the bf16 copy with streaming (non-temporal) 64-byte
/// stores, where the copy is 64-byte aligned (the trainer's large copies start on a page: see
/// `lt_model::upload::CopyBuf`). Both give the same bits. A streaming store skips the read for
/// ownership of the copy's lines; nothing on the host reads the copy before the next upload's DMA,
/// which reads memory anyway. Measured per microarchitecture (docs/benchmarks.md, session 32): on
/// AMD Zen 5 (family 26), `lt bench optimizer` at 64M parameters on 2 threads, bf16 gradients with
/// the copy, 12 alternations, medians 19.25 against 20.47 ms per step for the dynamic maps (faster
/// in 12 of 12) and 18.50 against 20.23 for the f8 codes (10 of 12); on Zen 4 (family 25)
/// streaming stores were slower (sessions 26 and 27: 27.9-29.4 against 20.8-22.7 ms). So:
/// streaming on AMD family 26 and later, cached elsewhere; `LT_OPTIM_COPY_STORES=stream` or
/// `=cached` overrides the choice. Read once per process.
pub(crate) fn stream_copy() -> bool {
    static STREAM: OnceLock<bool> = OnceLock::new();
    *STREAM.get_or_init(|| {
        let zen5_or_later = cpu_vendor() == *b"AuthenticAMD" && cpu_family() >= 0x1a;
        named_or(std::env::var("LT_OPTIM_COPY_STORES").ok().as_deref(), "cached", "stream", zen5_or_later)
    })
}

/// How the 8-bit update of `config` stores the bf16 copy `copy` in this process, for benchmark
/// reports: `streaming` where the dispatch streams it (the copy mode `copy_mode` picks for it, and
/// a kernel with a streaming form), else `cached`.
pub fn copy_stores_name_for(config: &crate::Quant8Config, copy: &[half::bf16]) -> &'static str {
    let path = crate::kernels::KernelPath::detect();
    let kernel_streams = match config.codes {
        crate::Q8Codes::Dynamic => {
            crate::kernels::Q8Kernel::select(path, crate::qmap::QuantMaps::default(), config.block_size).streams_copy()
        }
        crate::Q8Codes::F8 => crate::f8::F8Kernel::select(path, config.block_size).streams_copy(),
    };
    let streams = kernel_streams && crate::kernels::copy_mode(path, copy) == crate::kernels::COPY_STREAM;
    if streams { "streaming" } else { "cached" }
}

/// A kernel variant chosen by CPU vendor unless the environment names one: `var=off` gives false,
/// `var=on` true, and anything else (or nothing) whether the CPU is AMD's.
fn amd_unless_env(var: &str, off: &str, on: &str) -> bool {
    named_or(std::env::var(var).ok().as_deref(), off, on, cpu_vendor() == *b"AuthenticAMD")
}

/// `value` (trimmed) if it is `off` (false) or `on` (true), else `default`.
fn named_or(value: Option<&str>, off: &str, on: &str, default: bool) -> bool {
    match value.map(str::trim) {
        Some(v) if v == off => false,
        Some(v) if v == on => true,
        _ => default,
    }
}

/// The name of the 8-bit kernel that updates the default configuration's whole blocks in this
/// process (for benchmark reports; see [`simd_level`], `LT_OPTIM_Q8_DEQUANT` and
/// `LT_OPTIM_Q8_QUANT`), by the rule the update dispatches with: on CPUs with AVX-512 VBMI
/// `avx512-<dequantization>-<code finder>` (`permute` or `gather`; `rounded`, `affine` or `table`,
/// e.g. `avx512-gather-rounded`), `avx512-gather` (AVX-512 without VBMI: gathers and the bucket
/// table), `avx2-loads`, `avx2-gather` or `scalar`.
pub fn q8_kernel_name() -> &'static str {
    q8_kernel_name_for(&crate::Quant8Config::default())
}

/// As [`q8_kernel_name`], for the 8-bit configuration `config`: its codes and block size decide
/// (the f8 codes' kernels: `avx512` for blocks that are a multiple of 32, else `avx2`, or
/// `scalar`).
pub fn q8_kernel_name_for(config: &crate::Quant8Config) -> &'static str {
    let path = crate::kernels::KernelPath::detect();
    match config.codes {
        crate::Q8Codes::Dynamic => {
            crate::kernels::Q8Kernel::select(path, crate::qmap::QuantMaps::default(), config.block_size).name()
        }
        crate::Q8Codes::F8 => crate::f8::F8Kernel::select(path, config.block_size).name(),
    }
}

/// The CPUID vendor string (`GenuineIntel`, `AuthenticAMD`, ...); zeros off x86-64.
fn cpu_vendor() -> [u8; 12] {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let r = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&r.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&r.edx.to_le_bytes());
        v[8..].copy_from_slice(&r.ecx.to_le_bytes());
        v
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        [0; 12]
    }
}

/// The CPU's display family (CPUID leaf 1: the base family, plus the extended family when the base
/// is 15): 25 for AMD Zen 3 and Zen 4, 26 for Zen 5; 0 off x86-64.
fn cpu_family() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 1 exists on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let eax = unsafe { std::arch::x86_64::__cpuid(1) }.eax;
        let base = (eax >> 8) & 0xf;
        if base == 0xf { base + ((eax >> 20) & 0xff) } else { base }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// Whether the CPU has AVX512-BF16 (`vcvtneps2bf16`), used for the bf16 copy of the parameters.
pub(crate) fn has_avx512bf16() -> bool {
    static BF16: OnceLock<bool> = OnceLock::new();
    *BF16.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
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

#[cfg(test)]
mod tests {
    use super::named_or;

    #[test]
    fn an_override_names_a_variant_and_anything_else_keeps_the_default() {
        for default in [false, true] {
            assert!(!named_or(Some("gather"), "gather", "loads", default));
            assert!(named_or(Some(" loads\n"), "gather", "loads", default));
            assert_eq!(named_or(None, "gather", "loads", default), default);
            assert_eq!(named_or(Some("permute"), "gather", "loads", default), default);
        }
    }
}
