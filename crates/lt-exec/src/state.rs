//! Host state shared between the executor's streams and the optimizer thread.
//!
//! Each layer's fp32 master sits behind its own lock and carries a version (the number of optimizer
//! updates applied). The optimizer thread updates layers in forward order and bumps versions; the
//! upload stream waits for the version it needs. That is how the update of layer `i` overlaps the
//! next step's forward of layers `< i` without ever uploading a stale layer.
//!
//! On a bf16 device each slot also has a bf16 copy of its masters, the bytes that uploads send
//! ([`SharedModel::fill_upload_copies`]). The optimizer writes it in the same pass as the masters
//! and under the same lock, so a version covers both.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};

use lt_core::ModelConfig;
use lt_model::host::{HostLayer, HostModel, HostTensor};
use lt_model::upload::Bf16Copy;
use lt_optim::{OptimError, ThreadPool, fill_bf16};

/// The bf16 copies of one slot's tensors, in the slot's tensor order (the head: embedding, norm,
/// then `lm_head` when untied; a layer: its specs). `None` for a tensor no upload reads: the
/// embedding of an untied model, whose rows are gathered on the host from the fp32 master
/// (1.1 GB of bf16 on Qwen2.5-7B that the planner does not count either).
pub type UploadCopy = Vec<Option<Bf16Copy>>;

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

impl HeadHost {
    /// Position of the final norm in [`tensors`](Self::tensors) order.
    pub const NORM: usize = 1;

    /// The head's tensors in slot order, which is also the optimizer group's and the upload copy's:
    /// embedding, final norm, then `lm_head` when untied.
    pub fn tensors(&self) -> impl Iterator<Item = &HostTensor> {
        [&self.embed_tokens, &self.norm].into_iter().chain(self.lm_head.as_ref())
    }

