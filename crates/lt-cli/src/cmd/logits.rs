//! `lt logits` (not implemented yet).

/// Arguments of `lt logits`.
#[derive(Debug, clap::Args)]
pub struct LogitsArgs {}

/// Run the command.
pub fn run(_args: &LogitsArgs) -> anyhow::Result<()> {
    anyhow::bail!("`lt logits` is not implemented yet")
}
