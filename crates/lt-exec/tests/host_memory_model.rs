//! The planner's host memory model is the trainer's allocation, byte for byte: for tied and untied,
//! dense and hybrid fixtures, both optimizers, bf16 uploads (with the optimizer-written copy, as on
//! CUDA) and f32 uploads (CPU, wgpu), with and without gradient accumulation, what
//! `Trainer::host_bytes` counts after real steps equals, kind by kind,
//! `lt_sched::cost::host_param_bytes`, which `Instance::from_model` puts in the planner's static
//! host memory.
//!
//! (Before session 24 the model counted a bf16 gradient landing buffer the executor never had and an
//! accumulator on top of it, while the executor keeps one fp32 gradient per parameter whatever the
//! accumulation: on the first H200 run a 7B process passed the prediction by 11 GB.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::DType;
use lt_core::ByteSize;
use lt_exec::executor::Executor;
use lt_exec::plan::Step;
use lt_exec::state::SharedModel;
use lt_exec::train::{LrSchedule, TrainOptions, Trainer};
use lt_model::CpuAutodiff;
use lt_model::host::HostModel;
use lt_model::model::Batch;
use lt_optim::{AdamWConfig, OptimizerKind};
use lt_sched::cost::{OptimizerState, host_param_bytes};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models").join(name)
}

fn micro_batches(vocab: usize, n: u32) -> Vec<Batch> {
    (0..n).map(|r| Batch::from_ids(vec![(0..16u32).map(|i| (i * 5 + r * 11 + 3) % vocab as u32).collect()])).collect()
}

#[test]
fn the_planner_counts_exactly_the_host_bytes_the_trainer_keeps() {
    // The fixtures' tensors are too small for 8-bit state (under 4,096 elements keep fp32 moments):
    // a random model with 128-wide layers has both kinds.
    let wide = lt_core::ModelConfig::from_json_str(
        r#"{"model_type":"qwen2","vocab_size":512,"hidden_size":128,"intermediate_size":384,
          "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
          "rms_norm_eps":1e-6,"rope_theta":1e6,"tie_word_embeddings":false}"#,
    )
    .unwrap();
    let models = ["qwen3-tied-mqa", "qwen2-untied-mqa", "qwen35-hybrid"]
        .map(|n| (n.to_string(), HostModel::load(&fixture(n)).unwrap()))
        .into_iter()
        .chain([("random 128-wide qwen2".to_string(), HostModel::random_init(wide, 7))]);
    let mut eight_bit_seen = false;
    for (name, host) in models {
        let cfg = host.config.clone();
        let params = cfg.total_params() as u64;
        for (optimizer, state) in [
            (OptimizerKind::adamw8bit(), OptimizerState::Blockwise8bit),
            (OptimizerKind::adamw8bit_f8(), OptimizerState::Blockwise8bit),
            (OptimizerKind::AdamW, OptimizerState::Fp32),
        ] {
            // (upload dtype, its bytes: the planner's compute dtype)
            for (dtype, d) in [(DType::BF16, 2usize), (DType::F32, 4)] {
                for accum in [1u32, 3] {
                    let ex = Executor::<CpuAutodiff>::new(
                        Step::keep_all(cfg.num_layers()),
                        ByteSize::gib(1),
                        Default::default(),
                        None,
                    )
                    .with_upload_dtype(dtype)
                    .with_optimizer_copy(true);
                    let opts = TrainOptions {
                        adamw: AdamWConfig { lr: 1e-3, ..AdamWConfig::default() },
                        optimizer,
                        warmup_steps: 0,
                        schedule: LrSchedule::Constant,
                        total_steps: 2,
                        overlap_optimizer: true,
                        threads: 2,
                    };
                    let mut tr = Trainer::new(Arc::new(SharedModel::new(host.clone(), 0)), ex, opts, None, 0).unwrap();
                    for _ in 0..2 {
                        tr.step(&micro_batches(cfg.vocab_size, accum)).unwrap();
                    }
                    tr.flush().unwrap();
                    let got = tr.host_bytes();
                    let case = format!("{name}, {state:?}, {dtype:?} uploads, {accum} micro-batches: {got:?}");
                    assert_eq!(got.masters, 4 * params, "{case}");
                    // fp32 gradients, but a bf16 device's decoder layers keep bf16 ones (2 B/param)
                    // when a step has one micro-batch.
                    let layers: u64 = (0..cfg.num_layers()).map(|i| cfg.layer_numel(i) as u64).sum();
                    let bf16_layers = d == 2 && accum == 1;
                    assert_eq!(got.grads, 4 * params - if bf16_layers { 2 * layers } else { 0 }, "{case}");
                    assert_eq!(got.upload_copies > 0, d == 2, "{case}");
                    assert_eq!(got, host_param_bytes(&cfg, d, state, accum as usize), "{case}");
                    eight_bit_seen |= got.optimizer_state < 4 * params;
                }
            }
        }
    }
    assert!(eight_bit_seen, "no case had 8-bit state");
}
