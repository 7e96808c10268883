//! One decoder layer: stateless forward over streamed weights, and per-layer backward.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Tensor, TensorData};
use lt_core::ModelConfig;

use crate::delta::DeltaForm;
use crate::ops::{self, Rope};
use crate::weights::{AttnWeights, LayerWeights, LinearAttnWeights, Mixer, ParamMapper, ParamVisitor};

/// Per-batch context shared by all layers: rotary tables, the attention mask and, for packed rows,
/// the sequence boundaries that linear attention must respect.
#[derive(Debug, Clone)]
pub struct SeqCtx<B: Backend> {
    /// Rotary tables.
    pub rope: Rope<B>,
    /// `true` where attention is forbidden, `[B, 1, T, T]`.
    pub mask: Tensor<B, 4, Bool>,
    /// Packed rows only: sequence boundaries for the Gated DeltaNet.
    pub packing: Option<Packing<B>>,
    /// `[B, T, 1]`: 1 for real tokens, 0 for padding (batched generation with left padding).
    pub token_mask: Option<Tensor<B, 3>>,
    /// Form of the gated delta rule in linear-attention layers ([`DeltaForm::Chunked`] unless set
    /// with [`SeqCtx::with_delta_form`]). A one-token step is always recurrent: it is one update.
    pub delta_form: DeltaForm,
}

/// Sequence boundaries inside packed rows.
#[derive(Debug, Clone)]
pub struct Packing<B: Backend> {
    /// `[B, T]`: 0 at the first token of a sequence, 1 elsewhere (recurrent state reset).
    pub keep: Tensor<B, 2>,
    /// Per lag `d` in `0..K`: `[B, T, 1]`, 1 where token `t - d` is in the same sequence as `t`.
    pub lag_masks: Vec<Tensor<B, 3>>,
}

impl<B: Backend> SeqCtx<B> {
    /// Context for a batch of `b` rows of `t` tokens with positions `0..t` and causal masking.
    pub fn causal(cfg: &ModelConfig, b: usize, t: usize, device: &B::Device) -> Self {
        let positions: Vec<Vec<usize>> = (0..b).map(|_| (0..t).collect()).collect();
        Self {
            rope: Rope::new(&positions, cfg.rope_theta, cfg.rotary_dim, device),
            mask: ops::attention_mask(b, t, None, device),
            packing: None,
            token_mask: None,
            delta_form: DeltaForm::default(),
        }
    }

    /// The same context with linear-attention layers computing the gated delta rule in `form`
    /// (tests and benchmarks compare the forms; training and logits use the default, chunked).
    #[must_use]
    pub fn with_delta_form(mut self, form: DeltaForm) -> Self {
        self.delta_form = form;
        self
    }

    /// Context for packed rows: per-token positions (restarting at 0 per sequence) and segment ids
    /// (equal within a sequence; padding is its own segment). Attention never crosses a segment, and
    /// linear attention restarts its state and conv window at every sequence start, so a packed row
    /// computes exactly what its sequences would compute one by one.
    pub fn packed(cfg: &ModelConfig, positions: &[Vec<u32>], segments: &[Vec<u32>], device: &B::Device) -> Self {
        let b = positions.len();
        let t = positions.first().map_or(0, Vec::len);
        let pos: Vec<Vec<usize>> = positions.iter().map(|r| r.iter().map(|&p| p as usize).collect()).collect();
        let mut keep = Vec::with_capacity(b * t);
        for row in segments {
            for (i, s) in row.iter().enumerate() {
                keep.push(if i > 0 && row[i - 1] == *s { 1.0f32 } else { 0.0 });
            }
        }
        let kmax = cfg.linear.map_or(1, |l| l.conv_kernel);
        let lag_masks = (0..kmax)
            .map(|d| {
                let mut m = Vec::with_capacity(b * t);
                for row in segments {
                    for i in 0..t {
                        m.push(if i >= d && row[i - d] == row[i] { 1.0f32 } else { 0.0 });
                    }
                }
                Tensor::from_data(TensorData::new(m, [b, t, 1]), device)
            })
            .collect();
        Self {
            rope: Rope::new(&pos, cfg.rope_theta, cfg.rotary_dim, device),
            mask: ops::attention_mask(b, t, Some(segments), device),
            packing: Some(Packing { keep: Tensor::from_data(TensorData::new(keep, [b, t]), device), lag_masks }),
            token_mask: None,
            delta_form: DeltaForm::default(),
        }
    }
}

