//! When a run saves a checkpoint: [`SaveSchedule`] turns `--save-every` into a yes or no after each
//! step, and for `auto` chooses the interval from measured save and step times.
//!
//! `auto` saves after every step while a save costs at most [`AUTO_SAVE_BUDGET`] of the training
//! time, which on small models (the demo, the fixtures) is every step, so a `kill -9` loses at most
//! the step in progress. A large model's save (fp32 masters and the optimizer state, 6 B/param with
//! 8-bit state: ~45 GB for a 7B model) takes longer than a step; then every N steps, N the smallest
//! interval that keeps saving within the budget, and the run says so with what a kill would lose.

use crate::config::SaveEvery;

/// The share of training time that `--save-every auto` may spend saving checkpoints.
pub const AUTO_SAVE_BUDGET: f64 = 0.05;

/// How many of the latest save and step times the interval is chosen from (their medians).
const WINDOW: usize = 16;

/// Decides after each step whether to save; for [`SaveEvery::Auto`], adapts the interval.
#[derive(Debug, Clone)]
pub struct SaveSchedule {
    policy: SaveEvery,
    /// Steps finished since the last save (or since the run started).
    since_save: u64,
    /// `auto`'s current interval in steps (1 until a save was measured).
    every: u64,
    /// The first step's time: a warm-up (kernel compilation, autotuning, first allocations), used
    /// only until a second step is timed.
    first_step: Option<f64>,
    step_seconds: Vec<f64>,
    save_seconds: Vec<f64>,
}

/// What `auto` decided after a save.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AutoInterval {
    /// Save every this many steps from now on.
    pub every: u64,
    /// The median save time it was chosen from, seconds.
    pub save_seconds: f64,
    /// The median step time it was chosen from, seconds.
    pub step_seconds: f64,
}

impl AutoInterval {
    /// The share of training time saving takes at this interval.
    pub fn overhead(&self) -> f64 {
        self.save_seconds / (self.every as f64 * self.step_seconds).max(f64::MIN_POSITIVE)
    }
}

impl SaveSchedule {
    /// A schedule for `policy`, starting after a save (or at the run's start).
    pub fn new(policy: SaveEvery) -> Self {
        Self { policy, since_save: 0, every: 1, first_step: None, step_seconds: Vec::new(), save_seconds: Vec::new() }
    }

    /// Step `step` finished in `seconds`: whether to save now.
    pub fn step_done(&mut self, step: u64, seconds: f64) -> bool {
        self.since_save += 1;
        if self.first_step.is_none() && self.step_seconds.is_empty() {
            self.first_step = Some(seconds);
        } else {
            push_window(&mut self.step_seconds, seconds);
        }
        match self.policy {
            SaveEvery::Steps(0) => false,
            SaveEvery::Steps(n) => step.is_multiple_of(n),
            SaveEvery::Auto => self.since_save >= self.every,
        }
    }

    /// A save took `seconds`. Under `auto`, returns the interval when it changed (and after the first
    /// save, which sets it): it grows as soon as saving at the current interval costs more than the
    /// budget, and shrinks only when it costs less than a third of it (no flapping on noisy saves).
    pub fn saved(&mut self, seconds: f64) -> Option<AutoInterval> {
        self.since_save = 0;
        if self.policy != SaveEvery::Auto {
            return None;
        }
        let first = self.save_seconds.is_empty();
        push_window(&mut self.save_seconds, seconds);
        let step = match (self.step_seconds.is_empty(), self.first_step) {
            (true, Some(first)) => first,
            _ => median(&self.step_seconds),
        };
        let save = median(&self.save_seconds);
        let at = |every| AutoInterval { every, save_seconds: save, step_seconds: step };
        let target = auto_interval(save, step);
        let now = at(self.every).overhead();
        let changed =
            (now > AUTO_SAVE_BUDGET && target > self.every) || (now < AUTO_SAVE_BUDGET / 3.0 && target < self.every);
        if changed {
            self.every = target;
        }
        (changed || first).then(|| at(self.every))
    }
}

/// The smallest interval in steps at which saves of `save` seconds cost at most the budget of steps
/// of `step` seconds.
pub fn auto_interval(save: f64, step: f64) -> u64 {
    if save.is_nan() || step.is_nan() || save <= 0.0 || step <= 0.0 {
        return 1;
    }
    let n = (save / (AUTO_SAVE_BUDGET * step)).ceil();
    if n >= u64::MAX as f64 { u64::MAX } else { (n as u64).max(1) }
}

/// `0.2 s`, `7.5 min`, `2.1 h`: how long a stretch of training is.
pub fn human_seconds(s: f64) -> String {
    match s {
        s if s < 120.0 => format!("{s:.1} s"),
        s if s < 7200.0 => format!("{:.1} min", s / 60.0),
        s => format!("{:.1} h", s / 3600.0),
    }
}

