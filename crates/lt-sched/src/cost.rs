//! The cost model: per-layer FLOPs, times, bytes and working sets of one micro-batch on one machine.
//!
//! [`Instance::from_model`] turns a model shape, a step shape ([`ExecConfig`]) and a
//! [`HardwareProfile`] into an [`Instance`]: plain numbers that the window model, the DP, the MILP and
//! the simulator all read. Tests build instances by hand to explore shapes no real model has.
//!
//! # What one step executes (the executor contract the costs assume)
//! - **Embedding** on the host: the gather of boundary 0 runs on the CPU and boundary 0 is uploaded
//!   (`A` bytes); in backward its gradient `dx_0` is downloaded and scattered into the embedding
//!   gradient on the host.
//! - **Forward** of layer `i` needs its weights uploaded (bf16); boundary `i + 1` is kept or dropped.
//! - **Head** (final norm, LM head, loss) runs chunked over `loss_chunk_tokens` tokens: logits exist for
//!   one chunk at a time, forward and backward fused per chunk. Its weights (a buffer of their own) are
//!   uploaded while the last forward layer runs; its weight gradient accumulates in fp32 on the GPU, is
//!   converted to the compute dtype and downloaded while the first backward op runs, and the second
//!   backward op waits for that download.
//! - **Backward** of layer `j` re-runs its forward from its saved input with the autograd graph, then its
//!   backward (the executor keeps no graph across layers), so it costs `fwd + bwd`. Its weight gradients
//!   are downloaded while the next op runs. A segment `[s, e)` first re-runs the forward of layers
//!   `s..e-1` (exclusive: `s..=e-2`) to rebuild boundaries `s+1..e-1`.
//! - **Optimizer**: fp32 AdamW on the host, per layer. The global gradient norm is accumulated as
//!   gradients land (no extra pass).
//! - **Memory**: two device weight buffers and one gradient buffer of the largest layer (the running
//!   backward's), plus the previous backward's gradients while their download runs past the
//!   recording forward of the next (`window::row_workspace`), one slot for a prefetched boundary;
//!   on the host ([`host_param_bytes`]) fp32 master 4 B/param, gradient (fp32 4, into which every
//!   micro-batch's download is accumulated; a decoder layer's stays bf16, 2, on a bf16 device
//!   without accumulation), m and v (8 fp32, 2.03 8-bit: [`OptimizerState`]), bf16 upload copy 2
//!   (none on an f32 device, which uploads the master, nor for an untied model's embedding, whose
//!   rows are gathered on the host): 16 or 10.03 B/param on a bf16 device without accumulation,
//!   plus four boundary-sized pinned buffers.
//!
//! FLOPs count multiply-adds as 2; elementwise work is not counted but is covered by the profile's
//! `efficiency`.

use lt_core::ModelConfig;
use lt_core::config::LayerKind;
use lt_core::hardware::HardwareProfile;
use serde::{Deserialize, Serialize};

use crate::SchedError;
use crate::plan::OptimizerOverlap;
use crate::working_set::{self, Dims};

/// How attention is computed, which changes its FLOPs and working set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKernel {
    /// A fused kernel (flash attention): causal blocks skipped, scores never stored.
    #[default]
    Flash,
    /// Scores materialised (`T x T` per head, as Burn's autodiff does): full `T^2` work, scores saved.
    Materialized,
}

/// Precision of the host optimizer's AdamW moments (host memory only: the update speed is the profile's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerState {
    /// fp32 m and v: 8 B/param (PyTorch AdamW; what the published system used for ~98% of parameters).
    #[default]
    Fp32,
    /// Block-wise 8-bit m and v with one fp32 absmax per 256 values: 2 + 8/256 B/param (lt-optim's
    /// `adamw8bit`; tensors under 4,096 elements keep fp32 state, a negligible share).
    Blockwise8bit,
}

/// lt-optim's `Quant8Config` defaults: tensors of fewer elements keep fp32 moments...
const MIN_8BIT_NUMEL: u64 = 4096;
/// ...and the others have one fp32 absmax per moment for every block of this many values.
const BLOCK_8BIT: u64 = 256;

