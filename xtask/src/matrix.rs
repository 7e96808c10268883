//! Benchmark matrices: declarative TOML tables (`xtask/matrices/*.toml`) that say which models, batch
//! sizes and policies to run on which machine.
//!
//! Parsing is two-step: serde fills [`MatrixFile`] (unknown or mistyped fields are errors that name the
//! file and the field), then [`MatrixFile::validate`] checks the values and resolves paths into a
//! [`Matrix`].

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use lt_sched::hardware::HardwareSpec;
use serde::Deserialize;

/// A policy the matrix compares: lt-sched's, the one the `lt` CLI takes too.
pub use lt_sched::planner::Policy;

/// One model of the matrix, as written in the file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// Short name used in tables and plots (`qwen2.5-7b`).
    pub name: String,
    /// Hugging Face `config.json`, relative to the workspace root (random init: no weights needed).
    pub config: PathBuf,
}

/// The max-batch search of a matrix (the published RTX 3090 result).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MaxBatchEntry {
    /// Policies to search for.
    pub policies: Vec<Policy>,
    /// Largest batch a measured search tries (the predicted search is bounded by lt-sched).
    #[serde(default = "default_max_batch_limit")]
    pub limit: usize,
}

fn default_max_batch_limit() -> usize {
    1024
}

/// A matrix file as written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatrixFile {
    /// Matrix name: names the JSON and SVG outputs.
    pub name: String,
    /// One line saying what the matrix compares with.
    #[serde(default)]
    pub description: String,
    /// Hardware profile: a built-in name (h800, rtx3090, h200, cpu) or a TOML file (workspace-relative).
    pub hardware: String,
    /// Substring of `nvidia-smi --query-gpu=name` that identifies the matching GPU (`H800`).
    pub gpu_match: String,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per optimizer step; may be empty when the matrix only searches the max batch.
    #[serde(default)]
    pub batch_sizes: Vec<usize>,
    /// Policies compared at each batch size.
    pub policies: Vec<Policy>,
    /// Timed steps of a measured run.
    pub steps: usize,
    /// Untimed warm-up steps of a measured run.
    pub warmup: usize,
    /// Models, in table order.
    pub models: Vec<ModelEntry>,
    /// Optional max-batch search.
    #[serde(default)]
    pub max_batch: Option<MaxBatchEntry>,
}

/// A validated matrix with resolved paths.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    /// The file it came from.
    pub path: PathBuf,
    /// Its contents.
    pub file: MatrixFile,
    /// The hardware profile, parsed.
    pub hardware: HardwareSpec,
    /// Model config paths, resolved against the workspace root.
    pub model_paths: Vec<PathBuf>,
}

impl Matrix {
    /// Read and validate `path`; relative paths inside it resolve against `root`.
    ///
    /// # Errors
    /// When the file cannot be read, a field is unknown, missing or mistyped (the error names the file
    /// and the field), or a value is out of range.
    pub fn load(path: &Path, root: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text, path, root)
    }

    /// Parse matrix text; `path` labels errors.
    ///
    /// # Errors
    /// As [`Matrix::load`].
    pub fn parse(text: &str, path: &Path, root: &Path) -> Result<Self> {
        let file: MatrixFile = toml::from_str(text).map_err(|e| {
            let field = e.span().and_then(|s| field_at(text, s.start)).map_or_else(
                || missing_field(e.message()).map_or_else(String::new, |f| format!(" field `{f}`:")),
                |f| format!(" field `{f}`:"),
            );
            let line = e.span().map_or(String::new(), |s| format!(" (line {})", line_of(text, s.start)));
            anyhow::anyhow!("{}:{field} {}{line}", path.display(), e.message())
        })?;
        file.validate(path, root)
    }
}

