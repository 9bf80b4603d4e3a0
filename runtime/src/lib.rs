//! Sluice runtime.