impl OptimizerState {
    /// Host bytes per parameter of the two moments (8-bit: of a tensor large enough for 8-bit state).
    pub fn bytes_per_param(self) -> f64 {
        match self {
            OptimizerState::Fp32 => 8.0,
            OptimizerState::Blockwise8bit => 2.0 + 8.0 / BLOCK_8BIT as f64,
        }
    }

    /// Host bytes of the two moments of one tensor of `numel` elements, as lt-optim allocates them.
    pub fn tensor_bytes(self, numel: u64) -> u64 {
        match self {
            OptimizerState::Blockwise8bit if numel >= MIN_8BIT_NUMEL => 2 * numel + 8 * numel.div_ceil(BLOCK_8BIT),
            _ => 8 * numel,
        }
    }
}

/// Host bytes kept for the parameters for a whole run, by kind: predicted by [`host_param_bytes`],
/// allocated by lt-exec's `Trainer` (its `host_bytes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostBytes {
    /// fp32 master weights.
    pub masters: u64,
    /// Gradients: fp32 (also the accumulator over micro-batches), or bf16 for a bf16 device's decoder
    /// layers without accumulation.
    pub grads: u64,
    /// AdamW's moments: fp32, or 8-bit codes with their absmax values.
    pub optimizer_state: u64,
    /// Upload copies in the device dtype (devices narrower than f32 only).
    pub upload_copies: u64,
}

impl HostBytes {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.masters + self.grads + self.optimizer_state + self.upload_copies
    }
}

/// Host bytes the trainer keeps for the parameters of `model` for a whole run, exactly as lt-exec's
/// `Trainer` allocates them (a test there holds the two together): per tensor the fp32 master
/// (4 B/param), the gradient, AdamW's moments ([`OptimizerState::tensor_bytes`]) and, on a device
/// whose compute dtype is narrower than f32, the upload copy the optimizer writes
/// (`compute_dtype_bytes` per param) of every tensor that is uploaded: all but an untied model's
/// embedding, whose rows are gathered on the host.
///
/// Gradients: fp32 (4 B/param), into which each micro-batch's download is accumulated; but on a
/// narrower device with one micro-batch per step (`grad_accum_steps == 1`) a decoder layer's
/// gradient stays in the device dtype, as downloaded (lt-exec's `GradBuf`; `LT_BF16_GRADS=0`
/// switches that off, which this model does not follow). The embedding, final norm and head keep
/// fp32 gradients.
pub fn host_param_bytes(
    model: &ModelConfig,
    compute_dtype_bytes: usize,
    optimizer: OptimizerState,
    grad_accum_steps: usize,
) -> HostBytes {
    let d = compute_dtype_bytes as u64;
    let narrow = d < HOST_MASTER_BYTES_PER_PARAM;
    let layer_grad = if narrow && grad_accum_steps == 1 { d } else { HOST_GRAD_BYTES_PER_PARAM };
    let mut b = HostBytes::default();
    let mut add = |numel: u64, uploaded: bool, grad: u64| {
        b.masters += HOST_MASTER_BYTES_PER_PARAM * numel;
        b.grads += grad * numel;
        b.optimizer_state += optimizer.tensor_bytes(numel);
        if uploaded && narrow {
            b.upload_copies += d * numel;
        }
    };
    for p in model.outer_params() {
        let uploaded = p.name != "embed_tokens.weight" || model.tie_word_embeddings;
        add(p.numel() as u64, uploaded, HOST_GRAD_BYTES_PER_PARAM);
    }
    for p in (0..model.num_layers()).flat_map(|i| model.layer_params(i)) {
        add(p.numel() as u64, true, layer_grad);
    }
    b
}

/// Modelling options that are not properties of the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CostOptions {
    /// Attention kernel of the executor.
    pub attention: AttentionKernel,
    /// Precision of the optimizer state (host memory).
    #[serde(default)]
    pub optimizer: OptimizerState,
}

