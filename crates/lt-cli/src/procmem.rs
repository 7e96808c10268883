//! This process's and this machine's memory, from `/proc` (None where there is no `/proc`).

use std::io::BufRead;

/// A `/proc` field in kB, as bytes.
fn proc_kb(file: &str, field: &str) -> Option<u64> {
    let f = std::fs::File::open(file).ok()?;
    for line in std::io::BufReader::new(f).lines() {
        let line = line.ok()?;
        if let Some(rest) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
            let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            return Some(kb * 1024);
        }
    }
    None
}

/// `MemAvailable` from /proc/meminfo (None where there is no /proc).
pub fn mem_available() -> Option<u64> {
    proc_kb("/proc/meminfo", "MemAvailable")
}

/// This process's peak resident set (`VmHWM` from /proc/self/status).
pub fn vm_hwm() -> Option<u64> {
    proc_kb("/proc/self/status", "VmHWM")
}

/// This process's resident set size now (VmRSS), bytes.
pub fn vm_rss() -> Option<u64> {
    proc_kb("/proc/self/status", "VmRSS")
}
