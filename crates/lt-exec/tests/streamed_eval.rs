//! Evaluation streamed from the trainer's shared masters (`SharedModel` as
//! `lt_model::stream::HostWeights`) reads what training uploads: after training steps with the
//! optimizer-written bf16 copies, each layer it prepares is the bf16 conversion of the masters, and
//! shares the copies' memory rather than converting again; in f32 it gives the logits of a whole
//! model built from a snapshot, bit for bit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;

use burn::tensor::DType;
use lt_core::ByteSize;
use lt_exec::executor::Executor;
use lt_exec::plan::Step;
use lt_exec::state::{SharedModel, layer_slot};
use lt_exec::train::{LrSchedule, TrainOptions, Trainer};
use lt_model::host::HostModel;
use lt_model::model::{Batch, forward_logits, to_vec};
use lt_model::stream::{HostWeights, Streamed, forward_logits_with};
use lt_model::weights::{DeviceModel, LayerWeights};
use lt_model::{CpuAutodiff, CpuBackend};
use lt_optim::{AdamWConfig, OptimizerKind};

fn values(w: LayerWeights<CpuBackend>) -> Vec<Vec<u32>> {
    struct Collect(Vec<Vec<u32>>);
    impl lt_model::weights::ParamVisitor<CpuBackend> for Collect {
        fn visit<const D: usize>(&mut self, _name: &'static str, t: &burn::tensor::Tensor<CpuBackend, D>) {
            self.0.push(to_vec(t.clone()).iter().map(|v| v.to_bits()).collect());
        }
    }
    let mut c = Collect(Vec::new());
    w.visit(&mut c);
    c.0
}

#[test]
fn streaming_from_the_trainer_reads_the_trained_masters() {
    for name in ["qwen3-tied-mqa", "qwen35-hybrid"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models").join(name);
        let host = HostModel::load(&dir).unwrap();
        let n = host.layers.len();
        let plan = Step::keep_all(n);
        let ex = Executor::<CpuAutodiff>::new(plan, ByteSize::gib(1), Default::default(), None)
            .with_upload_dtype(DType::BF16)
            .with_optimizer_copy(true);
        let opts = TrainOptions {
            adamw: AdamWConfig { lr: 2e-3, ..AdamWConfig::default() },
            optimizer: OptimizerKind::adamw8bit(),
            warmup_steps: 0,
            schedule: LrSchedule::Constant,
            total_steps: 2,
            overlap_optimizer: true,
            threads: 2,
        };
        let model = Arc::new(SharedModel::new(host.clone(), 0));
        let mut tr = Trainer::new(Arc::clone(&model), ex, opts, None, 0).unwrap();
        let vocab = host.config.vocab_size as u32;
        let batch = Batch::from_ids(vec![(0..16u32).map(|i| (i * 7 + 3) % vocab).collect()]);
        for _ in 0..2 {
            tr.step(std::slice::from_ref(&batch)).unwrap();
        }
        tr.flush().unwrap();
        let snap = model.snapshot();
        assert_ne!(
            snap.layers[0].tensors[0].data, host.layers[0].tensors[0].data,
            "{name}: training moved the masters"
        );

        let device = Default::default();
        for i in 0..n {
            let shared = model.layer(i, DType::BF16);
            // The prepared layer holds the optimizer's copies (slot, this handle and the upload's).
            let copy = model.upload_copy(layer_slot(i)).unwrap();
            assert!(copy.iter().flatten().all(|c| Arc::strong_count(c) == 3), "{name}: layer {i} was converted again");
            let converted = snap.layer(i, DType::BF16);
            assert_eq!(
                values(shared.bind::<CpuBackend>(&device)),
                values(converted.bind::<CpuBackend>(&device)),
                "{name}: layer {i}"
            );
        }
        let ids = vec![vec![3u32, 9, 27, 1, 14, 5], vec![8, 8, 2, 30, 7, 11]];
        let mut streamed = Streamed::<CpuBackend, SharedModel>::new(&model, &device);
        let got = to_vec(forward_logits_with(&mut streamed, &ids));
        let want = to_vec(forward_logits(&DeviceModel::<CpuBackend>::from_host(&snap, &device), &ids));
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: logits");
    }
}
