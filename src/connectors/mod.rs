//! Real connector clients: the registry of connector definitions loaded from
//! storage, the clients built from them (once per connector version), and the
//! shared call policy (retries, circuit breakers) every connector call goes
//! through. Implements the runtime's connector traits.

pub mod cache;
pub mod mongo;
pub mod sql;
