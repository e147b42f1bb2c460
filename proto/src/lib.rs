//! rota's gRPC contract. `rota.v1` is the public API that the CLI, portals and
//! agents use; `rota.raft.v1` is the internal transport between replicas.
//! This crate holds generated code and its codec only: no logic.

pub mod codec;

/// The public API and the agent contract (package `rota.v1`: rota.proto, agent.proto).
pub mod v1 {
    tonic::include_proto!("rota.v1");
}

/// The replica-to-replica Raft transport (package `rota.raft.v1`).
pub mod raft {
    tonic::include_proto!("rota.raft.v1");
}

/// The encoded descriptors of rota.proto, agent.proto and raft.proto, for
/// gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/rota_descriptor.bin"));
