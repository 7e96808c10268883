//! Placeholder until the optimizer benchmark lands.
fn main() {}
