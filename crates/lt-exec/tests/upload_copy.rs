//! The optimizer-written bf16 upload copy changes where the uploaded bytes come from, not what they
//! are. On the CPU, with uploads forced to bf16 (what a CUDA device gets), training that reads the
//! copy must be bit-identical to training that converts the fp32 masters at every upload: same
//! losses, same gradient norms, same masters, every step, under several plans, both optimizers,
//! and with gradient accumulation and the overlapped update. After every step the copy equals
//! `bf16::from_f32` of the masters, and no upload ever still holds a copy when its layer is updated.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::DType;
use lt_core::ByteSize;
use lt_exec::executor::Executor;
use lt_exec::plan::{Placement, Step};
use lt_exec::state::{HEAD, SharedModel, layer_slot};
use lt_exec::train::{LrSchedule, TrainOptions, Trainer};
use lt_model::CpuAutodiff;
use lt_model::host::{HostModel, HostTensor};
use lt_model::model::Batch;
use lt_optim::{AdamWConfig, OptimizerKind, bf16};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models").join(name)
}

/// Four one-row micro-batches of 24 tokens (deterministic ids).
fn micro_batches(vocab: usize) -> Vec<Batch> {
    (0..4u32)
        .map(|r| Batch::from_ids(vec![(0..24u32).map(|i| (i * 7 + r * 13 + 1) % vocab as u32).collect()]))
        .collect()
}

fn options(optimizer: OptimizerKind, overlap: bool) -> TrainOptions {
    TrainOptions {
        adamw: AdamWConfig { lr: 2e-3, max_grad_norm: Some(1.0), ..AdamWConfig::default() },
        optimizer,
        warmup_steps: 0,
        schedule: LrSchedule::Constant,
        total_steps: 3,
        overlap_optimizer: overlap,
        threads: 2,
    }
}

/// `(loss, grad_norm)` bits per step, and the final masters.
type Run = (Vec<(u64, u64)>, HostModel);

fn train(host: &HostModel, plan: &Step, opts: &TrainOptions, optimizer_copy: bool) -> Run {
    train_with(host, plan, opts, optimizer_copy, true, &micro_batches(host.config.vocab_size))
}

fn train_with(
    host: &HostModel,
    plan: &Step,
    opts: &TrainOptions,
    optimizer_copy: bool,
    bf16_grads: bool,
    mbs: &[Batch],
) -> Run {
    let ex = Executor::<CpuAutodiff>::new(plan.clone(), ByteSize::gib(1), Default::default(), None)
        .with_upload_dtype(DType::BF16)
        .with_optimizer_copy(optimizer_copy)
        .with_bf16_gradients(bf16_grads);
    assert_eq!(ex.wants_upload_copies(), optimizer_copy);
    assert_eq!(ex.lands_bf16_gradients(), bf16_grads);
    let model = Arc::new(SharedModel::new(host.clone(), 0));
    let mut tr = Trainer::new(Arc::clone(&model), ex, opts.clone(), None, 0).unwrap();
    assert_eq!(model.has_upload_copies(), optimizer_copy);
    let mut steps = Vec::new();
    for _ in 0..opts.total_steps {
        let m = tr.step(mbs).unwrap();
        steps.push((m.loss.to_bits(), m.grad_norm.to_bits()));
        if optimizer_copy {
            tr.flush().unwrap();
            copies_are_current(&model);
        }
    }
    tr.flush().unwrap();
    assert_eq!(model.upload_copy_clones(), 0, "an upload still held a copy when its layer was updated");
    (steps, model.snapshot())
}

/// Every slot's copy is `bf16::from_f32` of its masters, bit for bit; the embedding of an untied
/// model, which no upload reads, has none.
fn copies_are_current(model: &SharedModel) {
    let check = |what: &str, masters: Vec<&HostTensor>, slot: usize, skip: Option<usize>| {
        let copy = model.upload_copy(slot).unwrap();
        assert_eq!(copy.len(), masters.len(), "{what}");
        for (k, (c, m)) in copy.iter().zip(masters).enumerate() {
            let Some(c) = c else {
                assert_eq!(Some(k), skip, "{what} tensor {k}: no copy");
                continue;
            };
            assert_ne!(Some(k), skip, "{what} tensor {k}: a copy no upload reads");
            assert_eq!(c.len(), m.data.len(), "{what} tensor {k}");
            assert!(
                c.iter().zip(&m.data).all(|(c, &x)| c.to_bits() == bf16::from_f32(x).to_bits()),
                "{what} tensor {k}: the copy is stale"
            );
        }
    };
    let head = model.head.read().unwrap().clone();
    let untied_embedding = head.lm_head.is_some().then_some(0);
    check("head", head.tensors().collect(), HEAD, untied_embedding);
    let snap = model.snapshot();
    for (i, l) in snap.layers.iter().enumerate() {
        check(&format!("layer {i}"), l.tensors.iter().collect(), layer_slot(i), None);
    }
}

