//! A model streamed from host memory one layer at a time (`lt_model::stream::Streamed`) computes what
//! the whole model bound on the device computes: the same logits bit for bit on the f32 CPU backend,
//! and the same greedy generations, for every family (tied and untied heads, attention and
//! Gated DeltaNet layers).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::path::Path;

use lt_model::CpuBackend;
use lt_model::generate::{generate_greedy, generate_greedy_with};
use lt_model::host::HostModel;
use lt_model::model::{forward_logits, to_vec};
use lt_model::stream::{Streamed, forward_logits_with};
use lt_model::weights::DeviceModel;

const FAMILIES: [&str; 5] = ["qwen35-hybrid", "qwen3-hd16-gqa", "qwen2-untied-mqa", "qwen2-tied-gqa", "qwen35-wrapped"];

fn load(name: &str) -> HostModel {
    HostModel::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models").join(name)).unwrap()
}

#[test]
fn streamed_logits_are_the_whole_models_bit_for_bit() {
    for name in FAMILIES {
        let host = load(name);
        let device = Default::default();
        let whole = DeviceModel::<CpuBackend>::from_host(&host, &device);
        let ids = vec![vec![5u32, 17, 3, 88, 41, 9, 60, 2], vec![12, 70, 1, 0, 33, 2, 19, 4]];
        let want = to_vec(forward_logits(&whole, &ids));
        let mut streamed = Streamed::<CpuBackend, HostModel>::new(&host, &device);
        let got = to_vec(forward_logits_with(&mut streamed, &ids));
        assert_eq!(got.len(), want.len(), "{name}");
        let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{name}: {differ} of {} logits differ", want.len());
        assert_eq!(streamed.layer_uploads(), host.layers.len() as u64, "{name}: one upload per layer per pass");
    }
}

#[test]
fn streamed_generation_equals_the_whole_models() {
    for name in FAMILIES {
        let host = load(name);
        let device = Default::default();
        let whole = DeviceModel::<CpuBackend>::from_host(&host, &device);
        let prompts = vec![vec![5u32, 17, 3, 88, 41, 9, 60], vec![12, 70], vec![33, 2, 19, 4]];
        let want = generate_greedy(&whole, &prompts, 8, &[]);
        let mut streamed = Streamed::<CpuBackend, HostModel>::new(&host, &device);
        let got = generate_greedy_with(&mut streamed, &prompts, 8, &[]);
        assert_eq!(got, want, "{name}");
        assert!(want.iter().all(|g| g.len() == 8), "{name}: no stop token, 8 new tokens per row");
        // The prefill and 7 decoding steps (the 8th token needs no forward), each streaming every layer.
        assert_eq!(streamed.layer_uploads(), 8 * host.layers.len() as u64, "{name}");
    }
}
