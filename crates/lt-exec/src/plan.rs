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

    /// One letter per boundary: `G` device (GPU), `H` host, `N` NVMe, `.` recomputed.
    pub fn tiers(&self) -> String {
        self.boundaries
            .iter()
            .map(|p| match p {
                Placement::Device => 'G',
                Placement::Host => 'H',
                Placement::Nvme => 'N',
                Placement::Recompute => '.',
            })
            .collect()
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

    /// The h2d stream's transfers for one micro-batch, in the order compute consumes them:
    /// the embedded tokens (gathered from the host embedding, so the embedding matrix never goes to the
    /// device), the forward layers, the head (final norm and output projection) when `with_head`,
    /// i.e. on the step's first micro-batch, while the last forward layer computes, and then per
    /// backward segment the segment's start boundary if it lives off-device, the recompute layers
    /// and the backward layers. The executor runs exactly this list.
    pub fn uploads(&self, with_head: bool) -> Vec<Upload> {
        let layers = self.boundaries.len().saturating_sub(1);
        let mut out = vec![Upload::Embed];
        out.extend((0..layers).map(Upload::Layer));
        if with_head {
            out.push(Upload::Head);
        }
        for (s, e) in self.segments_backward() {
            if matches!(self.boundaries[s], Placement::Host | Placement::Nvme) {
                out.push(Upload::Boundary(s));
            }
            out.extend((s..e.saturating_sub(1)).map(Upload::Layer));
            out.extend((s..e).rev().map(Upload::Layer));
        }
        out
    }

    /// Host-to-device transfers of one step of `micro_batches` micro-batches: the head once, the rest
    /// per micro-batch (see [`ExecPlan::uploads`]).
    pub fn uploads_per_step(&self, micro_batches: usize) -> usize {
        if micro_batches == 0 {
            return 0;
        }
        self.uploads(true).len() + (micro_batches - 1) * self.uploads(false).len()
    }
}

/// One host-to-device transfer of the h2d stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upload {
    /// The micro-batch's embedded tokens, `[B, T, hidden]` (boundary 0).
    Embed,
    /// Decoder layer `i`'s weights.
    Layer(usize),
    /// Final norm and output projection (the embedding matrix when tied).
    Head,
    /// Offloaded boundary `s` coming back for its backward segment.
    Boundary(usize),
}

impl std::fmt::Display for Upload {
    /// The name of the transfer's span in the trace.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Upload::Embed => write!(f, "upload embed"),
            Upload::Layer(i) => write!(f, "upload L{i}"),
            Upload::Head => write!(f, "upload head"),
            Upload::Boundary(s) => write!(f, "reload B{s}"),
        }
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

    /// Forward layers, the head once, then per segment: its off-device start, recompute, backward.
    #[test]
    fn upload_schedule_follows_the_segments() {
        use Upload::*;
        // Boundaries [device, recompute, host, recompute, device]: segments (2, 4) then (0, 2).
        let p = ExecPlan::every(4, 2, Placement::Host);
        assert_eq!(p.segments_backward(), vec![(2, 4), (0, 2)]);
        let want = [
            Embed,
            Layer(0),
            Layer(1),
            Layer(2),
            Layer(3),
            Head,
            Boundary(2),
            Layer(2),
            Layer(3),
            Layer(2),
            Layer(0),
            Layer(1),
            Layer(0),
        ];
        assert_eq!(p.uploads(true), want);
        let later: Vec<Upload> = want.iter().copied().filter(|u| *u != Head).collect();
        assert_eq!(p.uploads(false), later);
        assert_eq!(p.uploads_per_step(3), 13 + 2 * 12);
        assert_eq!(p.uploads_per_step(0), 0);
    }

    #[test]
    fn ends_must_be_on_device() {
        let mut p = ExecPlan::keep_all(3);
        p.boundaries[3] = Placement::Host;
        assert!(p.validate(3).is_err());
    }
}
