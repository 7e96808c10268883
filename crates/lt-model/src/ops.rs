//! The numerical building blocks, written once for every family and every backend.
//!
//! Each function mirrors the corresponding transformers code path, so parity is a matter of
//! arithmetic order only (checked against committed fixtures to 1e-4 on logits).

use burn::tensor::activation::{sigmoid, silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor, TensorData};

/// `x @ w^T (+ b)` for `x` of shape `[B, T, in]` and `w` of shape `[out, in]`.
///
/// # Shapes
/// - x: `[B, T, in]`, w: `[out, in]`, b: `[out]` -> `[B, T, out]`
pub fn linear<B: Backend>(x: Tensor<B, 3>, w: &Tensor<B, 2>, b: Option<&Tensor<B, 1>>) -> Tensor<B, 3> {
    let [bs, t, i] = x.dims();
    let o = w.dims()[0];
    let rows = bs * t;
    let y = if copies_transposed_operands::<B>() && rows.saturating_mul(i + o) < o.saturating_mul(i) {
        // burn-ndarray copies a transposed right operand into row-major order before every product:
        // the whole weight (a 152K-token head is 117M floats at 768 wide, per decoding step). With
        // fewer rows than that, `(w @ x^T)^T` copies only `x` and the output instead. Each output is
        // the same dot product, accumulated in the same order: the same bits
        // (`both_forms_of_linear_give_the_same_bits`).
        w.clone().matmul(x.reshape([rows, i]).transpose()).transpose().reshape([bs, t, o])
    } else {
        x.reshape([rows, i]).matmul(w.clone().transpose()).reshape([bs, t, o])
    };
    match b {
        Some(b) => y + b.clone().reshape([1, 1, o]),
        None => y,
    }
}

/// Whether `B` is the CPU backend, whose matmul copies a transposed right operand (device backends
/// read it through its strides, and the autodiff wrapper keeps the graph's form).
fn copies_transposed_operands<B: Backend>() -> bool {
    std::any::TypeId::of::<B>() == std::any::TypeId::of::<crate::CpuBackend>()
}

/// RMSNorm over the last dimension. The scale is `w`, or `1 + w` when `zero_centered` (Qwen3.5).
///
/// # Shapes
/// - x: `[..., n]`, w: `[n]` -> same as x
pub fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    w: &Tensor<B, 1>,
    eps: f64,
    zero_centered: bool,
) -> Tensor<B, D> {
    let n = w.dims()[0];
    let var = x.clone().powi_scalar(2).mean_dim(D - 1);
    let normed = x * (var + eps).sqrt().recip();
    let mut shape = [1usize; D];
    shape[D - 1] = n;
    let scale = if zero_centered { w.clone() + 1.0 } else { w.clone() };
    normed * scale.reshape(shape)
}

/// `log(1 + exp(x))`, computed stably as `max(x, 0) + log1p(exp(-|x|))`.
pub fn softplus<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    x.clone().clamp_min(0.0) + x.abs().neg().exp().log1p()
}

/// Rotary tables for a batch: cos and sin of shape `[B, T, rotary_dim]`, rotate-half layout.
#[derive(Debug, Clone)]
pub struct Rope<B: Backend> {
    /// cos, `[B, 1, T, rot]` (broadcast over heads).
    pub cos: Tensor<B, 4>,
    /// sin, `[B, 1, T, rot]`.
    pub sin: Tensor<B, 4>,
    /// Rotated dimensions per head.
    pub rotary_dim: usize,
}

impl<B: Backend> Rope<B> {
    /// Build the tables from per-token positions (`positions[b][t]`).
    ///
    /// The arithmetic follows transformers exactly in f32: `inv_freq = 1 / base^(2i/dim)`, then
    /// `pos * inv_freq`, then cos/sin of the concatenation `[freqs, freqs]`.
    pub fn new(positions: &[Vec<usize>], theta: f64, rotary_dim: usize, device: &B::Device) -> Self {
        let b = positions.len();
        let t = positions.first().map_or(0, Vec::len);
        let half = rotary_dim / 2;
        let inv: Vec<f32> =
            (0..half).map(|i| 1.0f32 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32)).collect();
        let mut cos = Vec::with_capacity(b * t * rotary_dim);
        let mut sin = Vec::with_capacity(b * t * rotary_dim);
        for row in positions {
            for &p in row {
                // [freqs, freqs]: the rotate-half layout.
                for _ in 0..2 {
                    for f in &inv {
                        let a = p as f32 * f;
                        cos.push(a.cos());
                        sin.push(a.sin());
                    }
                }
            }
        }
        let shape = [b, 1, t, rotary_dim];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
            rotary_dim,
        }
    }

    /// Rotate the first `rotary_dim` dims of each head; the rest pass through (partial rotary).
    ///
    /// # Shapes
    /// - x: `[B, H, T, head_dim]` -> same
    pub fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [_, _, _, d] = x.dims();
        let r = self.rotary_dim;
        let rot = x.clone().narrow(3, 0, r);
        let half = r / 2;
        let x1 = rot.clone().narrow(3, 0, half);
        let x2 = rot.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        let out = rot * self.cos.clone() + rotated * self.sin.clone();
        if r == d { out } else { Tensor::cat(vec![out, x.narrow(3, r, d - r)], 3) }
    }
}

