//! `rota`: the scheduler replica (`rota server`) and the command line client.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use rota_cli::{self as cli, bench::BenchSubmitArgs, drill::DrillArgs, outln, output::Format, SubmitArgs};
use rota_client::Client;
use rota_server::{self as server, limits, ServerConfig};

/// The replica's state is millions of small allocations (persistent maps'
/// nodes, job specs): mimalloc applies, builds and frees them about twice
/// as fast as the system allocator (BENCHMARKS.md, the state at a million
/// jobs).
#[global_allocator]
static ALLOCATOR: rota_alloc::Allocator = rota_alloc::Allocator;

#[derive(Parser)]
#[command(name = "rota", version, about = "A highly available GPU cluster scheduler")]
struct Cli {
    /// Replica API addresses (host:port), comma separated.
    #[arg(long, env = "ROTA_ENDPOINTS", global = true, value_delimiter = ',')]
    endpoints: Vec<String>,
    /// table or json (csv: `rota history` and `rota report` only).
    #[arg(long, global = true, value_enum, default_value = "table")]
    output: cli::history::Output,
    /// How long a client command keeps retrying through a failover, seconds.
    #[arg(long, global = true, default_value_t = 30)]
    timeout_s: u64,
    #[command(flatten)]
    tls: TlsArgs,
    /// A bearer token (from `rota token create`) for a client without a certificate.
    #[arg(long, env = "ROTA_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// Act as this user (needs the impersonate permission), as a portal does.
    #[arg(long = "as", env = "ROTA_AS", global = true, value_name = "USER")]
    act_as: Option<String>,
    /// The id this command's requests carry into every replica's log lines
    /// (default: a fresh random one, printed when the command fails).
    #[arg(long, env = "ROTA_REQUEST_ID", global = true)]
    request_id: Option<String>,
    /// Log lines as text or as one JSON object per line (for log collectors).
    #[arg(long, env = "ROTA_LOG_FORMAT", global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// Certificates: a replica's own (`rota server`), a user's (every client
/// command). Created with `rota tls`.
#[derive(clap::Args)]
struct TlsArgs {
    /// The cluster's CA certificate (PEM).
    #[arg(long, env = "ROTA_CA", global = true)]
    tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM), signed by the CA; re-read when it changes.
    #[arg(long, env = "ROTA_CERT", global = true)]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "ROTA_KEY", global = true)]
    tls_key: Option<PathBuf>,
    /// Plaintext, nothing verified: only for a cluster started --insecure, never in production.
    #[arg(long, global = true)]
    insecure: bool,
}

