//! Loading and validating hardware profiles: a built-in name or a TOML file.
//!
//! ```
//! let p = lt_sched::hardware::profile_from_toml(r#"
//!     name = "a100"
//!     gpu_memory = "80GB"
//!     host_memory = "512GiB"
//!     nvme_capacity = "2TB"
//!     h2d_gb_per_s = 24.0
//!     d2h_gb_per_s = 24.0
//!     nvme_read_gb_per_s = 3.0
//!     nvme_write_gb_per_s = 3.0
//!     peak_tflops = 312.0
//!     efficiency = 0.5
//!     optimizer_gparams_per_s = 3.0
//! "#, "a100.toml").unwrap();
//! assert_eq!(p.gpu_memory.0, 80_000_000_000);
//! ```

use std::path::{Path, PathBuf};
use std::str::FromStr;

use lt_core::hardware::{BuiltinProfile, HardwareProfile};

use crate::SchedError;

/// Where a profile comes from. Written as a built-in name or a path, in flags and files alike.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum HardwareSpec {
    /// A built-in profile.
    Builtin(BuiltinProfile),
    /// A TOML file.
    File(PathBuf),
}

impl FromStr for HardwareSpec {
    type Err = SchedError;

    /// A built-in name (`h800`, `rtx3090`, `h200`, `cpu`), or a path to a `.toml` file.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(b) = s.parse::<BuiltinProfile>() {
            return Ok(Self::Builtin(b));
        }
        let path = Path::new(s);
        if s.ends_with(".toml") || path.exists() || s.contains(std::path::MAIN_SEPARATOR) {
            return Ok(Self::File(path.to_path_buf()));
        }
        Err(SchedError::InvalidRequest {
            field: "hardware",
            reason: format!("{s:?} is neither a built-in profile (h800, rtx3090, h200, cpu) nor a .toml file"),
        })
    }
}

impl std::fmt::Display for HardwareSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Builtin(b) => write!(f, "{b}"),
            Self::File(p) => write!(f, "{}", p.display()),
        }
    }
}

impl TryFrom<String> for HardwareSpec {
    type Error = SchedError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<HardwareSpec> for String {
    fn from(spec: HardwareSpec) -> String {
        spec.to_string()
    }
}

/// Load and validate the profile `spec` names.
///
/// # Errors
/// [`SchedError::Read`], [`SchedError::ProfileToml`] or [`SchedError::InvalidProfile`].
pub fn load_profile(spec: &HardwareSpec) -> Result<HardwareProfile, SchedError> {
    match spec {
        HardwareSpec::Builtin(b) => {
            let p = b.profile();
            validate_profile_file(&p)?;
            Ok(p)
        }
        HardwareSpec::File(path) => {
            let name = path.display().to_string();
            let text =
                std::fs::read_to_string(path).map_err(|source| SchedError::Read { path: name.clone(), source })?;
            profile_from_toml(&text, &name)
        }
    }
}

/// Parse and validate a profile from TOML text; `name` labels errors.
///
/// # Errors
/// [`SchedError::ProfileToml`] or [`SchedError::InvalidProfile`].
pub fn profile_from_toml(text: &str, name: &str) -> Result<HardwareProfile, SchedError> {
    let p: HardwareProfile =
        toml::from_str(text).map_err(|source| SchedError::ProfileToml { path: name.to_string(), source })?;
    validate_profile_file(&p)?;
    Ok(p)
}

/// [`validate_profile`], and a reserve below the GPU memory: a profile as written (a budget given
/// later, at or below the reserve, is not a malformed profile but one no plan fits, which the
/// planner reports with the smallest budget that works).
///
/// # Errors
/// [`SchedError::InvalidProfile`] naming the first bad field.
pub fn validate_profile_file(p: &HardwareProfile) -> Result<(), SchedError> {
    validate_profile(p)?;
    if p.gpu_reserved.0 >= p.gpu_memory.0 {
        return Err(SchedError::InvalidProfile {
            profile: p.name.clone(),
            field: "gpu_reserved",
            reason: "must be smaller than gpu_memory".into(),
        });
    }
    Ok(())
}

/// Check that every figure is usable by the cost model.
///
/// # Errors
/// [`SchedError::InvalidProfile`] naming the first bad field.
pub fn validate_profile(p: &HardwareProfile) -> Result<(), SchedError> {
    let bad = |field: &'static str, reason: String| {
        Err(SchedError::InvalidProfile { profile: p.name.clone(), field, reason })
    };
    if p.gpu_memory.0 == 0 {
        return bad("gpu_memory", "must be > 0".into());
    }
    if p.host_memory.0 == 0 {
        return bad("host_memory", "must be > 0".into());
    }
    for (field, v) in [
        ("h2d_gb_per_s", p.h2d_gb_per_s),
        ("d2h_gb_per_s", p.d2h_gb_per_s),
        ("nvme_read_gb_per_s", p.nvme_read_gb_per_s),
        ("nvme_write_gb_per_s", p.nvme_write_gb_per_s),
        ("peak_tflops", p.peak_tflops),
        ("optimizer_gparams_per_s", p.optimizer_gparams_per_s),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return bad(field, format!("{v} must be a finite number > 0"));
        }
    }
    if !(p.efficiency > 0.0 && p.efficiency <= 1.0) {
        return bad("efficiency", format!("{} must be in (0, 1]", p.efficiency));
    }
    if !(p.gemm_half_efficiency_rows.is_finite() && p.gemm_half_efficiency_rows >= 0.0) {
        return bad("gemm_half_efficiency_rows", format!("{} must be finite and >= 0", p.gemm_half_efficiency_rows));
    }
    if !matches!(p.compute_dtype_bytes, 1 | 2 | 4 | 8) {
        return bad("compute_dtype_bytes", format!("{} must be 1, 2, 4 or 8", p.compute_dtype_bytes));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_are_valid_and_round_trip_through_toml() {
        for b in BuiltinProfile::ALL {
            let p = load_profile(&HardwareSpec::Builtin(b)).unwrap();
            let text = toml::to_string(&p).unwrap();
            let q = profile_from_toml(&text, "x.toml").unwrap();
            assert_eq!(p, q);
        }
    }

    #[test]
    fn names_and_paths_parse() {
        assert_eq!("H800".parse::<HardwareSpec>().unwrap(), HardwareSpec::Builtin(BuiltinProfile::H800));
        assert_eq!("my.toml".parse::<HardwareSpec>().unwrap(), HardwareSpec::File("my.toml".into()));
        assert!("a100".parse::<HardwareSpec>().unwrap_err().to_string().contains("neither a built-in"));
    }

    #[test]
    fn bad_fields_are_named() {
        let mut p = BuiltinProfile::Rtx3090.profile();
        p.efficiency = 1.5;
        let e = validate_profile(&p).unwrap_err().to_string();
        assert!(e.contains("`efficiency`"), "{e}");
        let e = profile_from_toml("name = \"x\"\ngpu_memory = \"lots\"", "x.toml").unwrap_err().to_string();
        assert!(e.starts_with("x.toml: invalid hardware profile"), "{e}");
        let e = profile_from_toml("name = \"x\"\nbogus = 1", "x.toml").unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
    }
}
