//! Checkpoints of a training run (fp32 masters + optimizer state + run metadata) and the
//! Hugging Face export of the trained weights.

use std::io::Write;
use std::path::Path;

use lt_model::host::HostModel;
use lt_optim::AdamW;
use lt_storage::StorageError;
use lt_storage::checkpoint::{BlobWriter, Checkpoint, CheckpointStore, Committed};
use lt_storage::export::{ExportDtype, ExportOptions, ExportReport, ExportTensor, export_hf};

use crate::error::ExecError;
use crate::state::SharedModel;

const WEIGHTS: &str = "master_weights";
const OPTIMIZER: &str = "optimizer";

/// Every parameter of `host` in checkpoint order: `(checkpoint name, shape, data)`.
pub fn named_params(host: &HostModel) -> Vec<(String, &[usize], &[f32])> {
    let mut v: Vec<(String, &[usize], &[f32])> = vec![
        (host.outer_param_name("embed_tokens.weight"), &host.embed_tokens.shape, &host.embed_tokens.data),
        (host.outer_param_name("norm.weight"), &host.norm.shape, &host.norm.data),
    ];
    if let Some(h) = &host.lm_head {
        v.push(("lm_head.weight".into(), &h.shape, &h.data));
    }
    for (i, l) in host.layers.iter().enumerate() {
        for (s, t) in l.specs.iter().zip(&l.tensors) {
            v.push((host.layer_param_name(i, &s.name), &t.shape, &t.data));
        }
    }
    v
}

fn params_mut(host: &mut HostModel) -> Vec<&mut Vec<f32>> {
    let mut v: Vec<&mut Vec<f32>> = vec![&mut host.embed_tokens.data, &mut host.norm.data];
    if let Some(h) = &mut host.lm_head {
        v.push(&mut h.data);
    }
    for l in &mut host.layers {
        v.extend(l.tensors.iter_mut().map(|t| &mut t.data));
    }
    v
}

/// About how many bytes [`save_checkpoint`] writes for a model trained by `optim`: 4 per master
/// weight plus the optimizer's state (its per-tensor headers, the manifest and the metadata, a few
/// KiB, are left out). For the disk-space check before a run.
pub fn checkpoint_bytes(optim: &AdamW) -> u64 {
    4 * optim.numel() as u64 + optim.state_bytes() as u64
}

/// Save `host` and `optim` as checkpoint `step` with `meta` (atomic; see lt-storage).
pub fn save_checkpoint(
    store: &CheckpointStore,
    step: u64,
    host: &HostModel,
    optim: &AdamW,
    meta: serde_json::Value,
) -> Result<Committed, ExecError> {
    let params = named_params(host);
    let names = params.iter().map(|(n, s, _)| (n.clone(), s.to_vec())).collect();
    write_checkpoint(store, step, names, optim, meta, |blob| params.iter().try_for_each(|(_, _, d)| blob.append_f32(d)))
}

/// [`save_checkpoint`] of the masters in `model`, read tensor by tensor under each slot's lock
/// instead of from a [`SharedModel::snapshot`], which would copy every master (4 B/param: 28 GB on
/// a 7B model) to save it. Same files, byte for byte. Call when no update runs.
pub fn save_shared_checkpoint(
    store: &CheckpointStore,
    step: u64,
    model: &SharedModel,
    optim: &AdamW,
    meta: serde_json::Value,
) -> Result<Committed, ExecError> {
    let names = shared_names(model);
    write_checkpoint(store, step, names, optim, meta, |blob| {
        {
            let head = model.head.read().unwrap_or_else(|e| e.into_inner());
            head.tensors().try_for_each(|t| blob.append_f32(&t.data))?;
        }
        model.layers.iter().try_for_each(|l| {
            let l = l.read().unwrap_or_else(|e| e.into_inner());
            l.tensors.iter().try_for_each(|t| blob.append_f32(&t.data))
        })
    })
}

/// `(checkpoint name, shape)` of every master in `model`, in [`named_params`]' order.
fn shared_names(model: &SharedModel) -> Vec<(String, Vec<usize>)> {
    use lt_model::host::{layer_param_name, outer_param_name};
    let p = &model.prefix;
    let mut v = Vec::new();
    {
        let head = model.head.read().unwrap_or_else(|e| e.into_inner());
        v.push((outer_param_name(p, "embed_tokens.weight"), head.embed_tokens.shape.clone()));
        v.push((outer_param_name(p, "norm.weight"), head.norm.shape.clone()));
        if let Some(h) = &head.lm_head {
            v.push(("lm_head.weight".into(), h.shape.clone()));
        }
    }
    for (i, l) in model.layers.iter().enumerate() {
        let l = l.read().unwrap_or_else(|e| e.into_inner());
        for (s, t) in l.specs.iter().zip(&l.tensors) {
            v.push((layer_param_name(p, i, &s.name), t.shape.clone()));
        }
    }
    v
}

