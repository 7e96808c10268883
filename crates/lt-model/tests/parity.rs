//! Parity with Hugging Face transformers on the committed tiny checkpoints
//! (tools/fixtures/gen_models.py; every family, tied/untied, GQA/MQA, head_dim != hidden/heads,
//! hybrid layer types, non-trivial norms).
//!
//! Tolerances: logits max-abs <= 1e-4 and loss rel <= 1e-5 (f32 both sides; the only differences are
//! summation orders), weight gradients rel <= 1e-3 measured against the largest entry of each
//! expected tensor (so near-zero entries do not dominate).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use lt_model::host::HostModel;
use lt_model::layer::{SeqCtx, layer_backward, layer_forward};
use lt_model::model::{
    causal_lm_loss, embed, forward_logits, forward_logits_ctx, full_graph_grads, head_logits, to_vec,
};
use lt_model::weights::DeviceModel;
use lt_model::{CpuAutodiff, CpuBackend, DeltaForm};
use lt_storage::safetensors_io::SafetensorsModel;

mod fixture;
use fixture::{FIXTURES, batch, dir as fixture, max_abs_diff, rel_to_max};

#[test]
fn logits_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let host = HostModel::load(&dir).unwrap();
        let exp = SafetensorsModel::open(&dir.join("expected.safetensors")).unwrap();
        let b = batch(&dir);
        let model = DeviceModel::<CpuBackend>::from_host(&host, &Default::default());
        let logits = to_vec(forward_logits(&model, &b.input_ids));
        let d = max_abs_diff(&logits, &exp.read_f32("logits").unwrap());
        eprintln!("{name}: logits max-abs diff {d:e}");
        assert!(d <= 1e-4, "{name}: logits max-abs diff {d}");
    }
}

#[test]
fn loss_and_every_gradient_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let host = HostModel::load(&dir).unwrap();
        let exp = SafetensorsModel::open(&dir.join("expected.safetensors")).unwrap();
        let b = batch(&dir);
        let model = DeviceModel::<CpuBackend>::from_host(&host, &Default::default());
        let (loss, grads) = full_graph_grads::<CpuAutodiff>(&model, &b);
        let want = exp.read_f32("loss").unwrap()[0];
        assert!(((loss - want) / want).abs() <= 1e-5, "{name}: loss {loss} vs {want}");
        let expected_grads = exp.names().iter().filter(|n| n.starts_with("grad.")).count();
        assert_eq!(grads.len(), expected_grads, "{name}: every parameter has a gradient");
        let mut worst = 0f32;
        for (rel, g) in &grads {
            let full =
                if rel.starts_with("layers.") { host.layer_param_name_full(rel) } else { host.outer_param_name(rel) };
            let want = exp.read_f32(&format!("grad.{full}")).unwrap();
            let r = rel_to_max(g, &want);
            worst = worst.max(r);
            assert!(r <= 1e-3, "{name}: grad {full} rel err {r}");
        }
        eprintln!("{name}: loss rel err {:e}, worst grad rel err {worst:e}", ((loss - want) / want).abs());
    }
}

/// Chaining `layer_backward` from the top equals one full-graph backward, for every family.
#[test]
fn per_layer_backward_equals_full_graph() {
    type Inner = CpuBackend;
    for name in FIXTURES {
        let dir = fixture(name);
        let host = HostModel::load(&dir).unwrap();
        let b = batch(&dir);
        let device = Default::default();
        let model = DeviceModel::<Inner>::from_host(&host, &device);
        let cfg = &model.config;
        let (bs, t) = (b.input_ids.len(), b.input_ids[0].len());
        let ctx = SeqCtx::<Inner>::causal(cfg, bs, t, &device);
        // Forward, keeping every boundary (keep-all policy).
        let mut xs = vec![embed(&model.head, &b.input_ids)];
        for w in &model.layers {
            let next = layer_forward(cfg, w, xs.last().unwrap().clone(), &ctx);
            xs.push(next);
        }
        // Head backward: d loss / d x_L.
        let xl: Tensor<CpuAutodiff, 3> = Tensor::from_inner(xs.last().unwrap().clone()).require_grad();
        let head_ad = model.head.clone().map(&mut LiftNoGrad);
        let loss = causal_lm_loss(head_logits(cfg, &head_ad, xl.clone()), &b.labels);
        let g = loss.backward();
        let mut grad = xl.grad(&g).unwrap();
        let ctx_ad = SeqCtx::<Autodiff<Inner>>::causal(cfg, bs, t, &device);
        let (_, reference) = full_graph_grads::<CpuAutodiff>(&model, &b);
        for i in (0..cfg.num_layers()).rev() {
            let lg = layer_backward::<CpuAutodiff>(cfg, i, &model.layers[i], xs[i].clone(), grad, &ctx_ad);
            assert_eq!(lg.params.len(), cfg.layer_params(i).len());
            for (pname, pg) in lg.params {
                let key = format!("layers.{i}.{pname}");
                let want = &reference.iter().find(|(n, _)| *n == key).unwrap().1;
                let r = rel_to_max(&to_vec(pg), want);
                assert!(r <= 1e-5, "{name}: {key} streamed vs full-graph rel err {r}");
            }
            grad = lg.input;
        }
    }
}

