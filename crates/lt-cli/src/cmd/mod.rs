//! One module per subcommand.

pub mod bench_optimizer;
pub mod bench_spill;
pub mod eval;
pub mod logits;
pub mod plan;
pub mod train;
