//! `rota-agent`: the node agent. `rota-agent shim --dir DIR` is the per-rank
//! shim the agent starts (not meant to be run by hand). `rota-agent fleet`
//! runs many simulated agents in one process (a test and benchmark tool).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use rota_agent::agent::{self, AgentConfig, Shared};
use rota_agent::contain::Containment;
use rota_agent::inventory::GpuSource;
use rota_agent::logs::LogServer;
use rota_agent::users::JobUsers;
use rota_proto::v1::node_agent_service_server::NodeAgentServiceServer;
use rota_tls::{IdentityKind, TlsFlags};
use tonic::service::interceptor::InterceptedService;

/// The same allocator as the replicas' (a fleet process holds a thousand
/// agents' sessions and reports).
#[global_allocator]
static ALLOCATOR: rota_alloc::Allocator = rota_alloc::Allocator;

#[derive(Parser)]
#[command(name = "rota-agent", version, about = "rota's node agent: runs job ranks on a GPU host")]
struct Args {
    /// Scheduler replica addresses (host:port), comma separated.
    #[arg(long, env = "ROTA_ENDPOINTS", value_delimiter = ',', required = true)]
    endpoints: Vec<String>,
    /// This host's name in the cluster.
    #[arg(long)]
    node_name: String,
    /// Where rank directories (shim records, logs) live; keep it across restarts.
    #[arg(long)]
    data_dir: PathBuf,
    /// Address the scheduler, other ranks (MASTER_ADDR) and `rota logs` reach this host at.
    #[arg(long, default_value = "127.0.0.1")]
    advertise_addr: IpAddr,
    /// Port of the agent's gRPC server (logs); 0 = any free port.
    #[arg(long, default_value_t = 0)]
    port: u16,
    #[arg(long, default_value = "")]
    rack: String,
    #[arg(long, default_value = "")]
    leaf: String,
    /// Declare GPUs instead of asking NVML: COUNTxMODEL[,COUNTxMODEL...], e.g. 8xH100-80GB.
    #[arg(long)]
    fake_gpus: Option<String>,
    /// A GPU under this utilization (percent) is idle.
    #[arg(long, default_value_t = rota_agent::idle::DEFAULT_IDLE_BELOW_PERCENT)]
    idle_below_percent: u32,
    /// A rank whose every GPU stayed idle this long is reported idle (ms).
    #[arg(long, default_value_t = rota_agent::idle::DEFAULT_IDLE_AFTER_MS)]
    idle_after_ms: u64,
    /// Heartbeat period (never longer than a quarter of the leader's TTL).
    #[arg(long, default_value_t = 2_000)]
    heartbeat_ms: u64,
    /// Command prefix for every rank, e.g. "podman run --rm --network host image"; empty = plain processes.
    #[arg(long, default_value = "")]
    runtime_prefix: String,
    /// stdout and stderr of a rank each keep at most this much.
    #[arg(long, default_value_t = 64)]
    log_cap_mib: u64,
    /// Finished ranks (and their logs) kept on disk.
    #[arg(long, default_value_t = 256)]
    keep_finished_ranks: usize,
    /// The agent's cgroup subtree, relative to the cgroup v2 mount: each rank
    /// runs in a cgroup of its own below it.
    #[arg(long, default_value = "rota-agent")]
    cgroup_parent: String,
    /// Run ranks without cgroups (no writable cgroup v2 hierarchy): their
    /// processes are then found only by the /proc scan of their environment,
    /// which misses a process that replaced its environment.
    #[arg(long)]
    no_cgroups: bool,
    /// Which local user a rank runs as: `owner` (the user who submitted the
    /// job, through the host's user database) or `agent` (the agent's own
    /// user, for a single-user host or tests; logs a warning).
    #[arg(long, default_value = "owner")]
    job_users: String,
    /// Lowest uid a job may run as (system accounts sit below it).
    #[arg(long, default_value_t = rota_agent::users::DEFAULT_MIN_UID)]
    min_job_uid: u32,
    /// Let jobs run as root (uid 0); refused otherwise.
    #[arg(long)]
    allow_root_jobs: bool,
    /// The cluster's CA certificate (PEM).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// This node's agent certificate (rota://agent/NODE, from `rota tls cert create --agent NODE`);
    /// re-read when it changes.
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// Plaintext, nothing verified: only with replicas started --insecure, never in production.
    #[arg(long)]
    insecure: bool,
    /// Serve Prometheus metrics (per-GPU telemetry, control-plane contact) over plain HTTP here.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
}