impl<B: AutodiffBackend> SeqCtx<B> {
    /// Lift an inner-backend context into the autodiff backend (constants: no gradient).
    pub fn lift(inner: &SeqCtx<B::InnerBackend>) -> Self {
        Self {
            rope: Rope {
                cos: Tensor::from_inner(inner.rope.cos.clone()),
                sin: Tensor::from_inner(inner.rope.sin.clone()),
                rotary_dim: inner.rope.rotary_dim,
            },
            mask: Tensor::from_inner(inner.mask.clone()),
            packing: inner.packing.as_ref().map(|p| Packing {
                keep: Tensor::from_inner(p.keep.clone()),
                lag_masks: p.lag_masks.iter().map(|m| Tensor::from_inner(m.clone())).collect(),
            }),
            token_mask: inner.token_mask.as_ref().map(|m| Tensor::from_inner(m.clone())),
            delta_form: inner.delta_form,
        }
    }
}

/// Forward of one decoder layer.
///
/// # Shapes
/// - x: `[B, T, hidden]` -> `[B, T, hidden]`
pub fn layer_forward<B: Backend>(
    cfg: &ModelConfig,
    w: &LayerWeights<B>,
    x: Tensor<B, 3>,
    ctx: &SeqCtx<B>,
) -> Tensor<B, 3> {
    layer_forward_cached(cfg, w, x, ctx, None)
}

/// Decoding state of one layer: keys/values of attention layers, conv window and recurrent state of
/// linear-attention layers.
#[derive(Debug, Clone, Default)]
pub struct LayerCache<B: Backend> {
    /// Attention keys after RoPE, `[B, H_kv, T, D]`.
    pub k: Option<Tensor<B, 4>>,
    /// Attention values, `[B, H_kv, T, D]`.
    pub v: Option<Tensor<B, 4>>,
    /// DeltaNet conv inputs of the last `K - 1` tokens, `[B, K - 1, C]`.
    pub conv: Option<Tensor<B, 3>>,
    /// DeltaNet recurrent state, `[B, H, dk, dv]`.
    pub state: Option<Tensor<B, 4>>,
}

/// [`layer_forward`] that reads and extends a decoding cache. With a cache, `ctx.mask` is
/// `[B, 1, T_new, T_cached + T_new]`, `ctx.rope` covers the new tokens, and `ctx.token_mask` (if any)
/// zeroes padding tokens' linear-attention inputs.
pub fn layer_forward_cached<B: Backend>(
    cfg: &ModelConfig,
    w: &LayerWeights<B>,
    x: Tensor<B, 3>,
    ctx: &SeqCtx<B>,
    cache: Option<&mut LayerCache<B>>,
) -> Tensor<B, 3> {
    let eps = cfg.rms_norm_eps;
    let zc = cfg.zero_centered_norm;
    let h = ops::rms_norm(x.clone(), &w.common.input_layernorm, eps, zc);
    let mixed = match &w.mixer {
        Mixer::Attention(a) => attention_forward(cfg, a, h, ctx, cache),
        Mixer::Linear(l) => delta_net_forward(cfg, l, h, ctx, cache),
    };
    let x = x + mixed;
    let h = ops::rms_norm(x.clone(), &w.common.post_attention_layernorm, eps, zc);
    let act = burn::tensor::activation::silu(ops::linear(h.clone(), &w.common.gate_proj, None))
        * ops::linear(h, &w.common.up_proj, None);
    x + ops::linear(act, &w.common.down_proj, None)
}

