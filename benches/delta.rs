//! One Qwen3.5-style Gated DeltaNet (linear-attention) layer on the CPU backend, forward and
//! forward + backward (`layer_backward`: the autodiff re-run plus the backward, what the trainer
//! does per layer), with the gated delta rule in chunked form against the same layer in recurrent
//! form and against a full-attention layer of the same hidden size, all measured in this run.
//!
//! Run: `RAYON_NUM_THREADS=2 cargo bench -p benches --bench delta`
//! (`LT_DELTA_BENCH_BATCH` rows, default 2; `LT_DELTA_BENCH_SEQ` tokens, default 1024;
//! `LT_DELTA_BENCH_REPEATS` timed repeats, default 3; ndarray's threads are rayon's, so
//! `RAYON_NUM_THREADS` sets them).
//!
//! Shapes: hidden 256, MLP 768; linear attention 2 key heads and 4 value heads of dim 64, conv
//! kernel 4; full attention 4 query heads and 2 KV heads of dim 64, gated, partial rotary 0.25
//! (Qwen3.5's layer types at a small hidden size). It also prints the chunked layer, and the
//! chunked delta rule alone, at twice the length: linear cost in `T` shows as a ratio near 2.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Instant;

use benches::env_usize;
use burn::tensor::{Distribution, Tensor};
use lt_core::{LayerKind, ModelConfig};
use lt_model::delta::DeltaForm;
use lt_model::host::HostModel;
use lt_model::layer::{SeqCtx, layer_backward, layer_forward};
use lt_model::weights::LayerWeights;
use lt_model::{CpuAutodiff, CpuBackend};

const CONFIG: &str = r#"{
  "model_type": "qwen3_5_text",
  "vocab_size": 256,
  "hidden_size": 256,
  "intermediate_size": 768,
  "num_hidden_layers": 2,
  "layer_types": ["linear_attention", "full_attention"],
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 64,
  "linear_conv_kernel_dim": 4,
  "linear_key_head_dim": 64,
  "linear_value_head_dim": 64,
  "linear_num_key_heads": 2,
  "linear_num_value_heads": 4,
  "rms_norm_eps": 1e-6,
  "max_position_embeddings": 8192,
  "tie_word_embeddings": false,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
}"#;

/// A timed case: a name and the work, which returns something to keep alive until timed.
type Case<'a> = (String, Box<dyn FnMut() -> Box<dyn std::any::Any> + 'a>);

/// Median seconds of each case over `repeats` rounds, after one warm-up round. Rounds interleave
/// the cases, so load from other processes on a shared machine hits every case alike and the
/// ratios stay meaningful. ndarray computes synchronously: a returned tensor is a finished one.
fn interleaved_medians(cases: &mut [Case<'_>], repeats: usize) -> Vec<f64> {
    for (_, f) in cases.iter_mut() {
        black_box(f());
    }
    let mut times = vec![Vec::new(); cases.len()];
    for _ in 0..repeats.max(1) {
        for (i, (_, f)) in cases.iter_mut().enumerate() {
            let s = Instant::now();
            black_box(f());
            times[i].push(s.elapsed().as_secs_f64());
        }
    }
    times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect()
}

/// Forward (`fwd = true`) or forward + backward of layer `i` of `host` over `[b, t]` tokens.
fn layer_case<'a>(host: &'a HostModel, i: usize, b: usize, t: usize, form: DeltaForm, fwd: bool) -> Case<'a> {
    let cfg = &host.config;
    let device = Default::default();
    let w = LayerWeights::<CpuBackend>::from_host(&host.layers[i], cfg.layer_types[i], &device);
    let ctx = SeqCtx::<CpuBackend>::causal(cfg, b, t, &device).with_delta_form(form);
    let ctx_ad = SeqCtx::<CpuAutodiff>::lift(&ctx);
    let x: Tensor<CpuBackend, 3> = Tensor::random([b, t, cfg.hidden_size], Distribution::Normal(0.0, 1.0), &device);
    let g: Tensor<CpuBackend, 3> = Tensor::random([b, t, cfg.hidden_size], Distribution::Normal(0.0, 1e-3), &device);
    let kind = match cfg.layer_types[i] {
        LayerKind::LinearAttention => format!("linear attention, {form:?}").to_lowercase(),
        LayerKind::FullAttention => "full attention".to_string(),
    };
    let name = format!("{kind}, seq {t}, {}", if fwd { "fwd" } else { "fwd+bwd" });
    let f: Box<dyn FnMut() -> Box<dyn std::any::Any>> = if fwd {
        Box::new(move || Box::new(layer_forward(cfg, &w, x.clone(), &ctx)))
    } else {
        Box::new(move || Box::new(layer_backward::<CpuAutodiff>(cfg, i, &w, x.clone(), g.clone(), &ctx_ad)))
    };
    (name, f)
}