fn push_window(v: &mut Vec<f64>, x: f64) {
    if v.len() == WINDOW {
        v.remove(0);
    }
    v.push(x);
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let mid = s.len() / 2;
    if s.len() % 2 == 1 { s[mid] } else { 0.5 * (s[mid - 1] + s[mid]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps of `step` seconds with saves of `save` seconds: the steps after which a save ran.
    fn run(policy: SaveEvery, steps: u64, step: f64, save: impl Fn(u64) -> f64) -> (Vec<u64>, Vec<AutoInterval>) {
        let mut s = SaveSchedule::new(policy);
        let (mut saved, mut said) = (Vec::new(), Vec::new());
        for k in 1..=steps {
            if s.step_done(k, step) {
                saved.push(k);
                said.extend(s.saved(save(k)));
            }
        }
        (saved, said)
    }

    #[test]
    fn fixed_intervals_save_at_multiples_and_zero_never() {
        assert_eq!(run(SaveEvery::Steps(3), 10, 1.0, |_| 100.0).0, vec![3, 6, 9]);
        assert!(run(SaveEvery::Steps(0), 10, 1.0, |_| 0.0).0.is_empty());
        assert!(run(SaveEvery::Steps(3), 10, 1.0, |_| 100.0).1.is_empty(), "fixed intervals announce nothing");
    }

    #[test]
    fn auto_saves_every_step_while_a_save_is_cheap() {
        // 2% of a step: within the budget.
        let (saved, said) = run(SaveEvery::Auto, 20, 0.5, |_| 0.01);
        assert_eq!(saved, (1..=20).collect::<Vec<_>>());
        assert_eq!(said.len(), 1, "announced once, after the first save");
        assert_eq!(said[0].every, 1);
        assert!((said[0].overhead() - 0.02).abs() < 1e-12);
    }

    #[test]
    fn auto_spaces_expensive_saves_to_the_budget() {
        // A 7B-sized save: 20 s against 4 s steps needs 100 steps for 5%.
        let (saved, said) = run(SaveEvery::Auto, 400, 4.0, |_| 20.0);
        assert_eq!(saved, vec![1, 101, 201, 301]);
        assert_eq!(said.iter().map(|a| a.every).collect::<Vec<_>>(), vec![100]);
        assert!(said[0].overhead() <= AUTO_SAVE_BUDGET + 1e-12);
        assert_eq!(auto_interval(20.0, 4.0), 100);
        assert_eq!(auto_interval(20.01, 4.0), 101);
    }

    #[test]
    fn auto_does_not_flap_on_noisy_saves_and_comes_back_when_saves_get_cheap() {
        // Saves alternate around the budget: the interval grows once and stays.
        let (_, said) = run(SaveEvery::Auto, 200, 1.0, |k| if k % 2 == 0 { 0.06 } else { 0.045 });
        let changes: Vec<u64> = said.iter().map(|a| a.every).collect();
        assert!(changes.len() <= 2, "{changes:?}");
        // Saves that become 100x cheaper (a cold disk cache, then warm) bring it back to every step.
        let (saved, said) = run(SaveEvery::Auto, 300, 1.0, |k| if k <= 40 { 1.0 } else { 0.001 });
        assert_eq!(said.first().map(|a| a.every), Some(20));
        assert_eq!(said.last().map(|a| a.every), Some(1));
        assert!(saved.ends_with(&[298, 299, 300]));
    }

    #[test]
    fn auto_leaves_out_the_warm_up_step_once_others_are_timed() {
        // A 200 s first step (kernel compilation on a GPU), then 4 s steps, 20 s saves: the first
        // decision uses the warm-up (every 2), the next ones the steady steps (every 100).
        let mut s = SaveSchedule::new(SaveEvery::Auto);
        assert!(s.step_done(1, 200.0));
        assert_eq!(s.saved(20.0).map(|a| a.every), Some(2));
        assert!(!s.step_done(2, 4.0));
        assert!(s.step_done(3, 4.0));
        let a = s.saved(20.0).unwrap();
        assert_eq!((a.every, a.step_seconds), (100, 4.0));
    }

    #[test]
    fn auto_handles_zero_and_odd_timings() {
        assert_eq!(auto_interval(0.0, 1.0), 1);
        assert_eq!(auto_interval(1.0, 0.0), 1);
        assert_eq!(auto_interval(f64::NAN, 1.0), 1);
        assert_eq!(auto_interval(f64::INFINITY, 1.0), u64::MAX);
    }

    #[test]
    fn parses_numbers_and_auto() {
        assert_eq!("auto".parse::<SaveEvery>(), Ok(SaveEvery::Auto));
        assert_eq!("25".parse::<SaveEvery>(), Ok(SaveEvery::Steps(25)));
        assert!("sometimes".parse::<SaveEvery>().unwrap_err().contains("a number of steps or `auto`"));
        assert_eq!(SaveEvery::Steps(7).to_string(), "7");
        assert_eq!(SaveEvery::Auto.to_string(), "auto");
    }
}
