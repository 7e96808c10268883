//! The model code on a device runtime: burn-wgpu (lavapipe in CI) against transformers' reference
//! outputs, on every fixture family. Run with
//!
//! ```sh
//! cargo test -p lt-model --features wgpu --test device_wgpu
//! ```
//!
//! Same bars as `parity.rs` (the CPU backend against transformers): logits max-abs <= 1e-4 and loss
//! rel <= 1e-5 (f32 on both sides, only summation orders differ), gradients rel <= 1e-3 of each
//! tensor's largest entry.
#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use lt_model::generate::{generate_greedy, generate_greedy_with};
use lt_model::host::HostModel;
use lt_model::model::{forward_logits, full_graph_grads, to_vec};
use lt_model::stream::{Streamed, forward_logits_with};
use lt_model::weights::DeviceModel;
use lt_model::{WgpuAutodiff, WgpuBackend};
use lt_storage::safetensors_io::SafetensorsModel;

mod fixture;
use fixture::{FIXTURES, batch, dir as fixture, max_abs_diff};

#[test]
fn wgpu_logits_loss_and_gradients_match_transformers() {
    let device = lt_model::device::wgpu_device().unwrap_or_else(|e| panic!("{e}"));
    for name in FIXTURES {
        let dir = fixture(name);
        let host = HostModel::load(&dir).unwrap();
        let exp = SafetensorsModel::open(&dir.join("expected.safetensors")).unwrap();
        let b = batch(&dir);
        let model = DeviceModel::<WgpuBackend>::from_host(&host, &device);
        let logits = to_vec(forward_logits(&model, &b.input_ids));
        let d = max_abs_diff(&logits, &exp.read_f32("logits").unwrap());
        assert!(d <= 1e-4, "{name}: wgpu logits max-abs diff {d}");
        let (loss, grads) = full_graph_grads::<WgpuAutodiff>(&model, &b);
        let want_loss = exp.read_f32("loss").unwrap()[0];
        let rl = ((loss - want_loss) / want_loss).abs();
        assert!(rl <= 1e-5, "{name}: wgpu loss {loss} vs {want_loss}");
        let expected_grads = exp.names().iter().filter(|n| n.starts_with("grad.")).count();
        assert_eq!(grads.len(), expected_grads, "{name}: every parameter has a gradient");
        let mut worst = 0.0f32;
        for (n, g) in &grads {
            let full = if n.starts_with("layers.") { host.layer_param_name_full(n) } else { host.outer_param_name(n) };
            let want = exp.read_f32(&format!("grad.{full}")).unwrap();
            let scale = want.iter().map(|x| x.abs()).fold(0.0, f32::max).max(1e-12);
            let e = max_abs_diff(g, &want) / scale;
            worst = worst.max(e);
            assert!(e <= 1e-3, "{name}: wgpu grad {n} rel err {e}");
        }
        // The same model streamed from host memory one layer at a time (what evaluation during
        // training and `lt eval --stream` run): the same bar against transformers.
        let mut streamed = Streamed::<WgpuBackend, HostModel>::new(&host, &device);
        let sd =
            max_abs_diff(&to_vec(forward_logits_with(&mut streamed, &b.input_ids)), &exp.read_f32("logits").unwrap());
        assert!(sd <= 1e-4, "{name}: streamed wgpu logits max-abs diff {sd}");
        eprintln!(
            "{name}: wgpu logits max-abs {d:.1e} (streamed {sd:.1e}), loss rel {rl:.1e}, worst grad rel {worst:.1e}"
        );
    }
}

/// Greedy generation on wgpu, whole and streamed from host memory (decoding caches on the device,
/// every layer uploaded once per decoding step), gives the CPU's whole-model tokens: a dense fixture
/// and the hybrid (attention caches, the delta rule's recurrent state and conv window). Three rows of
/// different lengths, left-padded. This caught batched one-token delta-rule steps going wrong on
/// wgpu (session 31, `delta_net_forward`).
#[test]
fn wgpu_streamed_generation_follows_the_cpu() {
    let device = lt_model::device::wgpu_device().unwrap_or_else(|e| panic!("{e}"));
    for name in ["qwen3-hd16-gqa", "qwen35-hybrid"] {
        let host = HostModel::load(&fixture(name)).unwrap();
        let prompts = vec![vec![5u32, 17, 3, 88, 41, 9, 60], vec![12, 70], vec![33, 2, 19, 4]];
        let cpu = DeviceModel::<lt_model::CpuBackend>::from_host(&host, &Default::default());
        let want = generate_greedy(&cpu, &prompts, 6, &[]);
        let whole = DeviceModel::<WgpuBackend>::from_host(&host, &device);
        assert_eq!(generate_greedy(&whole, &prompts, 6, &[]), want, "{name}: whole model on wgpu");
        let mut streamed = Streamed::<WgpuBackend, HostModel>::new(&host, &device);
        assert_eq!(generate_greedy_with(&mut streamed, &prompts, 6, &[]), want, "{name}: streamed onto wgpu");
    }
}
