//! The matmul hook and the BLAS mapping on a real cubecl runtime, without a GPU: burn-wgpu
//! (lavapipe in CI) with a hook that computes every product from the operands' raw buffers exactly
//! as a column-major strided-batched GEMM call would (`lt_model::gemm::reference_gemm` on the call
//! that `lt_model::gemm::hook::prepare` plans). So the layouts that Burn really hands to
//! `float_matmul` (transposed weights, attention's batched products, autodiff's backward products,
//! the hybrid layers' delta rule) go through the same planning, buffer addressing and output
//! construction as the CUDA hook (`LT_GEMM=cublas`); only the cuBLAS call itself is not exercised.
//! Run with
//!
//! ```sh
//! cargo test -p lt-model --features wgpu --test gemm_hook_wgpu
//! ```
//!
//! Its own test binary: the hook is process-wide.
#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::any::Any;
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::{DType, Tensor, TensorData};
use lt_model::burn_cubecl::matmul_hook::set_matmul_hook;
use lt_model::burn_cubecl::tensor::CubeTensor;
use lt_model::cubecl::wgpu::WgpuRuntime;
use lt_model::gemm::{hook::prepare, reference_gemm};
use lt_model::host::HostModel;
use lt_model::model::{forward_logits, full_graph_grads, to_vec};
use lt_model::weights::DeviceModel;
use lt_model::{CpuBackend, WgpuAutodiff, WgpuBackend};
use lt_storage::safetensors_io::SafetensorsModel;

mod fixture;
use fixture::{batch, max_abs_diff};

type T = CubeTensor<WgpuRuntime>;

/// Products the hook computed, and products it left to the kernels.
static HOOKED: AtomicUsize = AtomicUsize::new(0);
static DECLINED: AtomicUsize = AtomicUsize::new(0);

/// The hook: the planned call, computed on the host from the operands' raw buffers (each read
/// whole from its handle, so the call's offsets, leading dimensions and batch strides address the
/// memory as the device call would), into a fresh contiguous output.
fn host_gemm(lhs: &dyn Any, rhs: &dyn Any) -> Option<Box<dyn Any>> {
    let (lhs, rhs) = (lhs.downcast_ref::<T>()?, rhs.downcast_ref::<T>()?);
    let Some(p) = prepare(lhs, rhs) else {
        DECLINED.fetch_add(1, Ordering::Relaxed);
        return None;
    };
    assert_eq!(p.dtype, DType::F32, "the wgpu backend of these tests is f32");
    let client = p.b.client.clone();
    let read = |t: &T| -> Vec<f32> { bytemuck::pod_collect_to_vec(&client.read_one(t.handle.clone()).unwrap()) };
    let (a, b) = (read(&p.a), read(&p.b));
    let mut c = vec![f32::NAN; p.out_shape.iter().product()];
    reference_gemm(&p.call, &a, &b, &mut c);
    assert!(c.iter().all(|x| !x.is_nan()), "the call wrote every output element: {:?}", p.call);
    let handle = client.create(cubecl_common::bytes::Bytes::from_elems(c));
    let out = T::new_contiguous(client, p.b.device.clone(), p.out_shape.clone().into(), handle, p.dtype);
    HOOKED.fetch_add(1, Ordering::Relaxed);
    Some(Box::new(out))
}

fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| assert!(set_matmul_hook(host_gemm), "no other hook in this test binary"));
}

