//! Host gradient buffers with fused sum-of-squares accumulation.
//!
//! Each layer's gradients sit behind their own lock: the d2h stream accumulates into layer `i`
//! while the optimizer thread may be reading layer `j`'s gradients of the previous step.
//!
//! A decoder layer's gradient is kept in bf16 where the device computes in bf16 ([`GradBuf::Bf16`]):
//! with one micro-batch per step, the downloaded gradient is the whole gradient, and widening it
//! into an fp32 buffer would only double its memory and the optimizer's reads. A second landing in
//! the same step (gradient accumulation) widens the buffer to fp32 for good, so a step is always
//! exact whatever the number of micro-batches.

use std::sync::Mutex;

use burn::tensor::{DType, TensorData};
use lt_core::hostmem::huge_vec;
use lt_model::host::HostModel;
use lt_optim::grad::{accumulate_into, copy_into, land_bf16};
use lt_optim::{Grad, ThreadPool, bf16};

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

/// Where a bf16 gradient buffer stands in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Landing {
    /// Nothing has landed since the last update: the gradient is zero, but the buffer still holds
    /// the previous step's values. It is not cleared, since a landing overwrites every element; a
    /// read without one clears it first ([`GradBuf::grad`]).
    Empty,
    /// Nothing has landed, and the buffer holds zeros.
    Zeroed,
    /// This step's gradient is in.
    Landed,
}

/// One decoder-layer tensor's gradient.
#[derive(Debug)]
pub enum GradBuf {
    /// fp32: the accumulator for any number of micro-batches and any downloaded dtype.
    F32(Vec<f32>),
    /// bf16 as downloaded from a bf16 device, for steps of one micro-batch (a second landing in a
    /// step widens the buffer to [`GradBuf::F32`] for good).
    Bf16 {
        /// The gradient, when `state` says so.
        data: Vec<bf16>,
        /// Whether `data` holds this step's gradient.
        state: Bf16Landing,
    },
}

impl GradBuf {
    /// A zero gradient of `n` elements, bf16 or fp32.
    pub fn zeros(n: usize, bf16: bool) -> Self {
        if bf16 {
            GradBuf::Bf16 { data: huge_vec(n, bf16::ZERO), state: Bf16Landing::Zeroed }
        } else {
            GradBuf::F32(huge_vec(n, 0.0))
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            GradBuf::F32(g) => g.len(),
            GradBuf::Bf16 { data, .. } => data.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        match self {
            GradBuf::F32(g) => 4 * g.len() as u64,
            GradBuf::Bf16 { data, .. } => 2 * data.len() as u64,
        }
    }

    /// The gradient as the optimizer reads it (a bf16 buffer nothing landed in is cleared first).
    pub fn grad(&mut self) -> Grad<'_> {
        match self {
            GradBuf::F32(g) => Grad::F32(g),
            GradBuf::Bf16 { data, state } => {
                if *state == Bf16Landing::Empty {
                    data.fill(bf16::ZERO);
                    *state = Bf16Landing::Zeroed;
                }
                Grad::Bf16(data)
            }
        }
    }

    /// The values in f32 (a copy).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            GradBuf::F32(g) => g.clone(),
            GradBuf::Bf16 { data, state: Bf16Landing::Empty } => vec![0.0; data.len()],
            GradBuf::Bf16 { data, .. } => data.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// Back to zero, ready for the next step: an fp32 buffer is cleared (it accumulates); a bf16
    /// one only forgets its gradient, since the next landing overwrites it.
    pub fn zero(&mut self) {
        match self {
            GradBuf::F32(g) => g.fill(0.0),
            GradBuf::Bf16 { state, .. } => *state = Bf16Landing::Empty,
        }
    }

