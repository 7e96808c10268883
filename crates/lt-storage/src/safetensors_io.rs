//! Memory-mapped reading of Hugging Face safetensors checkpoints, single-file or sharded.
//!
//! Headers are parsed (and validated against the file size) once at open; tensor data stays in the
//! page cache behind the mmap until a caller converts it to an fp32 host buffer.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors};

use crate::error::StorageError;

/// Element type of a tensor on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskDtype {
    /// IEEE f32.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE f16.
    F16,
    /// Anything else (integers, f64, fp8...).
    Other,
}

/// Name, dtype and shape of one stored tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Element type on disk.
    pub dtype: DiskDtype,
    /// The dtype as the file spells it, for error messages.
    pub dtype_name: String,
    /// Shape.
    pub shape: Vec<usize>,
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// A safetensors checkpoint: `model.safetensors`, or shards listed in `model.safetensors.index.json`.
pub struct SafetensorsModel {
    root: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name -> shard index.
    location: HashMap<String, usize>,
}

impl std::fmt::Debug for SafetensorsModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsModel")
            .field("root", &self.root)
            .field("shards", &self.shards.len())
            .field("tensors", &self.location.len())
            .finish()
    }
}

fn map_dtype(d: Dtype) -> DiskDtype {
    match d {
        Dtype::F32 => DiskDtype::F32,
        Dtype::BF16 => DiskDtype::Bf16,
        Dtype::F16 => DiskDtype::F16,
        _ => DiskDtype::Other,
    }
}

fn open_shard(path: &Path) -> Result<Shard, StorageError> {
    let file = File::open(path).map_err(|e| StorageError::io(path, "open", e))?;
    // SAFETY: the map is read-only and private to this process; a concurrent truncation of the
    // file by another process would be a user error we cannot guard against (same contract as
    // every mmap-based safetensors loader). All reads go through bounds validated by the header.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| StorageError::io(path, "mmap", e))?;
    let (header_len, metadata) = SafeTensors::read_metadata(&mmap)
        .map_err(|e| StorageError::BadSafetensors { path: path.to_path_buf(), reason: e.to_string() })?;
    Ok(Shard { path: path.to_path_buf(), mmap, header_len, metadata })
}

