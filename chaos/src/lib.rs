//! rota-chaos: drives real rota processes on 127.0.0.1 and checks what they
//! did from the outside. `cluster` starts and stops replicas by PID,
//! `agents` node agents.

pub mod agents;
pub mod cluster;
