//! `rota limits ...`: the bounds of the replicated tables.

use anyhow::{Context as _, Result};
use rota_client::Client;
use rota_proto::v1 as pb;
use serde_json::{json, Value};

use crate::output::Format;

#[derive(Debug, clap::Subcommand)]
pub enum LimitsAction {
    /// Each bound beside what the cluster holds now.
    Show,
    /// Change bounds (admins; committed, so every replica applies it at
    /// one log index). A lower finished bound drops the oldest finished
    /// jobs to the archive at once; a lower live or spec-byte bound
    /// refuses new jobs until enough have ended.
    Set {
        /// Live (pending or running) jobs; a submit beyond it is refused.
        #[arg(long)]
        max_live_jobs: Option<u64>,
        /// Finished jobs the state keeps for `rota jobs` and `rota history`.
        #[arg(long)]
        max_finished_jobs: Option<u64>,
        /// Bytes of job specs (command, environment, labels) held, live or finished.
        #[arg(long)]
        max_spec_bytes: Option<u64>,
    },
}

fn limits_json(limits: &pb::Limits) -> Value {
    let mut object = serde_json::Map::new();
    for table in &limits.tables {
        object.insert(table.table.clone(), json!({ "held": table.held, "max": table.max }));
    }
    object.insert("dedupe_capacity".into(), json!(limits.dedupe_capacity));
    object.insert("cluster_version".into(), json!(limits.cluster_version));
    Value::Object(object)
}

fn show(limits: &pb::Limits, format: Format) -> Result<()> {
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&limits_json(limits))?),
        Format::Table => {
            outln!("{:<14} {:>14} {:>14} {:>6}", "TABLE", "HELD", "MAX", "USED%");
            for table in &limits.tables {
                let (held, bound) = (table.held, table.max);
                let used = if bound == 0 { 0.0 } else { held as f64 * 100.0 / bound as f64 };
                outln!("{:<14} {held:>14} {bound:>14} {used:>6.1}", table.table);
            }
        }
    }
    Ok(())
}

pub async fn limits(client: &Client, action: LimitsAction, format: Format) -> Result<()> {
    let answer = match action {
        LimitsAction::Show => client
            .retrying(|i| {
                let mut cluster = client.cluster_at(i);
                async move { cluster.get_limits(pb::GetLimitsRequest {}).await.map(|r| r.into_inner()) }
            })
            .await
            .context("read the limits")?,
        LimitsAction::Set { max_live_jobs, max_finished_jobs, max_spec_bytes } => {
            let request = pb::SetLimitsRequest { max_live_jobs, max_finished_jobs, max_spec_bytes };
            client
                .retrying(|i| {
                    let mut cluster = client.cluster_at(i);
                    async move { cluster.set_limits(request).await.map(|r| r.into_inner()) }
                })
                .await
                .context("set the limits")?
        }
    };
    show(&answer, format)
}
