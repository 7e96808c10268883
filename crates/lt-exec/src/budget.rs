//! Device memory sizes as `--gpu-memory` takes them. What is live on the device is lt-sched's memory
//! model (`lt_sched::window::gpu_live`), which the executor checks its budget with.

/// A flag-friendly size at least `bytes` (`3MiB`, `12GiB`).
pub fn round_up(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, unit) in UNITS {
        if bytes >= unit {
            return format!("{}{name}", bytes.div_ceil(unit));
        }
    }
    format!("{bytes}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_up_to_a_flag_friendly_size() {
        assert_eq!(round_up(1), "1");
        assert_eq!(round_up(1024), "1KiB");
        assert_eq!(round_up(1025), "2KiB");
        assert_eq!(round_up(3 << 20), "3MiB");
        assert_eq!(round_up((5 << 30) + 1), "6GiB");
    }
}
