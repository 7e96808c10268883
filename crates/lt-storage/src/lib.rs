//! lt-storage (work in progress).
