//! What a full-attention decoder layer holds on the device while it runs: the live sets of
//! lt-model's `layer_backward` (graph-recording forward plus backward) and `layer_forward`, as
//! tensor sizes in the layer's dimensions.
//!
//! **Where the numbers come from.** `crates/lt-model/tests/attention_live_sets.rs` runs each code
//! path of the attention layer (qwen2, qwen3, qwen3.5 gated; with and without K/V repeats) under a
//! recording allocator on ndarray, names every allocation by the one dimension product its size
//! equals at probe dimensions chosen so that no two products coincide, and keeps the live set after
//! every allocation. The table ([`PATHS`], in `working_set/table.rs`) holds, per path, the live sets
//! that no other one covers term by term (the Pareto front), so the peak at any dimensions is the
//! largest of them: a replay of the allocations, not a fit. The same test regenerates the table
//! (`LT_WRITE_WORKING_SETS=1`), fails when the committed table's peaks differ from the traced ones,
//! and checks the table against measured peaks at dimensions no probe used (forward 1.0x..1.1x,
//! backward 1.0x..1.2x: the backward counts the layer's whole gradient from its start).
//!
//! What a live set counts:
//! - activations per token (`n = b x t` rows of some width), the attention scores and their mask;
//! - weight-shaped tensors: the layer's own gradients and temporaries of their size. The gradients
//!   are counted once in the static gradient buffer, so only what exceeds the layer's gradient bytes
//!   counts here;
//! - `fixed`: every allocation no dimension product explains (autodiff graph nodes, shape vectors,
//!   small weight vectors): 40-100 KB at a backward's peak. On a GPU backend most of it is host
//!   heap; it is counted anyway, KBs against GBs.
//!
//! The element counts are ndarray's; on CUDA they are carried to bf16 unverified (cubecl's pools
//! and kernels' temporaries differ, and its booleans may be wider than the byte counted here).
//!
//! Where a live set held a packing buffer of the CPU GEMM (matrixmultiply, whose size depends on
//! the CPU's micro-kernel), [`gemm_scratch_bytes`] bounds it: the largest of the layer's products'.

mod table;

use lt_core::ModelConfig;
pub use table::PATHS;

/// A tensor size in the layer's dimensions: `n = b t` tokens, hidden `h`, MLP width `i`, `nh`
/// query heads and `kv` KV heads of `hd` dims with `rd` rotated, `t` tokens per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Term {
    /// `n h`
    TokHidden,
    /// `n i`
    TokInter,
    /// `n nh hd` (queries, attention output)
    TokQ,
    /// `n 2 nh hd` (gated q_proj output: query and gate)
    TokQGate,
    /// `n kv hd`
    TokKv,
    /// `n nh` (per query head scalars: q-norm statistics, softmax rows)
    TokHeads,
    /// `n kv` (per KV head scalars: k-norm statistics)
    TokKvHeads,
    /// `n` (per token scalars: layer-norm statistics)
    Tok,
    /// `n nh rd` (the rotated part of the queries, partial rotary only)
    TokQRot,
    /// `n nh rd / 2` (a rotate-half half of the queries)
    TokQHalf,
    /// `n nh (hd - rd)` (the queries' unrotated part, partial rotary only)
    TokQPass,
    /// `n kv rd` (partial rotary only)
    TokKRot,
    /// `n kv rd / 2`
    TokKHalf,
    /// `n kv (hd - rd)` (partial rotary only)
    TokKPass,
    /// `n nh` 8-byte integers (indices per query head and token).
    TokHeadsIndex,
    /// `t h`: a per-row partial sum of an `n h` tensor (a norm weight's gradient, summed over rows
    /// first).
    RowHidden,
    /// `t nh hd` (the q bias's or q-norm weight's gradient, partially summed).
    RowQ,
    /// `t kv hd` (the k/v biases' or k-norm weight's gradients, partially summed).
    RowKv,
    /// `b nh t t`: scores, probabilities and their gradients.
    Scores,
    /// `b nh t t` booleans (one byte each): the expanded causal mask.
    ScoreMask,
    /// `h i` (MLP weights)
    WeightMlp,
    /// `h nh hd` (o_proj, and q_proj without a gate)
    WeightQ,
    /// `h 2 nh hd` (a gated q_proj)
    WeightQGate,
    /// `h kv hd` (k_proj, v_proj)
    WeightKv,
}

