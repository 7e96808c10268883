//! Forward passes over weights that come one decoder layer at a time: a whole [`DeviceModel`], or
//! layers streamed from host memory ([`Streamed`]), so that a model larger than the device can be
//! evaluated on it (held-out loss, greedy generation) the way it is trained.
//!
//! A streamed pass holds on the device the final norm, the output projection and one or two layers;
//! token embeddings are gathered on the host and only the `[B, T, hidden]` rows cross the bus. The
//! next layer's host half (conversion to the device dtype, or the optimizer's bf16 copies) is
//! prepared on a helper thread while the current one computes; every device call stays on the
//! calling thread (on device runtimes a thread is a stream with its own memory pools).
//!
//! The arithmetic is the whole model's, operation for operation: on a backend whose float dtype is
//! f32 a streamed pass gives the same bits as [`DeviceModel`] (tested).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Element, Tensor, TensorData};
use lt_core::ModelConfig;

use crate::host::HostModel;
use crate::layer::{SeqCtx, layer_forward};
use crate::model::{embed, head_logits, head_logits_parts};
use crate::weights::{DeviceModel, LayerWeights, PreparedLayer};

/// What a pass does with each decoder layer: `x = f(i, layer i, x)`.
pub type LayerStep<'f, B> = dyn FnMut(usize, &LayerWeights<B>, Tensor<B, 3>) -> Tensor<B, 3> + 'f;

/// Weights for a forward pass, visited one decoder layer at a time.
pub trait ForwardWeights<B: Backend> {
    /// The validated config.
    fn config(&self) -> &ModelConfig;
    /// The device the pass runs on.
    fn device(&self) -> B::Device;
    /// Token embeddings, `[B][T]` -> `[B, T, hidden]`.
    fn embed(&mut self, ids: &[Vec<u32>]) -> Tensor<B, 3>;
    /// `x` through every decoder layer in order: `x = f(i, layer i, x)`.
    fn layers(&mut self, x: Tensor<B, 3>, f: &mut LayerStep<'_, B>) -> Tensor<B, 3>;
    /// Final norm and output projection, `[B, T, hidden]` -> `[B, T, vocab]`.
    fn logits(&mut self, x: Tensor<B, 3>) -> Tensor<B, 3>;
}

impl<B: Backend> ForwardWeights<B> for &DeviceModel<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn device(&self) -> B::Device {
        self.head.embed_tokens.device()
    }

    fn embed(&mut self, ids: &[Vec<u32>]) -> Tensor<B, 3> {
        embed(&self.head, ids)
    }

    fn layers(&mut self, mut x: Tensor<B, 3>, f: &mut LayerStep<'_, B>) -> Tensor<B, 3> {
        for (i, w) in self.layers.iter().enumerate() {
            x = f(i, w, x);
        }
        x
    }

    fn logits(&mut self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        head_logits(&self.config, &self.head, x)
    }
}

/// fp32 weights in host memory that a streamed pass reads: a loaded [`HostModel`], or the trainer's
/// shared masters (lt-exec), which hand out the optimizer's bf16 copies where they have them.
pub trait HostWeights: Sync {
    /// The validated config.
    fn config(&self) -> &ModelConfig;
    /// Decoder layer `i`'s tensors in `dtype`, ready to bind.
    fn layer(&self, i: usize, dtype: DType) -> PreparedLayer;
    /// The embedding rows of `ids` as `[B, T, hidden]` data in `dtype`. Ids must be below the
    /// vocabulary size (callers validate them).
    fn embed_rows(&self, ids: &[Vec<u32>], dtype: DType) -> TensorData;
    /// The final norm and the output projection (`lm_head`, or the embedding when tied) in `dtype`.
    fn head(&self, dtype: DType) -> (TensorData, TensorData);
}

/// The rows of `ids` of `embed` (`[vocab, hidden]` fp32) as `[B, T, hidden]` data in `dtype`.
///
/// # Panics
/// If an id is outside the vocabulary (callers validate ids against the config first).
pub fn gather_rows(embed: &[f32], hidden: usize, ids: &[Vec<u32>], dtype: DType) -> TensorData {
    let (b, t) = (ids.len(), ids.first().map_or(0, Vec::len));
    let mut rows = Vec::with_capacity(b * t * hidden);
    for &id in ids.iter().flatten() {
        let r = id as usize * hidden;
        rows.extend_from_slice(&embed[r..r + hidden]);
    }
    crate::upload::host_data(&rows, &[b, t, hidden], dtype)
}