    /// Position of the output projection in [`tensors`](Self::tensors) order: `lm_head` when untied,
    /// else the embedding.
    pub fn out_index(&self) -> usize {
        if self.lm_head.is_some() { 2 } else { 0 }
    }
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
    /// bf16 upload copies per slot (indexed as versions); `None` until
    /// [`fill_upload_copies`](Self::fill_upload_copies), and for good on f32 devices, which upload
    /// the masters themselves.
    copies: Vec<Mutex<Option<UploadCopy>>>,
    /// Copies the optimizer found still held by an upload (see [`Self::upload_copy_clones`]).
    copy_clones: AtomicU64,
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
            copies: (0..n).map(|_| Mutex::new(None)).collect(),
            copy_clones: AtomicU64::new(0),
        }
    }

    /// Make the bf16 upload copy of every master (on `pool`'s threads), which the optimizer then
    /// keeps current. Call once, before training starts: after loading or resuming the masters.
    pub fn fill_upload_copies(&self, pool: &ThreadPool) -> Result<(), OptimError> {
        let fill = |tensors: &mut dyn Iterator<Item = (&HostTensor, bool)>| -> Result<UploadCopy, OptimError> {
            tensors
                .map(|(t, uploaded)| {
                    if !uploaded {
                        return Ok(None);
                    }
                    let mut c = lt_model::upload::CopyBuf::zeroed(t.data.len());
                    fill_bf16(&t.data, c.as_mut_slice(), pool)?;
                    // Page-locked now where the device offers it (CUDA), so that the first step's
                    // uploads do not pay for it; elsewhere, or refused, it stays pageable.
                    c.pin();
                    Ok(Some(Arc::new(c)))
                })
                .collect()
        };
        {
            let h = self.head.read().unwrap_or_else(|e| e.into_inner());
            let out = h.out_index();
            // The embedding is uploaded only as the tied output projection.
            let c = fill(&mut h.tensors().enumerate().map(|(k, t)| (t, k != 0 || out == 0)))?;
            *self.copy_slot(HEAD) = Some(c);
        }
        for (i, l) in self.layers.iter().enumerate() {
            let l = l.read().unwrap_or_else(|e| e.into_inner());
            let c = fill(&mut l.tensors.iter().map(|t| (t, true)))?;
            *self.copy_slot(layer_slot(i)) = Some(c);
        }
        Ok(())
    }

    /// Whether uploads read bf16 copies (see [`fill_upload_copies`](Self::fill_upload_copies)).
    pub fn has_upload_copies(&self) -> bool {
        self.copies.first().is_some_and(|c| c.lock().map(|c| c.is_some()).unwrap_or(false))
    }

    /// Slot `slot`'s bf16 copies, shared (cheap: one reference per tensor), if it has them.
    pub fn upload_copy(&self, slot: usize) -> Option<UploadCopy> {
        self.copies.get(slot).and_then(|c| c.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// How many times the optimizer found a tensor's bf16 copy still held by an upload and wrote a
    /// fresh buffer instead (correct, but a copy the step order should make unnecessary: a layer is
    /// updated only after the backward that consumed its last upload). Zero in a healthy run.
    pub fn upload_copy_clones(&self) -> u64 {
        self.copy_clones.load(Ordering::Relaxed)
    }

    /// Bytes of the fp32 masters (every tensor's values).
    pub fn master_bytes(&self) -> u64 {
        let head = self.head.read().unwrap_or_else(|e| e.into_inner());
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.read().unwrap_or_else(|e| e.into_inner()).tensors.iter().map(|t| t.data.len()).sum::<usize>())
            .sum();
        (4 * (head.tensors().map(|t| t.data.len()).sum::<usize>() + layers)) as u64
    }

    /// Bytes of the bf16 upload copies held now (0 before [`fill_upload_copies`](Self::fill_upload_copies)
    /// and on f32 devices).
    pub fn upload_copy_bytes(&self) -> u64 {
        let held: usize = self
            .copies
            .iter()
            .map(|c| {
                let c = c.lock().unwrap_or_else(|e| e.into_inner());
                c.iter().flatten().flatten().map(|b| b.as_slice().len()).sum::<usize>()
            })
            .sum();
        (2 * held) as u64
    }

    pub(crate) fn count_copy_clone(&self) {
        self.copy_clones.fetch_add(1, Ordering::Relaxed);
    }

    /// Slot `slot`'s copies, locked for the optimizer to write.
    ///
    /// # Panics
    /// If `slot` is not a slot of this model.
    pub(crate) fn copy_slot(&self, slot: usize) -> MutexGuard<'_, Option<UploadCopy>> {
        self.copies[slot].lock().unwrap_or_else(|e| e.into_inner())
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

    /// The masters as a [`HostModel`], moved out without a copy (the upload copies are dropped).
    pub fn into_host(self) -> HostModel {
        let head = self.head.into_inner().unwrap_or_else(|e| e.into_inner());
        HostModel {
            config: self.config,
            embed_tokens: head.embed_tokens,
            norm: head.norm,
            lm_head: head.lm_head,
            layers: self.layers.into_iter().map(|l| l.into_inner().unwrap_or_else(|e| e.into_inner())).collect(),
            prefix: self.prefix,
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

/// Streamed evaluation reads the masters where they are, one layer under its lock at a time
/// (`lt_model::stream::Streamed`): no copy of the model. On a bf16 device the uploads share the
/// optimizer's bf16 copies, as training's do. Call when no update runs ([`crate::Trainer::flush`]).
impl lt_model::stream::HostWeights for SharedModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn layer(&self, i: usize, dtype: burn::tensor::DType) -> lt_model::weights::PreparedLayer {
        use lt_model::weights::PreparedLayer;
        let l = self.layers[i].read().unwrap_or_else(|e| e.into_inner());
        let kind = self.config.layer_types[i];
        let shared = (dtype == burn::tensor::DType::BF16)
            .then(|| self.upload_copy(layer_slot(i)))
            .flatten()
            .and_then(|c| c.into_iter().collect::<Option<Vec<_>>>())
            .and_then(|c| PreparedLayer::from_copies(&l, kind, &c));
        shared.unwrap_or_else(|| PreparedLayer::converted(&l, kind, dtype))
    }

    fn embed_rows(&self, ids: &[Vec<u32>], dtype: burn::tensor::DType) -> burn::tensor::TensorData {
        let h = self.head.read().unwrap_or_else(|e| e.into_inner());
        lt_model::stream::gather_rows(&h.embed_tokens.data, self.config.hidden_size, ids, dtype)
    }

    fn head(&self, dtype: burn::tensor::DType) -> (burn::tensor::TensorData, burn::tensor::TensorData) {
        let h = self.head.read().unwrap_or_else(|e| e.into_inner());
        let out = h.lm_head.as_ref().unwrap_or(&h.embed_tokens);
        let host = |t: &HostTensor| lt_model::upload::host_data(&t.data, &t.shape, dtype);
        (host(&h.norm), host(out))
    }
}