fn attention_forward<B: Backend>(
    cfg: &ModelConfig,
    a: &AttnWeights<B>,
    h: Tensor<B, 3>,
    ctx: &SeqCtx<B>,
    cache: Option<&mut LayerCache<B>>,
) -> Tensor<B, 3> {
    let [b, t, _] = h.dims();
    let (nh, nkv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let q_all = ops::linear(h.clone(), &a.q_proj, a.q_bias.as_ref());
    // Gated attention (Qwen3.5): per head, the first head_dim outputs are the query, the next
    // head_dim the output gate.
    let (q, gate) = if cfg.attn_output_gate {
        let qg = q_all.reshape([b, t, nh, 2 * d]);
        let q = qg.clone().narrow(3, 0, d);
        let g = qg.narrow(3, d, d).reshape([b, t, nh * d]);
        (q, Some(g))
    } else {
        (q_all.reshape([b, t, nh, d]), None)
    };
    let k = ops::linear(h.clone(), &a.k_proj, a.k_bias.as_ref()).reshape([b, t, nkv, d]);
    let v = ops::linear(h, &a.v_proj, a.v_bias.as_ref()).reshape([b, t, nkv, d]);
    let zc = cfg.zero_centered_norm;
    let q = match &a.q_norm {
        Some(w) => ops::rms_norm(q, w, cfg.rms_norm_eps, zc),
        None => q,
    };
    let k = match &a.k_norm {
        Some(w) => ops::rms_norm(k, w, cfg.rms_norm_eps, zc),
        None => k,
    };
    let q = ctx.rope.apply(q.swap_dims(1, 2));
    let mut k = ctx.rope.apply(k.swap_dims(1, 2));
    let mut v = v.swap_dims(1, 2);
    if let Some(c) = cache {
        if let (Some(pk), Some(pv)) = (c.k.take(), c.v.take()) {
            k = Tensor::cat(vec![pk, k], 2);
            v = Tensor::cat(vec![pv, v], 2);
        }
        c.k = Some(k.clone());
        c.v = Some(v.clone());
    }
    let k = ops::repeat_kv(k, nh / nkv);
    let v = ops::repeat_kv(v, nh / nkv);
    let o = ops::sdpa(q, k, v, &ctx.mask, (d as f64).powf(-0.5));
    let mut o = o.swap_dims(1, 2).reshape([b, t, nh * d]);
    if let Some(g) = gate {
        o = o * ops::gate(g);
    }
    ops::linear(o, &a.o_proj, a.o_bias.as_ref())
}

fn delta_net_forward<B: Backend>(
    cfg: &ModelConfig,
    l: &LinearAttnWeights<B>,
    h: Tensor<B, 3>,
    ctx: &SeqCtx<B>,
    mut cache: Option<&mut LayerCache<B>>,
) -> Tensor<B, 3> {
    let packing = ctx.packing.as_ref();
    let [b, t, _] = h.dims();
    // Validated: a linear layer implies `cfg.linear` is set.
    let Some(lc) = cfg.linear else { return h.zeros_like() };
    let (hk, hv, dk, dv) = (lc.num_key_heads, lc.num_value_heads, lc.key_head_dim, lc.value_head_dim);
    let mut qkv_in = ops::linear(h.clone(), &l.in_proj_qkv, None);
    if let Some(m) = &ctx.token_mask {
        qkv_in = qkv_in * m.clone();
    }
    let lags = packing.map(|p| p.lag_masks.as_slice());
    let qkv = match cache.as_deref_mut() {
        Some(c) => {
            let kk = l.conv1d.dims()[2];
            let [_, _, ch] = qkv_in.dims();
            let prev = c.conv.take().unwrap_or_else(|| Tensor::zeros([b, kk - 1, ch], &qkv_in.device()));
            let window = Tensor::cat(vec![prev.clone(), qkv_in.clone()], 1);
            let total = window.dims()[1];
            c.conv = Some(window.narrow(1, total - (kk - 1), kk - 1));
            ops::causal_conv_silu_with_state(qkv_in, &l.conv1d, lags, prev)
        }
        None => ops::causal_conv_silu(qkv_in, &l.conv1d, lags),
    };
    let z = ops::linear(h.clone(), &l.in_proj_z, None).reshape([b, t, hv, dv]);
    let beta = ops::gate(ops::linear(h.clone(), &l.in_proj_b, None)); // [B,T,Hv]
    let a = ops::linear(h, &l.in_proj_a, None);
    let g = ops::softplus(a + l.dt_bias.clone().reshape([1, 1, hv])) * l.a_log.clone().exp().neg().reshape([1, 1, hv]);
    let kd = lc.key_dim();
    let q = qkv.clone().narrow(2, 0, kd).reshape([b, t, hk, dk]);
    let k = qkv.clone().narrow(2, kd, kd).reshape([b, t, hk, dk]);
    let v = qkv.narrow(2, 2 * kd, lc.value_dim()).reshape([b, t, hv, dv]);
    // Each key head serves hv/hk consecutive value heads (repeat_interleave on the head dim).
    let rep = hv / hk;
    let expand = |x: Tensor<B, 4>| -> Tensor<B, 4> {
        if rep == 1 { x } else { x.unsqueeze_dim::<5>(3).repeat_dim(3, rep).reshape([b, t, hv, dk]) }
    };
    let q = ops::l2norm(expand(q), 1e-6) * (1.0 / (dk as f64).sqrt());
    let k = ops::l2norm(expand(k), 1e-6);
    let init = cache.as_deref_mut().and_then(|c| c.state.take());
    // A one-token step (cached decoding) is a single state update: the recurrent form is exact and
    // has nothing to batch, while a chunk would pad it to 64 tokens. Longer inputs (training,
    // recompute, logits, a cached prefill continuing from `init`) use the context's form.
    let form = if t == 1 { DeltaForm::Recurrent } else { ctx.delta_form };
    // Token-major to head-major. With one token that is a reshape, and done as one: on burn-wgpu the
    // swapped view of a one-token step with more than one row (a size-1 dimension with a large
    // stride) made the recurrent update wrong, so batched decoding of hybrid models diverged from the
    // CPU after the first token (`crates/lt-model/tests/device_wgpu.rs`). The same values either way.
    let heads4 = |x: Tensor<B, 4>| {
        let [b, t, h, d] = x.dims();
        if t == 1 { x.reshape([b, h, 1, d]) } else { x.swap_dims(1, 2) }
    };
    let heads3 = |x: Tensor<B, 3>| {
        let [b, t, h] = x.dims();
        if t == 1 { x.reshape([b, h, 1]) } else { x.swap_dims(1, 2) }
    };
    let (o, state) = form.run(heads4(q), heads4(k), heads4(v), heads3(g), heads3(beta), packing.map(|p| &p.keep), init); // [B,Hv,T,dv]
    if let Some(c) = cache {
        c.state = Some(state);
    }
    let o = if t == 1 { o.reshape([b, 1, hv, dv]) } else { o.swap_dims(1, 2) };
    let o = ops::gated_rms_norm(o, z, &l.norm, cfg.rms_norm_eps);
    ops::linear(o.reshape([b, t, hv * dv]), &l.out_proj, None)
}

/// Gradients of one layer's backward.
#[derive(Debug, Clone)]
pub struct LayerGrads<B: Backend> {
    /// Gradient with respect to the layer input, `[B, T, hidden]`.
    pub input: Tensor<B, 3>,
    /// Weight gradients, flattened, named relative to the layer, in [`ModelConfig::layer_params`] order.
    pub params: Vec<(String, Tensor<B, 1>)>,
}

/// Lifts inner-backend tensors into autodiff leaves that require gradients.
pub(crate) struct RequireGrad;

impl<B: AutodiffBackend> ParamMapper<B::InnerBackend, B> for RequireGrad {
    fn map<const D: usize>(&mut self, _name: &'static str, t: Tensor<B::InnerBackend, D>) -> Tensor<B, D> {
        Tensor::from_inner(t).require_grad()
    }
}

/// Collects each tensor's gradient, flattened (zeros where a tensor got none).
pub(crate) struct GradCollector<'a, B: AutodiffBackend> {
    pub grads: &'a B::Gradients,
    pub out: Vec<(String, Tensor<B::InnerBackend, 1>)>,
}

