//! Host state shared between the executor's streams and the optimizer thread.
//!
//! Each layer's fp32 master sits behind its own lock and carries a version (the number of optimizer
//! updates applied). The optimizer thread updates layers in forward order and bumps versions; the
//! upload stream waits for the version it needs. That is how the update of layer `i` overlaps the
//! next step's forward of layers `< i` without ever uploading a stale layer.

use std::sync::{Condvar, Mutex, RwLock};

use lt_core::ModelConfig;
use lt_model::host::{HostLayer, HostModel, HostTensor};

/// Embedding, final norm and untied head.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadHost {
    /// `embed_tokens.weight`.
    pub embed_tokens: HostTensor,
    /// `norm.weight`.
    pub norm: HostTensor,
    /// `lm_head.weight` when untied.
    pub lm_head: Option<HostTensor>,
}

/// The model's fp32 masters, shareable across threads.
#[derive(Debug)]
pub struct SharedModel {
    /// Validated config.
    pub config: ModelConfig,
    /// Checkpoint prefix of decoder tensors.
    pub prefix: String,
    /// Embedding, norm and head.
    pub head: RwLock<HeadHost>,
    /// Decoder layers.
    pub layers: Vec<RwLock<HostLayer>>,
    /// Versions: index 0 is the head, `i + 1` is layer `i`.
    versions: Mutex<Vec<u64>>,
    cv: Condvar,
}

/// Index of the head in version calls.
pub const HEAD: usize = 0;

/// Version index of layer `i`.
pub fn layer_slot(i: usize) -> usize {
    i + 1
}

impl SharedModel {
    /// Take ownership of a loaded model; every version starts at `version`.
    pub fn new(host: HostModel, version: u64) -> Self {
        let n = host.layers.len() + 1;
        Self {
            config: host.config,
            prefix: host.prefix,
            head: RwLock::new(HeadHost { embed_tokens: host.embed_tokens, norm: host.norm, lm_head: host.lm_head }),
            layers: host.layers.into_iter().map(RwLock::new).collect(),
            versions: Mutex::new(vec![version; n]),
            cv: Condvar::new(),
        }
    }

    /// A consistent copy as a [`HostModel`] (for checkpoints and export). Call when no update runs.
    pub fn snapshot(&self) -> HostModel {
        let head = self.head.read().map(|h| h.clone()).unwrap_or_else(|e| e.into_inner().clone());
        HostModel {
            config: self.config.clone(),
            embed_tokens: head.embed_tokens,
            norm: head.norm,
            lm_head: head.lm_head,
            layers: self
                .layers
                .iter()
                .map(|l| l.read().map(|g| g.clone()).unwrap_or_else(|e| e.into_inner().clone()))
                .collect(),
            prefix: self.prefix.clone(),
        }
    }

    /// Block until slot `slot` has at least `version`. Returns whether it had to wait.
    pub fn wait_version(&self, slot: usize, version: u64) -> bool {
        let Ok(mut v) = self.versions.lock() else { return false };
        let mut waited = false;
        while v.get(slot).is_some_and(|&cur| cur < version) {
            waited = true;
            v = match self.cv.wait(v) {
                Ok(v) => v,
                Err(_) => return waited,
            };
        }
        waited
    }

    /// Mark slot `slot` as updated to `version`.
    pub fn set_version(&self, slot: usize, version: u64) {
        if let Ok(mut v) = self.versions.lock()
            && let Some(x) = v.get_mut(slot)
        {
            *x = version;
        }
        self.cv.notify_all();
    }

    /// The lowest version over all slots (every slot is at least this fresh).
    pub fn min_version(&self) -> u64 {
        self.versions.lock().map(|v| v.iter().copied().min().unwrap_or(0)).unwrap_or(0)
    }
}
