//! Export of trained weights as a Hugging Face model folder: safetensors (one file, or shards
//! with `model.safetensors.index.json`), `config.json`, and the tokenizer and chat-template files
//! of the source model folder.
//!
//! Tensors come in as `(name, shape, f32 data)` borrowed from the trainer's fp32 master copy;
//! they are converted to the output dtype one tensor at a time, so the extra memory is one
//! tensor, not the model.
//!
//! ```no_run
//! use lt_storage::export::{ExportDtype, ExportOptions, ExportTensor, export_hf};
//! # fn main() -> Result<(), lt_storage::StorageError> {
//! let w = vec![0.0f32; 8 * 4];
//! let tensors = [ExportTensor { name: "model.norm.weight", shape: &[8, 4], data: &w }];
//! let opts = ExportOptions { source_dir: Some("models/Qwen3-0.6B".as_ref()), ..ExportOptions::new(ExportDtype::Bf16) };
//! export_hf("out/finetuned".as_ref(), &tensors, &opts)?;
//! # Ok(()) }
//! ```

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensorError};

use crate::error::StorageError;

/// Element type of the exported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    /// IEEE f32 (bit-exact copy of the master weights).
    F32,
    /// bfloat16, rounded to nearest even.
    Bf16,
}

impl ExportDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }

    /// The name `config.json` uses (`torch_dtype` / `dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
        }
    }
}

/// One tensor to export.
#[derive(Debug, Clone, Copy)]
pub struct ExportTensor<'a> {
    /// Hugging Face weight name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: &'a str,
    /// Shape, outermost first.
    pub shape: &'a [usize],
    /// Row-major values; `data.len()` must equal the product of `shape`.
    pub data: &'a [f32],
}

/// Export settings.
#[derive(Debug, Clone)]
pub struct ExportOptions<'a> {
    /// Output dtype.
    pub dtype: ExportDtype,
    /// The model folder training started from: its `config.json` (unless `config` is given) and
    /// tokenizer files are copied.
    pub source_dir: Option<&'a Path>,
    /// A `config.json` to write instead of the source folder's.
    pub config: Option<serde_json::Value>,
    /// Largest shard in bytes of tensor data (default 5 GB, as `transformers` writes).
    pub max_shard_bytes: u64,
}

impl ExportOptions<'_> {
    /// Defaults: no source folder, 5 GB shards.
    pub fn new(dtype: ExportDtype) -> Self {
        Self { dtype, source_dir: None, config: None, max_shard_bytes: 5_000_000_000 }
    }
}

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct ExportReport {
    /// Safetensors files, in shard order.
    pub weight_files: Vec<PathBuf>,
    /// Every other file written (config, index, tokenizer files).
    pub other_files: Vec<PathBuf>,
    /// Bytes of tensor data.
    pub total_bytes: u64,
}

/// Files of a model folder that belong to its tokenizer or chat template (copied when present).
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
];

fn is_tokenizer_file(name: &str) -> bool {
    TOKENIZER_FILES.contains(&name)
        || name.starts_with("tokenizer")
        || (name.starts_with("chat_template") && (name.ends_with(".jinja") || name.ends_with(".json")))
        || (name.starts_with("additional_chat_templates") && name.ends_with(".jinja"))
}

struct View<'a> {
    dtype: ExportDtype,
    shape: &'a [usize],
    data: &'a [f32],
}

impl safetensors::View for View<'_> {
    fn dtype(&self) -> Dtype {
        match self.dtype {
            ExportDtype::F32 => Dtype::F32,
            ExportDtype::Bf16 => Dtype::BF16,
        }
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match self.dtype {
            #[cfg(target_endian = "little")]
            ExportDtype::F32 => Cow::Borrowed(bytemuck::cast_slice(self.data)),
            #[cfg(target_endian = "big")]
            ExportDtype::F32 => Cow::Owned(self.data.iter().flat_map(|x| x.to_le_bytes()).collect()),
            ExportDtype::Bf16 => {
                let mut out = Vec::with_capacity(self.data.len() * 2);
                for &x in self.data {
                    out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
                }
                Cow::Owned(out)
            }
        }
    }
    fn data_len(&self) -> usize {
        self.data.len() * self.dtype.size()
    }
}

