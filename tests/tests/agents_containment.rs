//! Every process of a rank is tracked and stopped: a rank's exit is recorded
//! (and its GPUs released) only once none of its processes is left, every
//! stop reaches processes that left the rank's process group, the agent's
//! records are out of the job's reach, and a running rank is never started
//! a second time, even by an agent that lost its records.
//!
//! Each scenario runs twice: with a cgroup per rank (where the host has a
//! writable cgroup v2 hierarchy; else it says so and tests the /proc scan)
//! and with `--no-cgroups`, where the /proc scan of the ranks' environment
//! alone finds their processes.
//!
//! Every one of them failed on commit 81169b9 (before ranks were contained;
//! its agent given the two new flags as no-ops), in both variants:
//! - the background child: "job Succeeded while its background child ... still runs";
//! - the setsid grandchild: "job Cancelled while its setsid grandchild ...
//!   still runs" (the cgroup variant stops earlier: "pid ... is in no rank
//!   cgroup"); at the end of the lease: "timed out after 60s waiting for
//!   the setsid grandchild to be killed at the end of the lease";
//! - the control files: "an exit was committed for a rank that runs" (the
//!   job's exit.json, written into its working directory, then the rank
//!   directory, was reported while the job ran on);
//! - the wiped data dir: the restarted agent started the running rank again
//!   ("the rank was started again: pid ... instead of ...").

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::agents::{writable_cgroup2, AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_chaos::proxy::LinkProxy;
use rota_e2e::{pid_alive, shell_job, wait_nodes_ready, wait_number, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const GRACE_S: u64 = 2;

/// A cluster of three replicas and one agent, ranks in cgroups or not.
struct Setup {
    // Dropped in this order: the agent (and its ranks) before the replicas.
    agent: LocalAgent,
    _cluster: LocalCluster,
    any: AnyReplica,
    marks: PathBuf,
    _dir: tempfile::TempDir,
}

async fn setup(cgroups: bool) -> Result<Setup> {
    if cgroups && writable_cgroup2().is_none() {
        eprintln!("no writable cgroup v2 hierarchy on this host: the cgroup variant tests the /proc scan fallback instead");
    }
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let options = AgentOptions { cgroups, ..AgentOptions::default() };
    let agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), options)?;
    ensure!(agent.cgroup_dir.is_some() == (cgroups && writable_cgroup2().is_some()), "cgroups as asked");
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;
    Ok(Setup { agent, _cluster: cluster, any, marks, _dir: dir })
}

fn job(marks: &Path, script: &str) -> pb::SubmitJobRequest {
    let mut request = shell_job(1, 2, marks, script);
    request.spec.as_mut().expect("spec").grace_period_s = GRACE_S;
    request
}

/// The rank cgroups under the agent's subtree (none without cgroups).
fn rank_cgroups(agent: &LocalAgent) -> Vec<PathBuf> {
    let Some(subtree) = &agent.cgroup_dir else { return Vec::new() };
    std::fs::read_dir(subtree).into_iter().flatten().flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect()
}

/// With cgroups, the process runs in a rank cgroup of the agent's subtree.
fn ensure_in_rank_cgroup(agent: &LocalAgent, pid: u32) -> Result<()> {
    if agent.cgroup_dir.is_none() {
        return Ok(());
    }
    let listed = rank_cgroups(agent)
        .iter()
        .any(|cg| std::fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default().lines().any(|l| l.trim() == pid.to_string()));
    ensure!(listed, "pid {pid} is in no rank cgroup of {:?}", agent.cgroup_dir);
    Ok(())
}

