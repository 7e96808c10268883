//! Embedding, head, loss, and whole-model reference paths.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};

use crate::error::ModelError;
use crate::layer::{GradCollector, RequireGrad, SeqCtx, layer_forward};
use crate::ops;
use crate::weights::{DeviceModel, HeadWeights};

/// HF's ignore index in `labels`.
pub const IGNORE_INDEX: i64 = -100;

/// A batch of equal-length token sequences with optional labels aligned to them (HF convention:
/// the model shifts by one; `-100` is ignored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Token ids, `[B][T]`.
    pub input_ids: Vec<Vec<u32>>,
    /// Labels, `[B][T]`, aligned with `input_ids`.
    pub labels: Vec<Vec<i64>>,
    /// Packed rows: per-token positions and segment ids (see [`crate::layer::SeqCtx::packed`]);
    /// `None` for one sequence per row starting at position 0.
    pub packing: Option<PackInfo>,
}

/// Positions and segment ids of packed rows, `[B][T]` each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackInfo {
    /// Position of each token within its sequence.
    pub positions: Vec<Vec<u32>>,
    /// Sequence id of each token within its row (padding is its own segment).
    pub segments: Vec<Vec<u32>>,
}

impl Batch {
    /// Reads a token file: one JSON object per line with `input_ids` (non-negative 32-bit integers)
    /// and optionally `labels` (integers; the ids themselves when absent), blank lines skipped. The
    /// fixtures' `tokens.jsonl`, `lt logits --tokens` and `lt selftest` read this format. Errors name
    /// the file and line, and the field (`input_ids[3]`); shapes are checked by [`Self::validate`].
    pub fn read_jsonl(path: &std::path::Path) -> Result<Batch, ModelError> {
        let at = |n: Option<usize>, reason: String| ModelError::BadBatch {
            source_name: match n {
                Some(n) => format!("{}:{n}", path.display()),
                None => path.display().to_string(),
            },
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| at(None, format!("cannot open: {e}")))?;
        let (mut ids, mut labels) = (Vec::new(), Vec::new());
        for (i, line) in text.lines().enumerate() {
            let n = Some(i + 1);
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| at(n, format!("invalid JSON: {e}")))?;
            let field = |name: &str| match v.get(name) {
                None => Ok(None),
                Some(x) => x.as_array().map(Some).ok_or_else(|| at(n, format!("`{name}` is not an array"))),
            };
            let row: Vec<u32> = field("input_ids")?
                .ok_or_else(|| at(n, "missing array field `input_ids`".into()))?
                .iter()
                .enumerate()
                .map(|(j, x)| {
                    x.as_u64()
                        .and_then(|u| u32::try_from(u).ok())
                        .ok_or_else(|| at(n, format!("`input_ids[{j}]` = {x} is not a non-negative 32-bit integer")))
                })
                .collect::<Result<_, _>>()?;
            let lab: Vec<i64> = match field("labels")? {
                Some(l) => l
                    .iter()
                    .enumerate()
                    .map(|(j, x)| x.as_i64().ok_or_else(|| at(n, format!("`labels[{j}]` = {x} is not an integer"))))
                    .collect::<Result<_, _>>()?,
                None => row.iter().map(|&x| i64::from(x)).collect(),
            };
            ids.push(row);
            labels.push(lab);
        }
        if ids.is_empty() {
            return Err(at(None, "no sequences".into()));
        }
        Ok(Batch::new(ids, labels))
    }

    /// Check shape and vocabulary range; `source_name` names the origin in errors.
    pub fn validate(&self, vocab: usize, source_name: &str) -> Result<(usize, usize), ModelError> {
        let bad = |reason: String| ModelError::BadBatch { source_name: source_name.to_string(), reason };
        let b = self.input_ids.len();
        if b == 0 {
            return Err(bad("no sequences".into()));
        }
        let t = self.input_ids[0].len();
        if t == 0 {
            return Err(bad("sequence 0 is empty".into()));
        }
        for (row, ids) in self.input_ids.iter().enumerate() {
            if ids.len() != t {
                return Err(bad(format!(
                    "sequence {row} has {} tokens, sequence 0 has {t} (equal lengths required)",
                    ids.len()
                )));
            }
            if let Some((col, &id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
                return Err(ModelError::TokenOutOfRange {
                    source_name: source_name.into(),
                    row,
                    col,
                    id: id.into(),
                    vocab,
                });
            }
        }
        if self.labels.len() != b || self.labels.iter().any(|l| l.len() != t) {
            return Err(bad("labels are not aligned with input_ids".into()));
        }
        if let Some(p) = &self.packing {
            let aligned = |v: &Vec<Vec<u32>>| v.len() == b && v.iter().all(|r| r.len() == t);
            if !aligned(&p.positions) || !aligned(&p.segments) {
                return Err(bad("position_ids / segment_ids are not aligned with input_ids".into()));
            }
        }
        for (row, l) in self.labels.iter().enumerate() {
            if let Some((col, &id)) =
                l.iter().enumerate().find(|(_, v)| **v != IGNORE_INDEX && (**v < 0 || **v as usize >= vocab))
            {
                return Err(ModelError::TokenOutOfRange { source_name: source_name.into(), row, col, id, vocab });
            }
        }
        Ok((b, t))
    }

    /// Labels equal to the inputs (plain language modelling).
    pub fn from_ids(input_ids: Vec<Vec<u32>>) -> Self {
        let labels = input_ids.iter().map(|r| r.iter().map(|&v| i64::from(v)).collect()).collect();
        Self { input_ids, labels, packing: None }
    }

    /// A batch with labels (one sequence per row).
    pub fn new(input_ids: Vec<Vec<u32>>, labels: Vec<Vec<i64>>) -> Self {
        Self { input_ids, labels, packing: None }
    }

    /// The context (rotary tables, masks) this batch needs on `device`.
    pub fn context<B: Backend>(&self, cfg: &lt_core::ModelConfig, device: &B::Device) -> SeqCtx<B> {
        let (b, t) = (self.input_ids.len(), self.input_ids.first().map_or(0, Vec::len));
        match &self.packing {
            Some(p) => SeqCtx::packed(cfg, &p.positions, &p.segments, device),
            None => SeqCtx::causal(cfg, b, t, device),
        }
    }

    /// Number of tokens that contribute to the loss (shifted, non-ignored).
    pub fn loss_tokens(&self) -> usize {
        loss_token_count(&self.labels)
    }
}

