//! Batched greedy generation with a decoding cache (attention keys/values; DeltaNet conv window and
//! recurrent state).
//!
//! Prompts of different lengths are left-padded. Padding never influences a real token: attention
//! masks padding keys, RoPE positions count real tokens only, and linear-attention inputs of padding
//! are zeroed (as transformers' `apply_mask_to_padding_states` does), which keeps the recurrent state
//! and conv window empty until the first real token.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor, TensorData};

use crate::delta::DeltaForm;
use crate::layer::{LayerCache, SeqCtx, layer_forward_cached};
use crate::model::to_vec;
use crate::ops::Rope;
use crate::stream::ForwardWeights;
use crate::weights::DeviceModel;

/// Greedy continuation of each prompt: at most `max_new_tokens` tokens, stopping a row at the first
/// token in `stop` (which is included in its output). Returns the new tokens of each row.
///
/// # Panics
/// If a prompt is empty (a programmer error: callers validate prompts).
pub fn generate_greedy<B: Backend>(
    model: &DeviceModel<B>,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    stop: &[u32],
) -> Vec<Vec<u32>> {
    generate_greedy_with(&mut &*model, prompts, max_new_tokens, stop)
}

/// [`generate_greedy`] over any [`ForwardWeights`]: with [`crate::stream::Streamed`] weights every
/// decoding step streams the decoder layers once, for all rows together (so larger batches
/// amortize the uploads), while the decoding caches stay on the device.
///
/// # Panics
/// As [`generate_greedy`].
pub fn generate_greedy_with<B: Backend, W: ForwardWeights<B> + ?Sized>(
    model: &mut W,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    stop: &[u32],
) -> Vec<Vec<u32>> {
    let cfg = model.config().clone();
    let cfg = &cfg;
    let device = model.device();
    let b = prompts.len();
    if b == 0 || max_new_tokens == 0 {
        return vec![Vec::new(); b];
    }
    assert!(prompts.iter().all(|p| !p.is_empty()), "empty prompt");
    let t = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let pads: Vec<usize> = prompts.iter().map(|p| t - p.len()).collect();
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&pads)
        .map(|(p, &n)| std::iter::repeat_n(0u32, n).chain(p.iter().copied()).collect())
        .collect();
    // Prefill context.
    let positions: Vec<Vec<usize>> = pads.iter().map(|&n| (0..t).map(|i| i.saturating_sub(n)).collect()).collect();
    let mut mask = Vec::with_capacity(b * t * t);
    let mut token_mask = Vec::with_capacity(b * t);
    for &n in &pads {
        for i in 0..t {
            token_mask.push(if i >= n { 1.0f32 } else { 0.0 });
            for j in 0..t {
                // Future keys are hidden; padding keys are hidden from real queries (a padding query
                // may see padding, so its softmax row is never empty).
                mask.push(j > i || (j < n && i >= n));
            }
        }
    }
    let ctx = SeqCtx {
        rope: Rope::new(&positions, cfg.rope_theta, cfg.rotary_dim, &device),
        mask: Tensor::<B, 4, Bool>::from_data(TensorData::new(mask, [b, 1, t, t]), &device),
        packing: None,
        token_mask: Some(Tensor::from_data(TensorData::new(token_mask, [b, t, 1]), &device)),
        delta_form: DeltaForm::Chunked,
    };
    let mut caches: Vec<LayerCache<B>> = (0..cfg.num_layers()).map(|_| LayerCache::default()).collect();
    let x = model.embed(&ids);
    let x = model.layers(x, &mut |i, w, x| layer_forward_cached(cfg, w, x, &ctx, caches.get_mut(i)));
    let last = x.narrow(1, t - 1, 1);
    let mut next = argmax_rows(model.logits(last));

    let mut out: Vec<Vec<u32>> = vec![Vec::new(); b];
    let mut done = vec![false; b];
    for step in 0..max_new_tokens {
        // Tokens in the cache before this step's input.
        let len = t + step;
        for r in 0..b {
            if !done[r] {
                out[r].push(next[r]);
                done[r] = stop.contains(&next[r]);
            }
        }
        if step + 1 == max_new_tokens || done.iter().all(|d| *d) {
            break;
        }
        // One decoding step for every row (finished rows keep decoding; their output is ignored).
        let positions: Vec<Vec<usize>> = pads.iter().map(|&n| vec![len - n]).collect();
        let mut mask = Vec::with_capacity(b * (len + 1));
        for &n in &pads {
            mask.extend((0..=len).map(|j| j < n));
        }
        let ctx = SeqCtx {
            rope: Rope::new(&positions, cfg.rope_theta, cfg.rotary_dim, &device),
            mask: Tensor::<B, 4, Bool>::from_data(TensorData::new(mask, [b, 1, 1, len + 1]), &device),
            packing: None,
            token_mask: None,
            // One token per step: `delta_net_forward` runs it recurrently whatever this says.
            delta_form: DeltaForm::Recurrent,
        };
        let step_ids: Vec<Vec<u32>> = next.iter().map(|&v| vec![v]).collect();
        let x = model.embed(&step_ids);
        let x = model.layers(x, &mut |i, w, x| layer_forward_cached(cfg, w, x, &ctx, caches.get_mut(i)));
        next = argmax_rows(model.logits(x));
    }
    out
}

/// Index of the largest logit of each row (`[B, 1, V]`); ties pick the lowest index, like torch.
fn argmax_rows<B: Backend>(logits: Tensor<B, 3>) -> Vec<u32> {
    let [b, _, v] = logits.dims();
    let data = to_vec(logits);
    (0..b)
        .map(|r| {
            let row = &data[r * v..(r + 1) * v];
            let mut best = 0;
            for (i, x) in row.iter().enumerate() {
                if *x > row[best] {
                    best = i;
                }
            }
            best as u32
        })
        .collect()
}
