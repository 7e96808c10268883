//! Helpers shared by this crate's unit tests: a PRNG, child processes that re-run one ignored test
//! of this binary under different limits, and a private tmpfs mount.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// xorshift64*: deterministic test data without a `rand` dependency.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub(crate) fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(len);
        v
    }
}

/// A command that re-runs the ignored test `name` of the current test binary.
pub(crate) fn child_test(name: &str) -> Command {
    let exe = std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into());
    let mut c = Command::new(exe);
    c.args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Assert that a child made by [`child_test`] ran its test and the test passed.
pub(crate) fn assert_child_passed(out: &Output, what: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{what}: child failed ({:?})\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
}

/// Run child test `name` with a 1 MiB tmpfs mounted on `dir` (an empty directory), the mount
/// visible only to that child (a private mount namespace) so nothing is left mounted whatever
/// happens. Falls back to a mount in this namespace, undone after the child. Returns `Err(reason)`
/// when the machine allows neither (no `CAP_SYS_ADMIN`; a loop device would need it too).
pub(crate) fn run_child_on_small_tmpfs(name: &str, dir: &Path, env: &[(&str, &Path)]) -> Result<Output, String> {
    let target = CString::new(dir.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    let fstype = c"tmpfs";
    let opts = c"size=1m";
    let root = c"/";

    let mut c = child_test(name);
    for (k, v) in env {
        c.env(k, v);
    }
    {
        let target = target.clone();
        // SAFETY: the closure runs between fork and exec and only makes raw syscalls
        // (unshare, mount) on pre-built C strings: no allocation, no locks.
        unsafe {
            c.pre_exec(move || {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::mount(
                    std::ptr::null(),
                    root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, opts.as_ptr().cast()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let ns_err = match c.output() {
        Ok(out) => return Ok(out),
        Err(e) => e,
    };

    // No private namespace: mount here, run the child, always unmount.
    // SAFETY: plain mount syscall on NUL-terminated strings.
    let r = unsafe { libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, opts.as_ptr().cast()) };
    if r != 0 {
        let mount_err = std::io::Error::last_os_error();
        return Err(format!(
            "cannot mount a tmpfs (private namespace: {ns_err}; mount: {mount_err}); a loop device needs the same privilege"
        ));
    }
    struct Unmount(CString);
    impl Drop for Unmount {
        fn drop(&mut self) {
            // SAFETY: unmounting the tmpfs this test mounted; MNT_DETACH never blocks.
            unsafe {
                libc::umount2(self.0.as_ptr(), libc::MNT_DETACH);
            }
        }
    }
    let _guard = Unmount(target);
    let mut c = child_test(name);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().map_err(|e| format!("spawning the child test: {e}"))
}