fn bits(m: &HostModel) -> Vec<u32> {
    let tensors = [&m.embed_tokens, &m.norm].into_iter().chain(m.lm_head.as_ref());
    tensors.chain(m.layers.iter().flat_map(|l| &l.tensors)).flat_map(|t| t.data.iter().map(|x| x.to_bits())).collect()
}

#[test]
fn training_from_the_copy_is_bit_identical_to_converting_at_each_upload() {
    for name in ["qwen3-tied-mqa", "qwen2-untied-mqa", "qwen35-hybrid"] {
        let host = HostModel::load(&fixture(name)).unwrap();
        let layers = host.config.num_layers();
        let cases = [
            ("keep-all", Step::keep_all(layers), OptimizerKind::adamw8bit(), true),
            ("recompute-all", Step::recompute_all(layers), OptimizerKind::AdamW, true),
            ("all-host", Step::all_in(layers, Placement::Host), OptimizerKind::adamw8bit_f8(), false),
        ];
        for (pname, plan, optimizer, overlap) in cases {
            let opts = options(optimizer, overlap);
            let (want_steps, want_model) = train(&host, &plan, &opts, false);
            let (got_steps, got_model) = train(&host, &plan, &opts, true);
            assert_eq!(got_steps, want_steps, "{name} {pname}: losses or gradient norms differ");
            assert!(bits(&got_model) == bits(&want_model), "{name} {pname}: the masters differ");
            // The bf16 path really is another path: its first loss differs from f32 uploads'.
            let f32_ex = Executor::<CpuAutodiff>::new(plan.clone(), ByteSize::gib(1), Default::default(), None);
            assert!(!f32_ex.wants_upload_copies());
            let mut f32_tr =
                Trainer::new(Arc::new(SharedModel::new(host.clone(), 0)), f32_ex, opts.clone(), None, 0).unwrap();
            let f32_loss = f32_tr.step(&micro_batches(host.config.vocab_size)).unwrap().loss;
            assert_ne!(f32_loss.to_bits(), want_steps[0].0, "{name} {pname}: bf16 uploads were not bf16");
        }
    }
}

/// Keeping a bf16 device's layer gradients in bf16 as they land changes where they are kept, not
/// what the optimizer computes: against widening them into fp32 buffers (`LT_BF16_GRADS=0`), the
/// same losses, gradient norms (the clip scale) and masters, bit for bit, every step, with one
/// micro-batch per step (kept in bf16) and with four (widened at the second landing), the three
/// optimizers (8-bit with each codes), three plans.
#[test]
fn bf16_gradients_train_bit_identically_to_fp32_gradient_buffers() {
    for name in ["qwen3-tied-mqa", "qwen2-untied-mqa", "qwen35-hybrid"] {
        let host = HostModel::load(&fixture(name)).unwrap();
        let layers = host.config.num_layers();
        let vocab = host.config.vocab_size;
        let four = micro_batches(vocab);
        // The same four rows as one micro-batch.
        let one = vec![Batch::from_ids(four.iter().flat_map(|b| b.input_ids.clone()).collect())];
        let cases = [
            ("keep-all", Step::keep_all(layers), OptimizerKind::adamw8bit(), true),
            ("recompute-all", Step::recompute_all(layers), OptimizerKind::AdamW, false),
            ("all-host", Step::all_in(layers, Placement::Host), OptimizerKind::adamw8bit_f8(), true),
        ];
        for (pname, plan, optimizer, overlap) in cases {
            let opts = options(optimizer, overlap);
            for (mname, mbs) in [("one micro-batch", &one), ("four micro-batches", &four)] {
                let (want_steps, want_model) = train_with(&host, &plan, &opts, true, false, mbs);
                let (got_steps, got_model) = train_with(&host, &plan, &opts, true, true, mbs);
                assert_eq!(got_steps, want_steps, "{name} {pname} {mname}: losses or gradient norms differ");
                assert!(bits(&got_model) == bits(&want_model), "{name} {pname} {mname}: the masters differ");
            }
        }
    }
}
