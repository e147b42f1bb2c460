//! One chaos run: start a cluster, drive the workload, inject faults on a
//! seeded schedule, let the cluster settle, then check and report.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rota_proto::v1 as pb;

use crate::agents::{AgentOptions, LocalAgent};
use crate::check::{self, Check, FinalJob};
use crate::cli_probe::{self, CliProbe};
use crate::cluster::{ClusterOptions, LocalCluster};
use crate::faults::FaultKind;
use crate::history::{now_ms, Fault, History};
use crate::proxy::LinkProxy;
use crate::report::state_name;
pub use crate::report::Report;
use crate::workload::{self, Clients, WorkloadConfig};

/// A failover slower than this fails the run.
pub const FAILOVER_LIMIT_MS: u64 = 60_000;
const ELECTION_WAIT: Duration = Duration::from_secs(60);
const LIST_PAGE: u32 = 5_000;
/// `LinkProxy::from` of agent i's links is this plus i.
const AGENT_LINK_BASE: u64 = 1_000_000;

#[derive(Debug, Clone)]
pub struct RunConfig {
    pub replicas: u64,
    pub agents: u32,
    pub duration_s: u64,
    pub faults: Vec<FaultKind>,
    pub interval_s: u64,
    pub seed: u64,
    /// After the faults stop, how long the run waits for jobs to finish
    /// once none has finished for that long (see `settle`).
    pub settle_s: u64,
    pub submitters: usize,
    pub submit_interval_ms: u64,
    pub cluster: ClusterOptions,
    /// Where data dirs, logs and markers go; a temporary dir when absent.
    pub dir: Option<PathBuf>,
    /// Extra environment for every agent (test switches).
    pub agent_env: Vec<(String, String)>,
    /// Inject the faults in the order given, round and round, instead of
    /// drawing each from the seeded RNG (targets are still drawn).
    pub in_order: bool,
    /// The longest a stale-follower cut lasts (see `stale_follower`).
    pub stale_cut_s: u64,
    /// A fresh `rota submit` process starts this often (`cli_probe`); 0: none.
    pub cli_probe_ms: u64,
}

/// What faults can hit.
struct Targets<'a> {
    cluster: &'a mut LocalCluster,
    links: &'a [LinkProxy],
    agents: &'a mut Vec<LocalAgent>,
    /// Per agent, its links to each replica.
    agent_links: &'a [Vec<LinkProxy>],
    /// The run's directory.
    dir: PathBuf,
    /// The id the next new replica gets (ids are never reused).
    next_id: u64,
}

/// The file whose presence makes agent `name`'s rank directories unwritable
/// (its `ROTA_TEST_AGENT_DISK_FULL_FILE`).
fn disk_full_file(dir: &std::path::Path, name: &str) -> PathBuf {
    dir.join("disk-full").join(name)
}