fn st_error(path: &Path, e: SafeTensorError) -> StorageError {
    match e {
        SafeTensorError::IoError(io) => StorageError::io_write(path, "write safetensors", io),
        other => StorageError::BadSafetensors { path: path.to_path_buf(), reason: other.to_string() },
    }
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), StorageError> {
    let mut bytes = serde_json::to_vec_pretty(v)
        .map_err(|e| StorageError::BadIndex { path: path.to_path_buf(), reason: e.to_string() })?;
    bytes.push(b'\n');
    std::fs::write(path, bytes).map_err(|e| StorageError::io_write(path, "write", e))
}

/// Set the dtype fields of a `config.json` (top level and any `text_config`).
fn set_config_dtype(config: &mut serde_json::Value, dtype: ExportDtype) {
    let name = serde_json::Value::from(dtype.torch_name());
    if let Some(obj) = config.as_object_mut() {
        let mut set = false;
        for key in ["torch_dtype", "dtype"] {
            if obj.contains_key(key) {
                obj.insert(key.to_string(), name.clone());
                set = true;
            }
        }
        if !set {
            obj.insert("torch_dtype".to_string(), name.clone());
        }
        if let Some(text) = obj.get_mut("text_config").and_then(|t| t.as_object_mut()) {
            for key in ["torch_dtype", "dtype"] {
                if text.contains_key(key) {
                    text.insert(key.to_string(), name.clone());
                }
            }
        }
    }
}

