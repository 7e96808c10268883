//! [`TokenizedDataset`]: every tokenized example of one split, stored compactly.
//!
//! Ids are kept in one flat `Vec<u32>`; labels, which are almost always either the id or -100, are kept as
//! one bit per token. The rare pre-tokenized example whose labels are something else keeps its labels
//! verbatim on the side. That is about 4.1 bytes per token instead of 12 for `Vec<u32>` + `Vec<i64>`: the
//! whole of MetaMathQA (~100M Qwen tokens) fits in about 400 MB.

use std::collections::BTreeMap;

use crate::encode::{IGNORE_INDEX, TokenizedExample};
use crate::rng::{fnv1a64, mix64};

/// Tokenized examples, addressable by index.
#[derive(Debug, Clone)]
pub struct TokenizedDataset {
    ids: Vec<u32>,
    /// `offsets[i]..offsets[i + 1]` are the tokens of example `i`.
    offsets: Vec<usize>,
    /// Bit `t` set: the label of token `t` is its id; clear: -100 (unless overridden in `custom`).
    trained: Vec<u64>,
    custom: BTreeMap<usize, Vec<i64>>,
    loss_tokens: usize,
    max_len: usize,
}

impl Default for TokenizedDataset {
    fn default() -> Self {
        Self::new()
    }
}

impl TokenizedDataset {
    /// An empty dataset.
    pub fn new() -> Self {
        Self {
            ids: Vec::new(),
            offsets: vec![0],
            trained: Vec::new(),
            custom: BTreeMap::new(),
            loss_tokens: 0,
            max_len: 0,
        }
    }

    /// Builds a dataset from examples.
    pub fn from_examples<'a>(examples: impl IntoIterator<Item = &'a TokenizedExample>) -> Self {
        let mut d = Self::new();
        for ex in examples {
            d.push(ex);
        }
        d
    }

    /// Appends an example. Labels beyond the ids' length are ignored; missing ones count as -100.
    pub fn push(&mut self, ex: &TokenizedExample) {
        let base = self.ids.len();
        let index = self.len();
        self.ids.extend_from_slice(&ex.input_ids);
        self.trained.resize(self.ids.len().div_ceil(64), 0);
        let mut plain = true;
        for (k, &id) in ex.input_ids.iter().enumerate() {
            let label = ex.labels.get(k).copied().unwrap_or(IGNORE_INDEX);
            if label == i64::from(id) {
                let t = base + k;
                self.trained[t / 64] |= 1 << (t % 64);
            } else if label != IGNORE_INDEX {
                plain = false;
            }
        }
        if !plain {
            let mut labels = ex.labels.clone();
            labels.resize(ex.input_ids.len(), IGNORE_INDEX);
            self.custom.insert(index, labels);
        }
        self.loss_tokens += ex.labels.iter().take(ex.input_ids.len()).filter(|&&l| l != IGNORE_INDEX).count();
        self.max_len = self.max_len.max(ex.input_ids.len());
        self.offsets.push(self.ids.len());
    }

    /// Appends all examples of `other`, in order.
    pub fn append(&mut self, other: &TokenizedDataset) {
        for i in 0..other.len() {
            if let Some(ex) = other.get(i) {
                self.push(&ex);
            }
        }
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Whether there are no examples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of tokens of example `i` (0 when out of range).
    pub fn example_len(&self, i: usize) -> usize {
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(a), Some(b)) => b - a,
            _ => 0,
        }
    }

    /// The ids of example `i`.
    pub fn ids(&self, i: usize) -> Option<&[u32]> {
        let (a, b) = (*self.offsets.get(i)?, *self.offsets.get(i + 1)?);
        self.ids.get(a..b)
    }

    /// Appends the labels of example `i` to `out`.
    pub fn extend_labels(&self, i: usize, out: &mut Vec<i64>) {
        if let Some(custom) = self.custom.get(&i) {
            out.extend_from_slice(custom);
            return;
        }
        let (Some(&a), Some(&b)) = (self.offsets.get(i), self.offsets.get(i + 1)) else { return };
        out.extend(
            (a..b).map(
                |t| {
                    if self.trained[t / 64] >> (t % 64) & 1 == 1 { i64::from(self.ids[t]) } else { IGNORE_INDEX }
                },
            ),
        );
    }

    /// Example `i`, materialised.
    pub fn get(&self, i: usize) -> Option<TokenizedExample> {
        let input_ids = self.ids(i)?.to_vec();
        let mut labels = Vec::with_capacity(input_ids.len());
        self.extend_labels(i, &mut labels);
        Some(TokenizedExample { input_ids, labels })
    }

    /// Total number of tokens (no padding exists here).
    pub fn real_tokens(&self) -> usize {
        self.ids.len()
    }

    /// Total number of labels the loss uses.
    pub fn loss_tokens(&self) -> usize {
        self.loss_tokens
    }

    /// Length of the longest example.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// A hash of the example count and lengths, to check that a saved batcher state belongs to this data.
    pub fn fingerprint(&self) -> u64 {
        let mut bytes = Vec::with_capacity(self.offsets.len() * 8);
        for o in &self.offsets {
            bytes.extend_from_slice(&(*o as u64).to_le_bytes());
        }
        mix64(fnv1a64(&bytes) ^ self.loss_tokens as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_round_trip_including_custom_labels() {
        let exs = vec![
            TokenizedExample { input_ids: vec![5, 6, 7], labels: vec![-100, 6, 7] },
            TokenizedExample { input_ids: vec![], labels: vec![] },
            TokenizedExample {
                input_ids: (0..130).collect(),
                labels: (0..130).map(|i| if i % 3 == 0 { -100 } else { i }).collect(),
            },
            // A label that is neither the id nor -100 (allowed for pre-tokenized data).
            TokenizedExample { input_ids: vec![1, 2], labels: vec![-100, 9] },
        ];
        let d = TokenizedDataset::from_examples(&exs);
        assert_eq!(d.len(), 4);
        for (i, ex) in exs.iter().enumerate() {
            assert_eq!(d.get(i).as_ref(), Some(ex), "example {i}");
            assert_eq!(d.example_len(i), ex.len());
        }
        assert_eq!(d.real_tokens(), 135);
        assert_eq!(d.loss_tokens(), exs.iter().map(TokenizedExample::loss_tokens).sum::<usize>());
        assert_eq!(d.max_len(), 130);
        assert_eq!(d.get(4), None);
        let mut e = TokenizedDataset::new();
        e.append(&d);
        assert_eq!(e.fingerprint(), d.fingerprint());
        e.push(&exs[0]);
        assert_ne!(e.fingerprint(), d.fingerprint());
    }
}
