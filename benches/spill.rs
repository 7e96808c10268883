//! Placeholder until the spill benchmark lands.
fn main() {}
