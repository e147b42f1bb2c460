//! rota-scheduler: the replicated cluster state (`state`), and, around it,
//! the leader loop, the gRPC services and the `rota` binary.

pub mod state;
pub mod policy;
pub mod sim;
