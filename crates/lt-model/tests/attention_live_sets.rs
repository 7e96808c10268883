//! The live sets of a full-attention layer, traced: every allocation lt-model's `layer_backward`
//! (graph-recording forward plus backward) and `layer_forward` make on ndarray, named by the
//! dimension product its size equals ([`lt_sched::working_set::Term`]), reduced to the live sets no
//! other covers (the Pareto front). lt-sched's cost model counts a layer's working set as the largest
//! of those at the step's dimensions (`lt_sched::working_set::PATHS`, committed); this test holds the
//! committed table to the trace, and the table's peaks to the measured peaks at dimensions no probe
//! used.
//!
//! `LT_WRITE_WORKING_SETS=1 cargo test -p lt-model --test attention_live_sets` rewrites
//! `crates/lt-sched/src/working_set/table.rs` from the trace (after a change to the layer's code).
//!
//! **Naming.** Each path is probed at dimensions where every term's byte size is distinct and at
//! least [`NAMED_MIN_BYTES`]; an allocation of another size is "fixed" (graph nodes, shape vectors,
//! small weight vectors), and one aligned to 32 bytes or more is matrixmultiply's packing buffer
//! (its CPU-dependent size is bounded by `working_set::gemm_scratch_bytes` instead). Each path is
//! probed at two shapes, three runs each (burn frees in hash-map order, so a few live sets vary);
//! the table keeps the front of their union. A live set both probes hold must leave the same bytes
//! unnamed at both (a size that scales but matches no term would not), and the table must predict
//! the measured peaks at dimensions no probe used, one row and one KV head among them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod counting;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use burn::tensor::{Distribution, Tensor};
use lt_core::ModelConfig;
use lt_model::host::HostModel;
use lt_model::layer::{SeqCtx, layer_backward, layer_forward};
use lt_model::weights::DeviceModel;
use lt_model::{CpuAutodiff, CpuBackend};
use lt_sched::working_set::{Dims, PATHS, Path, Phase, Term, attention_peaks, gemm_scratch_bytes};

#[global_allocator]
static A: counting::Counting = counting::Counting;

/// Smaller allocations are not named (they are counted as fixed bytes).
const NAMED_MIN_BYTES: usize = 512;
/// Allocations aligned to this or more are matrixmultiply's packing buffers.
const GEMM_ALIGN: usize = 32;
const F32: f64 = 4.0;

/// A live set: tensors per term, and unnamed bytes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Set {
    terms: BTreeMap<Term, u32>,
    fixed: u64,
    /// A GEMM packing buffer is live.
    scratch: bool,
}

impl Set {
    fn covered_by(&self, o: &Set) -> bool {
        self.fixed <= o.fixed
            && (o.scratch || !self.scratch)
            && self.terms.iter().all(|(t, c)| o.terms.get(t).is_some_and(|oc| c <= oc))
    }
}

/// The sets no other set covers (one of equal ones).
fn front(mut sets: Vec<Set>) -> Vec<Set> {
    sets.sort();
    sets.dedup();
    let keep: Vec<bool> =
        (0..sets.len()).map(|i| !(0..sets.len()).any(|j| j != i && sets[i].covered_by(&sets[j]))).collect();
    sets.into_iter().zip(keep).filter(|(_, k)| *k).map(|(s, _)| s).collect()
}

fn qwen(family: &str, h: usize, i: usize, nh: usize, kv: usize, hd: usize) -> (ModelConfig, usize) {
    let j = serde_json::json!({
        "model_type": family, "vocab_size": 64, "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": 1, "num_attention_heads": nh, "num_key_value_heads": kv, "head_dim": hd,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": true});
    (ModelConfig::from_json_str(&j.to_string()).unwrap(), 0)
}

/// A Qwen3.5 hybrid whose layer 1 is its (gated, partially rotary) full-attention layer.
fn qwen35(h: usize, i: usize, nh: usize, kv: usize, hd: usize) -> (ModelConfig, usize) {
    let j = serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": 2, "num_attention_heads": nh, "num_key_value_heads": kv, "head_dim": hd,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": false,
        "layer_types": ["linear_attention", "full_attention"], "attn_output_gate": true,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25});
    (ModelConfig::from_json_str(&j.to_string()).unwrap(), 1)
}