/// The step shape: every plan-level decision except the boundary placements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecConfig {
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub grad_accum_steps: usize,
    /// Tokens per loss chunk.
    pub loss_chunk_tokens: usize,
    /// When the host optimizer runs.
    pub optimizer_overlap: OptimizerOverlap,
    /// MegaTrain's loss: every chunk's logits stay alive until one final backward (baseline only).
    #[serde(default)]
    pub retain_all_logits: bool,
}

/// Costs of one decoder layer for one micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerCost {
    /// Token mixer of the layer.
    pub kind: LayerKind,
    /// Parameters.
    pub params: u64,
    /// Weight bytes uploaded per use (compute dtype).
    pub weight_bytes: f64,
    /// Gradient bytes downloaded per backward (compute dtype).
    pub grad_bytes: f64,
    /// Forward FLOPs (also the cost of recomputing the layer).
    pub fwd_flops: f64,
    /// Backward FLOPs, excluding the graph-recording forward.
    pub bwd_flops: f64,
    /// Forward time, seconds (predicted).
    pub fwd_seconds: f64,
    /// Backward op time: graph-recording forward plus backward, seconds (predicted).
    pub bwd_seconds: f64,
    /// Device working set of a forward or recompute op beyond its input and output boundaries and
    /// weights (fitted to burn's allocations, see `layer_shape`).
    pub fwd_workspace_bytes: f64,
    /// Device working set of the backward op beyond its input boundary, output gradient, weights and
    /// weight gradients (fitted to burn's allocations, see `layer_shape`).
    pub bwd_workspace_bytes: f64,
    /// Host optimizer time for this layer, seconds (predicted).
    pub optimizer_seconds: f64,
}

/// Costs of the chunked head and loss for one micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadCost {
    /// Parameters of the LM head matrix (the embedding matrix when tied).
    pub params: u64,
    /// Forward and backward FLOPs (fused per chunk).
    pub flops: f64,
    /// Time of the head op, seconds (predicted).
    pub seconds: f64,
    /// Head weight bytes uploaded.
    pub weight_bytes: f64,
    /// Head gradient bytes downloaded.
    pub grad_bytes: f64,
    /// Device bytes the head op holds beyond boundary L and the kept boundaries: weights, fp32
    /// gradient accumulator, one chunk of logits, `dx_L` (and, for MegaTrain, every chunk's logits).
    pub workspace_bytes: f64,
    /// Device bytes of the converted head gradient waiting for its download after the op.
    pub stage_bytes: f64,
}

/// Everything the planner, DP, MILP and simulator need for one step shape on one machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    /// Per decoder layer.
    pub layers: Vec<LayerCost>,
    /// Head and loss.
    pub head: HeadCost,
    /// Bytes of one boundary activation (`tokens x hidden x dtype`): the memory slot unit.
    pub boundary_bytes: f64,
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Micro-batches per step.
    pub grad_accum_steps: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Tokens per loss chunk.
    pub loss_chunk_tokens: usize,
    /// MegaTrain's loss retention (baseline only).
    pub retain_all_logits: bool,
    /// Host-to-device bytes/s.
    pub h2d: f64,
    /// Device-to-host bytes/s.
    pub d2h: f64,
    /// NVMe read bytes/s.
    pub nvme_read: f64,
    /// NVMe write bytes/s.
    pub nvme_write: f64,
    /// GPU memory, bytes.
    pub gpu_capacity: f64,
    /// Host memory, bytes.
    pub host_capacity: f64,
    /// NVMe capacity, bytes.
    pub nvme_capacity: f64,
    /// Static device memory: reserve, two weight buffers, the gradient buffer of the running backward
    /// (no prefetch slot; the previous backward's gradients are counted per row, see `window`).
    pub gpu_static_bytes: f64,
    /// Static host memory: master weights, gradients, optimizer state, upload copies
    /// ([`host_param_bytes`]), staging buffers.
    pub host_static_bytes: f64,
    /// Host optimizer time of the embedding (plus the tied head), seconds (predicted).
    pub opt_embed_seconds: f64,
    /// Host optimizer time of the untied head and final norm, seconds (predicted).
    pub opt_head_seconds: f64,
    /// All parameters, embedding included (the published TFLOPS formula's `params`).
    pub total_params: u64,
}