async fn background_child(cgroups: bool) -> Result<()> {
    let s = setup(cgroups).await?;
    let script = r#"sleep 30 & echo $! > "$MARK_DIR/child.tmp"; mv "$MARK_DIR/child.tmp" "$MARK_DIR/child"; exit 0"#;
    let job_id = s.any.submit(job(&s.marks, script)).await?.job_id;
    let child = wait_number(&s.marks.join("child"), WAIT).await?;
    let seen_at = Instant::now();
    let done = s.any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    ensure!(!pid_alive(child), "job Succeeded while its background child {child} still runs: {done:?}");
    // SIGTERM ends a plain `sleep`: no need to wait for the grace period, let alone the 30 s.
    ensure!(seen_at.elapsed() < Duration::from_secs(20), "the child was stopped only after {:?}", seen_at.elapsed());
    wait_until("the rank's cgroup to be removed", WAIT, || async { Ok(rank_cgroups(&s.agent).is_empty().then_some(())) }).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_background_child_is_stopped_before_the_gpus_are_released() -> Result<()> {
    background_child(true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_background_child_is_stopped_before_the_gpus_are_released_without_cgroups() -> Result<()> {
    background_child(false).await
}

async fn setsid_grandchild(cgroups: bool) -> Result<()> {
    let s = setup(cgroups).await?;
    // The grandchild leaves the rank's session and process group and
    // ignores SIGTERM: only SIGKILL, sent to more than the group, ends it.
    let script = r#"setsid sh -c 'trap "" TERM; echo $$ > "$MARK_DIR/gc.tmp"; mv "$MARK_DIR/gc.tmp" "$MARK_DIR/gc"; while true; do sleep 0.05; done' &
echo $$ > "$MARK_DIR/pid.tmp"; mv "$MARK_DIR/pid.tmp" "$MARK_DIR/pid"
while true; do sleep 0.05; done"#;
    let job_id = s.any.submit(job(&s.marks, script)).await?.job_id;
    let main = wait_number(&s.marks.join("pid"), WAIT).await?;
    let grandchild = wait_number(&s.marks.join("gc"), WAIT).await?;
    s.any.wait_job_state(job_id, pb::JobState::Running, WAIT).await?;
    ensure_in_rank_cgroup(&s.agent, grandchild)?;

    let cancelled_at = Instant::now();
    s.any.cancel(job_id).await?;
    let job = s.any.wait_job_state(job_id, pb::JobState::Cancelled, WAIT).await?;
    ensure!(!pid_alive(grandchild), "job Cancelled while its setsid grandchild {grandchild} still runs: {job:?}");
    ensure!(!pid_alive(main), "the main process {main} survived");
    let waited = cancelled_at.elapsed();
    ensure!(waited >= Duration::from_millis(GRACE_S * 1000 - 200), "SIGKILL after {waited:?}, before the {GRACE_S} s grace period");
    wait_until("the rank's cgroup to be removed", WAIT, || async { Ok(rank_cgroups(&s.agent).is_empty().then_some(())) }).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_setsid_grandchild_ignoring_sigterm_is_still_killed() -> Result<()> {
    setsid_grandchild(true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_setsid_grandchild_ignoring_sigterm_is_still_killed_without_cgroups() -> Result<()> {
    setsid_grandchild(false).await
}

async fn control_files(cgroups: bool) -> Result<()> {
    let s = setup(cgroups).await?;
    // Files named like the agent's records, in the job's working directory,
    // then a checkpoint: the agent reports both in one pass if it reads both.
    let script = r#"for f in exit.json stop.json pids.json; do echo '{"exit_code":0,"finished_at_ms":1,"reason":"x","requested_at_ms":1,"kill_at_ms":1}' > $f; done
date > "$ROTA_CHECKPOINT_FILE"
echo $$ > "$MARK_DIR/pid.tmp"; mv "$MARK_DIR/pid.tmp" "$MARK_DIR/pid"
while [ ! -e "$MARK_DIR/go" ]; do sleep 0.05; done
exit 0"#;
    let job_id = s.any.submit(job(&s.marks, script)).await?.job_id;
    let pid = wait_number(&s.marks.join("pid"), WAIT).await?;
    let ranks = s.agent.data_dir.join("ranks");
    let rank_dir = wait_until("the checkpoint to be committed", WAIT, || async {
        let acked = std::fs::read_dir(&ranks)?.flatten().map(|e| e.path()).find(|p| p.join("checkpoint.ack").exists());
        Ok(acked)
    })
    .await?;
    ensure!(!rank_dir.join("exited.ack").exists(), "an exit was committed for a rank that runs");
    let job = s.any.get(job_id).await?;
    let log = s.agent.log_tail(4_000);
    ensure!(job.state == pb::JobState::Running as i32, "the job's own exit.json ended it: {job:?}\n{log}");
    ensure!(pid_alive(pid), "the rank was stopped\n{log}");

    std::fs::write(s.marks.join("go"), "")?;
    let done = s.any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    ensure!(done.attempts == 1, "{done:?}\n{}", s.agent.log_tail(6_000));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_files_written_by_a_job_change_nothing() -> Result<()> {
    control_files(true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_files_written_by_a_job_change_nothing_without_cgroups() -> Result<()> {
    control_files(false).await
}

/// The lease path: a node cut off from every replica (its agent alive)
/// stops its ranks once its lease runs out, setsid grandchild included.
async fn setsid_grandchild_at_lease_expiry(cgroups: bool) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions { node_ttl_ms: 2_000, ..ClusterOptions::default() })?;
    cluster.wait_leader(WAIT).await?;
    let mut links = Vec::new();
    for replica in cluster.replicas.values() {
        links.push(LinkProxy::start(100, replica.id, replica.addr.clone()).await?);
    }
    let endpoints: Vec<String> = links.iter().map(|l| l.listen_addr.clone()).collect();
    let agent = LocalAgent::start(dir.path(), "node-a", &endpoints.join(","), AgentOptions { cgroups, ..AgentOptions::default() })?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;
    let script = r#"trap '' TERM
setsid sh -c 'echo $$ > "$MARK_DIR/gc.tmp"; mv "$MARK_DIR/gc.tmp" "$MARK_DIR/gc"; while true; do sleep 0.05; done' &
while true; do sleep 0.05; done"#;
    let job_id = any.submit(job(&marks, script)).await?.job_id;
    let grandchild = wait_number(&marks.join("gc"), WAIT).await?;
    any.wait_job_state(job_id, pb::JobState::Running, WAIT).await?;
    for link in &links {
        link.cut();
    }
    // TTL, then the grace period, then SIGKILL to the whole rank.
    wait_until("the setsid grandchild to be killed at the end of the lease", WAIT, || async { Ok((!pid_alive(grandchild)).then_some(())) })
        .await
        .with_context(|| agent.log_tail(4_000))?;
    for link in &links {
        link.heal();
    }
    drop(agent);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_setsid_grandchild_ignoring_sigterm_is_killed_when_the_lease_runs_out() -> Result<()> {
    setsid_grandchild_at_lease_expiry(true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_setsid_grandchild_ignoring_sigterm_is_killed_when_the_lease_runs_out_without_cgroups() -> Result<()> {
    setsid_grandchild_at_lease_expiry(false).await
}

/// `start-ATTEMPT-PID` markers: one per start of a rank.
fn starts(marks: &Path) -> Vec<(u32, u32)> {
    let mut found: Vec<(u32, u32)> = std::fs::read_dir(marks)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let (attempt, pid) = name.strip_prefix("start-")?.split_once('-')?;
            Some((attempt.parse().ok()?, pid.parse().ok()?))
        })
        .collect();
    found.sort_unstable();
    found
}

async fn wiped_data_dir(cgroups: bool) -> Result<()> {
    let mut s = setup(cgroups).await?;
    let script = r#"touch "$MARK_DIR/start-$ROTA_ATTEMPT-$$"
while [ ! -e "$MARK_DIR/go" ]; do sleep 0.05; done"#;
    let job_id = s.any.submit(job(&s.marks, script)).await?.job_id;
    let first = wait_until("the rank to start", WAIT, || async { Ok(starts(&s.marks).first().copied()) }).await?;
    s.any.wait_job_state(job_id, pb::JobState::Running, WAIT).await?;

    // The agent dies and its data directory is lost (its log aside); the rank runs on.
    s.agent.kill()?;
    for entry in std::fs::read_dir(&s.agent.data_dir)?.flatten() {
        if entry.file_name() == "agent.log" {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    ensure!(pid_alive(first.1), "the rank outlives its agent");
    s.agent.restart()?;

    // The restarted agent knows the rank again (its pids recorded anew): by
    // adopting the running one, or by starting it a second time.
    let ranks = s.agent.data_dir.join("ranks");
    let recorded = wait_until("the rank to be recorded again", WAIT, || async {
        let pids = std::fs::read_dir(&ranks)
            .into_iter()
            .flatten()
            .flatten()
            .find_map(|e| std::fs::read_to_string(e.path().join("pids.json")).ok());
        Ok(pids.and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok()))
    })
    .await?;
    let child = recorded["child_pid"].as_u64().context("child_pid")?;
    ensure!(child == u64::from(first.1), "the rank was started again: pid {child} instead of {}", first.1);

    // Whatever the restarted agent decides (it may stop the rank: it holds no
    // lease until a heartbeat is answered), no start overlaps the first.
    std::fs::write(s.marks.join("go"), "")?;
    let deadline = Instant::now() + WAIT;
    loop {
        let all = starts(&s.marks);
        if all.len() > 1 && pid_alive(first.1) {
            bail!("started again while the first start runs: {all:?}\n{}", s.agent.log_tail(4_000));
        }
        ensure!(all.iter().filter(|(attempt, _)| *attempt == first.0).count() == 1, "attempt {} started twice: {all:?}", first.0);
        let job = s.any.get(job_id).await?;
        if job.state == pb::JobState::Succeeded as i32 {
            break;
        }
        if Instant::now() > deadline {
            bail!("the job never finished: {job:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wiped_agent_data_dir_does_not_start_a_running_rank_twice() -> Result<()> {
    wiped_data_dir(true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wiped_agent_data_dir_does_not_start_a_running_rank_twice_without_cgroups() -> Result<()> {
    wiped_data_dir(false).await
}

/// A `--cgroup-parent` outside the cgroup mount is refused at start-up,
/// with an error naming the flag. (`--insecure`: the agent dials nothing
/// before it checks the flag, so it needs no certificate here.)
#[test]
fn the_agent_refuses_a_cgroup_parent_outside_the_mount() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut child = std::process::Command::new(rota_chaos::agents::agent_bin()?)
        .args(["--insecure", "--endpoints", "127.0.0.1:1", "--node-name", "node-a", "--fake-gpus", "1xH100-80GB"])
        .args(["--cgroup-parent", "../escape"])
        .arg("--data-dir")
        .arg(dir.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("stderr"))?)
        .spawn()?;
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            child.kill()?;
            child.wait()?;
            bail!("the agent started with a cgroup parent outside the mount");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(dir.path().join("stderr"))?;
    ensure!(!status.success() && stderr.contains("--cgroup-parent \"../escape\""), "{status}: {stderr}");
    Ok(())
}
