//! One module per subcommand.

pub mod bench_layer;
pub mod bench_optimizer;
pub mod bench_spill;
pub mod bench_train;
pub mod eval;
pub mod logits;
pub mod plan;
pub mod profile;
pub mod selftest;
pub mod train;
