//! What one linear-attention (Gated DeltaNet) decoder layer really allocates on ndarray, measured
//! with a counting global allocator: the peak of its graph-recording forward plus backward
//! (`layer_backward`) and of a plain forward (`layer_forward`, as forward and recompute run it),
//! above the inputs that exist before the call. lt-sched's cost model counts these as each layer's
//! `bwd_workspace_bytes` and `fwd_workspace_bytes`; for linear-attention layers they are fitted
//! formulas, which this test pins to the measurement at several shapes: the backward (the op that
//! sets the peak) within 0.97x..1.25x, the forward within 1x..1.8x (loose: a forward sets the peak
//! only far from the top of a segment). Full-attention layers are not fitted but traced
//! (`tests/attention_live_sets.rs`). The bound that matters, the whole step's
//! predicted peak against its measured one, is lt-exec's `tests/memory_truth.rs`. `LAYER_MEMORY_CSV=1` prints one row per
//! measurement (config dims, shape, measured bytes) for refitting the coefficients in lt-sched's
//! `cost::layer_shape`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod counting;

use burn::tensor::{Distribution, Tensor};
use lt_core::ModelConfig;
use lt_core::hardware::BuiltinProfile;
use lt_model::host::HostModel;
use lt_model::layer::{SeqCtx, layer_backward, layer_forward};
use lt_model::weights::DeviceModel;
use lt_model::{CpuAutodiff, CpuBackend};
use lt_sched::cost::{AttentionKernel, CostOptions, ExecConfig, Instance};
use lt_sched::plan::OptimizerOverlap;

#[global_allocator]
static A: counting::Counting = counting::Counting;

fn hybrid(extra: serde_json::Value) -> ModelConfig {
    let mut j = serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": false,
        "layer_types": ["linear_attention", "full_attention"], "attn_output_gate": true,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25});
    for (k, v) in extra.as_object().unwrap() {
        j[k] = v.clone();
    }
    ModelConfig::from_json_str(&j.to_string()).unwrap()
}

/// Peak bytes above the live inputs of layer `i`'s backward and of its plain forward, `[b, t]`.
fn measure(cfg: &ModelConfig, i: usize, b: usize, t: usize) -> (f64, f64) {
    let _g = counting::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let device = Default::default();
    let host = HostModel::random_init(cfg.clone(), 3);
    let model = DeviceModel::<CpuBackend>::from_host(&host, &device);
    let w = &model.layers[i];
    let h = cfg.hidden_size;
    let x = Tensor::<CpuBackend, 3>::random([b, t, h], Distribution::Normal(0.0, 1.0), &device);
    let dy = Tensor::<CpuBackend, 3>::random([b, t, h], Distribution::Normal(0.0, 1.0), &device);
    let ctx = SeqCtx::<CpuBackend>::causal(cfg, b, t, &device);
    let ctx_ad = SeqCtx::<CpuAutodiff>::lift(&ctx);
    let base = counting::start();
    let g = layer_backward::<CpuAutodiff>(cfg, i, w, x.clone(), dy, &ctx_ad);
    let bwd = counting::peak_above(base);
    drop(g);
    let base = counting::start();
    let y = layer_forward(cfg, w, x, &ctx);
    let fwd = counting::peak_above(base);
    drop(y);
    (bwd as f64, fwd as f64)
}

/// The counted working sets of layer `i` at `[b, t]` in f32 (the CPU profile), as the measurement
/// sees them: the backward's with the weight gradients it returns (lt-sched counts those in its static
/// gradient buffers) and without the incoming gradient (allocated before the call), the forward's
/// without the boundary a recompute carries.
fn counted(cfg: &ModelConfig, i: usize, b: usize, t: usize) -> (f64, f64) {
    let hw = BuiltinProfile::Cpu.profile();
    let shape = ExecConfig {
        micro_batch_size: b,
        grad_accum_steps: 1,
        loss_chunk_tokens: 1024,
        optimizer_overlap: OptimizerOverlap::Serial,
        retain_all_logits: false,
    };
    let opts = CostOptions { attention: AttentionKernel::Materialized, ..CostOptions::default() };
    let inst = Instance::from_model(cfg, &hw, t, &shape, opts).unwrap();
    let l = &inst.layers[i];
    (l.bwd_workspace_bytes - inst.boundary_bytes + l.grad_bytes, l.fwd_workspace_bytes - inst.boundary_bytes)
}

#[test]
fn linear_attention_working_sets_match_the_counted_formula() {
    let cases = [
        ("qwen3.5 linear", hybrid(serde_json::json!({})), 0),
        ("qwen3.5 linear dk32", hybrid(serde_json::json!({"linear_key_head_dim": 32, "linear_value_head_dim": 32})), 0),
        (
            "qwen3.5 linear 8 v-heads",
            hybrid(serde_json::json!({"linear_num_value_heads": 8, "linear_num_key_heads": 4})),
            0,
        ),
        ("qwen3.5 linear h128", hybrid(serde_json::json!({"hidden_size": 128, "intermediate_size": 256})), 0),
    ];
    let mut worst = (0.0f64, 0.0f64);
    let mut below = Vec::new();
    for (name, cfg, layer) in &cases {
        for (b, t) in [(2, 40), (1, 64), (2, 96), (4, 128), (1, 256), (8, 32), (2, 200)] {
            let (mb, mf) = measure(cfg, *layer, b, t);
            let (cb, cf) = counted(cfg, *layer, b, t);
            if std::env::var_os("LAYER_MEMORY_CSV").is_some() {
                println!(
                    "CSV,{name},{b},{t},{},{},{},{},{},{},{},{mb},{mf},{},{},{}",
                    cfg.hidden_size,
                    cfg.intermediate_size,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    cfg.head_dim,
                    cfg.layer_numel(*layer),
                    u8::from(cfg.attn_output_gate),
                    cfg.linear.map_or(0, |l| l.conv_dim()),
                    cfg.linear.map_or(0, |l| l.value_dim()),
                    cfg.linear.map_or(0.0, |l| l.chunked_rule_saved_elems(b, t)),
                );
            }
            eprintln!(
                "{name} {b}x{t}: backward measured {mb:.0} counted {cb:.0} ({:.3}x); forward measured {mf:.0} counted {cf:.0} ({:.3}x)",
                cb / mb,
                cf / mf
            );
            if cb < 0.97 * mb || cf < mf {
                below.push(format!("{name} {b}x{t}: backward {:.3}x, forward {:.3}x", cb / mb, cf / mf));
            }
            worst = (worst.0.max(cb / mb), worst.1.max(cf / mf));
        }
    }
    assert!(below.is_empty(), "counted below the bounds: {below:#?}");
    eprintln!("largest counted/measured: backward {:.3}x, forward {:.3}x", worst.0, worst.1);
    assert!(worst.0 <= 1.25, "backward counted {:.3}x the measurement", worst.0);
    assert!(worst.1 <= 1.8, "forward counted {:.3}x the measurement", worst.1);
}