/// Attention mask `[B, 1, T, T]`: `true` where a query must NOT see a key (future tokens, or another
/// packed sequence when `segments` is given).
pub fn attention_mask<B: Backend>(
    b: usize,
    t: usize,
    segments: Option<&[Vec<u32>]>,
    device: &B::Device,
) -> Tensor<B, 4, Bool> {
    let mut m = Vec::with_capacity(b * t * t);
    for row in 0..b {
        for i in 0..t {
            for j in 0..t {
                let other = segments.is_some_and(|s| s[row][i] != s[row][j]);
                m.push(j > i || other);
            }
        }
    }
    Tensor::from_data(TensorData::new(m, [b, 1, t, t]), device)
}

/// Repeat each of `h_kv` heads `n_rep` times consecutively (transformers' `repeat_kv`).
///
/// # Shapes
/// - x: `[B, H_kv, T, D]` -> `[B, H_kv * n_rep, T, D]`
pub fn repeat_kv<B: Backend>(x: Tensor<B, 4>, n_rep: usize) -> Tensor<B, 4> {
    if n_rep == 1 {
        return x;
    }
    let [b, h, t, d] = x.dims();
    x.unsqueeze_dim::<5>(2).repeat_dim(2, n_rep).reshape([b, h * n_rep, t, d])
}

/// Eager softmax attention with a boolean mask.
///
/// # Shapes
/// - q: `[B, H, Tq, D]`, k/v: `[B, H, Tk, D]`, mask: `[B, 1, Tq, Tk]` -> `[B, H, Tq, D]`
pub fn sdpa<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &Tensor<B, 4, Bool>,
    scale: f64,
) -> Tensor<B, 4> {
    let [b, h, tq, _] = q.dims();
    let tk = k.dims()[2];
    let scores = q.matmul(k.swap_dims(2, 3)) * scale;
    let scores = scores.mask_fill(mask.clone().expand([b, h, tq, tk]), f32::NEG_INFINITY);
    softmax(scores, 3).matmul(v)
}

/// Causal depthwise conv1d with left zero padding of `K - 1`, followed by SiLU.
///
/// With packed sequences, `lag_masks[j]` (`[B, T, 1]`, 1 or 0) says whether the input `K - 1 - j`
/// steps back belongs to the same sequence, so no window reaches into the previous sequence.
///
/// # Shapes
/// - x: `[B, T, C]`, w: `[C, 1, K]` -> `[B, T, C]`
pub fn causal_conv_silu<B: Backend>(
    x: Tensor<B, 3>,
    w: &Tensor<B, 3>,
    lag_masks: Option<&[Tensor<B, 3>]>,
) -> Tensor<B, 3> {
    let [b, _, c] = x.dims();
    let k = w.dims()[2];
    let pad = Tensor::<B, 3>::zeros([b, k - 1, c], &x.device());
    causal_conv_silu_with_state(x, w, lag_masks, pad)
}

/// [`causal_conv_silu`] continuing from `state` (the previous `K - 1` inputs, `[B, K - 1, C]`),
/// as incremental decoding needs.
pub fn causal_conv_silu_with_state<B: Backend>(
    x: Tensor<B, 3>,
    w: &Tensor<B, 3>,
    lag_masks: Option<&[Tensor<B, 3>]>,
    pad: Tensor<B, 3>,
) -> Tensor<B, 3> {
    let [b, t, c] = x.dims();
    let k = w.dims()[2];
    let xp = Tensor::cat(vec![pad, x], 1);
    let w2 = w.clone().reshape([c, k]);
    let mut acc: Option<Tensor<B, 3>> = None;
    for j in 0..k {
        let mut term = xp.clone().narrow(1, j, t) * w2.clone().narrow(1, j, 1).reshape([1, 1, c]);
        if let Some(m) = lag_masks.and_then(|m| m.get(k - 1 - j)) {
            term = term * m.clone();
        }
        acc = Some(match acc {
            Some(a) => a + term,
            None => term,
        });
    }
    // k >= 1 is validated with the config, so acc is set.
    silu(acc.unwrap_or_else(|| Tensor::zeros([b, t, c], &xp.device())))
}