/// `rota-agent fleet`: simulated agents for tests and benchmarks (see
/// `rota_agent::fleet`); never a way to run a real node.
#[derive(Parser)]
#[command(
    name = "rota-agent fleet",
    about = "A test and benchmark tool: many simulated agents in one process, each with its own session, \
             heartbeats, assignment watch and reports; ranks are timers (FLEET_RUN_MS, or `sleep N`)"
)]
struct FleetArgs {
    /// Scheduler replica addresses (host:port), comma separated.
    #[arg(long, env = "ROTA_ENDPOINTS", value_delimiter = ',', required = true)]
    endpoints: Vec<String>,
    /// Simulated nodes (at most 10,000).
    #[arg(long)]
    nodes: usize,
    /// GPUs of every node: COUNTxMODEL[,COUNTxMODEL...].
    #[arg(long, default_value = "8xH100-80GB")]
    gpus: String,
    /// Racks the nodes fill in contiguous blocks.
    #[arg(long, default_value_t = 1)]
    racks: usize,
    /// Leaf switches per rack, filled in contiguous blocks.
    #[arg(long, default_value_t = 1)]
    leaves_per_rack: usize,
    /// Each node's data directory is DIR/nodes/NAME; figures go to DIR/fleet-stats.json.
    #[arg(long)]
    data_dir: PathBuf,
    /// Nodes are named PREFIX-0000, PREFIX-0001, ...
    #[arg(long, default_value = "sim")]
    node_prefix: String,
    /// Heartbeat period of every node (never longer than a quarter of the leader's TTL).
    #[arg(long, default_value_t = 2_000)]
    heartbeat_ms: u64,
    /// Finished ranks kept on disk per node.
    #[arg(long, default_value_t = 16)]
    keep_finished_ranks: usize,
    /// The cluster's CA certificate (PEM).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// The CA's private key: each simulated node gets its own agent certificate
    /// (rota://agent/NAME) issued from it, since an agent may act for its own node only.
    #[arg(long)]
    tls_ca_key: Option<PathBuf>,
    /// Plaintext, nothing verified: only with replicas started --insecure.
    #[arg(long)]
    insecure: bool,
}

#[tokio::main]
async fn run_fleet(args: FleetArgs) -> Result<()> {
    let tls = rota_agent::fleet::FleetTls::from_flags(args.tls_ca, args.tls_ca_key, args.insecure)?;
    let config = rota_agent::fleet::FleetConfig {
        endpoints: args.endpoints,
        nodes: args.nodes,
        gpus: args.gpus,
        racks: args.racks,
        leaves_per_rack: args.leaves_per_rack,
        data_dir: args.data_dir,
        node_prefix: args.node_prefix,
        heartbeat_ms: args.heartbeat_ms,
        keep_finished_ranks: args.keep_finished_ranks,
        tls,
    };
    rota_agent::fleet::run(config).await
}

/// Logs are read through a replica, which checks who may read whose job.
const LOG_READERS: &[IdentityKind] = &[IdentityKind::Replica];

fn run_shim() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(2).collect();
    let dir = match args.as_slice() {
        [flag, dir] if flag == "--dir" => PathBuf::from(dir),
        _ => bail!("usage: rota-agent shim --dir DIR"),
    };
    let code = rota_agent::shim::run(&dir)?;
    eprintln!("rank exited with {code}");
    Ok(())
}