/// Products as Burn's tensor API makes them (views, not copies), against the CPU backend.
#[test]
fn hooked_products_of_strided_views_match_the_cpu() {
    install();
    let device = lt_model::device::wgpu_device().unwrap_or_else(|e| panic!("{e}"));
    let data = |shape: &[usize], seed: usize| {
        let n: usize = shape.iter().product();
        TensorData::new(
            (0..n).map(|i| (((i * 37 + seed * 11) % 29) as f32 - 14.0) / 8.0).collect::<Vec<_>>(),
            shape.to_vec(),
        )
    };
    let both = |shape: &[usize], seed: usize| {
        (
            Tensor::<WgpuBackend, 4>::from_data(data(shape, seed), &device),
            Tensor::<CpuBackend, 4>::from_data(data(shape, seed), &Default::default()),
        )
    };
    let (x, xc) = both(&[2, 3, 5, 4], 1);
    let (w, wc) = both(&[1, 1, 6, 4], 2);
    let (k, kc) = both(&[2, 3, 7, 4], 3);
    let (y, yc) = both(&[2, 5, 3, 4], 4);
    let before = HOOKED.load(Ordering::Relaxed);
    let cases: Vec<(Tensor<WgpuBackend, 4>, Tensor<CpuBackend, 4>)> = vec![
        // x W^T with W broadcast over the batch dims (a transposed view of a broadcast operand).
        (x.clone().matmul(w.clone().swap_dims(2, 3)), xc.clone().matmul(wc.clone().swap_dims(2, 3))),
        // Attention's scores: q k^T.
        (x.clone().matmul(k.clone().swap_dims(2, 3)), xc.clone().matmul(kc.clone().swap_dims(2, 3))),
        // Scores times values, values a transposed view too.
        (
            x.clone().matmul(k.clone().swap_dims(2, 3)).matmul(k.clone()),
            xc.clone().matmul(kc.clone().swap_dims(2, 3)).matmul(kc.clone()),
        ),
        // Heads permuted in memory (`[B, S, H, D]` viewed as `[B, H, S, D]`): made contiguous first.
        (
            y.clone().swap_dims(1, 2).matmul(w.clone().swap_dims(2, 3)),
            yc.clone().swap_dims(1, 2).matmul(wc.clone().swap_dims(2, 3)),
        ),
        // A transposed left operand (autodiff's weight gradient: x^T dy).
        (x.clone().swap_dims(2, 3).matmul(x.clone()), xc.clone().swap_dims(2, 3).matmul(xc.clone())),
    ];
    for (i, (dev, cpu)) in cases.into_iter().enumerate() {
        assert_eq!(dev.dims(), cpu.dims(), "case {i}");
        let d = max_abs_diff(&to_vec(dev), &to_vec(cpu));
        assert!(d <= 1e-4, "case {i}: max-abs diff {d}");
    }
    assert!(HOOKED.load(Ordering::Relaxed) - before >= 6, "every product went through the hook");
}

/// Whole models, forward and backward, with every product through the hook: the same bars as
/// `device_wgpu.rs` against transformers' outputs.
#[test]
fn hooked_models_match_transformers() {
    install();
    let device = lt_model::device::wgpu_device().unwrap_or_else(|e| panic!("{e}"));
    for name in ["qwen2-untied-mqa", "qwen3-tied-mqa", "qwen35-hybrid"] {
        let dir = fixture::dir(name);
        let host = HostModel::load(&dir).unwrap();
        let exp = SafetensorsModel::open(&dir.join("expected.safetensors")).unwrap();
        let b = batch(&dir);
        let model = DeviceModel::<WgpuBackend>::from_host(&host, &device);
        let before = HOOKED.load(Ordering::Relaxed);
        let logits = to_vec(forward_logits(&model, &b.input_ids));
        let d = max_abs_diff(&logits, &exp.read_f32("logits").unwrap());
        assert!(d <= 1e-4, "{name}: logits max-abs diff {d}");
        let forward = HOOKED.load(Ordering::Relaxed) - before;
        let (loss, grads) = full_graph_grads::<WgpuAutodiff>(&model, &b);
        let want_loss = exp.read_f32("loss").unwrap()[0];
        assert!(((loss - want_loss) / want_loss).abs() <= 1e-5, "{name}: loss {loss} vs {want_loss}");
        let mut worst = 0.0f32;
        for (n, g) in &grads {
            let full = if n.starts_with("layers.") { host.layer_param_name_full(n) } else { host.outer_param_name(n) };
            let want = exp.read_f32(&format!("grad.{full}")).unwrap();
            let scale = want.iter().map(|x| x.abs()).fold(0.0, f32::max).max(1e-12);
            let e = max_abs_diff(g, &want) / scale;
            worst = worst.max(e);
            assert!(e <= 1e-3, "{name}: grad {n} rel err {e}");
        }
        let total = HOOKED.load(Ordering::Relaxed) - before;
        // Forward, then forward again and backward (two products per forward one, at least).
        assert!(forward > 0 && total >= 3 * forward, "{name}: {forward} forward, {total} in all through the hook");
        eprintln!(
            "{name}: logits max-abs {d:.1e}, worst grad rel {worst:.1e}; {forward} forward products, {total} in all through the hook, {} left to the kernels so far",
            DECLINED.load(Ordering::Relaxed)
        );
    }
}
