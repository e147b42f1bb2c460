//! Faults, injected on a seeded schedule against real processes.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Result};
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL the leader, restart it after a while.
    KillLeader,
    /// SIGSTOP the leader past an election timeout, then SIGCONT: it must
    /// not act as leader when it wakes.
    PauseLeader,
    /// Cut every link between the leader and the other replicas (clients
    /// and agents still reach it), then heal.
    PartitionLeader,
    /// SIGKILL a follower, restart it after a while.
    KillFollower,
    /// SIGKILL an agent while its ranks run, restart it.
    RestartAgent,
    /// Cut every link from one agent to the replicas for longer than the
    /// node TTL (the agent and its ranks keep running): its lease runs out,
    /// it stops its ranks, and only then may their jobs run elsewhere.
    PartitionAgent,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::KillLeader => "kill-leader",
            FaultKind::PauseLeader => "pause-leader",
            FaultKind::PartitionLeader => "partition-leader",
            FaultKind::KillFollower => "kill-follower",
            FaultKind::RestartAgent => "restart-agent",
            FaultKind::PartitionAgent => "partition-agent",
        }
    }

    pub fn is_leader_fault(self) -> bool {
        matches!(self, FaultKind::KillLeader | FaultKind::PauseLeader | FaultKind::PartitionLeader)
    }

    /// Whether the fault outlasts the node TTL, so that stopping the ranks
    /// it cuts off is the rule, not a fault of rota's.
    pub fn outlasts_ttl(self) -> bool {
        matches!(self, FaultKind::PartitionAgent)
    }

    /// How long the fault lasts before it is healed (process restarted,
    /// resumed, links healed). An agent partition lasts until its node is
    /// declared down (TTL + the leader's margin of 2 s + TTL/4 + the
    /// workload's grace period) and one more TTL, so requeued jobs start
    /// elsewhere while the partition lasts.
    pub fn duration(self, node_ttl_ms: u64) -> Duration {
        match self {
            FaultKind::KillLeader | FaultKind::KillFollower => Duration::from_millis(2_000),
            FaultKind::PauseLeader | FaultKind::PartitionLeader => Duration::from_millis(3_000),
            FaultKind::RestartAgent => Duration::from_millis(1_000),
            FaultKind::PartitionAgent => {
                let declared_down_ms = node_ttl_ms + 2_000 + node_ttl_ms / 4 + crate::workload::GRACE_PERIOD_S * 1_000;
                Duration::from_millis(declared_down_ms + node_ttl_ms + 1_000)
            }
        }
    }
}

impl FromStr for FaultKind {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<Self> {
        Ok(match text {
            "kill-leader" => FaultKind::KillLeader,
            "pause-leader" => FaultKind::PauseLeader,
            "partition-leader" => FaultKind::PartitionLeader,
            "kill-follower" => FaultKind::KillFollower,
            "restart-agent" => FaultKind::RestartAgent,
            "partition-agent" => FaultKind::PartitionAgent,
            other => bail!(
                "--faults: unknown fault {other:?} (kill-leader, pause-leader, partition-leader, kill-follower, restart-agent, partition-agent)"
            ),
        })
    }
}

pub fn parse_faults(text: &str) -> Result<Vec<FaultKind>> {
    let faults: Vec<FaultKind> = text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::parse).collect::<Result<_>>()?;
    if faults.is_empty() {
        bail!("--faults: name at least one fault");
    }
    Ok(faults)
}
