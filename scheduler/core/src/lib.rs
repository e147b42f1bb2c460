//! rota-core: the pure heart of rota.
//!
//! - `state`: the replicated cluster state, the `Command`s of the Raft log and
//!   their deterministic `apply`, with paired invariant checks.
//! - `policy`: `plan(state, now_ms)`, the scheduling decisions (queues,
//!   quotas, gangs, reservations, backfill, topology, preemption) with a
//!   reason for every pending job.
//! - `sim`: the simulator engine that drives the same apply and policy on a
//!   virtual clock, and the synthetic clusters of the benchmarks.
//! - `report`: monthly reports over job records (GPU-hours, waits,
//!   preemptions, daily series).
//!
//! This crate depends on no async runtime, network, disk or clock: time is
//! always an input (`now_ms`), so every decision can be replayed. Cargo
//! enforces it (see the workspace's layout test).

pub mod policy;
pub mod report;
pub mod sim;
pub mod state;
pub mod text;