impl Term {
    /// Every term, in table order.
    pub const ALL: [Term; 24] = [
        Term::TokHidden,
        Term::TokInter,
        Term::TokQ,
        Term::TokQGate,
        Term::TokKv,
        Term::TokHeads,
        Term::TokKvHeads,
        Term::Tok,
        Term::TokQRot,
        Term::TokQHalf,
        Term::TokQPass,
        Term::TokKRot,
        Term::TokKHalf,
        Term::TokKPass,
        Term::TokHeadsIndex,
        Term::RowHidden,
        Term::RowQ,
        Term::RowKv,
        Term::Scores,
        Term::ScoreMask,
        Term::WeightMlp,
        Term::WeightQ,
        Term::WeightQGate,
        Term::WeightKv,
    ];

    /// Elements of a tensor of this size.
    pub fn elems(self, d: &Dims) -> f64 {
        let (n, h, i, nh, kv, hd, rd) = (d.n(), d.h, d.i, d.nh, d.kv, d.hd, d.rd);
        match self {
            Term::TokHidden => n * h,
            Term::TokInter => n * i,
            Term::TokQ => n * nh * hd,
            Term::TokQGate => 2.0 * n * nh * hd,
            Term::TokKv => n * kv * hd,
            Term::TokHeads => n * nh,
            Term::TokKvHeads => n * kv,
            Term::Tok => n,
            Term::TokQRot => n * nh * rd,
            Term::TokQHalf => n * nh * rd / 2.0,
            Term::TokQPass => n * nh * (hd - rd),
            Term::TokKRot => n * kv * rd,
            Term::TokKHalf => n * kv * rd / 2.0,
            Term::TokKPass => n * kv * (hd - rd),
            Term::TokHeadsIndex => n * nh,
            Term::RowHidden => d.t * h,
            Term::RowQ => d.t * nh * hd,
            Term::RowKv => d.t * kv * hd,
            Term::Scores | Term::ScoreMask => d.b * nh * d.t * d.t,
            Term::WeightMlp => h * i,
            Term::WeightQ => h * nh * hd,
            Term::WeightQGate => 2.0 * h * nh * hd,
            Term::WeightKv => h * kv * hd,
        }
    }

    /// Bytes per element: one for the mask, eight for indices, the compute dtype's otherwise.
    pub fn elem_bytes(self, dtype_bytes: f64) -> f64 {
        match self {
            Term::ScoreMask => 1.0,
            Term::TokHeadsIndex => 8.0,
            _ => dtype_bytes,
        }
    }

    /// A weight-shaped tensor (a gradient, or a temporary of a gradient's size).
    pub fn is_weight(self) -> bool {
        matches!(self, Term::WeightMlp | Term::WeightQ | Term::WeightQGate | Term::WeightKv)
    }

    /// A term a materialised score matrix owns (absent under a fused attention kernel).
    pub fn is_score(self) -> bool {
        matches!(self, Term::Scores | Term::ScoreMask)
    }

    /// Whether the term can occur on `path` (the others are left out of its probe's naming, where
    /// they would coincide with another: `n nh rd` is `n nh hd` without partial rotary, and every
    /// K/V size is its query counterpart without K/V repeats).
    pub fn occurs_on(self, path: &Path) -> bool {
        let kv = matches!(
            self,
            Term::TokKv
                | Term::TokKvHeads
                | Term::TokKRot
                | Term::TokKHalf
                | Term::TokKPass
                | Term::RowKv
                | Term::WeightKv
        );
        if kv && !path.repeat_kv {
            return false;
        }
        match self {
            Term::TokQRot | Term::TokQPass => path.partial_rotary,
            Term::TokKRot | Term::TokKPass => path.partial_rotary,
            Term::TokQGate | Term::WeightQGate => path.gate,
            _ => true,
        }
    }
}

/// The dimensions of one full-attention layer at one step shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    /// Rows (micro-batch).
    pub b: f64,
    /// Tokens per row.
    pub t: f64,
    /// Hidden size.
    pub h: f64,
    /// MLP width.
    pub i: f64,
    /// Query heads.
    pub nh: f64,
    /// KV heads.
    pub kv: f64,
    /// Head dimension.
    pub hd: f64,
    /// Rotated dimensions per head.
    pub rd: f64,
}

impl Dims {
    /// The dimensions of `m`'s attention layers at `[b, t]`.
    pub fn of(m: &ModelConfig, b: f64, t: f64) -> Self {
        Self {
            b,
            t,
            h: m.hidden_size as f64,
            i: m.intermediate_size as f64,
            nh: m.num_heads as f64,
            kv: m.num_kv_heads as f64,
            hd: m.head_dim as f64,
            rd: m.rotary_dim as f64,
        }
    }

    /// Tokens.
    pub fn n(&self) -> f64 {
        self.b * self.t
    }
}

