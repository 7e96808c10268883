//! Device memory accounting. On GPU backends this mirrors real allocations; on ndarray it is the
//! budget that makes every tier and policy behave as it would on a card of that size.

use lt_core::ByteSize;

use crate::error::ExecError;

/// A device memory budget with peak tracking.
#[derive(Debug, Clone)]
pub struct DeviceBudget {
    limit: u64,
    used: u64,
    peak: u64,
}

impl DeviceBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: ByteSize) -> Self {
        Self { limit: limit.0, used: 0, peak: 0 }
    }

    /// Reserve `bytes` for `what`.
    pub fn alloc(&mut self, bytes: u64, what: impl FnOnce() -> String) -> Result<(), ExecError> {
        let now = self.used + bytes;
        if now > self.limit {
            return Err(ExecError::OutOfDeviceMemory {
                budget: ByteSize(self.limit),
                what: what(),
                needed: ByteSize(now.max(self.peak)),
                needed_round: round_up(now.max(self.peak)),
            });
        }
        self.used = now;
        self.peak = self.peak.max(now);
        Ok(())
    }

    /// Release `bytes`.
    pub fn free(&mut self, bytes: u64) {
        self.used = self.used.saturating_sub(bytes);
    }

    /// Bytes in use.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Highest use seen.
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Forget the peak (start of a step).
    pub fn reset_peak(&mut self) {
        self.peak = self.used;
    }
}

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
    fn overflow_reports_the_needed_peak() {
        let mut b = DeviceBudget::new(ByteSize(1000));
        b.alloc(600, || "a".into()).unwrap();
        let e = b.alloc(500, || "layer 3 weights".into()).unwrap_err().to_string();
        assert!(e.contains("layer 3 weights") && e.contains("--gpu-memory 2KiB"), "{e}");
        b.free(600);
        b.alloc(900, || "b".into()).unwrap();
        assert_eq!(b.peak(), 900);
    }
}
