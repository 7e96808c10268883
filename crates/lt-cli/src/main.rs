//! `lt`: the LazyTrain-rs command line.

fn main() -> anyhow::Result<()> {
    anyhow::bail!("no commands yet")
}
