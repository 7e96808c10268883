//! What the chunked gated delta rule really allocates under autodiff, measured with a counting
//! global allocator on ndarray (whose tensors all live on the heap): the bytes its graph holds from
//! the end of the forward to the backward, and the peak of forward plus backward. lt-sched's cost
//! model uses `lt_core::config::LinearAttnConfig::chunked_rule_saved_elems` as one term of a
//! linear-attention layer's fitted working set (`layer_memory.rs`); this test pins that formula to
//! the measurement: never below it, at most 1.5x above.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod counting;

use burn::tensor::{Distribution, Tensor};
use lt_model::delta::gated_delta_rule_chunked;
use lt_model::{CpuAutodiff, CpuBackend};

#[global_allocator]
static A: counting::Counting = counting::Counting;

struct Measured {
    held_after_forward: f64,
    peak: f64,
}

fn measure(b: usize, h: usize, t: usize, dk: usize, dv: usize) -> Measured {
    let _g = counting::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let device = Default::default();
    let rnd4 = |s: [usize; 4]| -> Tensor<CpuAutodiff, 4> {
        Tensor::<CpuBackend, 4>::random(s, Distribution::Normal(0.0, 1.0), &device).pipe_ad()
    };
    let l2 = |x: Tensor<CpuAutodiff, 4>| x.clone() / x.powi_scalar(2).sum_dim(3).sqrt();
    let (q, k, v) = (rnd4([b, h, t, dk]), rnd4([b, h, t, dk]), rnd4([b, h, t, dv]));
    let g: Tensor<CpuAutodiff, 3> =
        Tensor::<CpuBackend, 3>::random([b, h, t], Distribution::Uniform(-0.5, 0.0), &device).pipe_ad();
    let beta: Tensor<CpuAutodiff, 3> =
        Tensor::<CpuBackend, 3>::random([b, h, t], Distribution::Uniform(0.0, 1.0), &device).pipe_ad();
    // Normalised inputs as the layer feeds them: part of the layer's saved tensors, not the rule's.
    let (qn, kn) = (l2(q.clone()) / (dk as f32).sqrt(), l2(k.clone()));
    let base = counting::start();
    let (o, s) = gated_delta_rule_chunked(qn, kn, v.clone(), g.clone(), beta.clone(), None, None);
    let held = counting::live() - base;
    let grads = (o.sum() + s.sum()).backward();
    let peak = counting::peak_above(base);
    drop(grads);
    Measured { held_after_forward: held as f64, peak: peak as f64 }
}

trait PipeAd<const D: usize> {
    fn pipe_ad(self) -> Tensor<CpuAutodiff, D>;
}

impl<const D: usize> PipeAd<D> for Tensor<CpuBackend, D> {
    fn pipe_ad(self) -> Tensor<CpuAutodiff, D> {
        Tensor::from_inner(self).require_grad()
    }
}

/// The formula lt-sched and the executor count bounds the measurement from above, within 1.5x, for
/// both what the graph holds after forward and the peak through backward: chunk-multiple and ragged
/// lengths, batch 1 and 2, head dims 32 to 128.
#[test]
fn chunked_rule_allocations_match_the_counted_formula() {
    for (b, h, t, dk, dv) in [(1, 2, 256, 64, 64), (1, 4, 512, 64, 64), (2, 2, 256, 128, 128), (1, 2, 1000, 32, 32)] {
        let m = measure(b, h, t, dk, dv);
        let cfg = lt_core::config::LinearAttnConfig {
            conv_kernel: 4,
            key_head_dim: dk,
            value_head_dim: dv,
            num_key_heads: h,
            num_value_heads: h,
        };
        let held = cfg.chunked_rule_saved_elems(b, t) * 4.0;
        let peak = cfg.chunked_rule_peak_elems(b, t) * 4.0;
        eprintln!(
            "b {b} h {h} t {t} dk {dk} dv {dv}: held after forward {:.0} B (counted {held:.0}, {:.2}x), \
             peak {:.0} B (counted {peak:.0}, {:.2}x)",
            m.held_after_forward,
            held / m.held_after_forward,
            m.peak,
            peak / m.peak
        );
        for (what, counted, real) in [("held", held, m.held_after_forward), ("peak", peak, m.peak)] {
            assert!(counted >= real, "{what}: counted {counted} < measured {real} at {b} {h} {t} {dk} {dv}");
            assert!(counted <= 1.5 * real, "{what}: counted {counted} > 1.5x measured {real} at {b} {h} {t} {dk} {dv}");
        }
    }
}
