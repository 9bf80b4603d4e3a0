//! Sluice's runtime: executes compiled plans over the data context.
//!
//! Invariant: no sockets, no HTTP, no SQL here. Connector and composition
//! functions reach the outside world only through the traits in
//! [`connectors`]; the service crate provides the real implementations.

pub mod connectors;
pub mod exec;
pub mod fuzz;
pub mod json;
pub mod rollout;
pub mod xml;