struct LiftNoGrad;
impl lt_model::weights::ParamMapper<CpuBackend, CpuAutodiff> for LiftNoGrad {
    fn map<const D: usize>(&mut self, _: &'static str, t: Tensor<CpuBackend, D>) -> Tensor<CpuAutodiff, D> {
        Tensor::from_inner(t)
    }
}

/// The chunked gated delta rule at length: `qwen35-long` is one row of 700 tokens (ten full chunks
/// of 64 and a partial one) with real linear-attention head sizes (128) and a slowly decaying head,
/// so chunk-crossing state carries real weight. Same tolerances as the short fixtures, and the
/// recurrent form must agree with the chunked one to the same 1e-4 on logits: three f32
/// implementations of one function that differ only in summation order (measured: 5e-6 against
/// transformers, 6e-6 between the forms, on logits up to 3.9).
#[test]
fn long_hybrid_matches_transformers() {
    let dir = fixture("qwen35-long");
    let host = HostModel::load(&dir).unwrap();
    let exp = SafetensorsModel::open(&dir.join("expected.safetensors")).unwrap();
    let b = batch(&dir);
    assert_eq!(b.input_ids[0].len(), 700);
    let model = DeviceModel::<CpuBackend>::from_host(&host, &Default::default());
    let logits = to_vec(forward_logits(&model, &b.input_ids));
    let d = max_abs_diff(&logits, &exp.read_f32("logits").unwrap());
    eprintln!("qwen35-long: logits max-abs diff {d:e}");
    assert!(d <= 1e-4, "qwen35-long: logits max-abs diff {d}");

    let cfg = &model.config;
    let ctx = SeqCtx::causal(cfg, 1, 700, &Default::default()).with_delta_form(DeltaForm::Recurrent);
    let recurrent = to_vec(forward_logits_ctx(&model, &b.input_ids, &ctx));
    let dr = max_abs_diff(&logits, &recurrent);
    eprintln!("qwen35-long: chunked vs recurrent logits max-abs diff {dr:e}");
    assert!(dr <= 1e-4, "qwen35-long: chunked vs recurrent logits max-abs diff {dr}");

    let (loss, grads) = full_graph_grads::<CpuAutodiff>(&model, &b);
    let want = exp.read_f32("loss").unwrap()[0];
    assert!(((loss - want) / want).abs() <= 1e-5, "qwen35-long: loss {loss} vs {want}");
    let expected_grads = exp.names().iter().filter(|n| n.starts_with("grad.")).count();
    assert_eq!(grads.len(), expected_grads, "qwen35-long: every parameter has a gradient");
    let mut worst = 0f32;
    for (rel, g) in &grads {
        let full =
            if rel.starts_with("layers.") { host.layer_param_name_full(rel) } else { host.outer_param_name(rel) };
        let r = rel_to_max(g, &exp.read_f32(&format!("grad.{full}")).unwrap());
        worst = worst.max(r);
        assert!(r <= 1e-3, "qwen35-long: grad {full} rel err {r}");
    }
    eprintln!("qwen35-long: loss rel err {:e}, worst grad rel err {worst:e}", ((loss - want) / want).abs());
}
