//! The train/eval split, grouped so that no rewrite of an evaluation question is trained on.
//!
//! MetaMathQA holds several rewrites of each original question (GSM_AnsAug, GSM_Rephrased, GSM_SV,
//! GSM_FOBAR, ...); a record-level random split would put rewrites of one question on both sides. Here the
//! side is a pure function of the record's group key (its `original_question`) and the seed:
//!
//! `u = unit(mix64(fnv1a64(key) ^ mix64(seed)))`, and the group is in evaluation when `u < eval_fraction`,
//!
//! where `unit` maps the top 53 bits to `[0, 1)`. It needs no pass over the data, gives the same answer on
//! every machine, and the realised fraction of groups is `eval_fraction` up to sampling noise.

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};
use crate::rng::{fnv1a64, mix64, unit_f64};

/// Which side of the split a record is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Side {
    /// Training.
    Train,
    /// Held-out evaluation.
    Eval,
}

/// A deterministic split by group key.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GroupSplit {
    eval_fraction: f64,
    seed: u64,
}

impl GroupSplit {
    /// A split that sends about `eval_fraction` (in `[0, 1]`) of the groups to evaluation; 1 sends
    /// every group (a test file evaluated whole by `lt eval`).
    pub fn new(eval_fraction: f64, seed: u64) -> Result<Self> {
        if !(0.0..=1.0).contains(&eval_fraction) {
            return Err(DataError::InvalidConfig {
                field: "eval_fraction",
                reason: format!("{eval_fraction} is not in [0, 1]"),
            });
        }
        Ok(Self { eval_fraction, seed })
    }

    /// The fraction of groups held out.
    pub fn eval_fraction(&self) -> f64 {
        self.eval_fraction
    }

    /// The 64-bit hash of a group key (seed-independent; useful to count distinct groups).
    pub fn group_hash(key: &str) -> u64 {
        fnv1a64(key.as_bytes())
    }

    /// The side of a group, from its hash.
    pub fn side_of_hash(&self, hash: u64) -> Side {
        if unit_f64(mix64(hash ^ mix64(self.seed))) < self.eval_fraction { Side::Eval } else { Side::Train }
    }

    /// The side of a group key.
    pub fn side(&self, key: &str) -> Side {
        self.side_of_hash(Self::group_hash(key))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::rng::SplitMix64;

    #[test]
    fn fraction_one_holds_out_every_group() {
        let s = GroupSplit::new(1.0, 7).unwrap_or_else(|e| panic!("{e}"));
        assert!((0..1000).all(|i| s.side(&format!("q{i}")) == Side::Eval));
        assert!(GroupSplit::new(1.5, 7).is_err());
    }

    /// Property: over many groups with several rewrites each (shuffled, like MetaMathQA), every group lands
    /// wholly on one side, for many seeds and fractions, and the eval share of groups is near the fraction.
    #[test]
    fn grouped_split_never_leaks_and_hits_the_fraction() {
        let mut rng = SplitMix64::new(7);
        for &(fraction, seed) in &[(0.3, 42u64), (0.05, 1), (0.5, 123_456_789), (0.9, 0)] {
            let split = GroupSplit::new(fraction, seed).unwrap_or_else(|e| panic!("{e}"));
            let groups = 4000;
            let mut records: Vec<(String, usize)> = Vec::new();
            for g in 0..groups {
                let rewrites = 1 + rng.below(6) as usize;
                for r in 0..rewrites {
                    records.push((format!("Original question number {g}: what is {g} + {}?", g % 7), r));
                }
            }
            rng.shuffle(&mut records);
            let mut side_of: HashMap<&str, Side> = HashMap::new();
            for (key, _) in &records {
                let side = split.side(key);
                let first = *side_of.entry(key.as_str()).or_insert(side);
                assert_eq!(first, side, "group {key:?} is on both sides");
            }
            assert_eq!(side_of.len(), groups);
            let eval = side_of.values().filter(|&&s| s == Side::Eval).count() as f64 / groups as f64;
            // Binomial standard deviation is at most sqrt(0.25 / 4000) = 0.008; allow 5 sigma.
            assert!((eval - fraction).abs() < 0.04, "fraction {fraction}: realised {eval}");
        }
    }

    #[test]
    fn split_depends_on_the_seed_and_is_stable() {
        let a = GroupSplit::new(0.3, 1).unwrap_or_else(|e| panic!("{e}"));
        let b = GroupSplit::new(0.3, 2).unwrap_or_else(|e| panic!("{e}"));
        let keys: Vec<String> = (0..500).map(|i| format!("q{i}")).collect();
        let sa: Vec<Side> = keys.iter().map(|k| a.side(k)).collect();
        let sb: Vec<Side> = keys.iter().map(|k| b.side(k)).collect();
        assert_ne!(sa, sb);
        assert_eq!(sa, keys.iter().map(|k| a.side(k)).collect::<Vec<_>>());
        let none = GroupSplit::new(0.0, 1).unwrap_or_else(|e| panic!("{e}"));
        assert!(keys.iter().all(|k| none.side(k) == Side::Train));
        assert!(GroupSplit::new(1.0 + 1e-9, 1).is_err());
        assert!(GroupSplit::new(-0.1, 1).is_err());
        assert!(GroupSplit::new(f64::NAN, 1).is_err());
    }
}
