//! Starting a rank: its spec goes to disk first (so a restarted agent knows
//! the rank), then `rota-agent shim --dir DIR` starts in a session of its
//! own, so that neither the agent's death nor a signal to the agent's group
//! reaches the rank.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use crate::contain::{cgroup, procscan};
use crate::rankdir::{self, ExitStatus, RankDir, RankSpec, StopRequest};
use crate::reconcile::{DesiredRank, RankKey};
use crate::shared::AgentConfig;
use crate::shim::EXIT_NOT_STARTED;
use crate::users;

pub use crate::executor::Launch;

/// What the shim runs for `rank`: the runtime prefix and the command, the
/// job's environment plus the variables rota sets (which win).
pub fn rank_spec(config: &AgentConfig, key: RankKey, index: u64, rank: &DesiredRank, dir: &RankDir) -> RankSpec {
    let mut env: BTreeMap<String, String> = rank.env.clone();
    let gpus: Vec<String> = rank.gpus.iter().map(u32::to_string).collect();
    for (name, value) in [
        (procscan::JOB_VAR, rank.job_id.to_string()),
        (procscan::AGENT_VAR, config.data_dir.display().to_string()),
        // The tags the /proc scan finds the rank's processes by (see `contain::procscan`).
        (procscan::ALLOC_VAR, key.alloc_id.to_string()),
        (procscan::RANK_VAR, key.rank.to_string()),
        (procscan::ATTEMPT_VAR, rank.attempt.to_string()),
        ("ROTA_NODE", config.node_name.clone()),
        ("RANK", key.rank.to_string()),
        ("WORLD_SIZE", rank.world_size.to_string()),
        ("LOCAL_RANK", rank.local_rank.to_string()),
        ("NODE_RANK", rank.node_rank.to_string()),
        ("MASTER_ADDR", rank.master_addr.clone()),
        ("MASTER_PORT", rank.master_port.to_string()),
        ("CUDA_VISIBLE_DEVICES", gpus.join(",")),
        // What a container runtime's GPU hook reads (the NVIDIA container toolkit).
        ("NVIDIA_VISIBLE_DEVICES", gpus.join(",")),
        ("ROTA_CHECKPOINT_FILE", dir.checkpoint_file().display().to_string()),
    ] {
        env.insert(name.to_string(), value);
    }
    RankSpec {
        alloc_id: key.alloc_id,
        job_id: rank.job_id,
        attempt: rank.attempt,
        rank: key.rank,
        assigned_index: index,
        command: config.runtime_prefix.iter().chain(&rank.command).cloned().collect(),
        env,
        grace_period_s: rank.grace_period_s,
        log_cap_bytes: config.log_cap_bytes,
        cgroup: config.containment.rank_cgroup(key.alloc_id, key.rank),
        run_as: None,
        outlives: rank.outlives,
    }
}

/// Write the spec and start the shim. A shim that cannot start leaves the
/// rank recorded as not started.
pub fn launch(dir: &RankDir, spec: &RankSpec, now_ms: u64) -> Launch {
    if !prepare(dir, spec) {
        return Launch::Unprepared;
    }
    match spawn_shim(dir) {
        Ok(shim_pid) => Launch::Running { shim_pid },
        Err(error) => {
            tracing::error!(%error, "cannot start the shim");
            let _ = dir.write(rankdir::EXIT, &ExitStatus { exit_code: EXIT_NOT_STARTED, finished_at_ms: now_ms });
            Launch::Ended
        }
    }
}

/// Exit code of a rank the agent refused to run (the user it would run as
/// is not allowed): "cannot execute", as a shell says of a permission.
pub const EXIT_USER_REFUSED: i32 = 126;

/// Run the rank as `run_as` (the agent's own user when `None`), with the
/// login variables of that user unless the job set them.
pub fn run_as(spec: &mut RankSpec, run_as: Option<users::RunAs>) {
    if let Some(user) = &run_as {
        for (name, value) in [("USER", &user.user), ("LOGNAME", &user.user), ("HOME", &user.home)] {
            spec.env.entry(name.to_string()).or_insert_with(|| value.clone());
        }
    }
    spec.run_as = run_as;
}

/// Record a rank the agent may not run, with why on its stderr log (what
/// `rota logs --stderr` shows), as ended with `EXIT_USER_REFUSED`.
pub fn refuse(dir: &RankDir, spec: &RankSpec, why: &str, now_ms: u64) -> Launch {
    if !prepare(dir, spec) {
        return Launch::Unprepared;
    }
    let _ = rankdir::write_atomic(&dir.file("stderr.log"), format!("rota-agent: not started: {why}\n").as_bytes());
    let _ = dir.write(rankdir::EXIT, &ExitStatus { exit_code: EXIT_USER_REFUSED, finished_at_ms: now_ms });
    Launch::Ended
}

