//! `lt bench_spill` (not implemented yet).

/// Arguments of `lt bench_spill`.
#[derive(Debug, clap::Args)]
pub struct BenchSpillArgs {}

/// Run the command.
pub fn run(_args: &BenchSpillArgs) -> anyhow::Result<()> {
    anyhow::bail!("`lt bench_spill` is not implemented yet")
}