    /// Adds a downloaded gradient, returning the sum of squares of the result (as
    /// [`accumulate_data`]). A bf16 buffer takes the step's first landing of bf16 data as it is
    /// ([`land_bf16`]: the same values and the same sum as the fp32 path); anything else widens it
    /// to fp32 first, exactly, and accumulates there.
    pub fn land(&mut self, data: &TensorData, pool: &ThreadPool) -> Result<f64, ExecError> {
        if let GradBuf::Bf16 { data: buf, state } = self {
            if *state != Bf16Landing::Landed
                && data.dtype == DType::BF16
                && let Ok(src) = data.as_slice::<bf16>()
            {
                let sq = land_bf16(src, buf, pool).map_err(ExecError::Optim)?;
                *state = Bf16Landing::Landed;
                return Ok(sq);
            }
            let mut wide = huge_vec(buf.len(), 0.0f32);
            if *state == Bf16Landing::Landed {
                copy_into(Grad::Bf16(buf), &mut wide, 1.0, pool).map_err(ExecError::Optim)?;
            }
            *self = GradBuf::F32(wide);
        }
        match self {
            GradBuf::F32(dst) => accumulate_data(dst, data, pool),
            GradBuf::Bf16 { .. } => Err(ExecError::Worker("gradient landing")),
        }
    }
}

/// Gradients of every parameter: fp32, except decoder layers' on a bf16 device ([`GradBuf`]).
#[derive(Debug)]
pub struct HostGrads {
    /// Per layer, per parameter (in `layer_params` order).
    pub layers: Vec<Mutex<Vec<GradBuf>>>,
    /// Embedding, norm, head.
    pub head: Mutex<HeadGrads>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl HostGrads {
    /// Zero fp32 gradients shaped like `host`.
    pub fn zeros_like(host: &HostModel) -> Self {
        Self {
            layers: host
                .layers
                .iter()
                .map(|l| Mutex::new(l.tensors.iter().map(|t| GradBuf::zeros(t.data.len(), false)).collect()))
                .collect(),
            head: Mutex::new(HeadGrads {
                embed_tokens: huge_vec(host.embed_tokens.data.len(), 0.0),
                norm: vec![0.0; host.norm.data.len()],
                lm_head: host.lm_head.as_ref().map(|t| huge_vec(t.data.len(), 0.0)),
            }),
        }
    }

    /// Zero gradients shaped like the masters of `model`, reading only their sizes (no copy of the
    /// weights is made, unlike [`SharedModel::snapshot`] + [`HostGrads::zeros_like`]); decoder
    /// layers' in bf16 when `bf16_layers` (a bf16 device: see [`GradBuf`]).
    pub fn zeros_like_shared(model: &SharedModel, bf16_layers: bool) -> Self {
        let head = model.head.read().unwrap_or_else(|e| e.into_inner());
        Self {
            layers: model
                .layers
                .iter()
                .map(|l| {
                    let l = l.read().unwrap_or_else(|e| e.into_inner());
                    Mutex::new(l.tensors.iter().map(|t| GradBuf::zeros(t.data.len(), bf16_layers)).collect())
                })
                .collect(),
            head: Mutex::new(HeadGrads {
                embed_tokens: huge_vec(head.embed_tokens.data.len(), 0.0),
                norm: vec![0.0; head.norm.data.len()],
                lm_head: head.lm_head.as_ref().map(|t| huge_vec(t.data.len(), 0.0)),
            }),
        }
    }

    /// Bytes of every gradient buffer.
    pub fn bytes(&self) -> u64 {
        let h = lock(&self.head);
        let head = h.embed_tokens.len() + h.norm.len() + h.lm_head.as_ref().map_or(0, Vec::len);
        let layers: u64 = self.layers.iter().map(|l| lock(l).iter().map(GradBuf::bytes).sum::<u64>()).sum();
        4 * head as u64 + layers
    }

    /// Zero layer `i`'s gradients.
    pub fn zero_layer(&self, i: usize) {
        for p in lock(&self.layers[i]).iter_mut() {
            p.zero();
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
                out.push((format!("layers.{i}.{}", s.name), g.to_f32()));
            }
        }
        out
    }

    /// Lock layer `i`.
    pub fn layer(&self, i: usize) -> std::sync::MutexGuard<'_, Vec<GradBuf>> {
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