/// A model family's attention layer at the given dims.
type Make = fn(usize, usize, usize, usize, usize) -> (ModelConfig, usize);

fn make_qwen2(h: usize, i: usize, nh: usize, kv: usize, hd: usize) -> (ModelConfig, usize) {
    qwen("qwen2", h, i, nh, kv, hd)
}
fn make_qwen3(h: usize, i: usize, nh: usize, kv: usize, hd: usize) -> (ModelConfig, usize) {
    qwen("qwen3", h, i, nh, kv, hd)
}

/// The probed paths: a family, and whether K/V heads are repeated. Qwen3.5's head dim must be a
/// multiple of 8 (a quarter of it rotated, an even number).
fn paths() -> Vec<(&'static str, Make, bool)> {
    vec![
        ("qwen2 gqa", make_qwen2, true),
        ("qwen2 mha", make_qwen2, false),
        ("qwen3 gqa", make_qwen3, true),
        ("qwen3 mha", make_qwen3, false),
        ("qwen3.5 gated gqa", qwen35, true),
        ("qwen3.5 gated mha", qwen35, false),
    ]
}

/// A probe: `(label, b, t, h, i, nh, kv, hd)`.
type Probe = (&'static str, usize, usize, usize, usize, usize, usize, usize);

/// Probe shapes of one path. The dimensions keep every term's size distinct (checked by [`names`]):
/// at least three rows, K/V repeats of 4 and 5 (with 2 the half queries are as large as the
/// keys), Qwen3.5 head dims of 24 and 32 (a quarter rotated: with 16, the half rotated queries are
/// as large as the 8-byte per-head indices). Qwen2 derives its head dim, so its hidden size is
/// `nh x hd`.
fn probes(family: &str, repeat: bool) -> Vec<Probe> {
    // Rows, heads, KV heads, head dim, hidden; per generic probe.
    let [(b_a, nh_a, kv_a, hd_a, h_a), (b_b, nh_b, kv_b, hd_b, h_b)] = match family {
        "qwen2" => [(3, 8, 2, 10, 80), (4, 10, 2, 14, 140)],
        "qwen3" => [(3, 8, 2, 10, 56), (4, 10, 2, 14, 60)],
        // With four rows and a quarter of the head rotated, `b nh rd` would be `nh hd`.
        _ => [(3, 10, 2, 24, 50), (5, 14, 2, 32, 84)],
    };
    let (kv_a, kv_b) = if repeat { (kv_a, kv_b) } else { (nh_a, nh_b) };
    vec![("generic a", b_a, 43, h_a, 116, nh_a, kv_a, hd_a), ("generic b", b_b, 38, h_b, 124, nh_b, kv_b, hd_b)]
}

/// The byte size of each term that occurs on `path` at `d`, checked distinct and large enough to
/// name. Where the head dim is derived (`q_is_hidden`: qwen2), queries are as wide as the hidden
/// state at every size, and are named so.
fn names(path: &Path, d: &Dims, what: &str, q_is_hidden: bool) -> HashMap<usize, Term> {
    let mut m = HashMap::new();
    for t in Term::ALL.into_iter().filter(|t| t.occurs_on(path)) {
        if q_is_hidden && matches!(t, Term::TokQ | Term::RowQ) {
            continue;
        }
        let bytes = (t.elems(d) * t.elem_bytes(F32)) as usize;
        assert!(bytes >= NAMED_MIN_BYTES, "{what}: {t:?} is {bytes} B, too small to name");
        if let Some(o) = m.insert(bytes, t) {
            panic!("{what}: {t:?} and {o:?} are both {bytes} B");
        }
    }
    m
}

/// The front of the live sets of `events`, above what was live before.
fn live_front(events: &[counting::Event], names: &HashMap<usize, Term>) -> Vec<Set> {
    #[derive(Clone, Copy)]
    enum Kind {
        Named(Term),
        Fixed(u64),
        Scratch,
    }
    let mut live: HashMap<usize, Kind> = HashMap::new();
    let mut cur = Set { terms: BTreeMap::new(), fixed: 0, scratch: false };
    let mut scratch = 0usize;
    let mut sets = Vec::new();
    for (k, e) in events.iter().enumerate() {
        if e.size > 0 {
            let size = e.size as usize;
            let kind = if e.align >= GEMM_ALIGN {
                Kind::Scratch
            } else {
                match names.get(&size) {
                    Some(&t) if size >= NAMED_MIN_BYTES => Kind::Named(t),
                    _ => Kind::Fixed(size as u64),
                }
            };
            match kind {
                Kind::Named(t) => *cur.terms.entry(t).or_insert(0) += 1,
                Kind::Fixed(b) => cur.fixed += b,
                Kind::Scratch => scratch += 1,
            }
            cur.scratch = scratch > 0;
            live.insert(e.ptr, kind);
            // A local maximum: the next event frees, or this is the last.
            if events.get(k + 1).is_none_or(|n| n.size < 0) {
                sets.push(cur.clone());
            }
        } else if let Some(kind) = live.remove(&e.ptr) {
            match kind {
                Kind::Named(t) => {
                    let c = cur.terms.get_mut(&t).unwrap();
                    *c -= 1;
                    if *c == 0 {
                        cur.terms.remove(&t);
                    }
                }
                Kind::Fixed(b) => cur.fixed -= b,
                Kind::Scratch => scratch -= 1,
            }
            cur.scratch = scratch > 0;
        }
    }
    front(sets)
}

struct Traced {
    backward: Vec<Set>,
    forward: Vec<Set>,
    /// Measured peaks (bytes above the inputs) of the backward and the forward.
    peaks: (f64, f64),
}

/// Trace layer `layer` of `cfg` at `[b, t]`: after a warm-up call, one `layer_backward` and one
/// `layer_forward`. The caller holds [`counting::SERIAL`] for the whole test: the counters see every
/// thread's allocations, another test's included.
fn trace(cfg: &ModelConfig, layer: usize, b: usize, t: usize, names: &HashMap<usize, Term>) -> Traced {
    let device = Default::default();
    let host = HostModel::random_init(cfg.clone(), 3);
    let model = DeviceModel::<CpuBackend>::from_host(&host, &device);
    let w = &model.layers[layer];
    let x = Tensor::<CpuBackend, 3>::random([b, t, cfg.hidden_size], Distribution::Normal(0.0, 1.0), &device);
    let dy = Tensor::<CpuBackend, 3>::random([b, t, cfg.hidden_size], Distribution::Normal(0.0, 1.0), &device);
    let ctx = SeqCtx::<CpuBackend>::causal(cfg, b, t, &device);
    let ctx_ad = SeqCtx::<CpuAutodiff>::lift(&ctx);
    drop(layer_backward::<CpuAutodiff>(cfg, layer, w, x.clone(), dy.clone(), &ctx_ad));
    drop(layer_forward(cfg, w, x.clone(), &ctx));
    let base = counting::start();
    let (g, bwd_events) = counting::record(|| layer_backward::<CpuAutodiff>(cfg, layer, w, x.clone(), dy, &ctx_ad));
    let bwd_peak = counting::peak_above(base) as f64;
    drop(g);
    let base = counting::start();
    let (y, fwd_events) = counting::record(|| layer_forward(cfg, w, x, &ctx));
    let fwd_peak = counting::peak_above(base) as f64;
    drop(y);
    Traced {
        backward: live_front(&bwd_events, names),
        forward: live_front(&fwd_events, names),
        peaks: (bwd_peak, fwd_peak),
    }
}

/// How often each generic probe is traced: burn's autodiff may free a step's tensors in another
/// order from one run to the next (hash-map order), which changes a few live sets; the table keeps
/// them all.
const RUNS: usize = 3;

/// One traced path: its label, path, fronts, and per generic probe its config, layer, dimensions
/// and the fronts of that probe alone.
struct TracedPath {
    label: &'static str,
    path: Path,
    backward: Vec<Set>,
    forward: Vec<Set>,
    probes: Vec<(ModelConfig, usize, Dims, Vec<Set>)>,
}

/// Every path's fronts, from its generic probes.
fn traced_paths() -> Vec<TracedPath> {
    let mut out = Vec::new();
    for (label, make, repeat) in paths() {
        let family = label.split(' ').next().unwrap_or_default();
        let (mut backward, mut forward) = (Vec::new(), Vec::new());
        let mut per_probe = Vec::new();
        let mut path = None;
        for (probe, b, t, h, i, nh, kv, hd) in probes(family, repeat) {
            let (cfg, layer) = make(h, i, nh, kv, hd);
            let p = Path::of(&cfg);
            assert_eq!(p.repeat_kv, repeat, "{label} {probe}");
            if let Some(q) = path {
                assert_eq!(p, q, "{label} {probe}: another path");
            }
            path = Some(p);
            let d = Dims::of(&cfg, b as f64, t as f64);
            let names = names(&p, &d, &format!("{label} {probe}"), family == "qwen2");
            let mut mine = Vec::new();
            for _ in 0..RUNS {
                let tr = trace(&cfg, layer, b, t, &names);
                mine.extend(tr.backward.iter().cloned());
                backward.extend(tr.backward);
                forward.extend(tr.forward);
            }
            per_probe.push((cfg, layer, d, front(mine)));
        }
        // Both generic probes leave the same bytes unnamed in the live sets they share: a size that
        // scales with the dimensions but matches no term would differ here.
        let (a, b) = (&per_probe[0].3, &per_probe[1].3);
        for sa in a {
            if let Some(fb) = b.iter().filter(|sb| sb.terms == sa.terms).map(|sb| sb.fixed).max() {
                assert!(
                    sa.fixed.abs_diff(fb) <= FIXED_SLACK,
                    "{label}: {:?} leaves {} B unnamed at one generic probe, {fb} B at the other",
                    sa.terms,
                    sa.fixed
                );
            }
        }
        out.push(TracedPath {
            label,
            path: path.unwrap(),
            backward: front(backward),
            forward: front(forward),
            probes: per_probe,
        });
    }
    out
}

fn render(paths: &[TracedPath]) -> String {
    let mut s = String::new();
    s.push_str(
        "//! Generated by `LT_WRITE_WORKING_SETS=1 cargo test -p lt-model --test attention_live_sets`:\n\
         //! do not edit. The live sets of each probed attention-layer path (see the module docs).\n\
         use super::Term::*;\nuse super::{Path, PathSets, Phase};\n\n\
         /// The probed paths' live sets (see the module docs).\n\
         #[rustfmt::skip]\npub static PATHS: &[PathSets] = &[\n",
    );
    let phases = |s: &mut String, sets: &[Set]| {
        for set in sets {
            let terms: Vec<String> = set.terms.iter().map(|(t, c)| format!("({t:?}, {c})")).collect();
            writeln!(
                s,
                "        Phase {{ terms: &[{}], fixed: {}, scratch: {} }},",
                terms.join(", "),
                set.fixed,
                set.scratch
            )
            .unwrap();
        }
    };
    for TracedPath { label, path: p, backward: bwd, forward: fwd, .. } in paths {
        writeln!(s, "    // {label}").unwrap();
        writeln!(
            s,
            "    PathSets {{\n        path: Path {{ qkv_bias: {}, o_bias: {}, qk_norm: {}, gate: {}, zero_centered: {}, \
             partial_rotary: {}, repeat_kv: {} }},",
            p.qkv_bias, p.o_bias, p.qk_norm, p.gate, p.zero_centered, p.partial_rotary, p.repeat_kv
        )
        .unwrap();
        s.push_str("        backward: &[\n");
        phases(&mut s, bwd);
        s.push_str("        ],\n        forward: &[\n");
        phases(&mut s, fwd);
        s.push_str("        ],\n    },\n");
    }
    s.push_str("];\n");
    s
}

/// Fixed bytes may differ this much from the committed table (allocator and platform details).
const FIXED_SLACK: u64 = 16384;

/// Bytes of a traced live set at its probe's dimensions, as [`Phase::bytes`] counts a committed one.
fn set_bytes(set: &Set, d: &Dims, grads: f64, scratch: f64) -> f64 {
    let terms: Vec<(Term, u32)> = set.terms.iter().map(|(t, c)| (*t, *c)).collect();
    Phase { terms: &terms, fixed: set.fixed as u32, scratch: set.scratch }.bytes(d, F32, grads, true, scratch)
}

#[test]
fn the_committed_live_sets_are_the_traced_ones() {
    let _g = counting::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let traced = traced_paths();
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../lt-sched/src/working_set/table.rs");
    if std::env::var_os("LT_WRITE_WORKING_SETS").is_some() {
        std::fs::write(&file, render(&traced)).unwrap();
        return;
    }
    // At each probe, the committed table's backward peak is the traced one's, up to the unnamed
    // bytes' slack (graph bookkeeping varies by a few hundred bytes from run to run): a stale
    // table differs here.
    for tp in &traced {
        assert!(
            PATHS.iter().any(|p| p.path == tp.path),
            "{}: not in the committed table; rerun with LT_WRITE_WORKING_SETS=1",
            tp.label
        );
        for (cfg, layer, d, sets) in &tp.probes {
            let grads = cfg.layer_numel(*layer) as f64 * F32;
            let scratch = gemm_scratch_bytes(cfg, d, F32, true);
            let traced = sets.iter().map(|s| set_bytes(s, d, grads, scratch)).fold(0.0, f64::max);
            let (committed, _) = attention_peaks(cfg, d, F32, grads, true);
            assert!(
                (traced - committed).abs() <= FIXED_SLACK as f64,
                "{}: traced peak {traced} B, committed table's {committed} B; rerun with LT_WRITE_WORKING_SETS=1",
                tp.label
            );
        }
    }
}

#[test]
fn the_table_predicts_measured_layer_peaks() {
    let _g = counting::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Dimensions no probe used, one row and one KV head among them; head dims multiples of 8 for
    // Qwen3.5.
    let shapes =
        [(2, 61, 40, 100, 4, 2, 8), (4, 33, 64, 136, 8, 4, 16), (1, 97, 40, 88, 2, 1, 24), (3, 45, 48, 208, 4, 4, 16)];
    let mut worst = (f64::INFINITY, 0.0f64);
    let mut failures = Vec::new();
    for (label, make, _) in paths() {
        for &(b, t, h, i, nh, kv, hd) in &shapes {
            let (cfg, layer) = make(h, i, nh, kv, hd);
            if PATHS.iter().all(|p| p.path != Path::of(&cfg)) {
                continue; // (an MHA shape on a GQA path and the other way round)
            }
            let d = Dims::of(&cfg, b as f64, t as f64);
            let grads = cfg.layer_numel(layer) as f64 * F32;
            let (bwd, fwd) = attention_peaks(&cfg, &d, F32, grads, true);
            let tr = trace(&cfg, layer, b, t, &HashMap::new());
            // The measurement includes the gradients produced so far; the prediction counts the
            // layer's whole gradient from the start of its backward (lt-sched's static gradient
            // buffer), which is most of its excess at the peak (the graph complete, one MLP weight's
            // gradient made).
            let rb = (bwd + grads) / tr.peaks.0;
            let rf = fwd / tr.peaks.1;
            let scratch = gemm_scratch_bytes(&cfg, &d, F32, true);
            eprintln!(
                "{label} {b}x{t} h{h} i{i} {nh}x{hd} kv{kv}: backward measured {:.0} predicted {:.0} ({rb:.3}x), \
                 forward measured {:.0} predicted {:.0} ({rf:.3}x), GEMM scratch bound {scratch:.0}",
                tr.peaks.0,
                bwd + grads,
                tr.peaks.1,
                fwd
            );
            worst = (worst.0.min(rb.min(rf)), worst.1.max(rb.max(rf)));
            if !(1.0..=1.2).contains(&rb) || !(1.0..=1.1).contains(&rf) {
                failures.push(format!("{label} {b}x{t} h{h}: backward {rb:.3}x, forward {rf:.3}x"));
            }
        }
    }
    eprintln!("predicted / measured, layer peaks: {:.3}x .. {:.3}x", worst.0, worst.1);
    assert!(failures.is_empty(), "outside 1.0x..1.2x (backward) or 1.0x..1.1x (forward): {failures:#?}");
}
