//! Executors: each carries out one kind of reconcile action on the host.
//! They decide nothing; the only checks they make are the last-moment ones
//! that guard against a shim recording an exit while the pass runs.
//!
//! - `processes`: the `RankExecutor` of a real agent, built on the others.
//! - `spawn`: write a rank's spec and start its shim (or record it as ended).
//! - `signal`: SIGTERM / SIGKILL to every process of a rank (its process
//!   group, its cgroup, the processes carrying its tags).
//! - `record`: the agent's own records in a rank directory (stop requests,
//!   lost exits) and the removal of collected ranks.

pub mod processes;
pub mod record;
pub mod signal;
pub mod spawn;

pub use processes::Processes;
