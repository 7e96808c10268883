//! Placeholder until the planner benchmark lands.
fn main() {}
