//! rota-agent: the node agent of a GPU host.
//!
//! - `inventory`: GPUs from NVML, or declared with `--fake-gpus 8xH100-80GB`.
//! - `control`: the leader-following client of the replicas (AgentService).
//! - `agent`: registration and heartbeats (telemetry, never logged), the
//!   assignment watch (resumable on any replica), the reconcile loop, and the
//!   reporter that commits rank events from an on-disk outbox.
//! - `shim`: each rank runs under `rota-agent shim`, in its own session,
//!   which records the exit status on disk and caps/rotates the logs.
//! - `rankdir`: the on-disk record of each rank that makes agent restarts safe.
//! - `logs`: the agent's small gRPC server that serves rank logs.
//!
//! Safety rules: an update older than the highest index seen is ignored; a
//! running rank absent from the desired set is stopped only when the update
//! is newer than the rank's assignment; losing the control plane never stops
//! a rank. Stopping is SIGTERM to the rank's process group, the job's grace
//! period, then SIGKILL.

pub mod agent;
pub mod control;
pub mod inventory;
pub mod logs;
pub mod rankdir;
pub mod shim;
