//! Benchmarks live in the `[[bench]]` targets of this package; the library holds what several of
//! them share.

use std::hint::black_box;
use std::time::Instant;

/// The environment variable `name` as a number, or `default` when unset or not a number.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Median seconds of `repeats` runs of `f` (at least one), after one untimed warm-up run; what `f`
/// returns is kept alive through `black_box`, so the work is not optimised away.
pub fn median_secs<T>(repeats: usize, mut f: impl FnMut() -> T) -> f64 {
    black_box(f());
    let mut t: Vec<f64> = (0..repeats.max(1))
        .map(|_| {
            let s = Instant::now();
            black_box(f());
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}
