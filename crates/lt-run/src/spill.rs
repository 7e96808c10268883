//! The NVMe activation tier of a run: lt-storage's spill store behind the executor's trait.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use lt_exec::executor::ActivationSpill;
use lt_storage::spill::{SpillConfig, SpillStore};

/// Open a spill store of `capacity` bytes in `dir` (created if missing), and say how it was opened
/// (io_uring or the fallback, O_DIRECT or not). The file is preallocated and unlinked at once, so the
/// run never grows the folder and a crash leaves nothing behind.
pub fn open(dir: &Path, capacity: u64) -> Result<(Arc<dyn ActivationSpill>, String)> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create the spill folder", dir.display()))?;
    let store = SpillStore::open(SpillConfig::new(dir, capacity))?;
    let report = format!("nvme spill: {:?}", store.report());
    Ok((Arc::new(store), report))
}
