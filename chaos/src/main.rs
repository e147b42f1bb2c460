//! `rota-chaos run ...`: a chaos run against real processes on 127.0.0.1.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use rota_chaos::cluster::ClusterOptions;
use rota_chaos::faults::parse_faults;
use rota_chaos::report::summary;
use rota_chaos::run::{run, RunConfig};

#[derive(Parser)]
#[command(name = "rota-chaos", about = "Kill, pause and partition rota replicas; check that nothing is lost")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a cluster, drive a workload, inject faults, check, report.
    Run(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    #[arg(long, default_value_t = 3)]
    replicas: u64,
    #[arg(long, default_value_t = 0)]
    agents: u32,
    #[arg(long, default_value_t = 60)]
    duration_s: u64,
    /// Comma separated: kill-leader, pause-leader, partition-leader,
    /// long-partition-leader (leader cut from replicas and agents past the
    /// node TTL), kill-follower, stale-follower (needs a snapshot to catch
    /// up), wipe-follower (data dir wiped; replaced under a new id),
    /// skew-clock, change-membership (a replica added and removed),
    /// restart-agent, partition-agent (lasts past the node TTL),
    /// agent-disk-full; or all (those needing agents only with --agents).
    #[arg(long, default_value = "kill-leader,pause-leader")]
    faults: String,
    /// Inject the faults in the order given, round and round (default: each
    /// drawn at random from the list).
    #[arg(long)]
    in_order: bool,
    /// Longest stale-follower cut, seconds (ended sooner once the leader
    /// purged what the follower lacks).
    #[arg(long, default_value_t = 30)]
    stale_cut_s: u64,
    /// A fresh `rota submit` process starts this often, to measure failover
    /// as a shell user sees it (0: none).
    #[arg(long, default_value_t = 100)]
    cli_probe_ms: u64,
    /// Seconds between faults.
    #[arg(long, default_value_t = 10)]
    interval_s: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// After the faults stop, the run waits for every job to finish while
    /// jobs keep finishing; it stops waiting once none has finished for
    /// this many seconds (or after ten times it in all).
    #[arg(long, default_value_t = 180)]
    settle_s: u64,
    /// Concurrent submitters (default: 4 without agents, 1 with agents).
    #[arg(long)]
    submitters: Option<usize>,
    /// Pause between one submitter's submits (default: 50 ms without agents;
    /// with agents, sized so the jobs keep about 40% of the fake GPUs busy:
    /// gangs that take whole nodes need the rest to drain).
    #[arg(long)]
    submit_interval_ms: Option<u64>,
    #[arg(long, default_value_t = 50)]
    heartbeat_ms: u64,
    #[arg(long, default_value_t = 100)]
    election_min_ms: u64,
    #[arg(long, default_value_t = 200)]
    election_max_ms: u64,
    /// The replicas' node TTL; partition-agent faults last about twice it.
    #[arg(long, default_value_t = 30_000)]
    node_ttl_ms: u64,
    /// Replicas snapshot after this many entries (default: 20000, or 1000
    /// when stale-follower is among the faults, so a follower cut off for a
    /// while needs a snapshot to catch up).
    #[arg(long)]
    snapshot_every: Option<u64>,
    /// Log entries kept behind a snapshot (default: 5000, or 200 with stale-follower).
    #[arg(long)]
    keep_logs: Option<u64>,
    /// Keep data dirs, logs and markers here (default: a temporary dir, kept only on failure).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// text or json.
    #[arg(long, default_value = "text")]
    output: String,
    /// Write the JSON report here as well.
    #[arg(long)]
    report: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("ROTA_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    let Command::Run(args) = Cli::parse().command;
    if !matches!(args.replicas, 3 | 5 | 7) {
        anyhow::bail!("--replicas: 3, 5 or 7");
    }
    let faults = parse_faults(&args.faults, args.agents > 0)?;
    let stale = faults.contains(&rota_chaos::faults::FaultKind::StaleFollower);
    let defaults = ClusterOptions::default();
    let config = RunConfig {
        replicas: args.replicas,
        agents: args.agents,
        duration_s: args.duration_s,
        faults,
        interval_s: args.interval_s,
        seed: args.seed,
        settle_s: args.settle_s,
        submitters: args.submitters.unwrap_or(if args.agents == 0 { 4 } else { 1 }),
        submit_interval_ms: args.submit_interval_ms.unwrap_or(if args.agents == 0 { 50 } else { 6_000 / u64::from(args.agents) }),
        cluster: ClusterOptions {
            heartbeat_ms: args.heartbeat_ms,
            election_min_ms: args.election_min_ms,
            election_max_ms: args.election_max_ms,
            node_ttl_ms: args.node_ttl_ms,
            snapshot_every: args.snapshot_every.unwrap_or(if stale { 1_000 } else { defaults.snapshot_every }),
            keep_logs: args.keep_logs.unwrap_or(if stale { 200 } else { defaults.keep_logs }),
            ..defaults.clone()
        },
        dir: args.dir,
        agent_env: Vec::new(),
        in_order: args.in_order,
        stale_cut_s: args.stale_cut_s,
        cli_probe_ms: args.cli_probe_ms,
    };
    let report = run(config).await?;
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(path) = &args.report {
        std::fs::write(path, &json)?;
    }
    match args.output.as_str() {
        "json" => println!("{json}"),
        _ => print!("{}", summary(&report)),
    }
    if !report.passed {
        std::process::exit(1);
    }
    Ok(())
}
