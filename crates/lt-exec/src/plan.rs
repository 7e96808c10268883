//! What the executor runs: one placement per layer boundary.

use serde::{Deserialize, Serialize};

use crate::error::ExecError;

/// Where boundary activation `i` (the input of layer `i`; `L` is the input of the head) lives
/// between forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Kept in device memory.
    Device,
    /// Copied to (pinned) host memory and uploaded again for backward.
    Host,
    /// Spilled to the NVMe store and read back for backward.
    Nvme,
    /// Dropped; recomputed from the previous kept boundary during backward.
    Recompute,
}

impl Placement {
    /// Kept in some tier.
    pub fn is_kept(self) -> bool {
        self != Placement::Recompute
    }
}

/// The executor's plan: `L + 1` boundary placements plus step-shape knobs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecPlan {
    /// Placement of boundaries `0..=L`. The first and last must be `Device`.
    pub boundaries: Vec<Placement>,
    /// Tokens per head/loss chunk: logits exist for at most this many tokens at once.
    pub loss_chunk_tokens: usize,
}

impl ExecPlan {
    /// Keep every boundary on the device.
    pub fn keep_all(layers: usize) -> Self {
        Self { boundaries: vec![Placement::Device; layers + 1], loss_chunk_tokens: 1024 }
    }

    /// Keep only the ends; recompute everything in between.
    pub fn recompute_all(layers: usize) -> Self {
        let mut b = vec![Placement::Recompute; layers + 1];
        b[0] = Placement::Device;
        b[layers] = Placement::Device;
        Self { boundaries: b, loss_chunk_tokens: 1024 }
    }

    /// MegaTrain's policy: a checkpoint every `k` layers, kept on the device.
    pub fn every(layers: usize, k: usize, tier: Placement) -> Self {
        let k = k.max(1);
        let mut b: Vec<Placement> =
            (0..=layers).map(|i| if i % k == 0 { tier } else { Placement::Recompute }).collect();
        b[0] = Placement::Device;
        b[layers] = Placement::Device;
        Self { boundaries: b, loss_chunk_tokens: 1024 }
    }

    /// Every interior boundary in `tier` (e.g. all on NVMe).
    pub fn all_in(layers: usize, tier: Placement) -> Self {
        Self::every(layers, 1, tier)
    }

    /// Check the plan against a model with `layers` decoder layers.
    pub fn validate(&self, layers: usize) -> Result<(), ExecError> {
        let bad = |reason: String| Err(ExecError::PlanMismatch { reason });
        if self.boundaries.len() != layers + 1 {
            return bad(format!(
                "{} boundaries for a {layers}-layer model (need {})",
                self.boundaries.len(),
                layers + 1
            ));
        }
        if self.boundaries[0] != Placement::Device || self.boundaries[layers] != Placement::Device {
            return bad("boundaries 0 and L must be kept on the device".into());
        }
        if self.loss_chunk_tokens == 0 {
            return bad("loss_chunk_tokens must be > 0".into());
        }
        Ok(())
    }

    /// The executor's view of a planner's plan (lt-sched): the same boundary placements and loss chunk.
    pub fn from_sched(p: &lt_sched::plan::Plan) -> Self {
        let boundaries = p
            .boundaries
            .iter()
            .map(|b| match b {
                lt_sched::plan::Placement::Gpu => Placement::Device,
                lt_sched::plan::Placement::Host => Placement::Host,
                lt_sched::plan::Placement::Nvme => Placement::Nvme,
                lt_sched::plan::Placement::Recompute => Placement::Recompute,
            })
            .collect();
        Self { boundaries, loss_chunk_tokens: p.loss_chunk_tokens.max(1) }
    }

    /// Kept boundaries in order (always includes 0 and L).
    pub fn kept(&self) -> Vec<usize> {
        self.boundaries.iter().enumerate().filter(|(_, p)| p.is_kept()).map(|(i, _)| i).collect()
    }

    /// Segments `(s, e)` between consecutive kept boundaries, top segment first (backward order).
    pub fn segments_backward(&self) -> Vec<(usize, usize)> {
        let k = self.kept();
        k.windows(2).rev().map(|w| (w[0], w[1])).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatrain_every_four_and_segments() {
        let p = ExecPlan::every(10, 4, Placement::Device);
        assert_eq!(p.kept(), vec![0, 4, 8, 10]);
        assert_eq!(p.segments_backward(), vec![(8, 10), (4, 8), (0, 4)]);
        p.validate(10).unwrap();
        assert!(p.validate(9).is_err());
    }

    #[test]
    fn ends_must_be_on_device() {
        let mut p = ExecPlan::keep_all(3);
        p.boundaries[3] = Placement::Host;
        assert!(p.validate(3).is_err());
    }
}
