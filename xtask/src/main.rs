//! `cargo xtask <command>`: developer and CI entry points.

fn main() -> anyhow::Result<()> {
    let cmd = std::env::args().nth(1).unwrap_or_default();
    anyhow::bail!("unknown xtask command {cmd:?}; none are implemented yet")
}
