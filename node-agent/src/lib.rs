//! rota-agent: the node agent of a GPU host.
//!
//! - `agent`: the wiring: starts the tasks below and runs the reconcile loop
//!   (read the rank directories, call `reconcile`, execute its actions).
//! - `reconcile`: the pure decision: desired assignment set + local ranks +
//!   time in, actions out (start, stop, SIGTERM, SIGKILL, lost, collect).
//! - `local`: what the agent knows of its ranks, read from their directories.
//! - `executor`: the seam between decisions and the host (`RankExecutor`):
//!   host processes under shims (`exec::Processes`), or the fleet's simulation.
//! - `fleet`: many simulated agents in one process (a test and benchmark
//!   tool): this agent's own tasks, with a simulated executor.
//! - `exec`: the executors: `spawn` starts a rank's shim, `signal` signals
//!   every process of a rank, `record` writes the agent's records on disk.
//! - `users`: which local user a rank runs as (the job's owner, checked).
//! - `contain`: finds every process of a rank: its cgroup v2 (`cgroup`) and
//!   the /proc scan of its environment tags (`procscan`); stops leftovers.
//! - `shared`: what the tasks share (configuration, control plane, index guard).
//! - `session`: registration and heartbeats (telemetry, never logged).
//! - `watch`: the assignment watch (resumable on any replica), moved on when
//!   its replica lags the leader (`freshness`).
//! - `outbox`: the reporter that commits rank events found on disk.
//! - `control`: the leader-following client of the replicas (AgentService).
//! - `inventory`: GPUs from NVML, or declared with `--fake-gpus 8xH100-80GB`.
//! - `idle`: the one definition of an idle rank (every GPU under
//!   `--idle-below-percent` for `--idle-after-ms`), reported in heartbeats;
//!   fake GPUs read `fake-utilization`.
//! - `gpu_events`: XID errors (NVML's event set, or `fake-xids` for fake
//!   GPUs) and completed resets, reported with the rank events.
//! - `shim`: each rank runs under `rota-agent shim`, in its own session,
//!   which stops what the rank left when its main process ends, records the
//!   exit status on disk only then, and caps/rotates the logs.
//! - `rankdir`: the on-disk record of each rank that makes agent restarts safe.
//! - `logs`: the agent's small gRPC server that serves rank logs.
//! - `metrics`: per-GPU telemetry and control-plane contact as Prometheus
//!   gauges (`--metrics-listen`).
//!
//! Safety rules (see `reconcile`): an update older than the highest index
//! seen is ignored; a running rank absent from the desired set is stopped
//! only when the update is newer than the rank's assignment; losing the
//! control plane for less than the node TTL never stops a rank, and for
//! longer (the lease ran out) stops them all, so a job never runs on two
//! sets of nodes at once. Stopping is SIGTERM to every process of the rank
//! (its cgroup, its process group, whatever carries its tags), the job's
//! grace period, then SIGKILL; a rank's exit is recorded only once none is
//! left. A rank found running without a record is adopted, never started
//! again.

pub mod agent;
pub mod contain;
pub mod control;
pub mod datafile;
pub mod exec;
pub mod executor;
pub mod fleet;
pub mod freshness;
pub mod gpu_events;
pub mod idle;
pub mod inventory;
pub mod local;
pub mod logs;
pub mod metrics;
pub mod outbox;
pub mod rankdir;
pub mod reconcile;
pub mod session;
pub mod shared;
pub mod shim;
pub mod users;
pub mod watch;