/// Embedding lookup.
///
/// # Shapes
/// - ids: `[B][T]` -> `[B, T, hidden]`
pub fn embed<B: Backend>(head: &HeadWeights<B>, ids: &[Vec<u32>]) -> Tensor<B, 3> {
    let b = ids.len();
    let t = ids.first().map_or(0, Vec::len);
    let flat: Vec<i64> = ids.iter().flatten().map(|&v| i64::from(v)).collect();
    let device = head.embed_tokens.device();
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(flat, [b * t]), &device);
    let h = head.embed_tokens.dims()[1];
    head.embed_tokens.clone().select(0, idx).reshape([b, t, h])
}

/// Final norm and output projection.
///
/// # Shapes
/// - x: `[B, T, hidden]` -> `[B, T, vocab]`
pub fn head_logits<B: Backend>(cfg: &lt_core::ModelConfig, head: &HeadWeights<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    head_logits_parts(cfg, &head.norm, head.output_weight(), x)
}

/// [`head_logits`] from the final norm's weight and the output projection (`lm_head`, or the
/// embedding when tied).
///
/// # Shapes
/// - x: `[B, T, hidden]` -> `[B, T, vocab]`
pub fn head_logits_parts<B: Backend>(
    cfg: &lt_core::ModelConfig,
    norm: &Tensor<B, 1>,
    out: &Tensor<B, 2>,
    x: Tensor<B, 3>,
) -> Tensor<B, 3> {
    let h = ops::rms_norm(x, norm, cfg.rms_norm_eps, cfg.zero_centered_norm);
    ops::linear(h, out, None)
}

/// Tokens that contribute to the loss: shifted by one, `-100` ignored.
pub fn loss_token_count(labels: &[Vec<i64>]) -> usize {
    labels.iter().map(|l| l.iter().skip(1).filter(|&&v| v != IGNORE_INDEX).count()).sum()
}