/// Chunk length of the chunked Gated DeltaNet algorithm (lt-model's, flash-linear-attention's).
const DELTA_CHUNK: f64 = lt_core::config::DELTA_CHUNK as f64;

/// Host bytes per parameter of the fp32 master weights. The gradient, AdamW's m and v
/// ([`OptimizerState`]) and the upload copy come on top ([`host_param_bytes`]).
const HOST_MASTER_BYTES_PER_PARAM: u64 = 4;

/// Host bytes per parameter of an fp32 gradient buffer, which is also the accumulator over
/// micro-batches: downloads are widened and added into it as they land (see [`host_param_bytes`]
/// for the bf16 exception).
const HOST_GRAD_BYTES_PER_PARAM: u64 = 4;

/// Bytes per logit element of one loss chunk: fp32 logits (4) and fp32 `d logits` (4).
const CHUNK_LOGIT_BYTES: f64 = 8.0;

impl Instance {
    /// Build the costs of `model` for one step shape on `hw`.
    ///
    /// # Errors
    /// [`SchedError::InvalidRequest`] for a zero micro-batch, accumulation, sequence or chunk length.
    pub fn from_model(
        model: &ModelConfig,
        hw: &HardwareProfile,
        seq_len: usize,
        cfg: &ExecConfig,
        opts: CostOptions,
    ) -> Result<Self, SchedError> {
        for (field, v) in [
            ("micro_batch_size", cfg.micro_batch_size),
            ("grad_accum_steps", cfg.grad_accum_steps),
            ("seq_len", seq_len),
            ("loss_chunk_tokens", cfg.loss_chunk_tokens),
        ] {
            if v == 0 {
                return Err(SchedError::InvalidRequest { field, reason: "must be > 0".into() });
            }
        }
        let d = hw.compute_dtype_bytes as f64;
        let b = cfg.micro_batch_size as f64;
        let t = seq_len as f64;
        let n = b * t;
        let h = model.hidden_size as f64;
        let a_bytes = n * h * d;
        let rate = hw.flops_per_s(n);
        let opt_rate = hw.optimizer_params_per_s();

        let layers: Vec<LayerCost> = (0..model.num_layers())
            .map(|i| {
                let params = model.layer_numel(i) as u64;
                let s = layer_shape(model, i, b, t, d, opts.attention);
                let rate = match model.layer_types[i] {
                    LayerKind::FullAttention => rate,
                    LayerKind::LinearAttention => hw.linear_flops_per_s(n),
                };
                LayerCost {
                    kind: model.layer_types[i],
                    params,
                    weight_bytes: params as f64 * d,
                    grad_bytes: params as f64 * d,
                    fwd_flops: s.fwd_flops,
                    bwd_flops: s.bwd_flops,
                    fwd_seconds: s.fwd_flops / rate,
                    bwd_seconds: (s.fwd_flops + s.bwd_flops) / rate,
                    // Forward transient plus one boundary for the gradient carried through a recompute.
                    fwd_workspace_bytes: s.fwd_bytes + a_bytes,
                    bwd_workspace_bytes: s.bwd_bytes,
                    optimizer_seconds: params as f64 / opt_rate,
                }
            })
            .collect();

        let v = model.vocab_size as f64;
        let head_params = model.vocab_size as u64 * model.hidden_size as u64;
        let chunk = (cfg.loss_chunk_tokens as f64).min(n);
        let head_flops = 6.0 * n * h * v;
        let head_w = v * h * d;
        let chunk_ws = chunk * v * CHUNK_LOGIT_BYTES + 2.0 * chunk * h * d;
        // MegaTrain keeps each chunk's logits, in the compute dtype, for one final backward.
        let retained = if cfg.retain_all_logits { n * v * d } else { 0.0 };
        let head = HeadCost {
            params: head_params,
            flops: head_flops,
            seconds: head_flops / hw.flops_per_s(chunk),
            weight_bytes: head_w,
            grad_bytes: head_w,
            workspace_bytes: head_w + v * h * 4.0 + chunk_ws + retained + a_bytes,
            stage_bytes: head_w,
        };

        let total_params = model.total_params() as u64;
        let w_max = layers.iter().map(|l| l.weight_bytes).fold(0.0, f64::max);
        let g_max = layers.iter().map(|l| l.grad_bytes).fold(0.0, f64::max);
        // The second gradient buffer (the previous backward's, downloading) is counted where it is
        // live, per backward row (`window::row_workspace`).
        let gpu_static = hw.gpu_reserved.as_f64() + 2.0 * w_max + g_max;
        // The parameters' buffers, plus four boundary-sized pinned buffers: two NVMe staging buffers,
        // boundary 0 after the host-side embedding gather, and the landing buffer of dx_0.
        let host_static = host_param_bytes(model, hw.compute_dtype_bytes as usize, opts.optimizer, cfg.grad_accum_steps)
            .total() as f64
            + 4.0 * a_bytes;
        let embed_params = head_params as f64;
        let norm_params = h;
        let (opt_embed, opt_head) = if model.tie_word_embeddings {
            (embed_params / opt_rate, norm_params / opt_rate)
        } else {
            (embed_params / opt_rate, (embed_params + norm_params) / opt_rate)
        };

        Ok(Self {
            layers,
            head,
            boundary_bytes: a_bytes,
            micro_batch_size: cfg.micro_batch_size,
            grad_accum_steps: cfg.grad_accum_steps,
            seq_len,
            loss_chunk_tokens: cfg.loss_chunk_tokens,
            retain_all_logits: cfg.retain_all_logits,
            h2d: hw.h2d_bytes_per_s(),
            d2h: hw.d2h_bytes_per_s(),
            nvme_read: hw.nvme_read_bytes_per_s(),
            nvme_write: hw.nvme_write_bytes_per_s(),
            gpu_capacity: hw.gpu_memory.as_f64(),
            host_capacity: hw.host_memory.as_f64(),
            nvme_capacity: hw.nvme_capacity.as_f64(),
            gpu_static_bytes: gpu_static,
            host_static_bytes: host_static,
            opt_embed_seconds: opt_embed,
            opt_head_seconds: opt_head,
            total_params,
        })
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Tokens per step (all micro-batches).
    pub fn tokens_per_step(&self) -> f64 {
        (self.micro_batch_size * self.grad_accum_steps * self.seq_len) as f64
    }

    /// Static device memory plus the slot reserved for one prefetched boundary (a reload or the next
    /// micro-batch's boundary 0): the fixed part of every memory row.
    pub fn gpu_fixed_bytes(&self) -> f64 {
        self.gpu_static_bytes + self.boundary_bytes
    }

    /// Host optimizer time of the whole model, seconds (predicted).
    pub fn optimizer_seconds(&self) -> f64 {
        self.layers.iter().map(|l| l.optimizer_seconds).sum::<f64>() + self.opt_embed_seconds + self.opt_head_seconds
    }

    /// FLOPs by the published formula: `6 x params x tokens` per step.
    pub fn model_flops_per_step(&self) -> f64 {
        6.0 * self.total_params as f64 * self.tokens_per_step()
    }

    /// FLOPs a plan actually executes per step: forward, recompute, graph-recording forward, backward
    /// and head, attention included. `recomputed[i]` says whether layer `i` is re-run in a recompute
    /// pass.
    pub fn executed_flops_per_step(&self, recomputed: &[bool]) -> f64 {
        let per_mb: f64 = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let rec = if recomputed.get(i).copied().unwrap_or(false) { l.fwd_flops } else { 0.0 };
                2.0 * l.fwd_flops + l.bwd_flops + rec
            })
            .sum::<f64>()
            + self.head.flops;
        per_mb * self.grad_accum_steps as f64
    }
}

