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

use lt_model::host::HostModel;
use lt_model::model::{forward_logits, full_graph_grads, to_vec};
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
        eprintln!("{name}: wgpu logits max-abs {d:.1e}, loss rel {rl:.1e}, worst grad rel {worst:.1e}");
    }
}
