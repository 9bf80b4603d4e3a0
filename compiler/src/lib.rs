//! Sluice's language: the definitions users send, their validation, the
//! JSONLogic compiler and evaluator, and the compiled plans the runtime executes.
//!
//! Invariant: this crate is pure and synchronous. It does no I/O, spawns
//! nothing, and depends on no async runtime or client crate (CI checks this).

pub mod def;
pub mod diag;
pub mod functions;
pub mod fuzz;
pub mod logic;
pub mod path;
pub mod plan;
pub mod schema;
pub mod sql;
pub mod validate;
pub mod value;

pub use path::Path;
pub use value::Value;
