//! rota-scheduler: the replicated cluster state (`state`), the gRPC services
//! and leader loop (`server`), and the `rota` binary.

pub mod server;
pub mod state;
pub mod client;
pub mod cli;
