//! Timing one decoder layer on a backend: what `lt profile` fits the cost model to and what
//! `lt bench layer` reports.

use std::time::Instant;

use anyhow::{Context, Result};
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{Distribution, Tensor};
use lt_core::ModelConfig;
use lt_model::DeltaForm;
use lt_model::host::HostModel;
use lt_model::layer::{SeqCtx, layer_backward, layer_forward};
use lt_model::weights::LayerWeights;

/// Wait for the device to finish everything queued.
pub fn sync<B: Backend>(device: &B::Device) -> Result<()> {
    B::sync(device).map_err(|e| anyhow::anyhow!("device synchronisation failed: {e:?}"))
}

/// The smallest of `times`.
pub fn best(times: &[f64]) -> f64 {
    times.iter().copied().fold(f64::INFINITY, f64::min)
}

/// Measured times of one layer, seconds.
#[derive(Debug, Clone)]
pub struct LayerTimes {
    /// Forward alone, every timed round.
    pub fwd: Vec<f64>,
    /// The trainer's backward op (graph-recording forward plus backward), every timed round.
    pub bwd: Vec<f64>,
}

/// Forward and per-layer backward (`layer_backward`, as the trainer runs it) of layer `layer` of
/// `cfg` over `[batch, seq]` tokens with random weights (seed 7) and inputs, after `warmup` untimed
/// rounds (the first compiles kernels: NVRTC, autotune, shader compilation), `rounds` timed ones.
/// Only that layer's weights are built (a copy of `cfg` with just it and a 256-token vocabulary).
///
/// # Errors
/// When the layer does not exist or the device fails to synchronise.
#[allow(clippy::too_many_arguments)]
pub fn layer_times<B: AutodiffBackend>(
    cfg: &ModelConfig,
    layer: usize,
    batch: usize,
    seq: usize,
    form: DeltaForm,
    warmup: usize,
    rounds: usize,
    device: &<B::InnerBackend as BackendTypes>::Device,
) -> Result<LayerTimes> {
    let kind = *cfg.layer_types.get(layer).with_context(|| format!("the model has no layer {layer}"))?;
    let mut one = cfg.clone();
    one.layer_types = vec![kind];
    one.vocab_size = one.vocab_size.min(256);
    let host = HostModel::random_init(one.clone(), 7);
    let w = LayerWeights::<B::InnerBackend>::from_host(&host.layers[0], kind, device);
    drop(host);
    let ctx = SeqCtx::<B::InnerBackend>::causal(&one, batch, seq, device).with_delta_form(form);
    let ctx_ad = SeqCtx::<B>::lift(&ctx);
    let x: Tensor<B::InnerBackend, 3> =
        Tensor::random([batch, seq, one.hidden_size], Distribution::Normal(0.0, 1.0), device);
    let g: Tensor<B::InnerBackend, 3> =
        Tensor::random([batch, seq, one.hidden_size], Distribution::Normal(0.0, 1e-3), device);
    let mut out = LayerTimes { fwd: Vec::new(), bwd: Vec::new() };
    for round in 0..warmup + rounds.max(1) {
        let t = Instant::now();
        let y = layer_forward(&one, &w, x.clone(), &ctx);
        sync::<B::InnerBackend>(device)?;
        let tf = t.elapsed().as_secs_f64();
        drop(y);
        let t = Instant::now();
        let lg = layer_backward::<B>(&one, 0, &w, x.clone(), g.clone(), &ctx_ad);
        sync::<B::InnerBackend>(device)?;
        let tb = t.elapsed().as_secs_f64();
        drop(lg);
        // Where no terminal shows a bar: every round, so that the warm-up's kernel compilation and
        // autotuning on a fresh GPU are visible next to the rounds that follow.
        if crate::progress::as_lines() {
            let phase = if round < warmup { "warm-up" } else { "timed" };
            eprintln!("  layer {kind:?}, round {} ({phase}): forward {:.3} s, backward {:.3} s", round + 1, tf, tb);
        }
        if round >= warmup {
            out.fwd.push(tf);
            out.bwd.push(tb);
        }
    }
    Ok(out)
}