impl SafetensorsModel {
    /// Open a model folder (or a single `.safetensors` file).
    ///
    /// A folder with `model.safetensors.index.json` is read as sharded; otherwise
    /// `model.safetensors` must exist.
    pub fn open(path: &Path) -> Result<Self, StorageError> {
        if path.is_file() {
            return Self::from_shards(path.to_path_buf(), vec![path.to_path_buf()], None);
        }
        let index = path.join("model.safetensors.index.json");
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| StorageError::io(&index, "read", e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| StorageError::BadIndex { path: index.clone(), reason: e.to_string() })?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| StorageError::BadIndex {
                path: index.clone(),
                reason: "missing object `weight_map`".into(),
            })?;
            let mut files: Vec<String> = Vec::new();
            let mut want: HashMap<String, String> = HashMap::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| StorageError::BadIndex {
                    path: index.clone(),
                    reason: format!("weight_map[{name:?}] is not a string"),
                })?;
                if file.contains('/') || file.contains("..") {
                    return Err(StorageError::BadIndex {
                        path: index.clone(),
                        reason: format!("shard name {file:?} must be a plain file name"),
                    });
                }
                if !files.iter().any(|f| f == file) {
                    files.push(file.to_string());
                }
                want.insert(name.clone(), file.to_string());
            }
            let paths = files.iter().map(|f| path.join(f)).collect();
            return Self::from_shards(path.to_path_buf(), paths, Some((index, want)));
        }
        let single = path.join("model.safetensors");
        if !single.exists() {
            return Err(StorageError::io(
                &single,
                "open",
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors or model.safetensors.index.json",
                ),
            ));
        }
        Self::from_shards(path.to_path_buf(), vec![single], None)
    }

    fn from_shards(
        root: PathBuf,
        paths: Vec<PathBuf>,
        index: Option<(PathBuf, HashMap<String, String>)>,
    ) -> Result<Self, StorageError> {
        let mut shards = Vec::with_capacity(paths.len());
        let mut location = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            let shard = open_shard(p)?;
            for name in shard.metadata.tensors().keys() {
                location.insert(name.clone(), i);
            }
            shards.push(shard);
        }
        if let Some((index_path, want)) = index {
            // The index must not promise a tensor its shard lacks.
            let mut names: Vec<_> = want.keys().collect();
            names.sort();
            for name in names {
                let file = &want[name];
                let ok = location
                    .get(name)
                    .is_some_and(|&i| shards[i].path.file_name().is_some_and(|f| f.to_string_lossy() == *file));
                if !ok {
                    return Err(StorageError::BadIndex {
                        path: index_path,
                        reason: format!("tensor `{name}` is not in shard {file}"),
                    });
                }
            }
        }
        Ok(Self { root, shards, location })
    }

    /// The folder or file this model was opened from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.location.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// Dtype and shape of a tensor, if present.
    pub fn meta(&self, name: &str) -> Option<TensorMeta> {
        let shard = &self.shards[*self.location.get(name)?];
        let info = shard.metadata.info(name)?;
        Some(TensorMeta {
            dtype: map_dtype(info.dtype),
            dtype_name: format!("{:?}", info.dtype),
            shape: info.shape.clone(),
        })
    }

    fn raw(&self, name: &str) -> Result<(&Shard, DiskDtype, &[u8]), StorageError> {
        let missing = || StorageError::MissingTensor { path: self.root.clone(), name: name.to_string() };
        let shard = &self.shards[*self.location.get(name).ok_or_else(missing)?];
        let info = shard.metadata.info(name).ok_or_else(missing)?;
        let start = 8 + shard.header_len + info.data_offsets.0;
        let end = 8 + shard.header_len + info.data_offsets.1;
        // read_metadata validated the offsets against the buffer length, so this cannot fail;
        // keep the checked form anyway so a future safetensors change cannot turn into a panic.
        let bytes = shard.mmap.get(start..end).ok_or_else(|| StorageError::BadSafetensors {
            path: shard.path.clone(),
            reason: format!("tensor `{name}` lies outside the file"),
        })?;
        Ok((shard, map_dtype(info.dtype), bytes))
    }

    /// Read a tensor converted to f32, appending to `out`.
    pub fn read_f32_into(&self, name: &str, out: &mut Vec<f32>) -> Result<(), StorageError> {
        let (shard, dtype, bytes) = self.raw(name)?;
        match dtype {
            DiskDtype::F32 => out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
            DiskDtype::Bf16 => out.extend(
                bytes.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
            ),
            DiskDtype::F16 => out
                .extend(bytes.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())),
            DiskDtype::Other => {
                let dtype = self.meta(name).map(|m| m.dtype_name).unwrap_or_default();
                return Err(StorageError::UnsupportedDtype { path: shard.path.clone(), name: name.to_string(), dtype });
            }
        }
        Ok(())
    }

    /// Read a tensor converted to f32.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, StorageError> {
        // Masters are long-lived and streamed every step: on huge pages (see `lt_core::hostmem`).
        let numel = self.meta(name).map_or(0, |m| m.shape.iter().product());
        let mut v = lt_core::hostmem::huge_with_capacity(numel);
        self.read_f32_into(name, &mut v)?;
        Ok(v)
    }

    /// The file holding a tensor (for error messages).
    pub fn file_of(&self, name: &str) -> PathBuf {
        match self.location.get(name) {
            Some(&i) => self.shards[i].path.clone(),
            None => self.root.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn reads_f32_bf16_f16_as_f32() {
        let dir = tempfile::tempdir().unwrap();
        let f32b: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        let bf: Vec<u8> = [half::bf16::from_f32(0.5), half::bf16::from_f32(-3.0)]
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect();
        let hf: Vec<u8> = [half::f16::from_f32(0.25)].iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
        write_st(
            &dir.path().join("model.safetensors"),
            &[("a", Dtype::F32, vec![2], f32b), ("b", Dtype::BF16, vec![1, 2], bf), ("c", Dtype::F16, vec![1], hf)],
        );
        let m = SafetensorsModel::open(dir.path()).unwrap();
        assert_eq!(m.read_f32("a").unwrap(), vec![1.5, -2.0]);
        assert_eq!(m.read_f32("b").unwrap(), vec![0.5, -3.0]);
        assert_eq!(m.read_f32("c").unwrap(), vec![0.25]);
        assert_eq!(m.meta("b").unwrap().shape, vec![1, 2]);
        assert!(matches!(m.read_f32("zz"), Err(StorageError::MissingTensor { .. })));
    }

    #[test]
    fn sharded_index_is_followed_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let one: Vec<u8> = 1f32.to_le_bytes().to_vec();
        write_st(&dir.path().join("s1.safetensors"), &[("x", Dtype::F32, vec![1], one.clone())]);
        write_st(&dir.path().join("s2.safetensors"), &[("y", Dtype::F32, vec![1], one)]);
        let idx = r#"{"metadata":{},"weight_map":{"x":"s1.safetensors","y":"s2.safetensors"}}"#;
        std::fs::write(dir.path().join("model.safetensors.index.json"), idx).unwrap();
        let m = SafetensorsModel::open(dir.path()).unwrap();
        assert_eq!(m.names(), vec!["x", "y"]);
        let idx = r#"{"weight_map":{"x":"s2.safetensors"}}"#;
        std::fs::write(dir.path().join("model.safetensors.index.json"), idx).unwrap();
        let e = SafetensorsModel::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tensor `x` is not in shard s2.safetensors"), "{e}");
    }

    #[test]
    fn truncated_and_lying_headers_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        write_st(&p, &[("a", Dtype::F32, vec![4], vec![0u8; 16])]);
        let full = std::fs::read(&p).unwrap();
        std::fs::write(&p, &full[..full.len() - 3]).unwrap();
        let e = SafetensorsModel::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("invalid safetensors file"), "{e}");
        // A header length larger than the file.
        let mut lying = full.clone();
        lying[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        std::fs::write(&p, &lying).unwrap();
        assert!(SafetensorsModel::open(dir.path()).is_err());
        std::fs::write(&p, [1u8, 2]).unwrap();
        assert!(SafetensorsModel::open(dir.path()).is_err());
    }
}
