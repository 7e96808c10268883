//! Host gradient buffers with fused sum-of-squares accumulation.

use lt_model::host::HostModel;

/// fp32 gradients of every parameter, laid out like [`HostModel`].
#[derive(Debug, Clone, PartialEq)]
pub struct HostGrads {
    /// Per layer, per parameter (in `layer_params` order).
    pub layers: Vec<Vec<Vec<f32>>>,
    /// `embed_tokens.weight` (includes the head's contribution when tied).
    pub embed_tokens: Vec<f32>,
    /// `norm.weight`.
    pub norm: Vec<f32>,
    /// `lm_head.weight` when untied.
    pub lm_head: Option<Vec<f32>>,
}

impl HostGrads {
    /// Zero gradients shaped like `host`.
    pub fn zeros_like(host: &HostModel) -> Self {
        Self {
            layers: host.layers.iter().map(|l| l.tensors.iter().map(|t| vec![0.0; t.data.len()]).collect()).collect(),
            embed_tokens: vec![0.0; host.embed_tokens.data.len()],
            norm: vec![0.0; host.norm.data.len()],
            lm_head: host.lm_head.as_ref().map(|t| vec![0.0; t.data.len()]),
        }
    }

    /// Set every gradient to zero (start of a step).
    pub fn zero(&mut self) {
        for l in &mut self.layers {
            for p in l {
                p.fill(0.0);
            }
        }
        self.embed_tokens.fill(0.0);
        self.norm.fill(0.0);
        if let Some(h) = &mut self.lm_head {
            h.fill(0.0);
        }
    }

    /// Iterate `(checkpoint-relative name, gradient)` over every parameter.
    pub fn named<'a>(&'a self, host: &'a HostModel) -> impl Iterator<Item = (String, &'a [f32])> + 'a {
        let outer = [("embed_tokens.weight".to_string(), self.embed_tokens.as_slice()), ("norm.weight".into(), &self.norm)]
            .into_iter()
            .chain(self.lm_head.as_deref().map(|h| ("lm_head.weight".to_string(), h)));
        let layers = self.layers.iter().enumerate().flat_map(move |(i, l)| {
            l.iter().zip(&host.layers[i].specs).map(move |(g, s)| (format!("layers.{i}.{}", s.name), g.as_slice()))
        });
        outer.chain(layers)
    }
}

/// `dst += src`, returning the sum of squares of the updated `dst` (one pass: the fused norm).
pub fn accumulate_sq(dst: &mut [f32], src: &[f32]) -> f64 {
    let mut acc = 0.0f64;
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
        acc += f64::from(*d) * f64::from(*d);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulate_returns_sum_of_squares_of_the_total() {
        let mut d = vec![1.0, 2.0];
        let sq = accumulate_sq(&mut d, &[2.0, -4.0]);
        assert_eq!(d, vec![3.0, -2.0]);
        assert_eq!(sq, 13.0);
    }
}
