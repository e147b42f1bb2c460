//! `rota bench backup`: write a backup of a synthetic state of a given size
//! (finished and pending jobs, built through `apply`), to start a cluster
//! at that size with `rota snapshot restore` without submitting every job.
//! A benchmark tool: the state is made up, its cluster id empty.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use rota_core::sim::bench::build_history;
use rota_server::backup::{encode_backup, BackupHeader};

/// Jobs a synthetic state may hold: a few GiB of memory to build.
const MAX_SYNTHETIC_JOBS: u64 = 5_000_000;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchBackupArgs {
    /// Where to write the backup (refused if it exists).
    pub file: PathBuf,
    /// Jobs submitted and cancelled (kept as finished records).
    #[arg(long, default_value_t = 1_000_000)]
    pub finished: u64,
    /// Jobs left pending (the state has no nodes).
    #[arg(long, default_value_t = 50_000)]
    pub pending: u64,
    /// Voters named in the backup's header, 1..=N.
    #[arg(long, default_value_t = 3)]
    pub members: u64,
}

pub fn write_synthetic_backup(args: &BenchBackupArgs) -> Result<Value> {
    if args.finished + args.pending > MAX_SYNTHETIC_JOBS {
        bail!("--finished + --pending: at most {MAX_SYNTHETIC_JOBS} jobs");
    }
    if !(1..=9).contains(&args.members) {
        bail!("--members: 1 to 9");
    }
    if args.file.exists() {
        bail!("{}: exists; the backup is written to a new file", args.file.display());
    }
    let started = Instant::now();
    let (state, next_index) = build_history(args.finished, args.pending);
    let build_s = started.elapsed().as_secs_f64();
    let encoded = Instant::now();
    let bytes = state.to_snapshot();
    let encode_ms = encoded.elapsed().as_secs_f64() * 1e3;
    let header = BackupHeader {
        cluster_id: String::new(),
        index: next_index - 1,
        term: 1,
        source_replica: 1,
        members: (1..=args.members).collect(),
        saved_at_ms: 0,
        state_bytes: bytes.len() as u64,
    };
    // Synced as `rota snapshot save` syncs its file: a backup is durable
    // when the command ends, and hundreds of megabytes left dirty would be
    // written back by the kernel while the replicas restored from it run,
    // holding up their log syncs in the benchmark that follows.
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&args.file)?;
        std::io::Write::write_all(&mut file, &encode_backup(&header, &bytes))?;
        file.sync_all()
    };
    write().with_context(|| format!("writing {}", args.file.display()))?;
    Ok(json!({
        "file": args.file,
        "jobs": state.jobs.len(),
        "pending": state.live_jobs,
        "index": header.index,
        "state_bytes": bytes.len(),
        "build_s": (build_s * 10.0).round() / 10.0,
        "encode_ms": encode_ms.round(),
    }))
}
