//! How much a file system can still take: checked before a run writes checkpoints and an export.

use std::path::Path;

use crate::StorageError;

/// Bytes an unprivileged process can still write on the file system holding `path`, or holding its
/// nearest existing ancestor when `path` does not exist yet (an output folder about to be created).
pub fn available_bytes(path: &Path) -> Result<u64, StorageError> {
    let mut at = path;
    while !at.exists() {
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p,
            _ => {
                at = Path::new(".");
                break;
            }
        }
    }
    statvfs_available(at)
}

#[cfg(unix)]
fn statvfs_available(path: &Path) -> Result<u64, StorageError> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| StorageError::io(path, "statvfs", std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a valid NUL-terminated path and `st` is writable storage of the right type;
    // statvfs fills it on success and it is read only then.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(StorageError::io(path, "statvfs", std::io::Error::last_os_error()));
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

#[cfg(not(unix))]
fn statvfs_available(_path: &Path) -> Result<u64, StorageError> {
    Ok(u64::MAX)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_folder_reports_its_existing_parents_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let here = available_bytes(dir.path()).unwrap();
        let below = available_bytes(&dir.path().join("not/yet/made")).unwrap();
        assert!(here > 0);
        // The same file system, read twice: within what other processes wrote meanwhile (64 MiB).
        assert!(here.abs_diff(below) < 64 << 20, "{here} vs {below}");
    }
}
