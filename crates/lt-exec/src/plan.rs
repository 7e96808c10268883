//! What the executor runs: lt-sched's step contract ([`Step`]), whole. The placements, the upload
//! schedule and the fixed policies are defined there once; this module only re-exports them.

pub use lt_sched::plan::{Placement, Step, Upload};
