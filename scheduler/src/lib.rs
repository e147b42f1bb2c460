//! rota-scheduler: the replicated cluster state (`state`), the scheduling
//! policy (`policy`), the trace-driven simulator (`sim`), the gRPC services
//! and leader loop (`server`), the leader-following `client`, and the `cli`
//! behind the `rota` binary.

pub mod cli;
pub mod client;
pub mod policy;
pub mod server;
pub mod sim;
pub mod state;