impl MatrixFile {
    /// Check values and resolve paths.
    ///
    /// # Errors
    /// Names the file and the first bad field.
    pub fn validate(self, path: &Path, root: &Path) -> Result<Matrix> {
        let name = path.display();
        let hardware: HardwareSpec =
            self.hardware.parse().with_context(|| format!("{name}: field `hardware`: {:?}", self.hardware))?;
        let hardware = match hardware {
            HardwareSpec::File(p) if p.is_relative() => HardwareSpec::File(root.join(p)),
            other => other,
        };
        if self.seq_len == 0 {
            bail!("{name}: field `seq_len`: must be > 0");
        }
        if let Some(i) = self.batch_sizes.iter().position(|&b| b == 0) {
            bail!("{name}: field `batch_sizes[{i}]`: must be > 0");
        }
        if self.policies.is_empty() && !self.batch_sizes.is_empty() {
            bail!("{name}: field `policies`: needs at least one policy when `batch_sizes` is set");
        }
        if self.steps == 0 {
            bail!("{name}: field `steps`: must be > 0");
        }
        if self.models.is_empty() {
            bail!("{name}: field `models`: needs at least one model");
        }
        if self.gpu_match.trim().is_empty() {
            bail!("{name}: field `gpu_match`: must not be empty");
        }
        if let Some(mb) = &self.max_batch {
            if mb.policies.is_empty() {
                bail!("{name}: field `max_batch.policies`: needs at least one policy");
            }
            if mb.limit == 0 {
                bail!("{name}: field `max_batch.limit`: must be > 0");
            }
        }
        if self.batch_sizes.is_empty() && self.max_batch.is_none() {
            bail!("{name}: field `batch_sizes`: empty and no `max_batch` search: the matrix has nothing to run");
        }
        let mut model_paths = Vec::new();
        for (i, m) in self.models.iter().enumerate() {
            let p = if m.config.is_relative() { root.join(&m.config) } else { m.config.clone() };
            if !p.is_file() {
                bail!("{name}: field `models[{i}].config`: {} is not a file", p.display());
            }
            model_paths.push(p);
        }
        Ok(Matrix { path: path.to_path_buf(), file: self, hardware, model_paths })
    }
}

/// 1-based line of byte offset `at`.
fn line_of(text: &str, at: usize) -> usize {
    text.get(..at).map_or(1, |s| s.matches('\n').count() + 1)
}

/// `missing field `x`` -> `x`.
fn missing_field(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("missing field `")?;
    rest.split('`').next()
}

/// The dotted path of the key or value at byte offset `at` (`models[1].config`), if any.
fn field_at(text: &str, at: usize) -> Option<String> {
    let doc = toml::de::DeTable::parse(text).ok()?;
    let mut path = String::new();
    table_path(doc.get_ref(), at, &mut path).then_some(path)
}

fn table_path(table: &toml::de::DeTable<'_>, at: usize, path: &mut String) -> bool {
    for (k, v) in table.iter() {
        let (ks, vs) = (k.span(), v.span());
        if ks.contains(&at) || vs.contains(&at) {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(k.get_ref());
            if vs.contains(&at) {
                value_path(v.get_ref(), at, path);
            }
            return true;
        }
    }
    // Array-of-tables entries are spanned by their headers, not their bodies: search them all.
    for (k, v) in table.iter() {
        if let toml::de::DeValue::Array(items) = v.get_ref() {
            for (i, item) in items.iter().enumerate() {
                if let toml::de::DeValue::Table(t) = item.get_ref() {
                    let mut sub = String::new();
                    if table_path(t, at, &mut sub) {
                        if !path.is_empty() {
                            path.push('.');
                        }
                        path.push_str(&format!("{}[{i}].{sub}", k.get_ref()));
                        return true;
                    }
                }
            }
        } else if let toml::de::DeValue::Table(t) = v.get_ref() {
            let mut sub = String::new();
            if table_path(t, at, &mut sub) {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(&format!("{}.{sub}", k.get_ref()));
                return true;
            }
        }
    }
    false
}