/// Start `count` agents with 8 fake H100s each, each reaching the replicas
/// through links of its own (so one agent can be cut off), and wait until
/// all registered. With `disk_full_switch`, each agent gets its own
/// `ROTA_TEST_AGENT_DISK_FULL_FILE`.
async fn start_agents(
    dir: &std::path::Path,
    cluster: &LocalCluster,
    count: u32,
    env: &[(String, String)],
    disk_full_switch: bool,
) -> Result<(Vec<LocalAgent>, Vec<Vec<LinkProxy>>)> {
    let options = AgentOptions { env: env.to_vec(), insecure: cluster.is_insecure(), ..AgentOptions::default() };
    std::fs::create_dir_all(dir.join("disk-full"))?;
    let mut agents = Vec::new();
    let mut agent_links = Vec::new();
    for i in 1..=count {
        let mut links = Vec::new();
        for (&id, replica) in &cluster.replicas {
            // `from` names the agent by its number, far from replica ids.
            links.push(LinkProxy::start(AGENT_LINK_BASE + u64::from(i), id, replica.addr.clone()).await?);
        }
        let endpoints: Vec<&str> = links.iter().map(|l| l.listen_addr.as_str()).collect();
        let name = format!("node-{i}");
        let mut options = options.clone();
        if disk_full_switch {
            options.env.push(("ROTA_TEST_AGENT_DISK_FULL_FILE".into(), disk_full_file(dir, &name).display().to_string()));
        }
        agents.push(LocalAgent::start(dir, &name, &endpoints.join(","), options)?);
        agent_links.push(links);
    }
    let deadline = Instant::now() + ELECTION_WAIT;
    loop {
        let leader = cluster.wait_leader(ELECTION_WAIT).await?;
        let listed = cluster.cluster_client(leader)?.list_nodes(pb::ListNodesRequest {}).await;
        let ready = listed.map(|r| r.into_inner().nodes.iter().filter(|n| n.state == "ready").count()).unwrap_or(0);
        if ready >= count as usize {
            return Ok((agents, agent_links));
        }
        anyhow::ensure!(Instant::now() < deadline, "{ready} of {count} agents registered in time");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn run(config: RunConfig) -> Result<Report> {
    let temp = tempfile::tempdir()?;
    let dir = config.dir.clone().unwrap_or_else(|| temp.path().to_path_buf());
    let markers = dir.join("markers");
    std::fs::create_dir_all(&markers)?;
    let (mut cluster, links) = LocalCluster::start_proxied(&dir, config.replicas, config.cluster.clone()).await?;
    cluster.wait_leader(ELECTION_WAIT).await.context("first election")?;
    let clients = Clients::new(&cluster.endpoints(), cluster.security())?;
    let disk_full_switch = config.faults.contains(&FaultKind::AgentDiskFull);
    let (mut agents, agent_links) = start_agents(&dir, &cluster, config.agents, &config.agent_env, disk_full_switch).await?;
    let history = Arc::new(History::default());
    let stop = Arc::new(AtomicBool::new(false));
    let sampling = Arc::new(AtomicBool::new(false));
    let sampler = crate::procs::spawn_sampler(dir.clone(), sampling.clone());
    let workload_config = WorkloadConfig {
        seed: config.seed,
        submitters: config.submitters,
        submit_interval_ms: config.submit_interval_ms,
        marker_dir: markers.display().to_string(),
        max_gpus: 16,
        runnable: config.agents > 0,
    };
    let mut long_lived = rota_client::Client::new(&cluster.endpoints(), cluster.security())?;
    long_lived.deadline = Duration::from_millis(workload::SUBMIT_DEADLINE_MS);
    let mut tasks = vec![tokio::spawn(workload::probe(long_lived, clients.clone(), history.clone(), config.seed, stop.clone()))];
    if config.cli_probe_ms > 0 {
        let probe = CliProbe {
            rota: crate::cluster::rota_bin()?,
            endpoints_csv: cluster.endpoints_csv(),
            flags: cluster.cli_flags()?,
            cache_home: dir.join("cli-cache"),
            every_ms: config.cli_probe_ms,
        };
        tasks.push(tokio::spawn(cli_probe::run(probe, clients.clone(), history.clone(), config.seed, stop.clone())));
    }
    for i in 0..config.submitters {
        tasks.push(tokio::spawn(workload::submitter(i, clients.clone(), history.clone(), workload_config.clone(), stop.clone())));
    }

    let mut targets = Targets {
        cluster: &mut cluster,
        links: &links,
        agents: &mut agents,
        agent_links: &agent_links,
        dir: dir.clone(),
        next_id: config.replicas + 1,
    };
    inject_faults(&mut targets, &history, &config).await?;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await?;
    }
    cluster.wait_leader(ELECTION_WAIT).await.context("election after the faults")?;
    let acked: BTreeSet<u64> = {
        let acks = history.acks.lock().expect("history lock");
        let probes = history.probes.lock().expect("history lock");
        let cli_probes = history.cli_probes.lock().expect("history lock");
        acks.iter().chain(probes.iter()).chain(cli_probes.iter()).map(|a| a.job_id).collect()
    };
    if workload_config.runnable {
        settle(&clients, &acked, Duration::from_secs(config.settle_s)).await;
    }
    sampling.store(true, Ordering::Relaxed);
    let samples = sampler.join().map_err(|_| anyhow::anyhow!("the process sampler panicked"))?;
    let jobs = read_all_jobs(&clients).await?;
    let report = build_report(&config, &history, &jobs, &markers, &samples, dir.display().to_string());
    if config.dir.is_none() && !report.passed {
        // Keep the evidence of a failed run.
        let kept = temp.keep();
        tracing::warn!(dir = %kept.display(), "run failed; data kept");
    }
    Ok(report)
}

/// Every `interval_s`, one fault drawn from `faults` by the seeded RNG; each
/// is healed after its duration, and the next waits for an agreed leader.
async fn inject_faults(targets: &mut Targets<'_>, history: &History, config: &RunConfig) -> Result<()> {
    let mut rng = StdRng::seed_from_u64(config.seed);
    let started = Instant::now();
    let total = Duration::from_secs(config.duration_s);
    let interval = Duration::from_secs(config.interval_s.max(1));
    let mut next = started + interval;
    let mut injected = 0usize;
    while next + Duration::from_secs(1) < started + total {
        tokio::time::sleep_until(next.into()).await;
        let kind = match config.in_order {
            true => config.faults[injected % config.faults.len()],
            false => config.faults[rng.gen_range(0..config.faults.len())],
        };
        injected += 1;
        let leader = targets.cluster.wait_leader(ELECTION_WAIT).await.context("leader before a fault")?;
        inject_one(targets, history, kind, leader, &mut rng, config).await?;
        targets.cluster.wait_leader(ELECTION_WAIT).await.with_context(|| format!("leader after {}", kind.name()))?;
        next = Instant::now().max(next + interval);
    }
    tokio::time::sleep_until((started + total).into()).await;
    Ok(())
}

async fn inject_one(
    targets: &mut Targets<'_>,
    history: &History,
    kind: FaultKind,
    leader: u64,
    rng: &mut StdRng,
    config: &RunConfig,
) -> Result<()> {
    let node_ttl_ms = config.cluster.node_ttl_ms;
    let followers: Vec<u64> = targets.cluster.replicas.keys().copied().filter(|id| *id != leader).collect();
    let (target, name) = match kind {
        FaultKind::KillFollower | FaultKind::StaleFollower | FaultKind::WipeFollower | FaultKind::SkewClock => {
            let id = followers[rng.gen_range(0..followers.len())];
            (id, format!("replica-{id}"))
        }
        FaultKind::RestartAgent | FaultKind::PartitionAgent | FaultKind::AgentDiskFull => {
            anyhow::ensure!(!targets.agents.is_empty(), "{} needs agents (--agents N)", kind.name());
            let i = rng.gen_range(0..targets.agents.len());
            (i as u64, targets.agents[i].name.clone())
        }
        FaultKind::ChangeMembership => (targets.next_id, format!("replica-{}", targets.next_id)),
        _ => (leader, format!("replica-{leader}")),
    };
    let fault = Fault { kind: kind.name().into(), target: name, at_ms: now_ms(), healed_ms: None, leader_before: Some(leader) };
    tracing::info!(kind = kind.name(), target = %fault.target, "fault");
    let index = history.record_fault(fault);
    let slot = targets.cluster.link_slot(target);
    let links_of = |slot: u64| targets.links.iter().filter(move |l| l.from == slot || l.to == slot);
    let agent_links_to = |slot: u64| targets.agent_links.iter().flatten().filter(move |l| l.to == slot);
    match kind {
        FaultKind::KillLeader | FaultKind::KillFollower => targets.cluster.kill(target)?,
        FaultKind::PauseLeader => targets.cluster.pause(target)?,
        FaultKind::PartitionLeader => links_of(slot).for_each(LinkProxy::cut),
        FaultKind::LongPartitionLeader => {
            links_of(slot).for_each(LinkProxy::cut);
            agent_links_to(slot).for_each(LinkProxy::cut);
        }
        FaultKind::RestartAgent => targets.agents[target as usize].kill()?,
        FaultKind::PartitionAgent => targets.agent_links[target as usize].iter().for_each(LinkProxy::cut),
        FaultKind::AgentDiskFull => {
            std::fs::write(disk_full_file(&targets.dir, &targets.agents[target as usize].name), b"full")?;
        }
        FaultKind::StaleFollower => stale_follower(targets, history, target, slot, Duration::from_secs(config.stale_cut_s)).await?,
        FaultKind::WipeFollower => wipe_follower(targets, history, target, rng.gen_bool(0.5)).await?,
        FaultKind::SkewClock => skew_clock(targets, history, target, rng).await?,
        FaultKind::ChangeMembership => change_membership(targets, history).await?,
    }
    if !matches!(kind, FaultKind::SkewClock | FaultKind::StaleFollower | FaultKind::WipeFollower | FaultKind::ChangeMembership) {
        tokio::time::sleep(kind.duration(node_ttl_ms)).await;
    }
    match kind {
        FaultKind::KillLeader | FaultKind::KillFollower => targets.cluster.restart(target)?,
        FaultKind::PauseLeader => targets.cluster.resume(target)?,
        FaultKind::PartitionLeader => links_of(slot).for_each(LinkProxy::heal),
        FaultKind::LongPartitionLeader => {
            links_of(slot).for_each(LinkProxy::heal);
            agent_links_to(slot).for_each(LinkProxy::heal);
        }
        FaultKind::RestartAgent => targets.agents[target as usize].restart()?,
        FaultKind::PartitionAgent => targets.agent_links[target as usize].iter().for_each(LinkProxy::heal),
        FaultKind::AgentDiskFull => std::fs::remove_file(disk_full_file(&targets.dir, &targets.agents[target as usize].name))?,
        FaultKind::SkewClock => unskew_clock(targets, target)?,
        FaultKind::StaleFollower | FaultKind::WipeFollower | FaultKind::ChangeMembership => {}
    }
    history.heal_fault(index);
    Ok(())
}

/// The longest a replica with a skewed clock may lead: elected, it checks
/// its clock against its peers' before it takes writes (every 5 s after)
/// and hands leadership off once proven wrong.
const SKEWED_LEAD_LIMIT_MS: u64 = 6_000;

/// How long a replica fault waits for what it expects (a snapshot taken, a
/// replica caught up, a member change done) before it records a failure.
const RECOVERY_WAIT: Duration = Duration::from_secs(90);

/// Cut `target` from its peers until the leader has purged the log entries
/// it lacks (so only a snapshot can catch it up), at most `cut_limit`,
/// heal, and expect it to catch up. A leader that purged nothing meanwhile
/// is noted (the follower then catches up by log): openraft postpones a
/// purge while a replication to a follower is in flight, and one to a cut
/// off follower may stay so.
async fn stale_follower(targets: &mut Targets<'_>, history: &History, target: u64, slot: u64, cut_limit: Duration) -> Result<()> {
    let applied = targets.cluster.status(target).await.map_or(0, |s| s.applied_index);
    targets.links.iter().filter(|l| l.from == slot || l.to == slot).for_each(LinkProxy::cut);
    let deadline = Instant::now() + cut_limit;
    let mut purged = 0;
    while Instant::now() < deadline {
        if let Ok(leader) = targets.cluster.wait_leader(Duration::from_secs(5)).await {
            purged = targets.cluster.status(leader).await.map_or(0, |s| s.purged_index);
            if purged > applied {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    targets.links.iter().filter(|l| l.from == slot || l.to == slot).for_each(LinkProxy::heal);
    let how = if purged > applied { "snapshot" } else { "log" };
    if purged <= applied {
        history.note(format!(
            "stale-follower {target}: in {cut_limit:?} cut off, the leader purged nothing past the follower's index {applied} (purged up to {purged}); it caught up by log"
        ));
    }
    expect_caught_up(targets.cluster, history, target, &format!("stale-follower (by {how})")).await;
    Ok(())
}

/// Wait until `target` applied what the leader had committed; record a failure otherwise.
async fn expect_caught_up(cluster: &LocalCluster, history: &History, target: u64, what: &str) {
    let commit = match cluster.wait_leader(ELECTION_WAIT).await {
        Ok(leader) => cluster.status(leader).await.map_or(0, |s| s.commit_index),
        Err(error) => {
            history.record_recovery_failure(format!("{what} {target}: no leader to catch up from: {error}"));
            return;
        }
    };
    if let Err(error) = cluster.wait_applied(target, commit, RECOVERY_WAIT).await {
        history.record_recovery_failure(format!("{what} {target}: did not catch up: {error}"));
    }
}

/// SIGKILL `target`, wipe its data directory (whole, or its Raft store),
/// expect it to refuse to start, then replace it as an operator would.
///
/// A wiped whole directory is recognized only by what the leader matched
/// on that replica in its own term (the promise's known limit: see the
/// README); when the leader has matched nothing there yet (the replica was
/// cut off for all of its term), only the Raft store is wiped.
async fn wipe_follower(targets: &mut Targets<'_>, history: &History, target: u64, whole: bool) -> Result<()> {
    let cluster = &mut *targets.cluster;
    let leader = cluster.wait_leader(ELECTION_WAIT).await?;
    let matched = cluster.status(leader).await.is_some_and(|s| s.members.iter().any(|m| m.id == target && m.matched_index > 0));
    let whole = whole && matched;
    cluster.kill(target)?;
    let db = cluster.replicas[&target].data_dir.join("db");
    let wiped = if whole { db.clone() } else { db.join("raft") };
    std::fs::remove_dir_all(&wiped).with_context(|| format!("wiping {}", wiped.display()))?;
    cluster.restart(target)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let refused = loop {
        if let Some(status) = cluster.exit_status(target)? {
            break !status.success();
        }
        if Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    if !refused {
        history.record_recovery_failure(format!(
            "wipe-follower {target}: started (or exited zero) with its data directory wiped ({}); log: {}",
            if whole { "whole" } else { "Raft store" },
            cluster.log_tail(target, 1_000)
        ));
        cluster.kill(target)?;
    }
    // The operator's remedy: remove the member, add the host back under a new id.
    if let Err(error) = admin(cluster, |mut c| async move { c.remove_member(pb::RemoveMemberRequest { id: target }).await }).await {
        history.record_recovery_failure(format!("wipe-follower {target}: member remove failed: {error}"));
        return Ok(());
    }
    let new_id = targets.next_id;
    targets.next_id += 1;
    let address = cluster.replace_on_same_host(target, new_id)?;
    let added = admin(cluster, |mut c| {
        let address = address.clone();
        async move { c.add_member(pb::AddMemberRequest { id: new_id, address }).await }
    })
    .await;
    if let Err(error) = added {
        history.record_recovery_failure(format!("wipe-follower {target}: member add of replica {new_id} failed: {error}"));
        return Ok(());
    }
    expect_caught_up(cluster, history, new_id, "wipe-follower replacement").await;
    Ok(())
}

/// Restart `target` with its clock far off; it must not lead while skewed.
async fn skew_clock(targets: &mut Targets<'_>, history: &History, target: u64, rng: &mut StdRng) -> Result<()> {
    let offsets_ms: [i64; 3] = [86_400_000, -86_400_000, 30_000];
    let offset_ms = offsets_ms[rng.gen_range(0..offsets_ms.len())];
    let cluster = &mut *targets.cluster;
    cluster.kill(target)?;
    let normal = cluster.env_of(target);
    let mut skewed = normal.clone();
    skewed.push(("ROTA_TEST_CLOCK_OFFSET_MS".into(), offset_ms.to_string()));
    cluster.set_env_of(target, skewed);
    cluster.restart(target)?;
    cluster.set_env_of(target, normal);
    // Watch leadership while the clock is off (the fault's duration follows).
    let watch_until = Instant::now() + FaultKind::SkewClock.duration(0);
    let mut led_since: Option<Instant> = None;
    while Instant::now() < watch_until {
        let leads = cluster.status(target).await.is_some_and(|s| s.leader_id == target);
        match (leads, led_since) {
            (true, None) => led_since = Some(Instant::now()),
            (false, _) => led_since = None,
            _ => {}
        }
        // Elected, it checks its clock before it takes writes and hands
        // leadership off at once; one check's time (5 s) is the most it may hold it.
        if led_since.is_some_and(|since| since.elapsed() > Duration::from_millis(SKEWED_LEAD_LIMIT_MS)) {
            history.record_recovery_failure(format!(
                "skew-clock {target}: led for over {SKEWED_LEAD_LIMIT_MS} ms with its clock {offset_ms} ms off"
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Restart the skewed replica with its own clock.
fn unskew_clock(targets: &mut Targets<'_>, target: u64) -> Result<()> {
    targets.cluster.kill(target)?;
    targets.cluster.restart(target)
}

/// Add a replica under a new id (learner, then voter) and remove it again.
async fn change_membership(targets: &mut Targets<'_>, history: &History) -> Result<()> {
    let id = targets.next_id;
    targets.next_id += 1;
    let cluster = &mut *targets.cluster;
    let address = cluster.start_joining(id)?;
    let added = admin(cluster, |mut c| {
        let address = address.clone();
        async move { c.add_member(pb::AddMemberRequest { id, address }).await }
    })
    .await;
    match added {
        Ok(status) if status.members.iter().any(|m| m.id == id && m.role != "learner") => {
            expect_caught_up(cluster, history, id, "change-membership").await;
        }
        Ok(status) => {
            history.record_recovery_failure(format!("change-membership {id}: not a voter after member add: {:?}", status.members))
        }
        Err(error) => history.record_recovery_failure(format!("change-membership {id}: member add failed: {error}")),
    }
    if let Err(error) = admin(cluster, |mut c| async move { c.remove_member(pb::RemoveMemberRequest { id }).await }).await {
        history.record_recovery_failure(format!("change-membership {id}: member remove failed: {error}"));
    }
    // Removed (or never added): stop it, unless it still counts as a voter.
    let voter = match cluster.wait_leader(ELECTION_WAIT).await {
        Ok(leader) => cluster.status(leader).await.is_some_and(|s| s.members.iter().any(|m| m.id == id)),
        Err(_) => false,
    };
    if !voter {
        cluster.forget(id)?;
    }
    Ok(())
}

/// A cluster admin call sent to the leader, retried across leader changes
/// until it succeeds or `RECOVERY_WAIT` passes.
async fn admin<F, Fut>(cluster: &LocalCluster, call: F) -> Result<pb::ClusterStatus>
where
    F: Fn(pb::cluster_service_client::ClusterServiceClient<tonic::transport::Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<pb::ClusterStatus>, tonic::Status>>,
{
    let deadline = Instant::now() + RECOVERY_WAIT;
    loop {
        let error = match cluster.wait_leader(ELECTION_WAIT).await {
            Ok(leader) => match call(cluster.cluster_client(leader)?).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) => anyhow::anyhow!("{status}"),
            },
            Err(error) => error,
        };
        if Instant::now() > deadline {
            return Err(error);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// How many settle periods the wait may last in all while jobs keep finishing.
const SETTLE_MAX_PERIODS: u32 = 10;

/// Wait until every acknowledged job is final. A backlog left by the faults
/// takes as long as it takes to run: the wait goes on while jobs keep
/// finishing, and ends once none has finished for `stall` (a stuck job is
/// then reported by the liveness check) or after `SETTLE_MAX_PERIODS`
/// times `stall` in all.
async fn settle(clients: &Clients, acked: &BTreeSet<u64>, stall: Duration) {
    let started = Instant::now();
    let mut progress_at = Instant::now();
    let mut open: BTreeSet<u64> = acked.clone();
    while !open.is_empty() && progress_at.elapsed() < stall && started.elapsed() < stall * SETTLE_MAX_PERIODS {
        let mut still_open = BTreeSet::new();
        for &id in &open {
            let final_state = clients
                .get(id)
                .await
                .map(|j| matches!(j.state(), pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Cancelled));
            if !final_state.unwrap_or(false) {
                still_open.insert(id);
            }
        }
        if still_open.len() < open.len() {
            progress_at = Instant::now();
        }
        open = still_open;
        if !open.is_empty() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    if !open.is_empty() {
        tracing::warn!(open = open.len(), waited_s = started.elapsed().as_secs(), "jobs still open when the settle wait ended");
    }
}

/// Every job the cluster has, page by page (newest first).
async fn read_all_jobs(clients: &Clients) -> Result<Vec<FinalJob>> {
    let mut jobs = Vec::new();
    let mut before_id = 0;
    loop {
        let request = pb::ListJobsRequest { limit: LIST_PAGE, before_id, ..Default::default() };
        let (page, _) = clients
            .call(0, 60_000, |mut c| {
                let request = request.clone();
                async move { c.list_jobs(request).await }
            })
            .await;
        let page = page.context("listing jobs")?;
        let Some(last) = page.jobs.last() else { break };
        before_id = last.id;
        jobs.extend(page.jobs.iter().map(|j| FinalJob {
            id: j.id,
            request_id: j.request_id.clone(),
            state: state_name(j.state).to_string(),
            started_at_ms: j.started_at_ms,
            finished_at_ms: j.finished_at_ms,
            attempts: j.attempts,
            ranks: j.spec.as_ref().map_or(1, |s| s.replicas.max(1)),
            reason: format!("{}: {}", j.reason_code, j.reason_detail),
        }));
        if page.jobs.len() < LIST_PAGE as usize {
            break;
        }
    }
    Ok(jobs)
}

fn build_report(
    config: &RunConfig,
    history: &History,
    jobs: &[FinalJob],
    markers: &std::path::Path,
    samples: &crate::procs::Samples,
    dir: String,
) -> Report {
    let acks = history.acks.lock().expect("history lock").clone();
    let probes = history.probes.lock().expect("history lock").clone();
    let cli_probes = history.cli_probes.lock().expect("history lock").clone();
    let resubmits = history.resubmits.lock().expect("history lock").clone();
    let cancels = history.cancels.lock().expect("history lock").clone();
    let faults = history.faults.lock().expect("history lock").clone();
    let mut all_acks = acks.clone();
    all_acks.extend(probes.iter().cloned());
    all_acks.extend(cli_probes.iter().cloned());
    let mut checks = vec![check::acknowledged_exactly_once(&all_acks, jobs, &resubmits)];
    let by_id: BTreeMap<u64, FinalJob> = jobs.iter().map(|j| (j.id, j.clone())).collect();
    if config.agents > 0 {
        let runs = check::read_markers(markers);
        let probe_jobs = probes.iter().chain(cli_probes.iter()).map(|p| p.job_id);
        let cancelled: BTreeSet<u64> = cancels.iter().map(|c| c.0).chain(probe_jobs).collect();
        let acked: BTreeSet<u64> = acks.iter().chain(probes.iter()).chain(cli_probes.iter()).map(|a| a.job_id).collect();
        // Outages past the TTL stop ranks by rule: the ranks they cut off are
        // not counted as killed.
        let outages: Vec<check::Outage> = faults
            .iter()
            .filter(|f| f.kind.parse::<FaultKind>().is_ok_and(FaultKind::outlasts_ttl))
            .map(|f| check::Outage { node: f.target.clone(), from_ms: f.at_ms, to_ms: f.healed_ms.unwrap_or(u64::MAX) })
            .collect();
        // Faults that may end an agent's ranks by rule (an agent whose disk
        // is full ends the ranks it cannot record): their jobs may run again.
        let ended_by_rule: Vec<check::Outage> = faults
            .iter()
            .filter(|f| f.kind.parse::<FaultKind>().is_ok_and(FaultKind::ends_ranks_by_rule))
            .map(|f| check::Outage { node: f.target.clone(), from_ms: f.at_ms, to_ms: f.healed_ms.unwrap_or(u64::MAX) })
            .collect();
        checks.push(check::gpus_exclusive(&runs, &by_id, &outages, |pid, job, start| samples.gone_by(pid, job, start)));
        checks.push(check::no_rank_killed(&runs, &by_id, &cancelled, &ended_by_rule));
        checks.push(check::no_two_attempts_alive(samples));
        checks.push(check::liveness(jobs, &acked));
    } else {
        for name in [
            "no_gpu_held_by_two_running_ranks",
            "no_running_rank_killed_or_restarted",
            "no_two_attempts_of_a_job_alive_at_once",
            "every_job_reaches_a_final_state",
        ] {
            checks.push(Check::skipped(name, "no agents in this run (--agents 0): no job runs"));
        }
    }
    checks.push(check::faulted_replicas_recovered(&history.recovery_failures.lock().expect("history lock")));
    let with_cli = config.cli_probe_ms > 0;
    let failovers = check::failovers(&faults, &probes, with_cli.then_some(&cli_probes[..]), jobs);
    checks.push(check::failover_bound(&failovers, FAILOVER_LIMIT_MS, with_cli));
    let failover_submit = check::distribution(failovers.iter().filter_map(|f| f.submit_ms).collect());
    let failover_cli_submit = check::distribution(failovers.iter().filter_map(|f| f.cli_submit_ms).collect());
    let failover_schedule = check::distribution(failovers.iter().filter_map(|f| f.schedule_ms).collect());
    let failover_by_kind = check::failovers_by_kind(&failovers);
    Report {
        passed: checks.iter().all(|c| c.passed),
        replicas: config.replicas,
        agents: config.agents,
        seed: config.seed,
        duration_s: config.duration_s,
        acknowledged_submits: acks.len(),
        unacknowledged_submits: *history.unacked.lock().expect("history lock"),
        unacknowledged_errors: history.unacked_errors.lock().expect("history lock").clone(),
        resubmits: resubmits.len(),
        cancels: cancels.len(),
        probes: probes.len(),
        cli_probes: cli_probes.len(),
        cli_probes_failed: *history.cli_failed.lock().expect("history lock"),
        cli_probes_skipped: *history.cli_skipped.lock().expect("history lock"),
        cli_probe_errors: history.cli_errors.lock().expect("history lock").clone(),
        faults,
        notes: history.notes.lock().expect("history lock").clone(),
        failovers,
        failover_submit,
        failover_cli_submit,
        failover_schedule,
        failover_by_kind,
        checks,
        dir,
    }
}
