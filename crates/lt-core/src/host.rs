//! The host CPU, as a label for host-speed figures.
//!
//! A host-side speed (an optimizer step, a layer on the CPU, the preparation of an upload) measured
//! on one CPU may not hold on another: the 8-bit AdamW kernel, for one, runs 0.57x torch's fused
//! AdamW on one 2-core cloud VM and 1.1x on another of the same size. So every benchmark that
//! prints such a figure prints this label next to it: the CPU's model name (as `lscpu` shows it),
//! its family and model numbers (cloud VMs often hide the marketing name: "AMD EPYC" is Zen 2, 3 or
//! 4), the logical CPUs this process may run on, and the vector extensions the kernels can use.
//!
//! ```
//! let cpu = lt_core::host::HostCpu::detect();
//! assert!(cpu.logical_cpus >= 1);
//! println!("host: {cpu}");
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a benchmark says about the CPU it ran on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCpu {
    /// The model name (`/proc/cpuinfo`'s "model name"), or "unknown CPU".
    pub name: String,
    /// The CPUID vendor (`AuthenticAMD`, `GenuineIntel`), if known.
    pub vendor: Option<String>,
    /// The CPUID family (x86): with [`model`](Self::model) it names the microarchitecture where the
    /// model name does not (family 25 model 1 is Zen 3, family 6 model 207 Emerald Rapids).
    pub family: Option<u32>,
    /// The CPUID model number within the family (x86).
    pub model: Option<u32>,
    /// Logical CPUs this process may run on (its affinity mask, as `nproc` counts).
    pub logical_cpus: usize,
    /// Vector extensions detected at run time, widest first (`avx512f`, `avx2`, `fma`, ...); empty
    /// when there are none the kernels use.
    pub simd: Vec<String>,
}

impl HostCpu {
    /// The CPU this process runs on (Linux: `/proc/cpuinfo`; elsewhere the name is unknown but the
    /// vector extensions are still detected).
    pub fn detect() -> HostCpu {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let logical_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        HostCpu::from_cpuinfo(&cpuinfo, logical_cpus, detect_simd())
    }

    /// The label from a `/proc/cpuinfo` text (only its first processor's block is read; missing
    /// or garbled fields are left out, never an error: this is a label, not an input).
    pub fn from_cpuinfo(cpuinfo: &str, logical_cpus: usize, simd: Vec<String>) -> HostCpu {
        let mut name = None;
        let mut vendor = None;
        let mut family = None;
        let mut model = None;
        for line in cpuinfo.lines() {
            if line.trim().is_empty() {
                // The end of the first processor's block.
                if name.is_some() || vendor.is_some() {
                    break;
                }
                continue;
            }
            let Some((key, value)) = line.split_once(':') else { continue };
            let value = value.trim();
            match key.trim() {
                "model name" if !value.is_empty() => name = Some(value.to_string()),
                "vendor_id" if !value.is_empty() => vendor = Some(value.to_string()),
                "cpu family" => family = value.parse().ok(),
                "model" => model = value.parse().ok(),
                _ => {}
            }
        }
        HostCpu { name: name.unwrap_or_else(|| "unknown CPU".into()), vendor, family, model, logical_cpus, simd }
    }
}

impl fmt::Display for HostCpu {
    /// One line, e.g. `AMD EPYC (AuthenticAMD family 25 model 1), 2 logical CPUs, SIMD avx2 fma`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)?;
        let ids: Vec<String> =
            [self.vendor.clone(), self.family.map(|x| format!("family {x}")), self.model.map(|x| format!("model {x}"))]
                .into_iter()
                .flatten()
                .collect();
        if !ids.is_empty() {
            write!(f, " ({})", ids.join(" "))?;
        }
        let s = if self.logical_cpus == 1 { "" } else { "s" };
        write!(f, ", {} logical CPU{s}, SIMD ", self.logical_cpus)?;
        if self.simd.is_empty() { write!(f, "none") } else { write!(f, "{}", self.simd.join(" ")) }
    }
}

/// The vector extensions that LazyTrain's kernels choose between, as detected at run time.
fn detect_simd() -> Vec<String> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let found = [
            ("avx512f", has!("avx512f")),
            ("avx512bw", has!("avx512bw")),
            ("avx512vbmi", has!("avx512vbmi")),
            ("avx512bf16", has!("avx512bf16")),
            ("avx2", has!("avx2")),
            ("fma", has!("fma")),
        ];
        found.into_iter().filter(|(_, yes)| *yes).map(|(name, _)| name.to_string()).collect()
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") { vec!["neon".into()] } else { Vec::new() }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ZEN3: &str = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n\
                        model name\t: AMD EPYC\nflags\t\t: fpu avx2\n\nprocessor\t: 1\nvendor_id\t: \
                        AuthenticAMD\nmodel name\t: Other name\n";

    #[test]
    fn reads_the_first_processor_of_proc_cpuinfo() {
        let cpu = HostCpu::from_cpuinfo(ZEN3, 2, vec!["avx2".into(), "fma".into()]);
        assert_eq!(cpu.name, "AMD EPYC");
        assert_eq!(cpu.vendor.as_deref(), Some("AuthenticAMD"));
        assert_eq!((cpu.family, cpu.model), (Some(25), Some(1)));
        assert_eq!(cpu.to_string(), "AMD EPYC (AuthenticAMD family 25 model 1), 2 logical CPUs, SIMD avx2 fma");
    }

    #[test]
    fn missing_or_garbled_fields_are_left_out() {
        let cpu = HostCpu::from_cpuinfo("cpu family : twenty\nmodel name :\nno colon here\n", 1, Vec::new());
        assert_eq!(cpu.to_string(), "unknown CPU, 1 logical CPU, SIMD none");
        let arm =
            HostCpu::from_cpuinfo("processor : 0\nBogoMIPS : 50.00\nCPU implementer : 0x41\n", 4, vec!["neon".into()]);
        assert_eq!(arm.to_string(), "unknown CPU, 4 logical CPUs, SIMD neon");
    }

    #[test]
    fn detection_names_this_machine() {
        let cpu = HostCpu::detect();
        assert!(cpu.logical_cpus >= 1);
        #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
        assert_ne!(cpu.name, "unknown CPU", "/proc/cpuinfo has a model name on Linux x86-64");
        // Reports carry it as JSON and read it back for their human summary.
        let json = serde_json::to_value(&cpu).expect("serialises");
        assert_eq!(json["logical_cpus"], cpu.logical_cpus);
        assert_eq!(serde_json::from_value::<HostCpu>(json).expect("reads back"), cpu);
    }
}
