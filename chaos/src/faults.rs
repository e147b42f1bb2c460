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
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::KillLeader => "kill-leader",
            FaultKind::PauseLeader => "pause-leader",
            FaultKind::PartitionLeader => "partition-leader",
            FaultKind::KillFollower => "kill-follower",
            FaultKind::RestartAgent => "restart-agent",
        }
    }

    pub fn is_leader_fault(self) -> bool {
        matches!(self, FaultKind::KillLeader | FaultKind::PauseLeader | FaultKind::PartitionLeader)
    }

    /// How long the fault lasts before it is healed (process restarted,
    /// resumed, links healed).
    pub fn duration(self) -> Duration {
        match self {
            FaultKind::KillLeader | FaultKind::KillFollower => Duration::from_millis(2_000),
            FaultKind::PauseLeader | FaultKind::PartitionLeader => Duration::from_millis(3_000),
            FaultKind::RestartAgent => Duration::from_millis(1_000),
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
            other => bail!("--faults: unknown fault {other:?} (kill-leader, pause-leader, partition-leader, kill-follower, restart-agent)"),
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