/// Forward + backward of the chunked delta rule alone at `[b, h, t, d]`.
fn delta_rule_case(b: usize, h: usize, t: usize, d: usize) -> Case<'static> {
    let device = Default::default();
    let normal = |shape: [usize; 4]| -> Tensor<CpuAutodiff, 4> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), &device).require_grad()
    };
    let (q, k, v) = (normal([b, h, t, d]), normal([b, h, t, d]), normal([b, h, t, d]));
    let g: Tensor<CpuAutodiff, 3> = Tensor::random([b, h, t], Distribution::Uniform(-0.5, 0.0), &device).require_grad();
    let beta: Tensor<CpuAutodiff, 3> =
        Tensor::random([b, h, t], Distribution::Uniform(0.0, 1.0), &device).require_grad();
    let l2 = |x: Tensor<CpuAutodiff, 4>| x.clone() / x.powi_scalar(2).sum_dim(3).sqrt();
    let f = move || -> Box<dyn std::any::Any> {
        let (q, k) = (l2(q.clone()) / (d as f32).sqrt(), l2(k.clone()));
        let (o, s) = DeltaForm::Chunked.run(q, k, v.clone(), g.clone(), beta.clone(), None, None);
        Box::new((o.sum() + s.sum()).backward())
    };
    (format!("chunked delta rule alone [{b}, {h}, {t}, {d}], fwd+bwd"), Box::new(f))
}

fn main() {
    let b = env_usize("LT_DELTA_BENCH_BATCH", 2);
    let t = env_usize("LT_DELTA_BENCH_SEQ", 1024);
    let repeats = env_usize("LT_DELTA_BENCH_REPEATS", 3);
    let cfg = match ModelConfig::from_json_str(CONFIG) {
        Ok(c) => c,
        Err(e) => panic!("the bench config is invalid: {e}"),
    };
    assert_eq!(cfg.layer_types, [LayerKind::LinearAttention, LayerKind::FullAttention]);
    let host = HostModel::random_init(cfg, 7);
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset (all cores)".into());
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    println!(
        "one layer, batch {b}, hidden 256, median of {repeats} interleaved rounds; RAYON_NUM_THREADS {threads}, {cores} cores"
    );
    println!("host: {}", lt_core::HostCpu::detect());

    let (chunked, recurrent) = (DeltaForm::Chunked, DeltaForm::Recurrent);
    let mut cases = vec![
        layer_case(&host, 0, b, t, chunked, true),
        layer_case(&host, 0, b, t, chunked, false),
        layer_case(&host, 0, b, t, recurrent, true),
        layer_case(&host, 0, b, t, recurrent, false),
        layer_case(&host, 1, b, t, chunked, true),
        layer_case(&host, 1, b, t, chunked, false),
        layer_case(&host, 0, b, 2 * t, chunked, true),
        layer_case(&host, 0, b, 2 * t, chunked, false),
        delta_rule_case(b, 4, t, 64),
        delta_rule_case(b, 4, 2 * t, 64),
    ];
    let secs = interleaved_medians(&mut cases, repeats);
    for ((name, _), s) in cases.iter().zip(&secs) {
        println!("  {name:<52} {s:>8.3} s");
    }
    let r = |a: usize, b: usize| secs[a] / secs[b];
    println!("ratios (same run):");
    let line = |label: String, text: String| println!("  {label:<46} {text}");
    line("recurrent / chunked linear-attention layer".into(), format!("fwd {:.2}x, fwd+bwd {:.2}x", r(2, 0), r(3, 1)));
    line("chunked linear / full-attention layer".into(), format!("fwd {:.2}x, fwd+bwd {:.2}x", r(0, 4), r(1, 5)));
    line(format!("chunked layer, seq {} / seq {t}", 2 * t), format!("fwd {:.2}x, fwd+bwd {:.2}x", r(6, 0), r(7, 1)));
    line(format!("chunked delta rule alone, T {} / T {t}", 2 * t), format!("fwd+bwd {:.2}x", r(9, 8)));
}
