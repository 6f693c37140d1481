//! Host runtime.