/// L2-normalise over the last dim as FLA / transformers do: `x * rsqrt(sum(x^2) + eps)`.
pub fn l2norm<B: Backend, const D: usize>(x: Tensor<B, D>, eps: f64) -> Tensor<B, D> {
    let ss = x.clone().powi_scalar(2).sum_dim(D - 1);
    x * (ss + eps).sqrt().recip()
}

/// The gated delta rule, recurrent form (exact; its backward is plain autodiff through the loop).
///
/// One state update per token, so its backward is quadratic in `T` under autodiff. Layers use it
/// for one-token decoding steps and when [`crate::delta::DeltaForm::Recurrent`] is selected; the
/// chunked form [`crate::delta::gated_delta_rule_chunked`] computes the same function for training.
///
/// `q` and `k` must already be L2-normalised and `q` scaled by `1/sqrt(dk)`.
///
/// With packed sequences, `keep` (`[B, T]`, 0 at the first token of each sequence, else 1) clears
/// the state at every sequence start.
///
/// # Shapes
/// - q, k: `[B, H, T, dk]`, v: `[B, H, T, dv]`, g (log decay), beta: `[B, H, T]` -> `[B, H, T, dv]`
pub fn gated_delta_rule<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 3>,
    beta: Tensor<B, 3>,
    keep: Option<&Tensor<B, 2>>,
) -> Tensor<B, 4> {
    gated_delta_rule_with_state(q, k, v, g, beta, keep, None).0
}

/// [`gated_delta_rule`] from an initial state (`[B, H, dk, dv]`), also returning the final state.
pub fn gated_delta_rule_with_state<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 3>,
    beta: Tensor<B, 3>,
    keep: Option<&Tensor<B, 2>>,
    init: Option<Tensor<B, 4>>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [b, h, t, dk] = k.dims();
    let dv = v.dims()[3];
    let decay = g.exp();
    let mut state = init.unwrap_or_else(|| Tensor::<B, 4>::zeros([b, h, dk, dv], &q.device()));
    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let q_t = q.clone().narrow(2, i, 1); // [B,H,1,dk]
        let k_t = k.clone().narrow(2, i, 1); // [B,H,1,dk]
        let v_t = v.clone().narrow(2, i, 1); // [B,H,1,dv]
        let d_t = decay.clone().narrow(2, i, 1).reshape([b, h, 1, 1]);
        let b_t = beta.clone().narrow(2, i, 1).reshape([b, h, 1, 1]);
        state = state * d_t;
        if let Some(keep) = keep {
            state = state * keep.clone().narrow(1, i, 1).reshape([b, 1, 1, 1]);
        }
        let kv_mem = k_t.clone().matmul(state.clone()); // [B,H,1,dv]
        let delta = (v_t - kv_mem) * b_t;
        state = state + k_t.swap_dims(2, 3).matmul(delta); // outer product [B,H,dk,dv]
        outs.push(q_t.matmul(state.clone())); // [B,H,1,dv]
    }
    (Tensor::cat(outs, 2), state)
}

/// Gated RMSNorm of the DeltaNet output: `rmsnorm(x) * w * silu(gate)` (plain scale, not zero-centred).
///
/// # Shapes
/// - x, gate: `[..., dv]`, w: `[dv]` -> same as x
pub fn gated_rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    gate: Tensor<B, D>,
    w: &Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    rms_norm(x, w, eps, false) * silu(gate)
}

/// `sigmoid`, re-exported for the layer code.
pub fn gate<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    sigmoid(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    /// On the CPU backend `linear` multiplies few rows as `(w @ x^T)^T`: the same values as
    /// `x @ w^T`, bit for bit (each output is the same dot product in the same order), for shapes
    /// on both sides of the switch and inner sizes past one k-block.
    #[test]
    fn both_forms_of_linear_give_the_same_bits() {
        let device = Default::default();
        for (rows, i, o) in [(1, 64, 300), (3, 700, 129), (40, 32, 48), (7, 1030, 2000)] {
            let val = |n: usize, s: f32| (0..n).map(|k| ((k as f32 * s).sin() * 3.0).fract()).collect::<Vec<f32>>();
            let x = Tensor::<CpuBackend, 3>::from_data(TensorData::new(val(rows * i, 0.37), [1, rows, i]), &device);
            let w = Tensor::<CpuBackend, 2>::from_data(TensorData::new(val(o * i, 0.11), [o, i]), &device);
            let plain = x.clone().reshape([rows, i]).matmul(w.clone().transpose()).reshape([1, rows, o]);
            let got = linear(x, &w, None);
            let (a, b) = (got.into_data().to_vec::<f32>().unwrap(), plain.into_data().to_vec::<f32>().unwrap());
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()), "rows {rows}, in {i}, out {o}");
        }
    }
}
