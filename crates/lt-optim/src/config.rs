//! Hyper-parameters and the choice between fp32 and 8-bit state.

use crate::error::{OptimError, Result};

/// AdamW hyper-parameters, with PyTorch's meaning (`torch.optim.AdamW`): decoupled weight decay
/// `p *= 1 - lr * weight_decay`, bias-corrected moments, and `eps` added *after* the square root.
///
/// Values are f64 like Python floats; the kernels convert them to f32 where PyTorch does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to `sqrt(v_hat)`.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient L2 norm to this value (`None`: no clipping). The clip scale is
    /// `min(1, max_norm / (norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`.
    pub max_grad_norm: Option<f64>,
}

impl Default for AdamWConfig {
    /// PyTorch's AdamW defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01), no clipping.
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, max_grad_norm: None }
    }
}

impl AdamWConfig {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, value, reason| Err(OptimError::InvalidConfig { field, value, reason });
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", self.lr, "must be finite and >= 0");
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("beta1", self.beta1, "must be in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("beta2", self.beta2, "must be in [0, 1)");
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps", self.eps, "must be finite and > 0");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", self.weight_decay, "must be finite and >= 0");
        }
        if let Some(m) = self.max_grad_norm
            && !(m.is_finite() && m > 0.0)
        {
            return bad("max_grad_norm", m, "must be finite and > 0");
        }
        Ok(())
    }
}

/// Settings of the 8-bit state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quant8Config {
    /// Elements per quantization block (one f32 absmax each). bitsandbytes' CPU path uses 256.
    pub block_size: usize,
    /// Tensors with fewer elements keep fp32 state (bitsandbytes' `min_8bit_size`): their state is
    /// negligible in size and norms/biases are the most sensitive to quantization noise.
    pub min_8bit_numel: usize,
    /// How a value becomes a byte: bitsandbytes' dynamic maps or the `f8` small floats.
    pub codes: Q8Codes,
}

/// The 8-bit state's codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Q8Codes {
    /// bitsandbytes' dynamic maps (signed for `m`, unsigned for `v`), the exact nearest entry, one
    /// f32 absmax per block: bitsandbytes' `AdamW8bit` (`crate::qmap` says where its CPU rounding
    /// differs).
    #[default]
    Dynamic,
    /// Small floats found by integer rounding (`m`: sign and 3 mantissa bits over 16 octaves, `v`: 3
    /// mantissa bits over 32 octaves, each below its block's largest value): every value to 6.25%,
    /// `v` rounded with a deterministic dither so that it drifts without bias, found and read with a
    /// few integer operations instead of a table search (see `crate::f8`).
    F8,
}

impl Default for Quant8Config {
    /// Block 256, fp32 state below 4096 elements: bitsandbytes' defaults.
    fn default() -> Self {
        Quant8Config { block_size: 256, min_8bit_numel: 4096, codes: Q8Codes::Dynamic }
    }
}

impl Quant8Config {
    /// Checks the block size (a multiple of 16, the SIMD width, between 16 and 4096).
    pub fn validate(&self) -> Result<()> {
        let b = self.block_size;
        if b == 0 || !b.is_multiple_of(16) || b > MAX_BLOCK {
            return Err(OptimError::InvalidBlockSize { block: b });
        }
        Ok(())
    }
}

/// Largest supported block: the kernel keeps one block of `m` and `v` in stack buffers.
pub(crate) const MAX_BLOCK: usize = 4096;

/// Which AdamW: fp32 moments for every tensor, or 8-bit block-wise moments for large tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// fp32 `m` and `v` (8 bytes of state per parameter), bit-for-bit PyTorch's formula.
    AdamW,
    /// 8-bit `m` (signed dynamic map) and `v` (unsigned dynamic map), about 2.03 bytes per parameter.
    AdamW8bit(Quant8Config),
}

impl OptimizerKind {
    /// `adamw8bit` with bitsandbytes' defaults.
    pub fn adamw8bit() -> Self {
        OptimizerKind::AdamW8bit(Quant8Config::default())
    }

    /// `adamw8bit-f8`: bitsandbytes' block and size defaults with [`Q8Codes::F8`] codes.
    pub fn adamw8bit_f8() -> Self {
        OptimizerKind::AdamW8bit(Quant8Config { codes: Q8Codes::F8, ..Quant8Config::default() })
    }

    /// Short name (`adamw`, `adamw8bit`, `adamw8bit-f8`).
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::AdamW8bit(Quant8Config { codes: Q8Codes::Dynamic, .. }) => "adamw8bit",
            OptimizerKind::AdamW8bit(Quant8Config { codes: Q8Codes::F8, .. }) => "adamw8bit-f8",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        assert!(AdamWConfig::default().validate().is_ok());
        assert!(Quant8Config::default().validate().is_ok());
        let e = AdamWConfig { beta2: 1.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("beta2"), "{e}");
        let e = AdamWConfig { max_grad_norm: Some(f64::NAN), ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("max_grad_norm"), "{e}");
        assert!(AdamWConfig { eps: 0.0, ..Default::default() }.validate().is_err());
        assert!(AdamWConfig { lr: -1.0, ..Default::default() }.validate().is_err());
        for b in [0, 8, 100, 8192] {
            assert!(
                Quant8Config { block_size: b, min_8bit_numel: 0, ..Default::default() }.validate().is_err(),
                "block {b}"
            );
        }
        assert!(Quant8Config { block_size: 64, min_8bit_numel: 0, ..Default::default() }.validate().is_ok());
    }
}