/// The code path of an attention layer: what changes which tensors it allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Path {
    /// Bias on q, k and v (qwen2).
    pub qkv_bias: bool,
    /// Bias on o_proj.
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k (qwen3, qwen3.5).
    pub qk_norm: bool,
    /// Sigmoid output gate (qwen3.5).
    pub gate: bool,
    /// RMSNorm scale `1 + w` (qwen3.5).
    pub zero_centered: bool,
    /// Fewer rotated dims than head dims (qwen3.5).
    pub partial_rotary: bool,
    /// Fewer KV heads than query heads: `repeat_kv` copies K and V.
    pub repeat_kv: bool,
}

impl Path {
    /// The path of `m`'s attention layers.
    pub fn of(m: &ModelConfig) -> Self {
        Self {
            qkv_bias: m.qkv_bias,
            o_bias: m.o_bias,
            qk_norm: m.qk_norm,
            gate: m.attn_output_gate,
            zero_centered: m.zero_centered_norm,
            partial_rotary: m.rotary_dim < m.head_dim,
            repeat_kv: m.num_kv_heads != m.num_heads,
        }
    }
}

/// One live set: a count of tensors per term, plus bytes that no term explains.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Phase<'a> {
    /// Tensors live, per term.
    pub terms: &'a [(Term, u32)],
    /// Bytes of the allocations no term explains.
    pub fixed: u32,
    /// A GEMM packing buffer is live too ([`gemm_scratch_bytes`] bounds it).
    pub scratch: bool,
}

impl Phase<'_> {
    /// Bytes of this live set at `d` in a `dtype_bytes` compute dtype, with weight-shaped tensors
    /// counted only beyond `grad_bytes` (the layer's gradients, held in the static gradient
    /// buffer), score terms left out under a fused kernel (`scores == false`), and `scratch` (the
    /// GEMM packing bound) added where a packing buffer was live.
    pub fn bytes(&self, d: &Dims, dtype_bytes: f64, grad_bytes: f64, scores: bool, scratch: f64) -> f64 {
        let (mut act, mut weights) = (f64::from(self.fixed), 0.0);
        for &(term, count) in self.terms {
            if term.is_score() && !scores {
                continue;
            }
            let b = f64::from(count) * term.elems(d) * term.elem_bytes(dtype_bytes);
            if term.is_weight() { weights += b } else { act += b }
        }
        act + (weights - grad_bytes).max(0.0) + if self.scratch { scratch } else { 0.0 }
    }
}

/// The live sets of one path: the backward's (graph-recording forward plus backward) and the
/// plain forward's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PathSets {
    /// The code path.
    pub path: Path,
    /// The Pareto front of `layer_backward`'s live sets.
    pub backward: &'static [Phase<'static>],
    /// The Pareto front of `layer_forward`'s live sets.
    pub forward: &'static [Phase<'static>],
}

/// The live sets of `path`: its own when probed, else those of every probed path (the largest of
/// them then bounds a path no Qwen model uses).
pub fn sets_for(path: &Path) -> Vec<&'static PathSets> {
    match PATHS.iter().find(|p| p.path == *path) {
        Some(p) => vec![p],
        None => PATHS.iter().collect(),
    }
}

/// Peak bytes of the layer's backward and forward live sets at `d` (see [`Phase::bytes`]), without
/// the inputs allocated before the call (the boundary, and the incoming gradient of a backward).
pub fn attention_peaks(m: &ModelConfig, d: &Dims, dtype_bytes: f64, grad_bytes: f64, scores: bool) -> (f64, f64) {
    let path = Path::of(m);
    let peak = |phases: &[Phase<'_>], backward: bool| {
        let scratch = gemm_scratch_bytes(m, d, dtype_bytes, backward);
        phases.iter().map(|p| p.bytes(d, dtype_bytes, grad_bytes, scores, scratch)).fold(0.0, f64::max)
    };
    let sets = sets_for(&path);
    let bwd = sets.iter().map(|s| peak(s.backward, true)).fold(0.0, f64::max);
    let fwd = sets.iter().map(|s| peak(s.forward, false)).fold(0.0, f64::max);
    (bwd, fwd)
}

/// matrixmultiply's blocking (`archparam_defaults.rs`): at most `KC` of the inner dimension, `MC`
/// rows of A and `NC` columns of B per packing buffer, rounded up to the micro-kernel (at most 16
/// on AVX-512).
const GEMM_KC: f64 = 256.0;
const GEMM_MC: f64 = 64.0;
const GEMM_NC: f64 = 1024.0;
const GEMM_ROUND: f64 = 16.0;