impl<B: AutodiffBackend> ParamVisitor<B> for GradCollector<'_, B> {
    fn visit<const D: usize>(&mut self, name: &'static str, t: &Tensor<B, D>) {
        let n = t.shape().num_elements();
        let g = match t.grad(self.grads) {
            Some(g) => g.reshape([n]),
            None => Tensor::zeros([n], &t.device()),
        };
        self.out.push((name.to_string(), g));
    }
}

/// Per-layer backward: given the layer input `x` and the upstream gradient `grad_out`
/// (d loss / d output), return d loss / d input and every weight gradient.
///
/// The layer is re-run under autodiff with leaves for `x` and the weights, and
/// `(y * grad_out).sum()` is back-propagated: its gradient with respect to `y` is exactly
/// `grad_out`, so chaining this call from the last layer down equals one full-graph backward.
///
/// # Shapes
/// - x, grad_out: `[B, T, hidden]`
pub fn layer_backward<B: AutodiffBackend>(
    cfg: &ModelConfig,
    layer: usize,
    w: &LayerWeights<B::InnerBackend>,
    x: Tensor<B::InnerBackend, 3>,
    grad_out: Tensor<B::InnerBackend, 3>,
    ctx: &SeqCtx<B>,
) -> LayerGrads<B::InnerBackend> {
    let wg: LayerWeights<B> = w.clone().map(&mut RequireGrad);
    let xg: Tensor<B, 3> = Tensor::from_inner(x).require_grad();
    let y = layer_forward(cfg, &wg, xg.clone(), ctx);
    let grads = (y * Tensor::from_inner(grad_out)).sum().backward();
    let input = xg.grad(&grads).unwrap_or_else(|| xg.clone().inner().zeros_like());
    let mut c = GradCollector::<B> { grads: &grads, out: Vec::new() };
    wg.visit(&mut c);
    // Return in the canonical parameter order so host buffers line up without a lookup.
    let order = cfg.layer_params(layer);
    let mut params = Vec::with_capacity(order.len());
    for spec in order {
        if let Some(pos) = c.out.iter().position(|(n, _)| *n == spec.name) {
            params.push(c.out.swap_remove(pos));
        }
    }
    LayerGrads { input, params }
}