struct Shape {
    fwd_flops: f64,
    bwd_flops: f64,
    /// Peak bytes of the graph-recording forward plus backward beyond the layer's input, output
    /// gradient, weights and weight gradients.
    bwd_bytes: f64,
    /// Peak bytes of a forward without graph beyond its input and weights.
    fwd_bytes: f64,
}

/// How far above the least-squares fit the linear-attention working-set formulas sit (the
/// full-attention layer's are traced, not fitted: `working_set`). Per layer the fit is then within
/// `crates/lt-model/tests/layer_memory.rs`' bounds.
const LINEAR_MARGIN: f64 = 1.06;

/// FLOPs and working-set bytes of layer `i` for `b` sequences of `t` tokens in dtype `d`.
fn layer_shape(m: &ModelConfig, i: usize, b: f64, t: f64, d: f64, attention: AttentionKernel) -> Shape {
    let n = b * t;
    let h = m.hidden_size as f64;
    let inter = m.intermediate_size as f64;
    // MLP: gate, up and down projections.
    let mlp_flops = n * 6.0 * h * inter;
    match m.layer_types[i] {
        LayerKind::FullAttention => {
            let nh = m.num_heads as f64;
            let hd = m.head_dim as f64;
            let q_out = nh * hd * if m.attn_output_gate { 2.0 } else { 1.0 };
            let kv = m.num_kv_heads as f64 * hd;
            let attn_dim = nh * hd;
            let proj_flops = n * (2.0 * h * (q_out + 2.0 * kv) + 2.0 * attn_dim * h);
            // QK^T and PV, 2 b nh T^2 hd each; a causal fused kernel skips half.
            let (core_fwd, core_bwd, lse_bytes) = match attention {
                AttentionKernel::Flash => {
                    let f = 2.0 * b * nh * t * t * hd;
                    // FlashAttention-2 backward runs 5 matmuls of that size against 2 in forward.
                    (f, 2.5 * f, n * nh * 4.0)
                }
                AttentionKernel::Materialized => (4.0 * b * nh * t * t * hd, 8.0 * b * nh * t * t * hd, 0.0),
            };
            // Working sets: the largest live set of the layer's traced allocations at these
            // dimensions (`working_set`), plus the input boundary of a forward (recompute) and the
            // incoming gradient of a backward, allocated before the call.
            let dims = Dims::of(m, b, t);
            let grads = layer_params(m, i) * d;
            let scores = attention == AttentionKernel::Materialized;
            let (bwd_peak, fwd_peak) = working_set::attention_peaks(m, &dims, d, grads, scores);
            let boundary = n * h * d;
            Shape {
                fwd_flops: proj_flops + core_fwd + mlp_flops,
                bwd_flops: 2.0 * (proj_flops + mlp_flops) + core_bwd,
                bwd_bytes: bwd_peak + boundary + lse_bytes,
                fwd_bytes: fwd_peak + boundary,
            }
        }
        LayerKind::LinearAttention => {
            // Present whenever a layer is linear (validated by `ModelConfig::from_hf`).
            let (nk, nv, dk, dv, kernel) = match m.linear {
                Some(l) => (
                    l.num_key_heads as f64,
                    l.num_value_heads as f64,
                    l.key_head_dim as f64,
                    l.value_head_dim as f64,
                    l.conv_kernel as f64,
                ),
                None => (0.0, 0.0, 0.0, 0.0, 0.0),
            };
            let conv_dim = 2.0 * nk * dk + nv * dv;
            let vd = nv * dv;
            let proj_flops = n * (2.0 * h * (conv_dim + vd + 2.0 * nv) + 2.0 * vd * h);
            let conv_flops = n * 2.0 * conv_dim * kernel;
            // The chunked gated delta rule as lt-model computes it, per (padded) token and value head:
            // K K^T, Q K^T and the two WY products with the triangular inverse (2 C (3 dk + 2 dv)),
            // the blocked inverse (log2(C) - 1 levels of two C x C matmuls: 20 C^2 for C = 64), and
            // the state read, update and output against the chunk's state (6 dk dv).
            let c = DELTA_CHUNK;
            let padded = b * (t / c).ceil() * c;
            let levels = c.log2() - 1.0;
            let per = 2.0 * c * (3.0 * dk + 2.0 * dv) + 4.0 * levels * c * c + 6.0 * dk * dv;
            let delta_flops = padded * nv * per;
            let fwd = proj_flops + conv_flops + delta_flops + mlp_flops;
            let bwd = 2.0 * fwd;
            // Working sets in elements, fitted as the attention layer's (18 shapes of 4 linear-attention
            // configs), with the chunked rule's graph (`LinearAttnConfig::chunked_rule_saved_elems`,
            // itself measured) as one term.
            let rule = m.linear.map_or(0.0, |l| l.chunked_rule_saved_elems(b as usize, t as usize));
            let bwd_ws = LINEAR_MARGIN
                * (n * (9.56 * inter + 0.97 * conv_dim + 17.08 * vd)
                    + 0.5 * rule
                    + (n * (5.14 * inter + 3.3 * h)).max(0.5 * rule + 0.26 * n * vd)
                    + 0.22 * layer_params(m, i))
                + n * h;
            let fwd_ws = LINEAR_MARGIN
                * (n * (0.03 * h + 0.03 * inter + 0.7 * conv_dim) + (n * (4.53 * inter + 2.99 * h)).max(0.18 * rule));
            Shape { fwd_flops: fwd, bwd_flops: bwd, bwd_bytes: d * bwd_ws, fwd_bytes: d * fwd_ws }
        }
    }
}

