//! Sequential writes of one new file through `O_DIRECT`, for checkpoint blobs.
//!
//! A checkpoint is written once and read back only on resume, so the page cache gains nothing from
//! it, and on the development host a buffered write plus `fsync` ran at 1.5 GB/s where 4 MiB
//! `O_DIRECT` writes ran at 3.9 (`cargo bench -p benches --bench checkpoint`). The caller's bytes
//! are copied into one of three page-aligned 4 MiB buffers while a writer thread writes the
//! previous ones, so copying (and the caller's hashing) overlaps the disk. The last block is padded
//! to 4 KiB for the write and the file is then cut to its exact length.
//!
//! File systems that refuse `O_DIRECT` at open (tmpfs before Linux 6.6, some network and FUSE
//! mounts) get an ordinary buffered file; `LT_CHECKPOINT_DIRECT=0` asks for that everywhere.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use crate::error::StorageError;
use crate::spill::SpillBuf;

/// Bytes per write.
const BUF: usize = 4 << 20;
/// Buffers per file: one being filled, up to two being written.
const BUFFERS: usize = 3;
/// The alignment `O_DIRECT` asks of lengths and offsets (the largest logical block in use).
const ALIGN: usize = 4096;

struct Job {
    buf: SpillBuf,
    len: usize,
    offset: u64,
}

/// A new file written front to back: `O_DIRECT` where the file system takes it, buffered otherwise.
#[derive(Debug)]
pub(crate) enum SeqFile {
    /// Through the page cache.
    Buffered { out: BufWriter<File>, path: PathBuf },
    /// Around it.
    Direct(DirectWriter),
}

impl SeqFile {
    /// Create (truncate) `path`; `O_DIRECT` when `direct` and the file system accepts it.
    pub(crate) fn create(path: &Path, direct: bool) -> Result<Self, StorageError> {
        let open =
            |flags: i32| OpenOptions::new().write(true).create(true).truncate(true).custom_flags(flags).open(path);
        if direct {
            match open(libc::O_DIRECT) {
                Ok(f) => return DirectWriter::new(f, path).map(SeqFile::Direct),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(StorageError::io_write(path, "create checkpoint blob", e)),
            }
        }
        let f = open(0).map_err(|e| StorageError::io_write(path, "create checkpoint blob", e))?;
        Ok(SeqFile::Buffered { out: BufWriter::with_capacity(1 << 20, f), path: path.to_path_buf() })
    }

    /// Whether writes bypass the page cache.
    pub(crate) fn is_direct(&self) -> bool {
        matches!(self, SeqFile::Direct(_))
    }

    /// Append all of `data`.
    pub(crate) fn write_all(&mut self, data: &[u8]) -> Result<(), StorageError> {
        match self {
            SeqFile::Buffered { out, path } => {
                out.write_all(data).map_err(|e| StorageError::io_write(path.as_path(), "write checkpoint blob", e))
            }
            SeqFile::Direct(d) => d.write_all(data),
        }
    }

    /// Write everything out, cut the file to its length and fsync it.
    pub(crate) fn finish(self) -> Result<(), StorageError> {
        match self {
            SeqFile::Buffered { out, path } => {
                let f = out
                    .into_inner()
                    .map_err(|e| StorageError::io_write(path.as_path(), "write checkpoint blob", e.into_error()))?;
                f.sync_all().map_err(|e| StorageError::io_write(path.as_path(), "fsync checkpoint blob", e))
            }
            SeqFile::Direct(d) => d.finish(),
        }
    }
}

/// The `O_DIRECT` writer: fills aligned buffers, hands full ones to its thread.
#[derive(Debug)]
pub(crate) struct DirectWriter {
    path: PathBuf,
    file: Arc<File>,
    cur: SpillBuf,
    fill: usize,
    /// File offset of `cur`'s first byte.
    offset: u64,
    free: Vec<SpillBuf>,
    in_flight: usize,
    jobs: Option<Sender<Job>>,
    done: Receiver<(SpillBuf, std::io::Result<()>)>,
    thread: Option<JoinHandle<()>>,
}

