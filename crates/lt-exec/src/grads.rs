//! Host gradient buffers with fused sum-of-squares accumulation.
//!
//! Each layer's gradients sit behind their own lock: the d2h stream accumulates into layer `i`
//! while the optimizer thread may be reading layer `j`'s gradients of the previous step.

use std::sync::Mutex;

use burn::tensor::{DType, TensorData};
use lt_core::hostmem::huge_vec;
use lt_model::host::HostModel;
use lt_optim::grad::accumulate_into;
use lt_optim::{Grad, ThreadPool};

use crate::error::ExecError;
use crate::state::SharedModel;

/// Gradients of the embedding, final norm and untied head.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadGrads {
    /// `embed_tokens.weight` (includes the head's contribution when tied).
    pub embed_tokens: Vec<f32>,
    /// `norm.weight`.
    pub norm: Vec<f32>,
    /// `lm_head.weight` when untied.
    pub lm_head: Option<Vec<f32>>,
}

/// fp32 gradients of every parameter.
#[derive(Debug)]
pub struct HostGrads {
    /// Per layer, per parameter (in `layer_params` order).
    pub layers: Vec<Mutex<Vec<Vec<f32>>>>,
    /// Embedding, norm, head.
    pub head: Mutex<HeadGrads>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl HostGrads {
    /// Zero gradients shaped like `host`.
    pub fn zeros_like(host: &HostModel) -> Self {
        Self {
            layers: host
                .layers
                .iter()
                .map(|l| Mutex::new(l.tensors.iter().map(|t| huge_vec(t.data.len(), 0.0)).collect()))
                .collect(),
            head: Mutex::new(HeadGrads {
                embed_tokens: huge_vec(host.embed_tokens.data.len(), 0.0),
                norm: vec![0.0; host.norm.data.len()],
                lm_head: host.lm_head.as_ref().map(|t| huge_vec(t.data.len(), 0.0)),
            }),
        }
    }

    /// Zero gradients shaped like the masters of `model`, reading only their sizes (no copy of the
    /// weights is made, unlike [`SharedModel::snapshot`] + [`HostGrads::zeros_like`]).
    pub fn zeros_like_shared(model: &SharedModel) -> Self {
        let head = model.head.read().unwrap_or_else(|e| e.into_inner());
        Self {
            layers: model
                .layers
                .iter()
                .map(|l| {
                    let l = l.read().unwrap_or_else(|e| e.into_inner());
                    Mutex::new(l.tensors.iter().map(|t| huge_vec(t.data.len(), 0.0)).collect())
                })
                .collect(),
            head: Mutex::new(HeadGrads {
                embed_tokens: huge_vec(head.embed_tokens.data.len(), 0.0),
                norm: vec![0.0; head.norm.data.len()],
                lm_head: head.lm_head.as_ref().map(|t| huge_vec(t.data.len(), 0.0)),
            }),
        }
    }

    /// Bytes of every gradient buffer (fp32).
    pub fn bytes(&self) -> u64 {
        let h = lock(&self.head);
        let head = h.embed_tokens.len() + h.norm.len() + h.lm_head.as_ref().map_or(0, Vec::len);
        let layers: usize = self.layers.iter().map(|l| lock(l).iter().map(Vec::len).sum::<usize>()).sum();
        (4 * (head + layers)) as u64
    }

    /// Zero layer `i`'s gradients.
    pub fn zero_layer(&self, i: usize) {
        for p in lock(&self.layers[i]).iter_mut() {
            p.fill(0.0);
        }
    }

    /// Zero the head's gradients.
    pub fn zero_head(&self) {
        let mut h = lock(&self.head);
        h.embed_tokens.fill(0.0);
        h.norm.fill(0.0);
        if let Some(x) = &mut h.lm_head {
            x.fill(0.0);
        }
    }

    /// Zero everything.
    pub fn zero(&self) {
        self.zero_head();
        for i in 0..self.layers.len() {
            self.zero_layer(i);
        }
    }

    /// A copy of every gradient as `(checkpoint-relative name, values)`.
    pub fn named(&self, host: &HostModel) -> Vec<(String, Vec<f32>)> {
        let h = lock(&self.head);
        let mut out =
            vec![("embed_tokens.weight".to_string(), h.embed_tokens.clone()), ("norm.weight".into(), h.norm.clone())];
        if let Some(x) = &h.lm_head {
            out.push(("lm_head.weight".into(), x.clone()));
        }
        for (i, l) in self.layers.iter().enumerate() {
            for (g, s) in lock(l).iter().zip(&host.layers[i].specs) {
                out.push((format!("layers.{i}.{}", s.name), g.clone()));
            }
        }
        out
    }

    /// Lock layer `i`.
    pub fn layer(&self, i: usize) -> std::sync::MutexGuard<'_, Vec<Vec<f32>>> {
        lock(&self.layers[i])
    }

