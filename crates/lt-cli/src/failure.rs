//! Failures that commands classify for scripts: a device or host too small (exit 2, with a JSON
//! line saying which), or anything else (exit 1). Backends report device out-of-memory by panicking;
//! [`catch_panics`] is where that becomes a classified failure instead of a crash.

use std::panic::AssertUnwindSafe;
use std::sync::Mutex;

use lt_exec::ExecError;
use lt_sched::SchedError;

/// Why a benchmark did not produce a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    /// The device budget (or the real device) is too small.
    DeviceMemory,
    /// Host memory cannot hold the masters, gradients and optimizer state.
    HostMemory,
    /// The planner found no plan for another reason.
    Infeasible,
    /// Anything else (bad flags, unreadable files, a bug).
    Error,
}

impl FailKind {
    pub fn name(self) -> &'static str {
        match self {
            FailKind::DeviceMemory => "device_memory",
            FailKind::HostMemory => "host_memory",
            FailKind::Infeasible => "infeasible",
            FailKind::Error => "error",
        }
    }

    pub fn exit_code(self) -> i32 {
        if self == FailKind::Error { 1 } else { 2 }
    }
}

/// A classified failure.
#[derive(Debug)]
pub struct Failure {
    /// What kind of failure.
    pub kind: FailKind,
    /// One line saying what went wrong.
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Failure {
    pub fn new(kind: FailKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    /// Classify an error by the typed causes in its chain.
    pub fn from_error(e: &anyhow::Error) -> Self {
        let mut kind = FailKind::Error;
        for cause in e.chain() {
            if cause.downcast_ref::<lt_run::BudgetTooSmall>().is_some() {
                kind = FailKind::DeviceMemory;
                break;
            }
            if let Some(x) = cause.downcast_ref::<ExecError>()
                && matches!(x, ExecError::OutOfDeviceMemory { .. })
            {
                kind = FailKind::DeviceMemory;
                break;
            }
            if let Some(SchedError::Infeasible { gpu_memory, min_gpu_memory, min_host_memory, .. }) =
                cause.downcast_ref::<SchedError>()
            {
                kind = if min_host_memory.is_some() {
                    FailKind::HostMemory
                } else if min_gpu_memory.is_some_and(|m| m > *gpu_memory) {
                    FailKind::DeviceMemory
                } else {
                    FailKind::Infeasible
                };
                break;
            }
        }
        Self { kind, message: crate::error_line(e) }
    }
}

/// Whether a panic message is a device allocator running out of memory.
fn is_oom(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    ["out of memory", "out-of-memory", "outofmemory", "out_of_memory"].iter().any(|k| m.contains(k))
}

/// The first panic message seen while [`catch_panics`] runs (from any thread).
static PANIC_MESSAGE: Mutex<Option<String>> = Mutex::new(None);

/// Run `f`, turning a panic (on this thread, or one recorded from a worker thread that `f` then
/// reported as an error) into a classified [`Failure`]. Backends report device out-of-memory by
/// panicking; this is where that becomes `kind: device_memory` instead of a crash.
pub fn catch_panics<T>(f: impl FnOnce() -> Result<T, Failure>) -> Result<T, Failure> {
    if let Ok(mut m) = PANIC_MESSAGE.lock() {
        *m = None;
    }
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|info| {
        let text = info.payload_as_str().unwrap_or("(non-text panic payload)");
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        if let Ok(mut m) = PANIC_MESSAGE.lock()
            && m.is_none()
        {
            // One line, and short: cubecl's messages carry whole backtraces.
            let mut line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
            if line.len() > 400 {
                let cut = (0..=400).rev().find(|&i| line.is_char_boundary(i)).unwrap_or(0);
                line.truncate(cut);
                line.push_str(" ...");
            }
            *m = Some(format!("{line}{at}"));
        }
    }));
    let out = std::panic::catch_unwind(AssertUnwindSafe(f));
    std::panic::set_hook(previous);
    let recorded = PANIC_MESSAGE.lock().ok().and_then(|mut m| m.take());
    let oom = |p: &str| Failure::new(FailKind::DeviceMemory, format!("device out of memory: {p}"));
    match out {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => match recorded {
            None => Err(e),
            Some(p) if is_oom(&p) => Err(oom(&p)),
            Some(p) => Err(Failure::new(e.kind, format!("{} (a worker panicked: {p})", e.message))),
        },
        Err(_) => match recorded {
            Some(p) if is_oom(&p) => Err(oom(&p)),
            Some(p) => Err(Failure::new(FailKind::Error, format!("internal error (panic): {p}"))),
            None => Err(Failure::new(FailKind::Error, "internal error (a panic without a message)")),
        },
    }
}

/// Print a failure as the last stdout line and exit with its code.
pub fn fail(f: &Failure) -> ! {
    eprintln!("error: {}", f.message);
    println!("{}", serde_json::json!({"error": f.message, "kind": f.kind.name()}));
    std::process::exit(f.kind.exit_code());
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn oom_panics_are_device_memory_failures() {
        let r: Result<(), Failure> = catch_panics(|| panic!("CUDA_ERROR_OUT_OF_MEMORY while allocating"));
        assert_eq!(r.unwrap_err().kind, FailKind::DeviceMemory);
        // cubecl's launch error, with its multi-line backtrace folded into one line.
        let r: Result<(), Failure> = catch_panics(|| {
            panic!("An out-of-memory error happened during launch\nCaused by:\n  x\nBacktrace\n{}", "y\n".repeat(500))
        });
        let f = r.unwrap_err();
        assert_eq!(f.kind, FailKind::DeviceMemory);
        assert!(!f.message.contains('\n') && f.message.len() < 600, "{}", f.message);
        let r: Result<(), Failure> = catch_panics(|| panic!("index out of bounds"));
        assert_eq!(r.unwrap_err().kind, FailKind::Error);
        assert_eq!(catch_panics(|| Ok::<_, Failure>(3)).unwrap(), 3);
    }
}
