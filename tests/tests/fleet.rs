//! A fleet of simulated agents (`rota-agent fleet`: the agent's own session,
//! watch, reconcile and report code, ranks simulated) against a real
//! 3-replica cluster with TLS, each simulated node with its own agent
//! certificate.
//!
//! `two_hundred_nodes_ride_out_a_leader_kill` (CI): 200 nodes; 1-GPU jobs
//! and a 16-node gang run while the leader is killed by PID; no node is
//! ever marked down and every job succeeds on its first attempt.
//!
//! `fleet_benchmark` (ignored; run by hand, see BENCHMARKS.md): the figures
//! of a fleet of `ROTA_FLEET_BENCH_NODES` nodes (default 1,250).

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::fleet::LocalFleet;
use rota_e2e::{list_nodes, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(90);

/// A job of `replicas` ranks of `gpus` GPUs whose simulated ranks run `run_ms`.
fn fleet_job(request_id: &str, replicas: u32, gpus: u32, run_ms: u64) -> pb::SubmitJobRequest {
    let spec = pb::JobSpec {
        group: "e2e".into(),
        queue: "training".into(),
        replicas,
        gpus_per_replica: gpus,
        command: vec!["train".into()],
        env: [("FLEET_RUN_MS".to_string(), run_ms.to_string())].into_iter().collect(),
        ..Default::default()
    };
    pb::SubmitJobRequest { spec: Some(spec), request_id: request_id.to_string(), ..Default::default() }
}

/// Whether every rank of the job's current attempt reported its start.
fn all_ranks_running(job: &pb::Job) -> bool {
    job.state == pb::JobState::Running as i32 && !job.allocations.is_empty() && job.allocations.iter().all(|r| r.state == "running")
}

async fn wait_all_ranks_running(any: &AnyReplica, job_id: u64, timeout: Duration) -> Result<pb::Job> {
    wait_until(&format!("every rank of job {job_id} running"), timeout, || async {
        let job = any.get(job_id).await?;
        if job.finished_at_ms != 0 {
            bail!("job {job_id} ended before every rank ran: {job:?}");
        }
        Ok(all_ranks_running(&job).then_some(job))
    })
    .await
}

/// Watches the node list of whichever running replica answers, every
/// `every`, and keeps every node it ever saw in a state other than ready.
struct DownWatch {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl DownWatch {
    fn start(cluster: &LocalCluster, every: Duration) -> Result<DownWatch> {
        let clients: Vec<_> = cluster.replicas.keys().map(|&id| cluster.cluster_client(id)).collect::<Result<_>>()?;
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (stop_flag, seen_nodes) = (stop.clone(), seen.clone());
        let task = tokio::spawn(async move {
            let mut next = 0usize;
            while !stop_flag.load(Ordering::Relaxed) {
                let mut client = clients[next % clients.len()].clone();
                let asked = tokio::time::timeout(Duration::from_secs(2), client.list_nodes(pb::ListNodesRequest {})).await;
                match asked {
                    Ok(Ok(response)) => {
                        let not_ready: Vec<String> = response
                            .into_inner()
                            .nodes
                            .into_iter()
                            .filter(|n| n.state != "ready")
                            .map(|n| format!("{} {}", n.name, n.state))
                            .collect();
                        seen_nodes.lock().expect("seen lock").extend(not_ready);
                    }
                    // A killed replica: ask the next one.
                    _ => next += 1,
                }
                tokio::time::sleep(every).await;
            }
        });
        Ok(DownWatch { stop, seen, task })
    }

    async fn finish(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        let mut seen = self.seen.lock().expect("seen lock").clone();
        seen.sort();
        seen.dedup();
        seen
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_nodes_ride_out_a_leader_kill() -> Result<()> {
    const NODES: usize = 200;
    const TTL_MS: u64 = 6_000;
    const RUN_MS: u64 = 12_000;
    let dir = tempfile::tempdir()?;
    let options = ClusterOptions { node_ttl_ms: TTL_MS, ..ClusterOptions::default() };
    let mut cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(WAIT).await?;
    let fleet = LocalFleet::start(dir.path(), &cluster, NODES, 5, 1_000)?;
    if let Err(error) = wait_nodes_ready(&cluster, NODES, WAIT).await {
        bail!("{error}\nfleet log:\n{}", fleet.log_tail());
    }
    let nodes = list_nodes(&cluster, leader).await?;
    let racks: std::collections::BTreeSet<&str> = nodes.iter().map(|n| n.rack.as_str()).collect();
    ensure!(racks.len() == 5, "the nodes report their racks: {racks:?}");
    ensure!(nodes.iter().all(|n| n.gpus.len() == 8), "every node has 8 GPUs");

    let any = AnyReplica::new(&cluster)?;
    let mut jobs = Vec::new();
    for i in 0..24 {
        jobs.push(any.submit(fleet_job(&format!("one-{i}"), 1, 1, RUN_MS)).await?.job_id);
    }
    let gang = any.submit(fleet_job("gang", 16, 8, RUN_MS)).await?.job_id;
    jobs.push(gang);
    for &job_id in &jobs {
        wait_all_ranks_running(&any, job_id, WAIT).await?;
    }
    let gang_nodes = any.get(gang).await?.allocations.iter().map(|r| r.node.clone()).collect::<std::collections::BTreeSet<_>>();
    ensure!(gang_nodes.len() == 16, "the gang runs on 16 whole nodes: {gang_nodes:?}");

    let watch = DownWatch::start(&cluster, Duration::from_millis(100))?;
    cluster.kill(leader)?;
    let new_leader = cluster.wait_leader(WAIT).await?;
    ensure!(new_leader != leader);
    for &job_id in &jobs {
        let job = any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
        ensure!(job.attempts == 1, "job {job_id} ran {} times", job.attempts);
    }
    // One more TTL after the last job: a node the new leader never heard
    // from would be declared down by now.
    let settled = Instant::now() + Duration::from_millis(TTL_MS);
    while Instant::now() < settled {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let not_ready = watch.finish().await;
    ensure!(not_ready.is_empty(), "nodes were seen not ready: {not_ready:?}");
    let nodes = list_nodes(&cluster, new_leader).await?;
    ensure!(nodes.len() == NODES && nodes.iter().all(|n| n.state == "ready"), "a node is not ready: {nodes:?}");
    ensure!(fleet.stat("leases_held") == NODES as u64, "every simulated node holds its lease: {:?}", fleet.stats());
    ensure!(fleet.stat("ranks_started") == 24 + 16, "every rank started once: {:?}", fleet.stats());
    Ok(())
}

/// CPU seconds (user + system) a process has used so far, from /proc.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = text[text.rfind(')').context("stat")? + 1..].split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(ticks as f64 / clock_ticks_per_s())
}

fn clock_ticks_per_s() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        let output = Command::new("getconf").arg("CLK_TCK").output().ok();
        output.and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok()).unwrap_or(100.0)
    })
}

