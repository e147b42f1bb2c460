//! rota-chaos: drives real rota processes on 127.0.0.1, injects faults, and
//! checks what happened from the outside.
//!
//! - `cluster`: replicas started, killed, paused and restarted by PID
//! - `agents`: node agents (fake GPUs) started, killed and restarted by PID
//! - `proxy`: a TCP proxy per replica-to-replica link, to cut and heal links
//! - `workload`: submits, resubmits, cancels, probes; jobs write marker files
//! - `cli_probe`: fresh `rota submit` processes, failover as a shell user sees it
//! - `pki`: the cluster's CA and certificates (every link is TLS)
//! - `faults`: the fault kinds
//! - `history`: what the harness saw, on its own clock
//! - `check`: the checkers; `run`: one run; `report`: its summary

pub mod agents;
pub mod check;
pub mod cli_probe;
pub mod cluster;
pub mod faults;
pub mod history;
pub mod pki;
pub mod procs;
pub mod proxy;
pub mod report;
pub mod run;
pub mod workload;