/// Parameters of layer `i` (the linear-attention layer's fitted working sets grow a little with
/// them: weight-sized temporaries of the backward; the attention layer's gradient bytes).
fn layer_params(m: &ModelConfig, i: usize) -> f64 {
    m.layer_numel(i) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use lt_core::hardware::BuiltinProfile;

    fn qwen2_tiny() -> ModelConfig {
        let j = serde_json::json!({
            "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 256,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": true});
        ModelConfig::from_json_str(&j.to_string()).unwrap()
    }

    fn cfg(mb: usize) -> ExecConfig {
        ExecConfig {
            micro_batch_size: mb,
            grad_accum_steps: 1,
            loss_chunk_tokens: 128,
            optimizer_overlap: OptimizerOverlap::Serial,
            retain_all_logits: false,
        }
    }

    #[test]
    fn linear_flops_match_six_params_per_token_without_attention() {
        // With T = 1 the attention core is negligible, so fwd + bwd of the projections must be exactly
        // 6 x (layer matrix params) x tokens; norms and biases are the only params without FLOPs.
        let m = qwen2_tiny();
        let hw = BuiltinProfile::H800.profile();
        let inst = Instance::from_model(&m, &hw, 1, &cfg(8), CostOptions::default()).unwrap();
        let l = &inst.layers[0];
        let matrix_params: usize = m.layer_params(0).iter().filter(|p| p.shape.len() == 2).map(|p| p.numel()).sum();
        let core = 2.0 * 8.0 * 4.0 * 1.0 * 16.0;
        let expected = 6.0 * matrix_params as f64 * 8.0;
        let got = l.fwd_flops + l.bwd_flops - core * 3.5;
        assert!((got - expected).abs() / expected < 1e-12, "{got} vs {expected}");
    }

    #[test]
    fn memory_and_time_scale_with_micro_batch() {
        let m = qwen2_tiny();
        let hw = BuiltinProfile::H800.profile();
        let a = Instance::from_model(&m, &hw, 64, &cfg(1), CostOptions::default()).unwrap();
        let b = Instance::from_model(&m, &hw, 64, &cfg(4), CostOptions::default()).unwrap();
        let c = Instance::from_model(&m, &hw, 64, &cfg(2), CostOptions::default()).unwrap();
        assert_eq!(b.boundary_bytes, 4.0 * a.boundary_bytes);
        // Working sets are linear in tokens for flash attention (lse is per token) beyond their
        // fixed part (graph bookkeeping): the step from 2 to 4 rows is twice the step from 1 to 2.
        let ws = |i: &Instance| i.layers[1].bwd_workspace_bytes;
        let (d1, d2) = (ws(&c) - ws(&a), ws(&b) - ws(&c));
        assert!(d1 > 0.0 && (d2 / d1 - 2.0).abs() < 0.1, "{d1} then {d2}");
        // Weights do not depend on the batch.
        assert_eq!(a.layers[0].weight_bytes, b.layers[0].weight_bytes);
        assert!(b.layers[0].fwd_seconds > a.layers[0].fwd_seconds);
    }

    #[test]
    fn zero_micro_batch_is_rejected() {
        let m = qwen2_tiny();
        let hw = BuiltinProfile::Cpu.profile();
        let e = Instance::from_model(&m, &hw, 64, &cfg(0), CostOptions::default()).unwrap_err();
        assert!(e.to_string().contains("micro_batch_size"), "{e}");
    }

    #[test]
    fn materialized_attention_costs_more_memory_than_flash() {
        let m = qwen2_tiny();
        let hw = BuiltinProfile::Cpu.profile();
        let f = Instance::from_model(&m, &hw, 256, &cfg(2), CostOptions::default()).unwrap();
        let opts = CostOptions { attention: AttentionKernel::Materialized, ..Default::default() };
        let x = Instance::from_model(&m, &hw, 256, &cfg(2), opts).unwrap();
        assert!(x.layers[0].bwd_workspace_bytes > f.layers[0].bwd_workspace_bytes);
        assert!(x.layers[0].fwd_flops > f.layers[0].fwd_flops);
    }

    /// The bf16 upload copy covers what uploads read (lt-exec's `fill_upload_copies`): untying adds
    /// `lm_head`'s master, gradient and state, but no copy beyond the one matrix that tied and
    /// untied models both upload as the output projection.
    #[test]
    fn an_untied_embedding_has_no_upload_copy() {
        let tied = qwen2_tiny();
        let j = serde_json::json!({
            "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 256,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": false});
        let untied = ModelConfig::from_json_str(&j.to_string()).unwrap();
        let hw = BuiltinProfile::H800.profile();
        let d = hw.compute_dtype_bytes as f64;
        assert_eq!(d, 2.0, "a bf16 device, which has upload copies");
        let t = Instance::from_model(&tied, &hw, 64, &cfg(2), CostOptions::default()).unwrap();
        let u = Instance::from_model(&untied, &hw, 64, &cfg(2), CostOptions::default()).unwrap();
        let head = (1000 * 64) as f64;
        assert_eq!(u.total_params - t.total_params, 1000 * 64);
        let extra = u.host_static_bytes - t.host_static_bytes;
        let want = head * (4.0 + 4.0 + OptimizerState::Fp32.bytes_per_param());
        assert!((extra - want).abs() < 1e-9 * want, "{extra} vs {want}");
    }

    #[test]
    fn eight_bit_optimizer_state_saves_its_bytes_of_host_memory() {
        let m = qwen2_tiny();
        let hw = BuiltinProfile::Cpu.profile();
        let fp32 = Instance::from_model(&m, &hw, 64, &cfg(2), CostOptions::default()).unwrap();
        let opts = CostOptions { optimizer: OptimizerState::Blockwise8bit, ..Default::default() };
        let q8 = Instance::from_model(&m, &hw, 64, &cfg(2), opts).unwrap();
        let saved = fp32.host_static_bytes - q8.host_static_bytes;
        // Tensors of 4,096 elements or more: 2 B/param of codes and 8 B per 256 of absmax; the
        // rest (norms, biases) keep fp32 moments.
        let sizes: Vec<u64> = m
            .outer_params()
            .into_iter()
            .chain((0..m.num_layers()).flat_map(|i| m.layer_params(i)))
            .map(|p| p.numel() as u64)
            .collect();
        let want: u64 = sizes.iter().filter(|&&n| n >= 4096).map(|&n| 8 * n - 2 * n - 8 * n.div_ceil(256)).sum();
        assert!(sizes.iter().any(|&n| n < 4096) && want > 0);
        assert_eq!(saved, want as f64);
        // Nothing else changes.
        assert_eq!(fp32.gpu_static_bytes, q8.gpu_static_bytes);
        assert_eq!(fp32.layers, q8.layers);
    }
}