/// Per-position loss weights for HF's causal-LM loss: position `t` predicts `labels[t+1]`, each
/// valid target weighs `1/N` (N = valid targets in the batch), the last position weighs 0.
/// Returns the targets (ignored ones set to 0) and weights, both `[B][T]` flattened.
///
/// `denom` is the number of loss tokens the mean divides by: [`loss_token_count`] of these labels for
/// one batch, or of the whole step when micro-batches accumulate. With `denom == 0` every weight is 0.
pub fn shifted_targets(labels: &[Vec<i64>], denom: usize) -> (Vec<i64>, Vec<f32>) {
    let mut targets = Vec::new();
    let mut weights = Vec::new();
    for row in labels {
        for t in 0..row.len() {
            match row.get(t + 1) {
                Some(&v) if v != IGNORE_INDEX && denom > 0 => {
                    targets.push(v);
                    weights.push(1.0 / denom as f32);
                }
                _ => {
                    targets.push(0);
                    weights.push(0.0);
                }
            }
        }
    }
    (targets, weights)
}

/// Mean cross-entropy over non-ignored shifted targets, exactly as transformers' `ForCausalLMLoss`.
/// A batch with no valid target has loss 0.
///
/// # Shapes
/// - logits: `[B, T, V]` -> `[1]`
pub fn causal_lm_loss<B: Backend>(logits: Tensor<B, 3>, labels: &[Vec<i64>]) -> Tensor<B, 1> {
    let [b, t, _] = logits.dims();
    let device = logits.device();
    let (targets, weights) = shifted_targets(labels, loss_token_count(labels));
    let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(targets, [b, t, 1]), &device);
    let w = Tensor::<B, 3>::from_data(TensorData::new(weights, [b, t, 1]), &device);
    let logp = log_softmax(logits, 2).gather(2, idx);
    (logp * w).sum().neg()
}

/// Whole-model logits (the parity entry point; no streaming).
///
/// # Shapes
/// - ids: `[B][T]` -> `[B, T, vocab]`
pub fn forward_logits<B: Backend>(model: &DeviceModel<B>, ids: &[Vec<u32>]) -> Tensor<B, 3> {
    let cfg = &model.config;
    let (b, t) = (ids.len(), ids.first().map_or(0, Vec::len));
    let ctx = SeqCtx::causal(cfg, b, t, &model.head.embed_tokens.device());
    forward_logits_ctx(model, ids, &ctx)
}

/// Whole-model logits under an explicit context (e.g. packed rows).
///
/// # Shapes
/// - ids: `[B][T]` -> `[B, T, vocab]`
pub fn forward_logits_ctx<B: Backend>(model: &DeviceModel<B>, ids: &[Vec<u32>], ctx: &SeqCtx<B>) -> Tensor<B, 3> {
    let cfg = &model.config;
    let ctx = ctx.clone();
    let mut x = embed(&model.head, ids);
    for w in &model.layers {
        x = layer_forward(cfg, w, x, &ctx);
    }
    head_logits(cfg, &model.head, x)
}

/// Loss and gradients of every parameter from one full-graph backward (the reference the streamed
/// executor must reproduce). Gradient names are checkpoint-relative (`layers.3.mlp.up_proj.weight`,
/// `embed_tokens.weight`, ...).
pub fn full_graph_grads<B: AutodiffBackend>(
    model: &DeviceModel<B::InnerBackend>,
    batch: &Batch,
) -> (f32, Vec<(String, Vec<f32>)>) {
    let cfg = &model.config;
    let m: DeviceModel<B> = model.clone().map(&mut RequireGrad);
    let ctx = batch.context::<B>(cfg, &m.head.embed_tokens.device());
    let mut x = embed(&m.head, &batch.input_ids);
    for w in &m.layers {
        x = layer_forward(cfg, w, x, &ctx);
    }
    let loss = causal_lm_loss(head_logits(cfg, &m.head, x), &batch.labels);
    let loss_value = to_vec(loss.clone().inner()).first().copied().unwrap_or(f32::NAN);
    let grads = loss.backward();
    let mut out = Vec::new();
    let mut c = GradCollector::<B> { grads: &grads, out: Vec::new() };
    m.head.visit(&mut c);
    out.extend(c.out.drain(..).map(|(n, g)| (n, to_vec(g))));
    for (i, w) in m.layers.iter().enumerate() {
        w.visit(&mut c);
        out.extend(c.out.drain(..).map(|(n, g)| (format!("layers.{i}.{n}"), to_vec(g))));
    }
    (loss_value, out)
}

/// Copy a tensor to a host `Vec<f32>`.
pub fn to_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default()
}
