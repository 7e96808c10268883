//! The one error type of `lt-sched`.

/// Everything that can go wrong in planning, loading plans and loading hardware profiles.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// A file could not be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file could not be written.
    #[error("{path}: cannot write: {source}")]
    Write {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A plan file is not valid JSON or lacks a field.
    #[error("{path}: invalid plan file: {source}")]
    PlanJson {
        /// The file.
        path: String,
        /// The parser error (names the field and line).
        source: serde_json::Error,
    },
    /// A plan file has a version this build does not read.
    #[error("{path}: plan version {found} is not supported (this build reads version {expected})")]
    PlanVersion {
        /// The file.
        path: String,
        /// The version in the file.
        found: u64,
        /// The version this build reads.
        expected: u32,
    },
    /// A plan does not match the model it is used with.
    #[error("plan does not match the model: {field}: the plan has {plan}, the model has {model}")]
    PlanMismatch {
        /// What differs.
        field: &'static str,
        /// The plan's value.
        plan: String,
        /// The model's value.
        model: String,
    },
    /// A plan breaks one of the plan rules (boundary 0 and L on the GPU, batch = micro x accumulation...).
    #[error("invalid plan: {field}: {reason}")]
    InvalidPlan {
        /// The offending field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A hardware profile TOML file does not parse.
    #[error("{path}: invalid hardware profile: {source}")]
    ProfileToml {
        /// The file.
        path: String,
        /// The parser error.
        source: toml::de::Error,
    },
    /// A hardware profile holds a value the cost model cannot use.
    #[error("hardware profile {profile:?}: field `{field}`: {reason}")]
    InvalidProfile {
        /// The profile's name.
        profile: String,
        /// The offending field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A planning request is malformed (zero batch, micro-batch that does not divide the batch...).
    #[error("invalid request: `{field}`: {reason}")]
    InvalidRequest {
        /// The offending field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// No plan fits the machine; says what would.
    #[error("{}", infeasible_message(*batch_size, *seq_len, *gpu_memory, *min_gpu_memory, *host_memory, *min_host_memory))]
    Infeasible {
        /// Requested batch size.
        batch_size: usize,
        /// Requested sequence length.
        seq_len: usize,
        /// GPU memory of the profile, bytes.
        gpu_memory: u64,
        /// Smallest GPU memory with which a plan exists (predicted), if any does.
        min_gpu_memory: Option<u64>,
        /// Host memory of the profile, bytes.
        host_memory: u64,
        /// Smallest host memory with which a plan exists (predicted), when host memory is what is short.
        min_host_memory: Option<u64>,
    },
    /// The MILP solver failed in a way the planner could not recover from.
    #[error("MILP solver failed: {reason}")]
    Solver {
        /// The solver's message.
        reason: String,
    },
}

/// A size in the unit that fits it (KiB, MiB, GiB, TiB), so a tiny model's budget does not read
/// "0.00 GiB".
fn size(b: u64) -> String {
    lt_core::ByteSize(b).to_string()
}

fn infeasible_message(
    batch: usize,
    seq: usize,
    gpu: u64,
    min_gpu: Option<u64>,
    host: u64,
    min_host: Option<u64>,
) -> String {
    let mut s = format!("no plan fits batch {batch} x seq {seq} (predicted)");
    if let Some(h) = min_host {
        s += &format!("; host memory {} is short, at least {} is needed", size(host), size(h));
    }
    match min_gpu {
        Some(g) if g > gpu => {
            s += &format!(
                "; GPU memory {} is short, the smallest GPU memory that would work is {} ({g} bytes)",
                size(gpu),
                size(g)
            )
        }
        Some(_) => {}
        None => s += "; no GPU memory size would make it fit",
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infeasible_message_names_the_smallest_gpu_memory() {
        let e = SchedError::Infeasible {
            batch_size: 8,
            seq_len: 1024,
            gpu_memory: 24 << 30,
            min_gpu_memory: Some(30 << 30),
            host_memory: 1 << 40,
            min_host_memory: None,
        };
        let m = e.to_string();
        assert!(m.contains("smallest GPU memory that would work is 30.00 GiB"), "{m}");
        assert!(!m.contains('\n'));
        // Small sizes in small units (a tiny model's budget read "0.00 GiB" before).
        let small = SchedError::Infeasible {
            batch_size: 4,
            seq_len: 20,
            gpu_memory: 1 << 20,
            min_gpu_memory: Some(2 << 20),
            host_memory: 1 << 40,
            min_host_memory: None,
        };
        let m = small.to_string();
        assert!(m.contains("GPU memory 1.00 MiB is short, the smallest GPU memory that would work is 2.00 MiB"), "{m}");
    }
}
