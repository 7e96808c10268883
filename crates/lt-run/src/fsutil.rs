//! File helpers for the CLI.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// Write `data` to `path` atomically: a temp file in the same folder, fsync, rename. On error the
/// previous file (if any) is untouched and the temp file is removed.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create folder", dir.display()))?;
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| -> Result<()> {
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
        f.write_all(data).with_context(|| format!("{}: write failed", tmp.display()))?;
        f.sync_all().with_context(|| format!("{}: fsync failed", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot replace", path.display()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Bytes of the regular files directly in `dir` (0 where it cannot be read: the figure is a report,
/// not a check).
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries.filter_map(|e| e.ok()?.metadata().ok()).filter(std::fs::Metadata::is_file).map(|m| m.len()).sum()
        })
        .unwrap_or(0)
}
