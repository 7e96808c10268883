//! A packed row computes exactly what its sequences compute one by one: attention never crosses a
//! sequence, positions restart, and the Gated DeltaNet resets its state and conv window.
//! Tolerance 1e-5 max-abs on logits (same kernels; only matmul blocking differs).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::path::Path;

use lt_model::CpuBackend;
use lt_model::host::HostModel;
use lt_model::layer::SeqCtx;
use lt_model::model::{forward_logits, forward_logits_ctx, to_vec};
use lt_model::weights::DeviceModel;

#[test]
fn packed_rows_equal_separate_sequences() {
    for name in ["qwen35-hybrid", "qwen3-hd16-gqa", "qwen2-tied-gqa"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models").join(name);
        let host = HostModel::load(&dir).unwrap();
        let v = host.config.vocab_size;
        let model = DeviceModel::<CpuBackend>::from_host(&host, &Default::default());
        let a: Vec<u32> = vec![5, 17, 3, 88, 41, 9, 60];
        let b: Vec<u32> = vec![12, 70, 33, 2, 19];
        let pad = 0u32;
        // Row: a, b, then 2 padding tokens (segment 0).
        let ids = vec![[a.clone(), b.clone(), vec![pad; 2]].concat()];
        let positions = vec![[(0..7).collect::<Vec<u32>>(), (0..5).collect(), vec![0, 0]].concat()];
        let segments = vec![[vec![1u32; 7], vec![2; 5], vec![0; 2]].concat()];
        let ctx = SeqCtx::<CpuBackend>::packed(&host.config, &positions, &segments, &Default::default());
        let packed = to_vec(forward_logits_ctx(&model, &ids, &ctx));
        let la = to_vec(forward_logits(&model, std::slice::from_ref(&a)));
        let lb = to_vec(forward_logits(&model, std::slice::from_ref(&b)));
        let d = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        let da = d(&packed[..7 * v], &la);
        let db = d(&packed[7 * v..12 * v], &lb);
        assert!(da <= 1e-5 && db <= 1e-5, "{name}: packed vs separate max-abs {da} / {db}");
    }
}