impl HostWeights for HostModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn layer(&self, i: usize, dtype: DType) -> PreparedLayer {
        PreparedLayer::converted(&self.layers[i], self.config.layer_types[i], dtype)
    }

    fn embed_rows(&self, ids: &[Vec<u32>], dtype: DType) -> TensorData {
        gather_rows(&self.embed_tokens.data, self.config.hidden_size, ids, dtype)
    }

    fn head(&self, dtype: DType) -> (TensorData, TensorData) {
        let out = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        (
            crate::upload::host_data(&self.norm.data, &self.norm.shape, dtype),
            crate::upload::host_data(&out.data, &out.shape, dtype),
        )
    }
}

/// A model streamed from host memory onto `device`, one decoder layer at a time (see the module
/// docs). Uploads are made in the backend's float dtype.
pub struct Streamed<'a, B: Backend, H: HostWeights + ?Sized> {
    host: &'a H,
    device: B::Device,
    dtype: DType,
    norm: Tensor<B, 1>,
    out: Tensor<B, 2>,
    uploads: u64,
}

impl<'a, B: Backend, H: HostWeights + ?Sized> Streamed<'a, B, H> {
    /// Upload the final norm and the output projection, which stay on `device` for the pass's
    /// lifetime; the layers are uploaded as each pass reaches them.
    pub fn new(host: &'a H, device: &B::Device) -> Self {
        let dtype = <B::FloatElem as Element>::dtype();
        let (norm, out) = host.head(dtype);
        Self {
            host,
            device: device.clone(),
            dtype,
            norm: crate::upload::upload_data(norm, device),
            out: crate::upload::upload_data(out, device),
            uploads: 0,
        }
    }

    /// Decoder layers uploaded so far (each pass uploads every layer once).
    pub fn layer_uploads(&self) -> u64 {
        self.uploads
    }
}

impl<B: Backend, H: HostWeights + ?Sized> ForwardWeights<B> for Streamed<'_, B, H> {
    fn config(&self) -> &ModelConfig {
        self.host.config()
    }

    fn device(&self) -> B::Device {
        self.device.clone()
    }

    fn embed(&mut self, ids: &[Vec<u32>]) -> Tensor<B, 3> {
        crate::upload::upload_data(self.host.embed_rows(ids, self.dtype), &self.device)
    }

    fn layers(&mut self, mut x: Tensor<B, 3>, f: &mut LayerStep<'_, B>) -> Tensor<B, 3> {
        let n = self.host.config().num_layers();
        let (host, dtype) = (self.host, self.dtype);
        std::thread::scope(|s| {
            // One layer prepared ahead: the channel holds one, the helper works on the next.
            let (tx, rx) = std::sync::mpsc::sync_channel::<PreparedLayer>(1);
            s.spawn(move || {
                for i in 0..n {
                    if tx.send(host.layer(i, dtype)).is_err() {
                        return;
                    }
                }
            });
            for i in 0..n {
                // The helper sends every layer unless it panicked, and the scope re-raises that.
                let Ok(prepared) = rx.recv() else { break };
                let w = prepared.bind::<B>(&self.device);
                self.uploads += 1;
                x = f(i, &w, x);
            }
            x
        })
    }

    fn logits(&mut self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let cfg = self.host.config();
        head_logits_parts(cfg, &self.norm, &self.out, x)
    }
}

/// The last decoder layer's output for `ids` (equal-length rows, causal attention) over weights
/// `w`, before the final norm: [`ForwardWeights::logits`] of it are the logits, which a caller may
/// take a few rows at a time to bound the `[B, T, vocab]` tensor.
///
/// # Shapes
/// - ids: `[B][T]` -> `[B, T, hidden]`
pub fn hidden_states_with<B: Backend, W: ForwardWeights<B> + ?Sized>(w: &mut W, ids: &[Vec<u32>]) -> Tensor<B, 3> {
    let (b, t) = (ids.len(), ids.first().map_or(0, Vec::len));
    let ctx = SeqCtx::causal(w.config(), b, t, &w.device());
    let cfg = w.config().clone();
    let x = w.embed(ids);
    w.layers(x, &mut |_, l, x| layer_forward(&cfg, l, x, &ctx))
}

/// Logits of `ids` (equal-length rows, causal attention) over weights `w`.
///
/// # Shapes
/// - ids: `[B][T]` -> `[B, T, vocab]`
pub fn forward_logits_with<B: Backend, W: ForwardWeights<B> + ?Sized>(w: &mut W, ids: &[Vec<u32>]) -> Tensor<B, 3> {
    let x = hidden_states_with(w, ids);
    w.logits(x)
}