/// Resident memory of a process, MiB.
fn rss_mib(pid: u32) -> Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = text.lines().find_map(|l| l.strip_prefix("VmRSS:")).context("VmRSS")?.trim().trim_end_matches("kB").trim().parse()?;
    Ok(kib / 1024.0)
}

/// CLOCK_BOOTTIME in ms, as the fleet's figures count time (/proc/uptime, 10 ms steps).
fn boottime_ms() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/uptime")?;
    let seconds: f64 = text.split_whitespace().next().context("uptime")?.parse()?;
    Ok((seconds * 1_000.0) as u64)
}

fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Submit a job and time submit -> every rank started on its node (the
/// fleet's count of ranks started, which counts a rank when its agent
/// launches it; the job's own rank states lag by the agent's report), ms;
/// then wait for its end.
async fn time_to_running(any: &AnyReplica, fleet: &LocalFleet, request: pb::SubmitJobRequest) -> Result<f64> {
    let ranks = u64::from(request.spec.as_ref().map_or(1, |s| s.replicas));
    let before = fleet.stat("ranks_started");
    let started = Instant::now();
    let job_id = any.submit(request).await?.job_id;
    wait_until(&format!("every rank of job {job_id} started"), WAIT, || async {
        Ok((fleet.stat("ranks_started") >= before + ranks).then_some(()))
    })
    .await?;
    let elapsed_ms = started.elapsed().as_secs_f64() * 1_000.0;
    any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    Ok(elapsed_ms)
}

/// The figures of BENCHMARKS.md's fleet section: 3 replicas with TLS and a
/// fleet of `ROTA_FLEET_BENCH_NODES` (default 1,250) nodes of 8 H100s in 32
/// racks of 4 leaves, node TTL `ROTA_FLEET_BENCH_TTL_MS` (default 30 s),
/// heartbeats every 2 s; Raft election timeouts `ROTA_FLEET_BENCH_ELECTION_MIN_MS`
/// and `_MAX_MS` (the harness's 100..200 ms by default). Prints one line per figure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a benchmark: minutes of CPU; run by hand (see BENCHMARKS.md)"]
async fn fleet_benchmark() -> Result<()> {
    let nodes = env_or("ROTA_FLEET_BENCH_NODES", 1_250) as usize;
    let ttl_ms = env_or("ROTA_FLEET_BENCH_TTL_MS", 30_000);
    let steady_s = env_or("ROTA_FLEET_BENCH_STEADY_S", 20);
    let rounds = env_or("ROTA_FLEET_BENCH_ROUNDS", 3) as usize;
    let gang_nodes = env_or("ROTA_FLEET_BENCH_GANG", 128).min(nodes as u64) as u32;
    let dir = tempfile::tempdir()?;
    let defaults = ClusterOptions::default();
    let options = ClusterOptions {
        node_ttl_ms: ttl_ms,
        election_min_ms: env_or("ROTA_FLEET_BENCH_ELECTION_MIN_MS", defaults.election_min_ms),
        election_max_ms: env_or("ROTA_FLEET_BENCH_ELECTION_MAX_MS", defaults.election_max_ms),
        ..defaults
    };
    println!("raft: heartbeat {} ms, election {}..{} ms", options.heartbeat_ms, options.election_min_ms, options.election_max_ms);
    let mut cluster = LocalCluster::start(dir.path(), 3, options)?;
    let mut leader = cluster.wait_leader(WAIT).await?;
    let racks = 32.min(nodes);
    let started = Instant::now();
    let fleet = LocalFleet::start(dir.path(), &cluster, nodes, racks, 2_000)?;
    let register_timeout = Duration::from_secs(600);
    if let Err(error) = wait_nodes_ready(&cluster, nodes, register_timeout).await {
        bail!("{error}\nfleet log:\n{}", fleet.log_tail());
    }
    println!("fleet: {nodes} nodes x 8 GPUs, {racks} racks; TTL {ttl_ms} ms; heartbeats every 2000 ms");
    println!("all nodes registered and ready: {:.1} s after the fleet started", started.elapsed().as_secs_f64());

    // Steady heartbeat load.
    let settle = Instant::now() + Duration::from_secs(5);
    while Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pids: Vec<(u64, u32)> = cluster.replicas.iter().filter_map(|(&id, r)| r.pid().map(|p| (id, p))).collect();
    let before: Vec<f64> = pids.iter().map(|&(_, p)| cpu_seconds(p)).collect::<Result<_>>()?;
    let fleet_before = cpu_seconds(fleet.pid())?;
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(steady_s)).await;
    let seconds = window.elapsed().as_secs_f64();
    for (i, &(id, pid)) in pids.iter().enumerate() {
        let cpu = (cpu_seconds(pid)? - before[i]) / seconds * 100.0;
        let role = if id == leader { "leader" } else { "follower" };
        println!("steady: replica {id} ({role}): CPU {cpu:.1}% of one core, RSS {:.0} MiB", rss_mib(pid)?);
    }
    let fleet_cpu = (cpu_seconds(fleet.pid())? - fleet_before) / seconds * 100.0;
    println!("steady: fleet process: CPU {fleet_cpu:.1}% of one core, RSS {:.0} MiB", rss_mib(fleet.pid())?);

    // Submit -> every rank running.
    let any = AnyReplica::new(&cluster)?;
    let mut single = Vec::new();
    for i in 0..(rounds * 3) {
        single.push(time_to_running(&any, &fleet, fleet_job(&format!("bench-one-{i}"), 1, 1, 5_000)).await?);
    }
    println!(
        "1-GPU job, submit -> rank started on its node: p50 {:.0} ms, p99 {:.0} ms ({} jobs: {single:.0?})",
        percentile(&single, 50.0),
        percentile(&single, 99.0),
        single.len()
    );
    let mut gangs = Vec::new();
    for i in 0..rounds {
        gangs.push(time_to_running(&any, &fleet, fleet_job(&format!("bench-gang-{i}"), gang_nodes, 8, 5_000)).await?);
    }
    println!(
        "{gang_nodes}-node x 8 GPU gang, submit -> every rank started on its node: p50 {:.0} ms, p99 {:.0} ms ({} gangs: {gangs:.0?})",
        percentile(&gangs, 50.0),
        percentile(&gangs, 99.0),
        gangs.len()
    );

    // Leader kills: time until every node had a heartbeat acknowledged and
    // an assignment update after the kill; any node marked down.
    let mut takeovers = Vec::new();
    let mut elections = Vec::new();
    let mut downs = Vec::new();
    for round in 0..rounds {
        let registrations_before = fleet.stat("registrations");
        let watch = DownWatch::start(&cluster, Duration::from_millis(250))?;
        let killed_at_ms = boottime_ms()?;
        let killed = Instant::now();
        cluster.kill(leader)?;
        let new_leader = cluster.wait_leader(WAIT).await?;
        elections.push(killed.elapsed().as_secs_f64() * 1_000.0);
        let taken_over_ms = wait_until("every node heard by the new control plane", WAIT, || async {
            let Some(stats) = fleet.stats() else { return Ok(None) };
            let acked = stats["heartbeat_acked_min_ms"].as_u64().unwrap_or(0);
            let watched = stats["assignments_min_ms"].as_u64().unwrap_or(0);
            Ok((acked > killed_at_ms && watched > killed_at_ms).then(|| stats["boottime_ms"].as_u64().unwrap_or(0)))
        })
        .await?;
        takeovers.push(taken_over_ms.saturating_sub(killed_at_ms) as f64);
        // Watch for downs for a TTL and a bit after the kill.
        let until = killed + Duration::from_millis(ttl_ms + 5_000);
        while Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let not_ready = watch.finish().await;
        println!(
            "leader kill {round}: leader {leader} -> {new_leader}; new leader agreed after {:.0} ms; every node heard after {:.0} ms; \
             re-registrations {}; nodes seen not ready: {}",
            elections[round],
            takeovers[round],
            fleet.stat("registrations") - registrations_before,
            not_ready.len()
        );
        downs.extend(not_ready);
        cluster.restart(leader)?;
        leader = new_leader;
        let caught_up = Instant::now() + Duration::from_secs(10);
        while Instant::now() < caught_up {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    println!(
        "failover: new leader agreed p50 {:.0} ms; whole fleet taken over p50 {:.0} ms, max {:.0} ms; nodes marked down: {}",
        percentile(&elections, 50.0),
        percentile(&takeovers, 50.0),
        percentile(&takeovers, 100.0),
        downs.len()
    );
    ensure!(downs.is_empty(), "nodes marked down by a failover: {downs:?}");
    Ok(())
}
