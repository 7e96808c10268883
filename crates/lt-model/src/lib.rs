//! lt-model (work in progress).
