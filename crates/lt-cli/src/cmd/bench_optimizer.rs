//! `lt bench_optimizer` (not implemented yet).

/// Arguments of `lt bench_optimizer`.
#[derive(Debug, clap::Args)]
pub struct BenchOptimizerArgs {}

/// Run the command.
pub fn run(_args: &BenchOptimizerArgs) -> anyhow::Result<()> {
    anyhow::bail!("`lt bench_optimizer` is not implemented yet")
}
