//! lt-optim (work in progress).
