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
    /// Cut the leader from the other replicas and from every agent for
    /// longer than the node TTL (clients still reach it): the agents renew
    /// their leases through the new leader, so no rank stops, no node is
    /// declared down, and the old leader acts on nothing when it returns.
    LongPartitionLeader,
    /// SIGKILL a follower, restart it after a while.
    KillFollower,
    /// Cut a follower from the other replicas until the leader has purged
    /// the log entries it lacks, then heal: it must catch up from a
    /// snapshot (the run's `snapshot_every` must be small for this).
    StaleFollower,
    /// SIGKILL a follower and wipe its data directory (whole, or the Raft
    /// store behind its marker): it must refuse to start. The harness then
    /// does what an operator does: `member remove` it, start a fresh
    /// replica on the same host under a new id (`server --join`) and
    /// `member add` it; the new member must catch up.
    WipeFollower,
    /// Restart a follower with its clock far off (ROTA_TEST_CLOCK_OFFSET_MS)
    /// for longer than the leader's clock check period, then with its own
    /// clock again: it must not lead meanwhile.
    SkewClock,
    /// Add a replica under a new id (a learner, then promoted to voter) and
    /// remove it again, while submits go on.
    ChangeMembership,
    /// SIGKILL an agent while its ranks run, restart it.
    RestartAgent,
    /// Cut every link from one agent to the replicas for longer than the
    /// node TTL (the agent and its ranks keep running): its lease runs out,
    /// it stops its ranks, and only then may their jobs run elsewhere.
    PartitionAgent,
    /// One agent's rank directories cannot be written (ENOSPC, through the
    /// agent's test switch ROTA_TEST_AGENT_DISK_FULL_FILE): ranks it cannot
    /// record end with the reason `agent_disk_full` and their jobs are
    /// requeued, never left to hang; its other ranks keep running.
    AgentDiskFull,
}

/// Every fault kind, in the order `--faults all` names them.
pub const ALL: [FaultKind; 12] = [
    FaultKind::KillLeader,
    FaultKind::PauseLeader,
    FaultKind::PartitionLeader,
    FaultKind::LongPartitionLeader,
    FaultKind::KillFollower,
    FaultKind::StaleFollower,
    FaultKind::WipeFollower,
    FaultKind::SkewClock,
    FaultKind::ChangeMembership,
    FaultKind::RestartAgent,
    FaultKind::PartitionAgent,
    FaultKind::AgentDiskFull,
];

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::KillLeader => "kill-leader",
            FaultKind::PauseLeader => "pause-leader",
            FaultKind::PartitionLeader => "partition-leader",
            FaultKind::LongPartitionLeader => "long-partition-leader",
            FaultKind::KillFollower => "kill-follower",
            FaultKind::StaleFollower => "stale-follower",
            FaultKind::WipeFollower => "wipe-follower",
            FaultKind::SkewClock => "skew-clock",
            FaultKind::ChangeMembership => "change-membership",
            FaultKind::RestartAgent => "restart-agent",
            FaultKind::PartitionAgent => "partition-agent",
            FaultKind::AgentDiskFull => "agent-disk-full",
        }
    }

    pub fn is_leader_fault(self) -> bool {
        matches!(self, FaultKind::KillLeader | FaultKind::PauseLeader | FaultKind::PartitionLeader | FaultKind::LongPartitionLeader)
    }

    /// Whether the fault needs agents.
    pub fn needs_agents(self) -> bool {
        matches!(self, FaultKind::RestartAgent | FaultKind::PartitionAgent | FaultKind::AgentDiskFull)
    }

    /// Whether the fault outlasts the node TTL, so that stopping the ranks
    /// it cuts off is the rule, not a fault of rota's.
    pub fn outlasts_ttl(self) -> bool {
        matches!(self, FaultKind::PartitionAgent)
    }

    /// Whether the fault may end ranks of its agent by rule: a rank whose
    /// start or exit cannot be recorded ends (`agent_disk_full`) and its job
    /// runs again.
    pub fn ends_ranks_by_rule(self) -> bool {
        matches!(self, FaultKind::PartitionAgent | FaultKind::AgentDiskFull)
    }

    /// How long the fault lasts before it is healed (process restarted,
    /// resumed, links healed); for faults healed on a condition
    /// (stale-follower, wipe-follower, change-membership), the least time.
    /// An agent partition lasts until its node is declared down (TTL + the
    /// leader's margin of 2 s + TTL/4 + the workload's grace period) and one
    /// more TTL, so requeued jobs start elsewhere while the partition lasts.
    /// A long leader partition lasts past the point at which the agents'
    /// nodes would be declared down had they not renewed their leases
    /// through the new leader.
    pub fn duration(self, node_ttl_ms: u64) -> Duration {
        let declared_down_ms = node_ttl_ms + 2_000 + node_ttl_ms / 4 + crate::workload::GRACE_PERIOD_S * 1_000;
        match self {
            FaultKind::KillLeader | FaultKind::KillFollower => Duration::from_millis(2_000),
            FaultKind::PauseLeader | FaultKind::PartitionLeader => Duration::from_millis(3_000),
            FaultKind::LongPartitionLeader => Duration::from_millis(declared_down_ms + 1_000),
            FaultKind::RestartAgent => Duration::from_millis(1_000),
            FaultKind::PartitionAgent => Duration::from_millis(declared_down_ms + node_ttl_ms + 1_000),
            // Past one clock check of the leader (every 5 s) and an election.
            FaultKind::SkewClock => Duration::from_millis(8_000),
            FaultKind::AgentDiskFull => Duration::from_millis(5_000),
            FaultKind::StaleFollower | FaultKind::WipeFollower | FaultKind::ChangeMembership => Duration::from_millis(1_000),
        }
    }
}

impl FromStr for FaultKind {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<Self> {
        match ALL.iter().find(|kind| kind.name() == text) {
            Some(kind) => Ok(*kind),
            None => {
                let names: Vec<&str> = ALL.iter().map(|k| k.name()).collect();
                bail!("--faults: unknown fault {text:?} ({}, or all)", names.join(", "))
            }
        }
    }
}

/// A comma separated list of fault names; `all` stands for every kind
/// (those that need agents only when the run has agents).
pub fn parse_faults(text: &str, with_agents: bool) -> Result<Vec<FaultKind>> {
    let mut faults = Vec::new();
    for name in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if name == "all" {
            faults.extend(ALL.iter().copied().filter(|kind| with_agents || !kind.needs_agents()));
        } else {
            faults.push(name.parse()?);
        }
    }
    if faults.is_empty() {
        bail!("--faults: name at least one fault");
    }
    if let Some(kind) = faults.iter().find(|kind| kind.needs_agents() && !with_agents) {
        bail!("--faults: {} needs agents (--agents N)", kind.name());
    }
    faults.dedup();
    Ok(faults)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back() {
        for kind in ALL {
            assert_eq!(kind.name().parse::<FaultKind>().unwrap(), kind);
        }
        assert!("nope".parse::<FaultKind>().unwrap_err().to_string().contains("agent-disk-full"));
    }

    #[test]
    fn all_names_every_kind_that_the_run_can_inject() {
        assert_eq!(parse_faults("all", true).unwrap(), ALL.to_vec());
        let without_agents = parse_faults("all", false).unwrap();
        assert!(without_agents.iter().all(|k| !k.needs_agents()) && without_agents.len() == 9);
        assert!(parse_faults("agent-disk-full", false).is_err(), "an agent fault without agents is refused");
        assert!(parse_faults(" , ", true).is_err());
    }
}