/// Write the spec of a rank assigned already stopped, with its stop and an
/// exit, without running it: the report then says it ended for `reason`.
pub fn end_unstarted(dir: &RankDir, spec: &RankSpec, reason: &str, now_ms: u64) -> Launch {
    if !prepare(dir, spec) {
        return Launch::Unprepared;
    }
    let stop = StopRequest { reason: reason.to_string(), requested_at_ms: now_ms, kill_at_ms: now_ms };
    let _ = dir.write(rankdir::STOP, &stop);
    let _ = dir.write(rankdir::EXIT, &ExitStatus { exit_code: 0, finished_at_ms: now_ms });
    Launch::Ended
}

/// Create the rank directory and its cgroup, and write its spec.
pub fn prepare(dir: &RankDir, spec: &RankSpec) -> bool {
    let prepared = dir
        .create()
        .map_err(|e| e.to_string())
        .and_then(|()| spec.cgroup.as_deref().map_or(Ok(()), cgroup::create).map_err(|e| e.to_string()))
        .and_then(|()| dir.write(rankdir::SPEC, spec).map_err(|e| e.to_string()));
    if let Err(error) = &prepared {
        tracing::error!(%error, "cannot prepare the rank directory");
    }
    prepared.is_ok()
}

/// Start `rota-agent shim --dir DIR` in its own session.
fn spawn_shim(dir: &RankDir) -> std::io::Result<u32> {
    let exe = std::env::current_exe()?;
    let log = std::fs::File::create(dir.file("shim.log"))?;
    let mut command = Command::new(exe);
    command.arg("shim").arg("--dir").arg(&dir.path).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn()?;
    let pid = child.id();
    // Reap it when it ends, so it never lingers as a zombie of the agent.
    std::thread::spawn(move || child.wait());
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contain::Containment;
    use std::path::{Path, PathBuf};

    fn config() -> AgentConfig {
        AgentConfig {
            endpoints: vec![],
            node_name: "node-a".into(),
            data_dir: PathBuf::from("/data"),
            address: String::new(),
            rack: String::new(),
            leaf: String::new(),
            heartbeat_ms: 1_000,
            runtime_prefix: vec!["podman".into(), "run".into()],
            log_cap_bytes: 4_096,
            keep_finished_ranks: 1,
            containment: Containment::Cgroups { subtree: "/cg/rota".into() },
            job_users: crate::users::JobUsers::Agent,
            idle_rule: crate::idle::IdleRule::default(),
        }
    }

    #[test]
    fn the_spec_prefixes_the_command_and_sets_rotas_variables_over_the_jobs() {
        let key = RankKey { alloc_id: 12, rank: 3 };
        let rank = DesiredRank {
            job_id: 5,
            gpus: vec![0, 2],
            command: vec!["train".into()],
            env: [("RANK".to_string(), "wrong".to_string()), ("LR".to_string(), "0.1".to_string())].into(),
            grace_period_s: 30,
            ..DesiredRank::default()
        };
        let dir = RankDir::new(Path::new("/data/ranks"), key.alloc_id, key.rank);
        let spec = rank_spec(&config(), key, 40, &rank, &dir);
        assert_eq!(spec.command, ["podman", "run", "train"]);
        assert_eq!((spec.alloc_id, spec.rank, spec.assigned_index, spec.grace_period_s), (12, 3, 40, 30));
        assert_eq!(spec.env["RANK"], "3");
        assert_eq!(spec.env["LR"], "0.1");
        assert_eq!(spec.env["CUDA_VISIBLE_DEVICES"], "0,2");
        assert_eq!(spec.env["ROTA_CHECKPOINT_FILE"], "/data/ranks/12-3/work/checkpoint");
        assert_eq!((spec.env["ROTA_ALLOC_ID"].as_str(), spec.env["ROTA_RANK"].as_str()), ("12", "3"));
        assert_eq!(spec.cgroup, Some(PathBuf::from("/cg/rota/rank-12-3")));
    }

    #[test]
    fn a_rank_assigned_stopped_is_recorded_as_ended_for_its_reason() {
        let root = tempfile::tempdir().unwrap();
        let key = RankKey { alloc_id: 1, rank: 0 };
        let dir = RankDir::new(root.path(), key.alloc_id, key.rank);
        // No cgroup: this test must not create one on the host.
        let config = AgentConfig { containment: Containment::ProcScan, ..config() };
        let spec = rank_spec(&config, key, 7, &DesiredRank::default(), &dir);
        assert_eq!(end_unstarted(&dir, &spec, "cancelled", 99), Launch::Ended);
        assert_eq!(dir.spec().unwrap(), Some(spec));
        assert_eq!(dir.stop().unwrap().reason, "cancelled");
        assert_eq!(dir.exit(), Some(ExitStatus { exit_code: 0, finished_at_ms: 99 }));
        assert!(!dir.has(rankdir::PIDS), "nothing ran");
    }
}
