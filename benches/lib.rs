//! Criterion benchmarks live in the `[[bench]]` targets of this package; the library is empty.
