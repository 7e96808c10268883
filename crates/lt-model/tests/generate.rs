//! Cached, batched, left-padded greedy generation produces exactly the tokens of naive greedy
//! decoding (a full forward over the whole sequence for every new token), for every family.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::path::Path;

use lt_model::CpuBackend;
use lt_model::generate::generate_greedy;
use lt_model::host::HostModel;
use lt_model::model::{forward_logits, to_vec};
use lt_model::weights::DeviceModel;

fn naive(model: &DeviceModel<CpuBackend>, prompt: &[u32], n: usize, stop: &[u32]) -> Vec<u32> {
    let v = model.config.vocab_size;
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let logits = to_vec(forward_logits(model, std::slice::from_ref(&seq)));
        let last = &logits[(seq.len() - 1) * v..seq.len() * v];
        let mut best = 0;
        for (i, x) in last.iter().enumerate() {
            if *x > last[best] {
                best = i;
            }
        }
        out.push(best as u32);
        seq.push(best as u32);
        if stop.contains(&(best as u32)) {
            break;
        }
    }
    out
}

#[test]
fn cached_batched_generation_equals_naive_greedy() {
    for name in ["qwen35-hybrid", "qwen3-hd16-gqa", "qwen2-untied-mqa"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models").join(name);
        let host = HostModel::load(&dir).unwrap();
        let model = DeviceModel::<CpuBackend>::from_host(&host, &Default::default());
        let prompts = vec![vec![5u32, 17, 3, 88, 41, 9, 60], vec![12, 70], vec![33, 2, 19, 4]];
        let got = generate_greedy(&model, &prompts, 8, &[]);
        for (p, g) in prompts.iter().zip(&got) {
            assert_eq!(g, &naive(&model, p, 8, &[]), "{name}: prompt {p:?}");
        }
        // A stop token ends its row only.
        let stop = got[0][2];
        let got2 = generate_greedy(&model, &prompts, 8, &[stop]);
        assert_eq!(got2[0], got[0][..=got[0].iter().position(|&t| t == stop).unwrap()].to_vec());
    }
}