fn value_path(value: &toml::de::DeValue<'_>, at: usize, path: &mut String) {
    match value {
        toml::de::DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                if item.span().contains(&at) {
                    path.push_str(&format!("[{i}]"));
                    value_path(item.get_ref(), at, path);
                    return;
                }
            }
        }
        toml::de::DeValue::Table(t) => {
            table_path(t, at, path);
        }
        _ => {}
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    const GOOD: &str = r#"
name = "t"
hardware = "h800"
gpu_match = "H800"
seq_len = 1024
batch_sizes = [8, 72]
policies = ["auto", "megatrain"]
steps = 3
warmup = 1

[[models]]
name = "qwen2.5-3b"
config = "configs/models/qwen2.5-3b.json"

[[models]]
name = "qwen2.5-7b"
config = "configs/models/qwen2.5-7b.json"

[max_batch]
policies = ["auto"]
"#;

    fn err(text: &str) -> String {
        format!("{:#}", Matrix::parse(text, Path::new("m.toml"), &root()).unwrap_err())
    }

    #[test]
    fn committed_matrices_parse() {
        let dir = root().join("xtask/matrices");
        for name in ["h800.toml", "rtx3090.toml", "h200.toml"] {
            let m = Matrix::load(&dir.join(name), &root()).unwrap();
            assert_eq!(m.model_paths.len(), 4, "{name}");
            assert_eq!(m.file.seq_len, 1024, "{name}: the published runs use seq 1024");
        }
    }

    #[test]
    fn good_matrix_resolves_paths_and_defaults() {
        let m = Matrix::parse(GOOD, Path::new("m.toml"), &root()).unwrap();
        assert_eq!(m.file.batch_sizes, vec![8, 72]);
        assert_eq!(m.file.policies, vec![Policy::Auto, Policy::Megatrain]);
        assert_eq!(m.file.max_batch.as_ref().map(|b| b.limit), Some(1024));
        assert!(m.model_paths[1].ends_with("configs/models/qwen2.5-7b.json"));
    }

    #[test]
    fn mistyped_field_names_the_file_and_the_field() {
        let e = err(&GOOD.replace("seq_len = 1024", "seq_len = \"long\""));
        assert!(e.starts_with("m.toml: field `seq_len`:"), "{e}");
        let e = err(&GOOD.replace("[8, 72]", "[8, \"x\"]"));
        assert!(e.contains("m.toml: field `batch_sizes[1]`:"), "{e}");
        let e = err(&GOOD.replace("config = \"configs/models/qwen2.5-7b.json\"", "config = 7"));
        assert!(e.contains("m.toml: field `models[1].config`:"), "{e}");
        let e = err(&GOOD.replace("policies = [\"auto\"]", "policies = [\"fast\"]"));
        assert!(e.contains("m.toml: field `max_batch.policies[0]`:"), "{e}");
        assert!(e.contains("unknown variant `fast`"), "{e}");
    }

    #[test]
    fn unknown_missing_and_out_of_range_fields_are_named() {
        let e = err(&format!("bogus = 1\n{GOOD}"));
        assert!(e.starts_with("m.toml: field `bogus`:") && e.contains("unknown field"), "{e}");
        let e = err(&GOOD.replace("steps = 3\n", ""));
        assert!(e.starts_with("m.toml: field `steps`:") && e.contains("missing field"), "{e}");
        let e = err(&GOOD.replace("seq_len = 1024", "seq_len = 0"));
        assert_eq!(e, "m.toml: field `seq_len`: must be > 0");
        let e = err(&GOOD.replace("qwen2.5-7b.json", "nope.json"));
        assert!(e.starts_with("m.toml: field `models[1].config`:"), "{e}");
        let e = err(&GOOD.replace("\"h800\"", "\"a100\""));
        assert!(e.starts_with("m.toml: field `hardware`:"), "{e}");
    }
}