/// The one checkpoint writer: the masters' blob (`write_masters` appends every tensor in `names`'
/// order), the optimizer's, and `meta` with the step and the parameters' names and shapes.
fn write_checkpoint(
    store: &CheckpointStore,
    step: u64,
    names: Vec<(String, Vec<usize>)>,
    optim: &AdamW,
    meta: serde_json::Value,
    write_masters: impl FnOnce(&mut BlobWriter<'_, '_>) -> Result<(), StorageError>,
) -> Result<Committed, ExecError> {
    let mut w = store.begin(step)?;
    {
        let mut blob = w.blob(WEIGHTS)?;
        write_masters(&mut blob)?;
        blob.finish()?;
    }
    {
        let mut blob = w.blob(OPTIMIZER)?;
        optim.save(&mut blob).map_err(ExecError::Optim)?;
        blob.flush().map_err(|e| {
            ExecError::Storage(StorageError::Io {
                path: store.root().to_path_buf(),
                op: "write optimizer state",
                source: e,
            })
        })?;
        blob.finish()?;
    }
    let names: Vec<serde_json::Value> = names.iter().map(|(n, s)| serde_json::json!({"name": n, "shape": s})).collect();
    let mut meta = meta;
    if let Some(obj) = meta.as_object_mut() {
        obj.insert("step".into(), step.into());
        obj.insert("params".into(), names.into());
    }
    Ok(w.commit(meta)?)
}

/// Restore master weights into `host` (whose shapes come from its config) and return the optimizer.
pub fn load_checkpoint(ckpt: &Checkpoint, host: &mut HostModel) -> Result<AdamW, ExecError> {
    let expected: Vec<serde_json::Value> =
        named_params(host).iter().map(|(n, s, _)| serde_json::json!({"name": n, "shape": s})).collect();
    if ckpt.meta().get("params") != Some(&serde_json::Value::Array(expected)) {
        return Err(ExecError::CheckpointMismatch {
            path: ckpt.path().to_path_buf(),
            reason: "its parameter names or shapes differ from the model's config".into(),
        });
    }
    let mut params = params_mut(host);
    let (mut idx, mut off) = (0usize, 0usize);
    let mut carry: Vec<u8> = Vec::new();
    ckpt.read_blob_with(WEIGHTS, |chunk| {
        carry.extend_from_slice(chunk);
        let whole = carry.len() / 4 * 4;
        for c in carry[..whole].chunks_exact(4) {
            while idx < params.len() && off == params[idx].len() {
                idx += 1;
                off = 0;
            }
            if idx < params.len() {
                params[idx][off] = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                off += 1;
            }
        }
        carry.drain(..whole);
    })?;
    let complete = params.iter().skip(idx + 1).all(|p| p.is_empty()) && params.get(idx).is_none_or(|p| off == p.len());
    if !complete || !carry.is_empty() {
        return Err(ExecError::CheckpointMismatch {
            path: ckpt.path().to_path_buf(),
            reason: "master_weights blob has the wrong size for this model".into(),
        });
    }
    let bytes = ckpt.read_blob(OPTIMIZER)?;
    AdamW::load(bytes.as_slice()).map_err(ExecError::Optim)
}

/// Write `host` as a Hugging Face model folder (safetensors + config.json + tokenizer files copied
/// from `source_dir` when it has them).
pub fn export_model(
    host: &HostModel,
    out_dir: &Path,
    source_dir: Option<&Path>,
    config: Option<serde_json::Value>,
    dtype: ExportDtype,
) -> Result<ExportReport, ExecError> {
    let params = named_params(host);
    let tensors: Vec<ExportTensor<'_>> =
        params.iter().map(|(n, s, d)| ExportTensor { name: n, shape: s, data: d }).collect();
    let mut opts = ExportOptions::new(dtype);
    opts.source_dir = source_dir;
    opts.config = config;
    Ok(export_hf(out_dir, &tensors, &opts)?)
}