    /// A bf16 buffer keeps the step's first bf16 landing as it is, widens to fp32 at a second one
    /// (accumulation) or at f32 data, and each time gives the fp32 path's values and sum of squares.
    #[test]
    fn a_bf16_gradient_buffer_keeps_one_landing_and_widens_for_more() {
        let pool = ThreadPool::new(2).unwrap();
        let n = 1000;
        let a: Vec<lt_optim::bf16> = (0..n).map(|i| lt_optim::bf16::from_f32((i as f32 - 500.0) * 0.01)).collect();
        let b: Vec<lt_optim::bf16> = (0..n).map(|i| lt_optim::bf16::from_f32((i % 7) as f32 * 0.5)).collect();
        let fp32_path = |landings: &[&Vec<lt_optim::bf16>]| {
            let mut dst = vec![0f32; n];
            let mut sq = 0.0;
            for l in landings {
                sq = accumulate_data(&mut dst, &TensorData::new((*l).clone(), [n]), &pool).unwrap();
            }
            (dst, sq)
        };
        let mut g = GradBuf::zeros(n, true);
        assert_eq!(g.bytes(), 2 * n as u64);
        let sq = g.land(&TensorData::new(a.clone(), [n]), &pool).unwrap();
        let (want, want_sq) = fp32_path(&[&a]);
        assert!(matches!(g, GradBuf::Bf16 { state: Bf16Landing::Landed, .. }));
        assert!(matches!(g.grad(), Grad::Bf16(_)));
        assert_eq!(g.to_f32(), want);
        assert_eq!(sq.to_bits(), want_sq.to_bits());
        // A second micro-batch in the same step: fp32 for good, holding the sum.
        let sq = g.land(&TensorData::new(b.clone(), [n]), &pool).unwrap();
        let (want, want_sq) = fp32_path(&[&a, &b]);
        assert!(matches!(g, GradBuf::F32(_)));
        assert_eq!(g.bytes(), 4 * n as u64);
        assert_eq!(g.to_f32(), want);
        assert_eq!(sq.to_bits(), want_sq.to_bits());
        // The next step starts from zero; the buffer stays fp32.
        g.zero();
        assert!(g.to_f32().iter().all(|&x| x == 0.0));
        // After zero(), a bf16 buffer reads as zero without being rewritten (a landing overwrites
        // it), takes a landing again, and is cleared when read without one.
        let mut h = GradBuf::zeros(n, true);
        h.land(&TensorData::new(a.clone(), [n]), &pool).unwrap();
        h.zero();
        assert!(matches!(h, GradBuf::Bf16 { state: Bf16Landing::Empty, .. }));
        assert!(h.to_f32().iter().all(|&x| x == 0.0));
        let sq = h.land(&TensorData::new(b.clone(), [n]), &pool).unwrap();
        let (want, want_sq) = fp32_path(&[&b]);
        assert_eq!((h.to_f32(), sq.to_bits()), (want, want_sq.to_bits()));
        h.zero();
        match h.grad() {
            Grad::Bf16(x) => assert!(x.iter().all(|v| v.to_bits() == 0)),
            Grad::F32(_) => panic!("still bf16"),
        }
        // f32 data (or a second landing) into a buffer nothing landed in widens it to zeros plus
        // the landing, not to stale values.
        h.land(&TensorData::new(a.clone(), [n]), &pool).unwrap();
        h.zero();
        let f: Vec<f32> = a.iter().map(|x| x.to_f32() * 0.3).collect();
        h.land(&TensorData::new(f.clone(), [n]), &pool).unwrap();
        assert!(matches!(h, GradBuf::F32(_)));
        assert_eq!(h.to_f32(), f);
        // A landing of the wrong length is an error, not a panic.
        let mut k = GradBuf::zeros(n, true);
        assert!(k.land(&TensorData::new(a[..10].to_vec(), [10]), &pool).is_err());
    }

    #[test]
    fn accumulate_returns_sum_of_squares_of_the_total() {
        let mut d = vec![1.0, 2.0];
        let sq = accumulate_sq(&mut d, &[2.0, -4.0]);
        assert_eq!(d, vec![3.0, -2.0]);
        assert_eq!(sq, 13.0);
    }
}