impl TlsArgs {
    fn flags(&self) -> rota_tls::TlsFlags {
        rota_tls::TlsFlags { ca: self.tls_ca.clone(), cert: self.tls_cert.clone(), key: self.tls_key.clone(), insecure: self.insecure }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run a scheduler replica.
    Server(ServerArgs),
    /// Create a CA and certificates for replicas, agents and users.
    Tls {
        #[command(subcommand)]
        what: TlsWhat,
    },
    /// Submit a job; prints its id.
    Submit(SubmitArgs),
    /// Show one job.
    Status { job_id: u64 },
    /// List jobs, newest first.
    Jobs {
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        group: Option<String>,
        /// Only jobs of this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only jobs this user owns.
        #[arg(long)]
        user: Option<String>,
        /// Only jobs with this label, KEY=VALUE; repeatable (all must match).
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
        /// Only jobs whose GPUs are flagged idle past their queue's idle time (idle since, for how long).
        #[arg(long)]
        idle: bool,
        #[arg(long, default_value_t = 1000)]
        limit: u32,
    },
    /// Finished jobs, newest first: those the cluster's state keeps, then
    /// the replicas' monthly archive (`--output table|json|csv`).
    History(cli::history::HistoryArgs),
    /// A month's GPU-hours, jobs, mean wait, preemptions and idle GPU-hours
    /// per group, queue or label value; `--chart FILE.svg` draws daily
    /// busy and idle GPU-hours per group.
    Report(cli::history::ReportArgs),
    /// Job templates: `rota template save NAME --group G [submit flags] -- CMD`, `list`, `show`, `delete`, `grant`.
    Template {
        #[command(subcommand)]
        action: rota_cli::tenancy::TemplateAction,
    },
    /// Bounds of the replicated tables (live and finished jobs, spec bytes):
    /// `rota limits show`, `rota limits set --max-live-jobs N` (admins).
    Limits {
        #[command(subcommand)]
        action: rota_cli::limits::LimitsAction,
    },
    /// GPU-hour budgets per group and month: `rota budget set G --gpu-hours N [--month YYYY-MM] [--strict]`, `show`.
    Budget {
        #[command(subcommand)]
        action: rota_cli::tenancy::BudgetAction,
    },
    /// Two-person changes: `rota change require quota|budget|grant|policy`, `list`, `approve ID`, `withdraw ID`.
    Change {
        #[command(subcommand)]
        action: rota_cli::change::ChangeAction,
    },
    /// Policy versions: `rota policy show [--version N]`, `history`, `diff [A] [B]`,
    /// `apply FILE [--comment C] [--canary queue=Q|group=G]`, `promote`, `rollback [--to N]`.
    Policy {
        #[command(subcommand)]
        action: rota_cli::policy::PolicyAction,
    },
    /// Why a job is pending (machine-readable code, detail, estimated start).
    Why { job_id: u64 },
    /// Replay a trace through the policy on a virtual clock (no cluster needed).
    Sim(rota_cli::sim::SimArgs),
    /// Cancel a job.
    Cancel { job_id: u64 },
    /// Change the priority of a job not yet finished: high, medium or low.
    /// Its owner may lower it; its group's admins and operators may set any.
    Priority { job_id: u64, priority: String },
    /// Print a rank's output, read from the agent of the node that ran it.
    Logs {
        job_id: u64,
        #[arg(long, default_value_t = 0)]
        rank: u32,
        /// stderr instead of stdout.
        #[arg(long)]
        stderr: bool,
        /// Keep printing until the rank ends.
        #[arg(long, short)]
        follow: bool,
    },
    /// Follow every committed change (jobs, nodes, quotas, queues) as
    /// events, in log order, across failovers; `--output json` prints one
    /// JSON object per line.
    Events {
        /// Events of log entries after this index; 0 = from the oldest kept.
        #[arg(long, default_value_t = 0)]
        since: u64,
        /// Topics, comma-separated: jobs, nodes, quotas, queues, budgets; default all.
        #[arg(long, value_delimiter = ',')]
        topic: Vec<String>,
        /// Stop after this many events (default: follow until stopped).
        #[arg(long)]
        max_events: Option<u64>,
    },
    /// Show the replicas, the leader and the Raft indexes.
    Cluster,
    /// Show the GPU hosts, their fences and drains.
    Nodes,
    /// Operate a node (operators): `rota node drain NODE`, `undrain`, `readmit NODE [--gpu N]`, `fence`.
    Node {
        #[command(subcommand)]
        action: NodeAction,
    },
    /// Queues (replicated): `rota queue show`, `rota queue set NAME --weight 3 ...`.
    Queue {
        #[command(subcommand)]
        action: QueueAction,
    },
    /// Group quotas (replicated) with use, borrowed and lendable GPUs.
    Quota {
        #[command(subcommand)]
        action: QuotaAction,
    },
    /// GPU-hours used per group and queue.
    Usage,
    /// Change the set of replicas without downtime.
    Member {
        #[command(subcommand)]
        action: MemberAction,
    },
    /// Alarms that stop new work (replicated): `rota alarm list`, `rota alarm disarm`.
    Alarm {
        #[command(subcommand)]
        action: AlarmAction,
    },
    /// Who this client is to the cluster: user, role, groups.
    Whoami,
    /// Users and roles (admin): `rota auth user add alice --groups vision --role user`, `rota auth show`.
    Auth {
        #[command(subcommand)]
        action: AuthAction,
    },
    /// Bearer tokens: `rota token create --user alice --ttl 30d`, `revoke ID`, `list`.
    Token {
        #[command(subcommand)]
        action: TokenAction,
    },
    /// The audit trail: who changed what, on whose behalf, from where, and the outcome.
    Audit {
        /// Only records acted as, or on behalf of, this user.
        #[arg(long)]
        user: Option<String>,
        /// Only records since this Unix ms, or this long ago (`2h`, `7d`).
        #[arg(long)]
        since: Option<String>,
        /// At most this many of the newest records.
        #[arg(long, default_value_t = 1000)]
        limit: u32,
    },
    /// Failover drill: move the leader (no process is stopped) and measure recovery.
    Drill(DrillArgs),
    /// Benchmarks against a running cluster.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
    /// Is a replica SERVING (part of a working quorum)? Exits 0 if so,
    /// non-zero otherwise: for readiness probes.
    Health {
        /// The replica at this address (default: the first of --endpoints).
        #[arg(long, conflicts_with = "replica")]
        endpoint: Option<String>,
        /// The member with this id (its address found through --endpoints).
        #[arg(long)]
        replica: Option<u64>,
    },
    /// Backups: `rota snapshot save FILE`, `rota snapshot restore FILE --data-dir DIR --id N --peers ...`.
    Snapshot {
        #[command(subcommand)]
        action: SnapshotAction,
    },
}

#[derive(Subcommand)]
enum SnapshotAction {
    /// Save the leader's state (everything acknowledged before the call) with its index and a checksum.
    Save { file: PathBuf },
    /// Build one replica's data directory of a NEW cluster from a backup
    /// (run it for every member, with the same --peers and --cluster-id).
    Restore {
        file: PathBuf,
        /// The new replica's data directory (empty).
        #[arg(long)]
        data_dir: PathBuf,
        /// The new replica's id.
        #[arg(long)]
        id: u64,
        /// The new cluster's members: ID=HOST:PORT,... including this replica.
        #[arg(long, value_delimiter = ',', required = true)]
        peers: Vec<String>,
        /// The new cluster's id, as printed by the first member's restore
        /// (default: a new one).
        #[arg(long)]
        cluster_id: Option<String>,
    },
}

#[derive(Subcommand)]
enum TlsWhat {
    /// `rota tls ca create`: a new CA in --dir (ca.pem, ca-key.pem).
    Ca {
        #[command(subcommand)]
        action: TlsCaAction,
    },
    /// `rota tls cert create --server ID | --agent NODE | --client NAME`.
    Cert {
        #[command(subcommand)]
        action: TlsCertAction,
    },
}

#[derive(Subcommand)]
enum TlsCaAction {
    Create {
        /// Directory to write into (created if missing).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        #[arg(long, default_value_t = rota_tls::certs::DEFAULT_CA_DAYS)]
        days: u32,
    },
}

#[derive(Subcommand)]
enum TlsCertAction {
    /// Sign a certificate with the CA in --dir; writes KIND-NAME.pem and KIND-NAME-key.pem.
    Create(CertCreateArgs),
}

#[derive(clap::Args)]
struct CertCreateArgs {
    /// A replica's certificate (rota://replica/ID), serving 127.0.0.1, localhost and each --san.
    #[arg(long, alias = "peer", conflicts_with_all = ["agent", "client"], required_unless_present_any = ["agent", "client"])]
    server: Option<u64>,
    /// A node agent's certificate (rota://agent/NODE), serving 127.0.0.1, localhost and each --san.
    #[arg(long, conflicts_with = "client")]
    agent: Option<String>,
    /// A user's client certificate (rota://user/NAME).
    #[arg(long)]
    client: Option<String>,
    /// Extra IP address or DNS name the certificate serves (replicas and agents).
    #[arg(long)]
    san: Vec<String>,
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    #[arg(long, default_value_t = rota_tls::certs::DEFAULT_CERT_DAYS)]
    days: u32,
}

fn run_tls(what: TlsWhat) -> Result<()> {
    use rota_tls::{Identity, IdentityKind};
    match what {
        TlsWhat::Ca { action: TlsCaAction::Create { dir, days } } => {
            let files = rota_tls::certs::create_ca(&dir, days)?;
            outln!("{}\n{}", files.cert.display(), files.key.display());
        }
        TlsWhat::Cert { action: TlsCertAction::Create(args) } => {
            let identity = match (args.server, args.agent, args.client) {
                (Some(id), _, _) => Identity::new(IdentityKind::Replica, &id.to_string())?,
                (_, Some(node), _) => Identity::new(IdentityKind::Agent, &node)?,
                (_, _, Some(user)) => Identity::new(IdentityKind::User, &user)?,
                _ => bail!("one of --server, --agent, --client is required"),
            };
            let files = rota_tls::certs::create_cert(&args.dir, &identity, &args.san, args.days)?;
            outln!("{}\n{}", files.cert.display(), files.key.display());
        }
    }
    Ok(())
}

#[derive(Subcommand)]
enum AuthAction {
    /// Users: add (or change), remove.
    User {
        #[command(subcommand)]
        action: UserAction,
    },
    /// Every user with its role and groups.
    Show,
}

#[derive(Subcommand)]
enum UserAction {
    /// Add a user, or change its role and groups.
    Add {
        name: String,
        /// viewer, user, group-admin, operator or admin.
        #[arg(long, default_value = "user")]
        role: String,
        /// Groups it belongs to, comma separated.
        #[arg(long, value_delimiter = ',')]
        groups: Vec<String>,
        /// May act for other users (`--as`), as a portal does.
        #[arg(long)]
        impersonate: bool,
    },
    /// Remove a user and revoke its tokens.
    Remove { name: String },
}

#[derive(Subcommand)]
enum TokenAction {
    /// Make a token; prints it (shown once).
    Create {
        #[arg(long)]
        user: String,
        /// Lifetime: 30d, 12h, 90m.
        #[arg(long, default_value = "30d")]
        ttl: String,
    },
    Revoke {
        id: String,
    },
    List {
        #[arg(long)]
        user: Option<String>,
    },
}

#[derive(Subcommand)]
enum QueueAction {
    Show,
    Set(rota_cli::config::QueueSetArgs),
}

#[derive(Subcommand)]
enum QuotaAction {
    Show,
    Set(rota_cli::config::QuotaSetArgs),
}

#[derive(Subcommand)]
enum MemberAction {
    /// Add replica ID (started with --join) at ADDR: learner first, then voter.
    Add { id: u64, address: String },
    /// Remove replica ID from the voters.
    Remove { id: u64 },
}

#[derive(Subcommand)]
enum NodeAction {
    /// Running ranks finish; nothing new is placed on the node.
    Drain { node: String },
    /// Place work on the node again.
    Undrain { node: String },
    /// Lift the fences of a node (a GPU fault or an operator's), or with
    /// --gpu those of one GPU and its NVLink domain.
    Readmit {
        node: String,
        #[arg(long)]
        gpu: Option<u32>,
    },
    /// Fence a node (or one GPU) by hand: its jobs' attempts end and
    /// nothing is placed there until `rota node readmit`.
    Fence {
        node: String,
        #[arg(long)]
        gpu: Option<u32>,
        /// Why, for people (shown by `rota nodes` and `rota why`).
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand)]
enum AlarmAction {
    /// Raised alarms.
    List,
    /// Clear an alarm once its cause is gone (a replica still short of
    /// space raises it again within a second).
    Disarm {
        /// Replica whose alarm to clear; 0 = every replica's.
        #[arg(long, default_value_t = 0)]
        replica: u64,
        #[arg(long, default_value = "nospace")]
        kind: String,
    },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Durable submit throughput and latency.
    Submit(BenchSubmitArgs),
    /// Scheduling pass time over a synthetic cluster (no cluster needed).
    Plan(rota_cli::sim::BenchPlanArgs),
    /// Write a backup of a synthetic state of N finished and M pending jobs,
    /// to restore a cluster at that size (no cluster needed).
    Backup(rota_cli::bench_backup::BenchBackupArgs),
    /// Durable puts/s against an etcd cluster, the same closed loop as
    /// `bench submit`, for a side-by-side figure (no rota cluster needed).
    Etcd(rota_cli::bench_etcd::BenchEtcdArgs),
}

#[derive(clap::Args)]
struct ServerArgs {
    /// This replica's id; never reuse an id.
    #[arg(long)]
    id: u64,
    /// API and Raft address to listen on.
    #[arg(long)]
    listen: SocketAddr,
    #[arg(long)]
    data_dir: PathBuf,
    /// Initial members: ID=HOST:PORT,... including this replica.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Join an existing cluster (wait for `rota member add`) instead of founding one.
    #[arg(long)]
    join: bool,
    /// Serve Prometheus metrics on this address.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Serve the REST/JSON API (`/v1`, OpenAPI at `/v1/openapi.json`) on
    /// this address: HTTPS with this replica's certificate, plain HTTP only
    /// with --insecure.
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// Leader heartbeat interval.
    #[arg(long, default_value_t = rota_server::defaults::DEFAULT_HEARTBEAT_INTERVAL_MS)]
    heartbeat_ms: u64,
    /// A follower campaigns after the leader lease (= election-max-ms) plus a
    /// random time in election-min-ms..election-max-ms without a heartbeat.
    #[arg(long, default_value_t = rota_server::defaults::DEFAULT_ELECTION_TIMEOUT_MIN_MS)]
    election_min_ms: u64,
    #[arg(long, default_value_t = rota_server::defaults::DEFAULT_ELECTION_TIMEOUT_MAX_MS)]
    election_max_ms: u64,
    /// Take a snapshot after this many entries (plus an eighth of it per id
    /// step, ids mod 5, so replicas take theirs at different times).
    #[arg(long, default_value_t = rota_server::defaults::DEFAULT_SNAPSHOT_EVERY_ENTRIES)]
    snapshot_every: u64,
    /// Log entries kept behind a snapshot.
    #[arg(long, default_value_t = rota_server::defaults::DEFAULT_KEEP_LOGS_BEHIND_SNAPSHOT)]
    keep_logs: u64,
    /// Events kept for the event stream (`rota events`, `/v1/events`); a
    /// reader asking for older ones is told they are compacted. Their
    /// bytes are bounded too (32 MiB).
    #[arg(long, default_value_t = rota_server::events::MAX_KEPT_EVENTS)]
    keep_events: usize,
    /// Gone: the finished-job bound is replicated (`rota limits set
    /// --max-finished-jobs N`); a replica taking it from its own command
    /// line replayed the log to another state than its peers.
    #[arg(long, hide = true)]
    keep_finished_jobs: Option<u64>,
    /// A node silent this long is declared down and its jobs requeued.
    #[arg(long, default_value_t = 30_000)]
    node_ttl_ms: u64,
    /// A replica whose clock is further than this from a majority of its
    /// peers' refuses to lead (and hands leadership to a peer).
    #[arg(long, default_value_t = rota_server::clock::DEFAULT_MAX_CLOCK_SKEW_MS)]
    max_clock_skew_ms: u64,
    /// A rank assigned this long and not reported started by its agent gets
    /// its allocation stopped and its job requeued (default: 2 x the node
    /// TTL + 30 s); its GPUs are freed once the agent reports the rank ended
    /// or the node is declared down.
    #[arg(long)]
    start_timeout_ms: Option<u64>,
    /// Raise the `nospace` alarm (the cluster takes no new work) when the
    /// data directory has less free space than this, in MiB.
    #[arg(long, default_value_t = rota_server::alarms::DEFAULT_MIN_FREE_BYTES / (1024 * 1024))]
    min_free_mb: u64,
    /// Make this user (the NAME of its rota://user/NAME certificate) the
    /// cluster's first admin, once, when the cluster has no users. Give it
    /// to the founding replicas.
    #[arg(long, value_name = "NAME")]
    bootstrap_admin: Option<String>,
    /// After losing a quorum for good: make this replica the only member of
    /// its cluster, from its own data, then grow it back with `rota member
    /// add`. Refused when this replica lacks entries it knows were committed.
    #[arg(long)]
    force_new_cluster: bool,
    /// With --force-new-cluster: carry on although committed entries are missing here (they are lost).
    #[arg(long, requires = "force_new_cluster")]
    i_accept_data_loss: bool,
    #[command(flatten)]
    limits: LimitArgs,
}

/// Limits per caller identity (each user, each agent; replicas are never
/// limited). A refused request gets RESOURCE_EXHAUSTED with `retry-after-ms`.
#[derive(clap::Args, Debug)]
struct LimitArgs {
    /// Requests per second of one user (0: no rate limit).
    #[arg(long, default_value_t = limits::DEFAULT_USER_REQUESTS_PER_S)]
    user_requests_per_s: u32,
    /// Requests one user may send at once above its rate.
    #[arg(long, default_value_t = limits::DEFAULT_USER_BURST)]
    user_burst: u32,
    /// Streams (job watches) one user may hold open.
    #[arg(long, default_value_t = limits::DEFAULT_USER_MAX_STREAMS)]
    user_max_streams: u32,
    /// Requests of one user being served at once.
    #[arg(long, default_value_t = limits::DEFAULT_USER_MAX_IN_FLIGHT)]
    user_max_in_flight: u32,
    /// Requests per second of one agent (0: no rate limit).
    #[arg(long, default_value_t = limits::DEFAULT_AGENT_REQUESTS_PER_S)]
    agent_requests_per_s: u32,
    #[arg(long, default_value_t = limits::DEFAULT_AGENT_BURST)]
    agent_burst: u32,
    /// Streams (assignment watches) one agent may hold open.
    #[arg(long, default_value_t = limits::DEFAULT_AGENT_MAX_STREAMS)]
    agent_max_streams: u32,
    #[arg(long, default_value_t = limits::DEFAULT_AGENT_MAX_IN_FLIGHT)]
    agent_max_in_flight: u32,
    /// Identities whose limits are tracked at once (idle ones are forgotten).
    #[arg(long, default_value_t = limits::DEFAULT_MAX_IDENTITIES)]
    max_limited_identities: usize,
}

impl LimitArgs {
    fn config(&self) -> limits::LimitsConfig {
        limits::LimitsConfig {
            user: limits::ClassLimits {
                requests_per_s: self.user_requests_per_s,
                burst: self.user_burst,
                max_streams: self.user_max_streams,
                max_in_flight: self.user_max_in_flight,
            },
            agent: limits::ClassLimits {
                requests_per_s: self.agent_requests_per_s,
                burst: self.agent_burst,
                max_streams: self.agent_max_streams,
                max_in_flight: self.agent_max_in_flight,
            },
            max_identities: self.max_limited_identities,
        }
    }
}

fn parse_peers(peers: &[String]) -> Result<BTreeMap<u64, String>> {
    let mut parsed = BTreeMap::new();
    for peer in peers {
        let (id, addr) =
            peer.split_once('=').with_context(|| format!("--peers {peer:?}: expected ID=HOST:PORT (HOST an IP address or a DNS name)"))?;
        let id: u64 = id.parse().with_context(|| format!("--peers {peer:?}: id must be a number"))?;
        rota_client::wire::check_replica_address(addr).map_err(|why| anyhow::anyhow!("--peers {peer:?}: address: {why}"))?;
        if id == 0 {
            bail!("--peers {peer:?}: ids start at 1");
        }
        if parsed.insert(id, addr.to_string()).is_some() {
            bail!("--peers: id {id} given twice");
        }
    }
    Ok(parsed)
}

/// The CA bundle and certificate a TLS replica uses, for the expiry gauge.
fn certificate_files(tls: &TlsArgs) -> Vec<(&'static str, PathBuf)> {
    if tls.insecure {
        return Vec::new();
    }
    let ca = tls.tls_ca.clone().map(|path| ("ca", path));
    let cert = tls.tls_cert.clone().map(|path| ("replica", path));
    ca.into_iter().chain(cert).collect()
}

async fn run_server(args: ServerArgs, tls: &TlsArgs) -> Result<()> {
    if args.keep_finished_jobs.is_some() {
        bail!("--keep-finished-jobs: the finished-job bound is part of the replicated state now; start the replica without it and run `rota limits set --max-finished-jobs N` once the cluster is up");
    }
    let security = tls.flags().for_machine()?;
    let mut peers = parse_peers(&args.peers)?;
    if args.join {
        peers.entry(args.id).or_insert_with(|| args.listen.to_string());
    }
    if args.id == 0 {
        bail!("--id: must be at least 1");
    }
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("--data-dir {}", args.data_dir.display()))?;
    if args.force_new_cluster {
        let forced = rota_server::backup::force_new_cluster(&args.data_dir, args.id, &args.listen.to_string(), args.i_accept_data_loss)?;
        eprintln!(
            "rota server: --force-new-cluster: replica {} is the only member of its cluster (log to index {}, committed {}); \
             remove the flag from its next start and add members with `rota member add`",
            args.id, forced.last_index, forced.known_committed
        );
        // The others are not members any more; the survivor alone founds nothing.
        peers.retain(|id, _| *id == args.id);
        peers.entry(args.id).or_insert_with(|| args.listen.to_string());
    }
    let config = ServerConfig {
        id: args.id,
        listen: args.listen,
        data_dir: args.data_dir,
        peers,
        join: args.join,
        metrics_listen: args.metrics_listen,
        http_listen: args.http_listen,
        heartbeat_interval_ms: args.heartbeat_ms,
        election_timeout_min_ms: args.election_min_ms,
        election_timeout_max_ms: args.election_max_ms,
        snapshot_every_entries: args.snapshot_every,
        keep_logs_behind_snapshot: args.keep_logs,
        keep_events: args.keep_events,
        node_ttl_ms: args.node_ttl_ms,
        max_clock_skew_ms: args.max_clock_skew_ms,
        start_timeout_ms: args.start_timeout_ms,
        min_free_bytes: args.min_free_mb.saturating_mul(1024 * 1024),
        security,
        bootstrap_admin: args.bootstrap_admin,
        limits: args.limits.config(),
        certificate_files: certificate_files(tls),
    };
    server::run(config).await?;
    Ok(())
}

