//! `lt plan` (not implemented yet).

/// Arguments of `lt plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {}

/// Run the command.
pub fn run(_args: &PlanArgs) -> anyhow::Result<()> {
    anyhow::bail!("`lt plan` is not implemented yet")
}