    /// Lock the head.
    pub fn head(&self) -> std::sync::MutexGuard<'_, HeadGrads> {
        lock(&self.head)
    }
}

/// `dst += g` for a downloaded gradient, returning the sum of squares of the updated `dst`. f32 and
/// bf16 data (the CPU and CUDA backends) go straight into lt-optim's fused widening accumulate (SIMD,
/// split over `pool`) without an intermediate f32 copy; other dtypes are converted to f32 first.
pub fn accumulate_data(dst: &mut [f32], data: &TensorData, pool: &ThreadPool) -> Result<f64, ExecError> {
    let r = match data.dtype {
        DType::F32 => data.as_slice::<f32>().ok().map(|g| accumulate_into(Grad::F32(g), dst, 1.0, pool)),
        DType::BF16 => data.as_slice::<lt_optim::bf16>().ok().map(|g| accumulate_into(Grad::Bf16(g), dst, 1.0, pool)),
        _ => None,
    };
    let r = match r {
        Some(r) => r,
        None => {
            let g = data.clone().convert::<f32>().to_vec::<f32>().unwrap_or_default();
            accumulate_into(Grad::F32(&g), dst, 1.0, pool)
        }
    };
    r.map_err(ExecError::Optim)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalar reference: `dst += src`, returning the sum of squares of the updated `dst`.
    fn accumulate_sq(dst: &mut [f32], src: &[f32]) -> f64 {
        let mut acc = 0.0f64;
        for (d, s) in dst.iter_mut().zip(src) {
            *d += *s;
            acc += f64::from(*d) * f64::from(*d);
        }
        acc
    }

    /// The download path gives the scalar reference's result for f32 and bf16 data (the norm to
    /// rounding: lt-optim sums squares in 16 lanes), on one thread and on several.
    #[test]
    fn accumulate_data_equals_scalar_accumulate() {
        let n = 300_001;
        let g: Vec<f32> = (0..n).map(|i| ((i % 977) as f32 - 488.0) * 1e-3).collect();
        let g16: Vec<lt_optim::bf16> = g.iter().map(|&x| lt_optim::bf16::from_f32(x)).collect();
        let g16_as_f32: Vec<f32> = g16.iter().map(|x| x.to_f32()).collect();
        let start: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.25).collect();
        for threads in [1, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            for (data, src) in [
                (TensorData::new(g.clone(), [n]), &g),
                (TensorData::new(g16.clone(), [n]), &g16_as_f32),
                (TensorData::new(g.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>(), [n]), &g),
            ] {
                let (mut want, mut got) = (start.clone(), start.clone());
                let sq_want = accumulate_sq(&mut want, src);
                let sq_got = accumulate_data(&mut got, &data, &pool).unwrap();
                assert_eq!(got, want, "{:?}", data.dtype);
                assert!((sq_got - sq_want).abs() <= 1e-12 * sq_want, "{sq_got} vs {sq_want}");
            }
            let mut short = vec![0f32; 3];
            assert!(accumulate_data(&mut short, &TensorData::new(g.clone(), [n]), &pool).is_err());
        }
    }

    #[test]
    fn accumulate_returns_sum_of_squares_of_the_total() {
        let mut d = vec![1.0, 2.0];
        let sq = accumulate_sq(&mut d, &[2.0, -4.0]);
        assert_eq!(d, vec![3.0, -2.0]);
        assert_eq!(sq, 13.0);
    }
}