impl DirectWriter {
    fn new(file: File, path: &Path) -> Result<Self, StorageError> {
        let file = Arc::new(file);
        let mut free = (0..BUFFERS).map(|_| SpillBuf::zeroed(BUF)).collect::<Result<Vec<_>, _>>()?;
        let cur = free
            .pop()
            .ok_or_else(|| StorageError::io(path, "allocate write buffers", std::io::Error::other("none")))?;
        let (jobs, rx) = channel::<Job>();
        let (tx, done) = channel();
        let f = Arc::clone(&file);
        let thread = std::thread::Builder::new()
            .name("lt-ckpt-write".into())
            .spawn(move || {
                for job in rx {
                    let r = f.write_all_at(&job.buf[..job.len], job.offset);
                    if tx.send((job.buf, r)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| StorageError::io(path, "start checkpoint writer thread", e))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            cur,
            fill: 0,
            offset: 0,
            free,
            in_flight: 0,
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    fn write_all(&mut self, mut data: &[u8]) -> Result<(), StorageError> {
        while !data.is_empty() {
            let n = (BUF - self.fill).min(data.len());
            self.cur[self.fill..self.fill + n].copy_from_slice(&data[..n]);
            self.fill += n;
            data = &data[n..];
            if self.fill == BUF {
                self.submit(BUF)?;
            }
        }
        Ok(())
    }

    /// Hand `cur[..len]` to the thread and take a free buffer.
    fn submit(&mut self, len: usize) -> Result<(), StorageError> {
        let next = match self.free.pop() {
            Some(b) => b,
            None => self.reap()?,
        };
        let buf = std::mem::replace(&mut self.cur, next);
        let job = Job { buf, len, offset: self.offset };
        let sent = self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok());
        if !sent {
            return Err(self.thread_gone());
        }
        self.in_flight += 1;
        self.offset += self.fill as u64;
        self.fill = 0;
        Ok(())
    }

    /// Wait for one write to finish; its buffer, or its error.
    fn reap(&mut self) -> Result<SpillBuf, StorageError> {
        let (buf, r) = self.done.recv().map_err(|_| self.thread_gone())?;
        self.in_flight -= 1;
        r.map_err(|e| {
            // A file system that opened the file with O_DIRECT but refuses its writes.
            let op = if e.raw_os_error() == Some(libc::EINVAL) {
                "write checkpoint blob with O_DIRECT (LT_CHECKPOINT_DIRECT=0 writes through the page cache)"
            } else {
                "write checkpoint blob"
            };
            StorageError::io_write(self.path.as_path(), op, e)
        })?;
        Ok(buf)
    }

    fn thread_gone(&self) -> StorageError {
        StorageError::io(self.path.as_path(), "write checkpoint blob", std::io::Error::other("writer thread stopped"))
    }

    fn finish(mut self) -> Result<(), StorageError> {
        let len = self.offset + self.fill as u64;
        if self.fill > 0 {
            let padded = self.fill.next_multiple_of(ALIGN);
            self.cur[self.fill..padded].fill(0);
            self.submit(padded)?;
        }
        while self.in_flight > 0 {
            let b = self.reap()?;
            self.free.push(b);
        }
        self.file
            .set_len(len)
            .map_err(|e| StorageError::io_write(self.path.as_path(), "set checkpoint blob length", e))?;
        self.file.sync_all().map_err(|e| StorageError::io_write(self.path.as_path(), "fsync checkpoint blob", e))
    }
}

impl Drop for DirectWriter {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u32) -> Vec<u8> {
        (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).to_le_bytes()[2]).collect()
    }

    /// Lengths around the buffer and block sizes, written in uneven pieces, read back exactly, on
    /// both paths.
    #[test]
    fn files_read_back_exactly_at_every_length_on_both_paths() {
        let dir = tempfile::tempdir().unwrap();
        for direct in [true, false] {
            for (k, len) in [0, 1, 4095, 4096, 4097, BUF - 1, BUF, BUF + 1, 3 * BUF + 12_345].into_iter().enumerate() {
                let want = pattern(len, k as u32);
                let path = dir.path().join(format!("f-{direct}-{k}"));
                let mut f = SeqFile::create(&path, direct).unwrap();
                for piece in want.chunks(1_000_003) {
                    f.write_all(piece).unwrap();
                }
                f.finish().unwrap();
                assert!(std::fs::read(&path).unwrap() == want, "direct {direct}, {len} bytes");
            }
        }
    }

    /// On tmpfs, which refused `O_DIRECT` at open before Linux 6.6 and takes it since, the file is
    /// whole either way.
    #[test]
    fn a_tmpfs_file_is_written_whole_whichever_way_it_opened() {
        let shm = Path::new("/dev/shm");
        if !crate::spill::is_tmpfs(shm) {
            println!("SKIPPED: no tmpfs at /dev/shm");
            return;
        }
        let dir = tempfile::tempdir_in(shm).unwrap();
        let path = dir.path().join("f");
        let want = pattern(BUF + 77, 9);
        let mut f = SeqFile::create(&path, true).unwrap();
        println!("tmpfs: O_DIRECT {}", if f.is_direct() { "taken" } else { "refused, buffered" });
        f.write_all(&want).unwrap();
        f.finish().unwrap();
        assert!(std::fs::read(&path).unwrap() == want);
    }
}