#[tokio::main]
async fn run_agent(args: Args) -> Result<()> {
    let flags = TlsFlags { ca: args.tls_ca.clone(), cert: args.tls_cert.clone(), key: args.tls_key.clone(), insecure: args.insecure };
    let security = flags.for_machine()?;
    if !security.is_tls() {
        tracing::warn!("--insecure: plaintext links, no certificates: anyone who reaches the replicas can act as this node, and anyone who reaches this agent can read its logs");
    }
    if let Some(addr) = args.metrics_listen {
        rota_agent::metrics::install(addr)?;
    }
    let source = GpuSource::open(args.fake_gpus.as_deref())?
        .with_fake_unhealthy_file(args.data_dir.join(rota_agent::inventory::FAKE_UNHEALTHY_FILE))
        .with_fake_utilization_file(args.data_dir.join(rota_agent::idle::FAKE_UTILIZATION_FILE));
    let inventory = source.inventory()?;
    let containment = Containment::init(&args.cgroup_parent, args.no_cgroups)?;
    match &containment {
        Containment::Cgroups { subtree } => tracing::info!(subtree = %subtree.display(), "each rank runs in a cgroup of its own"),
        Containment::ProcScan => tracing::warn!(
            "--no-cgroups: ranks run without cgroups; their processes are found by the /proc scan of their environment \
             (ROTA_ALLOC_ID), which misses any process that clears or replaces its environment"
        ),
    }
    let job_users = match args.job_users.as_str() {
        "owner" => JobUsers::Owner { min_uid: args.min_job_uid, allow_root: args.allow_root_jobs },
        "agent" => {
            tracing::warn!("--job-users agent: every rank runs as the agent's own user, whoever submitted it");
            JobUsers::Agent
        }
        other => anyhow::bail!("--job-users {other:?}: expected owner or agent"),
    };
    tracing::info!(gpus = inventory.len(), model = ?inventory.first().map(|g| g.model.clone()), "GPU inventory");
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("--data-dir {}", args.data_dir.display()))?;
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.advertise_addr, args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.advertise_addr, args.port))?;
    let address = listener.local_addr()?.to_string();
    let config = AgentConfig {
        endpoints: args.endpoints,
        node_name: args.node_name,
        data_dir: args.data_dir,
        address: address.clone(),
        rack: args.rack,
        leaf: args.leaf,
        heartbeat_ms: args.heartbeat_ms.max(50),
        runtime_prefix: args.runtime_prefix.split_whitespace().map(str::to_string).collect(),
        log_cap_bytes: args.log_cap_mib.max(1) * 1024 * 1024,
        keep_finished_ranks: args.keep_finished_ranks,
        containment,
        job_users,
        idle_rule: rota_agent::idle::IdleRule { below_percent: args.idle_below_percent.min(100), after_ms: args.idle_after_ms },
    };
    let shared = Shared::new(config, &security, source, inventory, std::sync::Arc::new(rota_agent::exec::Processes))?;
    let logs = InterceptedService::new(
        NodeAgentServiceServer::new(LogServer::new(shared.ranks_root.clone())),
        rota_tls::auth::interceptor(LOG_READERS),
    );
    let incoming = security.incoming(listener)?;
    tokio::spawn(async move {
        if let Err(error) = tonic::transport::Server::builder().add_service(logs).serve_with_incoming(incoming).await {
            tracing::error!(%error, "log server stopped");
        }
    });
    tracing::info!(%address, node = %shared.config.node_name, "agent serving");
    agent::run(shared).await
}

/// Log to stderr, filtered by `ROTA_LOG`; one JSON object per line when
/// `ROTA_LOG_FORMAT=json` (read from the environment: the shim logs before
/// any flag is parsed).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ROTA_LOG").unwrap_or_else(|_| "info".into());
    // Colours only for a person at a terminal, never into a log file.
    let colours = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(colours).with_writer(std::io::stderr);
    match std::env::var("ROTA_LOG_FORMAT").as_deref() {
        Ok("json") => logs.json().with_current_span(true).with_span_list(false).init(),
        _ => logs.init(),
    }
}

fn main() -> Result<()> {
    init_logging();
    match std::env::args().nth(1).as_deref() {
        Some("shim") => return run_shim(),
        // "fleet" stands in for the program's name, so its flags parse alone.
        Some("fleet") => return run_fleet(FleetArgs::parse_from(std::env::args().skip(1))),
        _ => {}
    }
    run_agent(Args::parse())
}
