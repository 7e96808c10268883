//! lt-exec (work in progress).