fn print_json(value: &serde_json::Value) -> Result<()> {
    outln!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Cli::parse();
    init_logging(args.log_format);
    match args.command {
        Command::Server(server_args) => return run_server(server_args, &args.tls).await,
        Command::Tls { what } => return run_tls(what),
        Command::Sim(sim) => return print_json(&rota_cli::sim::run_sim(&sim)?),
        Command::Bench { what: BenchWhat::Plan(bench) } => return print_json(&rota_cli::sim::run_bench_plan(&bench)?),
        Command::Bench { what: BenchWhat::Backup(bench) } => return print_json(&rota_cli::bench_backup::write_synthetic_backup(&bench)?),
        Command::Bench { what: BenchWhat::Etcd(bench) } => return print_json(&rota_cli::bench_etcd::run(&bench).await?),
        Command::Snapshot { action: SnapshotAction::Restore { file, data_dir, id, peers, cluster_id } } => {
            let peers = parse_peers(&peers)?;
            return rota_cli::ops::snapshot_restore(&file, &data_dir, id, &peers, cluster_id, args.output.format()?);
        }
        Command::Health { endpoint, replica } => {
            let security = args.tls.flags().for_client()?;
            let target = match (endpoint, replica) {
                (Some(endpoint), _) => rota_cli::ops::HealthTarget::Endpoint(endpoint),
                (None, Some(id)) => rota_cli::ops::HealthTarget::Replica(id),
                (None, None) => rota_cli::ops::HealthTarget::Endpoint(
                    args.endpoints.first().cloned().context("--endpoint, --replica or --endpoints: which replica to ask")?,
                ),
            };
            let client = if args.endpoints.is_empty() { None } else { Some(Client::new(&args.endpoints, &security)?) };
            return rota_cli::ops::health(client.as_ref(), &security, target, args.output.format()?).await;
        }
        _ => {}
    }
    let mut credentials = rota_client::Credentials::new(args.token.as_deref(), args.act_as.as_deref())?;
    if let Some(id) = &args.request_id {
        credentials = credentials.with_request_id(id).context("--request-id")?;
    }
    let request_id = credentials.request_id().to_string();
    let mut client = Client::new(&args.endpoints, &args.tls.flags().for_client()?)?.with_credentials(credentials);
    client.deadline = Duration::from_secs(args.timeout_s);
    let memory = rota_cli::endpoint_memory::file();
    if let Some(endpoint) = memory.as_deref().and_then(|file| rota_cli::endpoint_memory::recall(file, client.endpoints())) {
        client.prefer(&endpoint);
    }
    let output = args.output;
    let format = match &args.command {
        // Read only by the commands that print CSV.
        Command::History(_) | Command::Report(_) | Command::Policy { .. } => Format::Table,
        _ => output.format()?,
    };
    let outcome = match args.command {
        Command::Server(_)
        | Command::Tls { .. }
        | Command::Sim(_)
        | Command::Bench { what: BenchWhat::Plan(_) | BenchWhat::Backup(_) | BenchWhat::Etcd(_) }
        | Command::Health { .. }
        | Command::Snapshot { action: SnapshotAction::Restore { .. } } => {
            unreachable!("handled above")
        }
        Command::Snapshot { action: SnapshotAction::Save { file } } => {
            // A large state takes longer than a request's usual attempt.
            client.attempt_timeout = client.attempt_timeout.max(Duration::from_secs(args.timeout_s));
            rota_cli::ops::snapshot_save(&client, &file, format).await
        }
        Command::Why { job_id } => cli::why(&client, job_id, format).await,
        Command::Submit(submit) => cli::submit(&client, &submit, format).await,
        Command::Status { job_id } => cli::status(&client, job_id, format).await,
        Command::Jobs { state, group, queue, user, labels, idle, limit } => {
            let filter = cli::JobFilter { state, group, queue, user, labels, idle };
            cli::jobs(&client, &filter, limit, format).await
        }
        Command::History(history) => cli::history::history(&client, &history, output).await,
        Command::Report(report) => cli::history::report(&client, &report, output).await,
        Command::Template { action } => cli::tenancy::template(&client, action, format).await,
        Command::Budget { action } => cli::tenancy::budget(&client, action, format).await,
        Command::Limits { action } => cli::limits::limits(&client, action, format).await,
        Command::Change { action } => cli::change::change(&client, action, format).await,
        Command::Policy { action } => cli::policy::policy(&client, action, output).await,
        Command::Cancel { job_id } => cli::cancel(&client, job_id, format).await,
        Command::Priority { job_id, priority } => cli::set_priority(&client, job_id, &priority, format).await,
        Command::Logs { job_id, rank, stderr, follow } => cli::logs(&client, job_id, rank, stderr, follow).await,
        Command::Events { since, topic, max_events } => cli::events(&client, since, topic, max_events, format).await,
        Command::Cluster => cli::cluster(&client, format).await,
        Command::Queue { action: QueueAction::Show } => cli::config::queue_show(&client, format).await,
        Command::Queue { action: QueueAction::Set(set) } => cli::config::queue_set(&client, &set, format).await,
        Command::Quota { action: QuotaAction::Show } => cli::config::quota_show(&client, format).await,
        Command::Quota { action: QuotaAction::Set(set) } => cli::config::quota_set(&client, &set, format).await,
        Command::Usage => cli::config::usage(&client, format).await,
        Command::Nodes => cli::nodes(&client, format).await,
        Command::Member { action: MemberAction::Add { id, address } } => cli::member_add(&client, id, &address, format).await,
        Command::Member { action: MemberAction::Remove { id } } => cli::member_remove(&client, id, format).await,
        Command::Node { action } => {
            let request = match action {
                NodeAction::Drain { node } => cli::NodeRequest::Drain { node, drain: true },
                NodeAction::Undrain { node } => cli::NodeRequest::Drain { node, drain: false },
                NodeAction::Readmit { node, gpu } => cli::NodeRequest::Readmit { node, gpu },
                NodeAction::Fence { node, gpu, reason } => cli::NodeRequest::Fence { node, gpu, reason },
            };
            cli::node_command(&client, request, format).await
        }
        Command::Alarm { action: AlarmAction::List } => cli::config::alarm_list(&client, format).await,
        Command::Alarm { action: AlarmAction::Disarm { replica, kind } } => {
            cli::config::alarm_disarm(&client, replica, &kind, format).await
        }
        Command::Whoami => cli::auth::whoami(&client, format).await,
        Command::Auth { action: AuthAction::Show } => cli::auth::show(&client, format).await,
        Command::Auth { action: AuthAction::User { action: UserAction::Add { name, role, groups, impersonate } } } => {
            cli::auth::user_set(&client, &name, &role, &groups, impersonate, format).await
        }
        Command::Auth { action: AuthAction::User { action: UserAction::Remove { name } } } => {
            cli::auth::user_remove(&client, &name, format).await
        }
        Command::Token { action: TokenAction::Create { user, ttl } } => cli::auth::token_create(&client, &user, &ttl, format).await,
        Command::Token { action: TokenAction::Revoke { id } } => cli::auth::token_revoke(&client, &id, format).await,
        Command::Token { action: TokenAction::List { user } } => cli::auth::token_list(&client, user.as_deref(), format).await,
        Command::Audit { user, since, limit } => cli::auth::audit(&client, user.as_deref(), since.as_deref(), limit, format).await,
        Command::Drill(drill) => {
            let report = cli::drill::run(&client, &drill).await?;
            outln!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Command::Bench { what: BenchWhat::Submit(bench) } => {
            let report = cli::bench::run(&client, &bench).await?;
            outln!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
    };
    if let (Some(file), Some(answered)) = (memory.as_deref(), client.last_answered()) {
        rota_cli::endpoint_memory::remember(file, client.endpoints(), answered);
    }
    if outcome.is_err() {
        // What to search the replicas' logs for.
        eprintln!("request id: {request_id}");
    }
    outcome
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Log to stderr, filtered by `ROTA_LOG` (default: info, openraft's
/// warnings), with the lines a failing replication stream repeats thinned.
fn init_logging(format: LogFormat) {
    use rota_server::log_format::LogLines;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = tracing_subscriber::EnvFilter::try_from_env("ROTA_LOG").unwrap_or_else(|_| "info,openraft=warn".into());
    let thinned = rota_cli::log_thinning::replication_lines();
    let registry = tracing_subscriber::registry().with(filter);
    // Colours only for a person at a terminal: a log file, journald or a
    // collector would keep the escape codes as text.
    let colours = std::io::IsTerminal::is_terminal(&std::io::stderr());
    match format {
        LogFormat::Text => {
            let layer = tracing_subscriber::fmt::layer().event_format(LogLines::Text).with_ansi(colours).with_writer(std::io::stderr);
            registry.with(layer.with_filter(thinned)).init();
        }
        LogFormat::Json => {
            let layer = tracing_subscriber::fmt::layer()
                .event_format(LogLines::Json)
                .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                .with_writer(std::io::stderr);
            registry.with(layer.with_filter(thinned)).init();
        }
    }
}
