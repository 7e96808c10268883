//! lt-sched (work in progress).
