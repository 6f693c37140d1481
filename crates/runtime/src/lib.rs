//! Host runtime.
pub mod image;