/// Write `tensors` and the model's config and tokenizer files into `out_dir` (created if
/// missing; existing files of the same names are replaced).
pub fn export_hf(
    out_dir: &Path,
    tensors: &[ExportTensor<'_>],
    opts: &ExportOptions<'_>,
) -> Result<ExportReport, StorageError> {
    // Validate everything before writing anything.
    let mut seen = HashSet::new();
    for t in tensors {
        if t.name.is_empty() {
            return Err(StorageError::InvalidName { name: String::new(), reason: "tensor names must not be empty" });
        }
        if !seen.insert(t.name) {
            return Err(StorageError::InvalidName { name: t.name.to_string(), reason: "duplicate tensor name" });
        }
        let expected = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).unwrap_or(usize::MAX);
        if expected != t.data.len() {
            return Err(StorageError::ShapeMismatch {
                tensor: t.name.to_string(),
                shape: t.shape.to_vec(),
                expected,
                found: t.data.len(),
            });
        }
    }
    if opts.max_shard_bytes == 0 {
        return Err(StorageError::InvalidConfig { field: "max_shard_bytes", reason: "must be positive".into() });
    }
    let mut config = match (&opts.config, opts.source_dir) {
        (Some(c), _) => c.clone(),
        (None, Some(src)) => {
            let p = src.join("config.json");
            let bytes = std::fs::read(&p).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => StorageError::MissingConfig { path: src.to_path_buf() },
                _ => StorageError::io(&p, "read", e),
            })?;
            serde_json::from_slice(&bytes)
                .map_err(|e| StorageError::BadIndex { path: p.clone(), reason: e.to_string() })?
        }
        (None, None) => return Err(StorageError::MissingConfig { path: out_dir.to_path_buf() }),
    };
    set_config_dtype(&mut config, opts.dtype);

    std::fs::create_dir_all(out_dir).map_err(|e| StorageError::io_write(out_dir, "create export directory", e))?;

    // Greedy sharding in the caller's order (layers stay together).
    let mut shards: Vec<Vec<&ExportTensor<'_>>> = vec![Vec::new()];
    let mut shard_bytes = 0u64;
    let mut total_bytes = 0u64;
    for t in tensors {
        let b = (t.data.len() * opts.dtype.size()) as u64;
        if shard_bytes > 0 && shard_bytes + b > opts.max_shard_bytes {
            shards.push(Vec::new());
            shard_bytes = 0;
        }
        if let Some(last) = shards.last_mut() {
            last.push(t);
        }
        shard_bytes += b;
        total_bytes += b;
    }
    let n = shards.len();
    let mut weight_files = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file =
            if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
        let path = out_dir.join(&file);
        let views = shard.iter().map(|t| (t.name, View { dtype: opts.dtype, shape: t.shape, data: t.data }));
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::tensor::serialize_to_file(views, Some(meta), &path).map_err(|e| st_error(&path, e))?;
        for t in shard {
            weight_map.insert(t.name.to_string(), serde_json::Value::from(file.clone()));
        }
        weight_files.push(path);
    }

    let mut other_files = Vec::new();
    if n > 1 {
        let p = out_dir.join("model.safetensors.index.json");
        let index = serde_json::json!({ "metadata": { "total_size": total_bytes }, "weight_map": weight_map });
        write_json(&p, &index)?;
        other_files.push(p);
    } else {
        // A stale index from an earlier sharded export would shadow the single file.
        let _ = std::fs::remove_file(out_dir.join("model.safetensors.index.json"));
    }
    let p = out_dir.join("config.json");
    write_json(&p, &config)?;
    other_files.push(p);

    if let Some(src) = opts.source_dir {
        let rd = std::fs::read_dir(src).map_err(|e| StorageError::io(src, "read source model directory", e))?;
        let mut names: Vec<String> = rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file() || t.is_symlink()))
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| is_tokenizer_file(n))
            .collect();
        names.sort();
        for name in names {
            let from = src.join(&name);
            let to = out_dir.join(&name);
            std::fs::copy(&from, &to).map_err(|e| StorageError::io_write(&to, "copy tokenizer file", e))?;
            other_files.push(to);
        }
    }
    Ok(ExportReport { weight_files, other_files, total_bytes })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;
    use crate::safetensors_io::{DiskDtype, SafetensorsModel};

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 + seed) * 0.7311).sin() * 3.0).collect()
    }

    fn source_model(dir: &Path) {
        std::fs::write(dir.join("config.json"), r#"{"model_type":"qwen3","hidden_size":8,"torch_dtype":"bfloat16"}"#)
            .unwrap();
        std::fs::write(dir.join("tokenizer.json"), r#"{"version":"1.0"}"#).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template":"x"}"#).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "{{ messages }}").unwrap();
        std::fs::write(dir.join("merges.txt"), "a b\n").unwrap();
        std::fs::write(dir.join("model.safetensors"), b"not copied").unwrap();
        std::fs::write(dir.join("README.md"), "not copied").unwrap();
    }

    #[test]
    fn f32_export_is_bit_exact_with_config_and_tokenizer_files() {
        let src = tempfile::tempdir().unwrap();
        source_model(src.path());
        let out = tempfile::tempdir().unwrap();
        let (a, b) = (data(8 * 4, 0.0), data(8, 1.0));
        let tensors = [
            ExportTensor { name: "model.layers.0.mlp.up_proj.weight", shape: &[8, 4], data: &a },
            ExportTensor { name: "model.norm.weight", shape: &[8], data: &b },
        ];
        let opts = ExportOptions { source_dir: Some(src.path()), ..ExportOptions::new(ExportDtype::F32) };
        let rep = export_hf(out.path(), &tensors, &opts).unwrap();
        assert_eq!(rep.weight_files, vec![out.path().join("model.safetensors")]);
        assert_eq!(rep.total_bytes, 40 * 4);

        let m = SafetensorsModel::open(out.path()).unwrap();
        assert_eq!(m.meta("model.norm.weight").unwrap().dtype, DiskDtype::F32);
        assert_eq!(m.meta("model.layers.0.mlp.up_proj.weight").unwrap().shape, vec![8, 4]);
        assert_eq!(m.read_f32("model.layers.0.mlp.up_proj.weight").unwrap(), a);
        assert_eq!(m.read_f32("model.norm.weight").unwrap(), b);

        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.path().join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["torch_dtype"], "float32");
        assert_eq!(cfg["model_type"], "qwen3");
        for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "merges.txt"] {
            assert_eq!(std::fs::read(out.path().join(f)).unwrap(), std::fs::read(src.path().join(f)).unwrap(), "{f}");
        }
        assert!(!out.path().join("README.md").exists());
    }

    #[test]
    fn bf16_export_rounds_to_nearest_even_and_shards_with_an_index() {
        let out = tempfile::tempdir().unwrap();
        let ws: Vec<Vec<f32>> = (0..5).map(|i| data(1000, i as f32)).collect();
        let names: Vec<String> = (0..5).map(|i| format!("model.layers.{i}.self_attn.o_proj.weight")).collect();
        let tensors: Vec<ExportTensor<'_>> =
            names.iter().zip(&ws).map(|(n, w)| ExportTensor { name: n, shape: &[10, 100], data: w }).collect();
        let opts = ExportOptions {
            config: Some(serde_json::json!({"model_type": "qwen2", "dtype": "float32"})),
            max_shard_bytes: 4500, // 2 tensors (2000 bytes each in bf16) per shard
            ..ExportOptions::new(ExportDtype::Bf16)
        };
        let rep = export_hf(out.path(), &tensors, &opts).unwrap();
        assert_eq!(rep.weight_files.len(), 3);
        assert!(rep.weight_files[2].ends_with("model-00003-of-00003.safetensors"));
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.path().join("model.safetensors.index.json")).unwrap()).unwrap();
        assert_eq!(index["metadata"]["total_size"], 5 * 2000);
        assert_eq!(index["weight_map"][&names[4]], "model-00003-of-00003.safetensors");

        let m = SafetensorsModel::open(out.path()).unwrap();
        for (n, w) in names.iter().zip(&ws) {
            assert_eq!(m.meta(n).unwrap().dtype, DiskDtype::Bf16);
            let back = m.read_f32(n).unwrap();
            // Exact: the reader widens bf16 losslessly, so the result must be the bf16 rounding.
            let expect: Vec<f32> = w.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
            assert_eq!(back, expect);
        }
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.path().join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["dtype"], "bfloat16");
    }

    #[test]
    fn bad_input_is_refused_before_anything_is_written() {
        let out = tempfile::tempdir().unwrap();
        let target = out.path().join("x");
        let d = vec![0f32; 5];
        let opts = ExportOptions { config: Some(serde_json::json!({})), ..ExportOptions::new(ExportDtype::F32) };
        let err = export_hf(&target, &[ExportTensor { name: "w", shape: &[2, 3], data: &d }], &opts).unwrap_err();
        assert!(matches!(err, StorageError::ShapeMismatch { expected: 6, found: 5, .. }), "{err:?}");
        let two =
            [ExportTensor { name: "w", shape: &[5], data: &d }, ExportTensor { name: "w", shape: &[5], data: &d }];
        assert!(matches!(export_hf(&target, &two, &opts), Err(StorageError::InvalidName { .. })));
        let no_cfg = ExportOptions::new(ExportDtype::F32);
        assert!(matches!(export_hf(&target, &two[..1], &no_cfg), Err(StorageError::MissingConfig { .. })));
        let empty_src = tempfile::tempdir().unwrap();
        let opts = ExportOptions { source_dir: Some(empty_src.path()), ..ExportOptions::new(ExportDtype::F32) };
        let err = export_hf(&target, &two[..1], &opts).unwrap_err();
        assert!(matches!(&err, StorageError::MissingConfig { path } if path == empty_src.path()));
        assert!(!target.exists());
    }
}