/// The largest packing buffer the CPU GEMM allocates inside one of the layer's matrix products
/// (`k' (round(m') + round(n'))` elements for an `m x k` by `k x n` product, `m' <= MC`,
/// `k' <= KC`, `n' <= NC`): live during the product on top of its operands and output. The forward
/// multiplies tokens by each projection and, per head, queries by keys and probabilities by values;
/// a backward also takes both operands' gradients of each (`m x n` by `n x k`, `k x m` by `m x n`),
/// each possibly transposed.
pub fn gemm_scratch_bytes(m: &ModelConfig, d: &Dims, dtype_bytes: f64, backward: bool) -> f64 {
    let round = |x: f64| (x / GEMM_ROUND).ceil() * GEMM_ROUND;
    let pack = |m: f64, k: f64, n: f64| k.min(GEMM_KC) * (round(m.min(GEMM_MC)) + round(n.min(GEMM_NC)));
    let n = d.n();
    let (q, kv) = (d.nh * d.hd, d.kv * d.hd);
    let q_out = q * if m.attn_output_gate { 2.0 } else { 1.0 };
    let forward =
        [(n, d.h, q_out), (n, d.h, kv), (n, q, d.h), (n, d.h, d.i), (n, d.i, d.h), (d.t, d.hd, d.t), (d.t, d.t, d.hd)];
    let worst = forward
        .iter()
        .map(|&(a, k, b)| {
            // ndarray may compute the transposed product (`n x k` by `k x m`).
            let f = pack(a, k, b).max(pack(b, k, a));
            if backward {
                [(a, b, k), (b, a, k), (k, a, b), (k, b, a)].iter().map(|&(x, y, z)| pack(x, y, z)).fold(f, f64::max)
            } else {
                f
            }
        })
        .fold(0.0, f64::max);
    worst * dtype_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen(extra: &str) -> ModelConfig {
        let json = format!(
            r#"{{"vocab_size":64,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"rms_norm_eps":1e-6,"rope_theta":1e6,"tie_word_embeddings":true,{extra}}}"#
        );
        ModelConfig::from_json_str(&json).unwrap()
    }

    #[test]
    fn every_qwen_path_is_probed_and_peaks_grow_with_tokens() {
        for extra in [
            r#""model_type":"qwen2","num_key_value_heads":2"#,
            r#""model_type":"qwen2","num_key_value_heads":4"#,
            r#""model_type":"qwen3","num_key_value_heads":1,"head_dim":16"#,
            r#""model_type":"qwen3","num_key_value_heads":4,"head_dim":16"#,
        ] {
            let m = qwen(extra);
            assert_eq!(sets_for(&Path::of(&m)).len(), 1, "{extra}: not probed");
            let grads = m.layer_numel(0) as f64 * 4.0;
            let peaks = |b: f64| attention_peaks(&m, &Dims::of(&m, b, 64.0), 4.0, grads, true);
            let (one, two) = (peaks(1.0), peaks(2.0));
            assert!(two.0 > one.0 && two.1 > one.1, "{extra}: {one:?} then {two:?}");
            // A fused kernel holds no score matrix.
            assert!(attention_peaks(&m, &Dims::of(&m, 2.0, 64.0), 4.0, grads, false).0 < two.0);
        }
    }

    #[test]
    fn an_unprobed_path_takes_the_largest_of_the_probed_ones() {
        // qwen3 with attention_bias: q/k/v and o biases and a QK norm, a path no Qwen model uses.
        let m = qwen(r#""model_type":"qwen3","num_key_value_heads":2,"head_dim":16,"attention_bias":true"#);
        assert_eq!(sets_for(&Path::of(&m)).len(), PATHS.len());
        let probed = qwen(r#""model_type":"qwen3","num_key_value_heads":2,"head_dim":16"#);
        let d = Dims::of(&m, 2.0, 64.0);
        let grads = m.layer_numel(0) as f64 * 4.0;
        assert!(attention_peaks(&m, &d, 4.0, grads, true).0 >= attention_peaks(&probed, &d, 4.0, grads, true).0);
    }

    #[test]
    fn weight_shaped_tensors_count_beyond_the_gradients() {
        let d = Dims { b: 1.0, t: 1.0, h: 10.0, i: 20.0, nh: 1.0, kv: 1.0, hd: 10.0, rd: 10.0 };
        let p = Phase { terms: &[(Term::WeightMlp, 3), (Term::TokHidden, 1)], fixed: 100, scratch: true };
        // 3 x 200 weight elements x 4 B = 2400 B against 2000 B of gradients: 400 B count.
        assert_eq!(p.bytes(&d, 4.0, 2000.0, true, 7.0), 100.0 + 40.0 + 400.0 + 7.0);
        assert_eq!(p.bytes(&d, 4.0, 5000.0, true, 0.0), 140.0);
    }
}
