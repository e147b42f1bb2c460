//! `rota queue`, `rota quota` and `rota usage`: the replicated policy
//! settings and what groups use.

use anyhow::{Context as _, Result};
use rota_proto::v1 as pb;
use serde_json::json;

use super::output::Format;
use rota_client::Client;
use rota_core::state::QueueConfig;

#[derive(Debug, clap::Args)]
pub struct QueueSetArgs {
    pub name: String,
    #[arg(long)]
    pub weight: Option<u32>,
    /// Largest job in total GPUs (0 = no cap).
    #[arg(long)]
    pub max_gpus_per_job: Option<u32>,
    #[arg(long)]
    pub default_runtime_s: Option<u64>,
    #[arg(long)]
    pub max_runtime_s: Option<u64>,
    #[arg(long)]
    pub preemptible: Option<bool>,
    #[arg(long)]
    pub protected_runtime_s: Option<u64>,
    /// Flag a job whose GPUs stay idle this long: 2h, 30m, 90s, 500ms (cluster version 8).
    #[arg(long)]
    pub idle_after: Option<String>,
    /// What then: flag (listed by `rota jobs --idle`) or reclaim (the job is stopped, idle_reclaimed).
    #[arg(long)]
    pub idle_action: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct QuotaSetArgs {
    pub group: String,
    /// Guaranteed GPUs.
    #[arg(long)]
    pub gpus: u32,
    /// Guaranteed GPUs of one model, MODEL=N; repeatable.
    #[arg(long = "model", value_name = "MODEL=N")]
    pub per_model: Vec<String>,
    /// Lend idle guaranteed GPUs to other groups.
    #[arg(long)]
    pub lend: bool,
    /// Lend only to these groups (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub lend_to: Vec<String>,
    /// Most GPUs this group may borrow beyond its quota.
    #[arg(long)]
    pub borrow_limit: Option<u32>,
}

async fn list_queues(client: &Client) -> Result<Vec<pb::Queue>> {
    let response = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.list_queues(pb::ListQueuesRequest {}).await.map(|r| r.into_inner()) }
        })
        .await?;
    Ok(response.queues)
}

/// Change only the fields given; a new queue starts from the `training` defaults.
pub async fn queue_set(client: &Client, args: &QueueSetArgs, format: Format) -> Result<()> {
    let existing = list_queues(client).await?.into_iter().find(|q| q.name == args.name);
    let base = existing.unwrap_or_else(|| {
        let training = QueueConfig::defaults().into_iter().find(|q| q.name == "training").expect("default queue");
        rota_client::convert::queue_to_pb(&QueueConfig { name: args.name.clone(), ..training })
    });
    let queue = pb::Queue {
        name: args.name.clone(),
        weight: args.weight.unwrap_or(base.weight),
        max_gpus_per_job: args.max_gpus_per_job.unwrap_or(base.max_gpus_per_job),
        default_runtime_s: args.default_runtime_s.unwrap_or(base.default_runtime_s),
        max_runtime_s: args.max_runtime_s.unwrap_or(base.max_runtime_s),
        preemptible: args.preemptible.unwrap_or(base.preemptible),
        protected_runtime_s: args.protected_runtime_s.unwrap_or(base.protected_runtime_s),
        idle_after_ms: args
            .idle_after
            .as_deref()
            .map(rota_core::state::idle::parse_duration_ms)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--idle-after: {e}"))?,
        idle_action: match args.idle_action.as_deref() {
            None => String::new(),
            Some(text) => rota_core::state::idle::IdleAction::parse(text)
                .with_context(|| format!("--idle-action {text:?}: expected flag or reclaim"))?
                .as_str()
                .to_string(),
        },
    };
    client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            let queue = queue.clone();
            async move { cluster.set_queue(queue).await.map(|r| r.into_inner()) }
        })
        .await?;
    queue_show(client, format).await
}

fn queue_json(q: &pb::Queue) -> serde_json::Value {
    json!({"name": q.name, "weight": q.weight, "max_gpus_per_job": q.max_gpus_per_job, "default_runtime_s": q.default_runtime_s,
           "max_runtime_s": q.max_runtime_s, "preemptible": q.preemptible, "protected_runtime_s": q.protected_runtime_s,
           "idle_after_ms": q.idle_after_ms, "idle_action": q.idle_action})
}

pub async fn queue_show(client: &Client, format: Format) -> Result<()> {
    let queues = list_queues(client).await?;
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&queues.iter().map(queue_json).collect::<Vec<_>>())?),
        Format::Table => {
            outln!(
                "{:<12} {:>6} {:>8} {:>12} {:>12} {:>11} {:>12} {:>10} {:<8}",
                "QUEUE",
                "WEIGHT",
                "MAXGPUS",
                "DEFAULT_S",
                "MAX_S",
                "PREEMPTIBLE",
                "PROTECTED_S",
                "IDLE_AFTER",
                "IDLE"
            );
            for q in &queues {
                let idle_after = q.idle_after_ms.map_or("-".to_string(), rota_core::state::idle::duration_text);
                let idle_action = if q.idle_action.is_empty() { "-" } else { q.idle_action.as_str() };
                outln!(
                    "{:<12} {:>6} {:>8} {:>12} {:>12} {:>11} {:>12} {:>10} {:<8}",
                    q.name,
                    q.weight,
                    q.max_gpus_per_job,
                    q.default_runtime_s,
                    q.max_runtime_s,
                    q.preemptible,
                    q.protected_runtime_s,
                    idle_after,
                    idle_action
                );
            }
        }
    }
    Ok(())
}

pub async fn quota_set(client: &Client, args: &QuotaSetArgs, format: Format) -> Result<()> {
    let per_model = args
        .per_model
        .iter()
        .map(|pair| {
            let (model, n) = pair.split_once('=').with_context(|| format!("--model {pair:?}: expected MODEL=N"))?;
            Ok((model.to_string(), n.parse().with_context(|| format!("--model {pair:?}: N must be a number"))?))
        })
        .collect::<Result<_>>()?;
    let quota = pb::Quota {
        group: args.group.clone(),
        gpus: args.gpus,
        per_model,
        lend: args.lend,
        lend_to: args.lend_to.clone(),
        borrow_limit: args.borrow_limit,
    };
    client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            let quota = quota.clone();
            async move { cluster.set_quota(quota).await.map(|r| r.into_inner()) }
        })
        .await?;
    quota_show(client, format).await
}

pub async fn quota_show(client: &Client, format: Format) -> Result<()> {
    let response = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.list_quotas(pb::ListQuotasRequest {}).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => {
            let quotas: Vec<_> = response
                .quotas
                .iter()
                .map(|s| {
                    let q = s.quota.clone().unwrap_or_default();
                    json!({"group": q.group, "gpus": q.gpus, "per_model": q.per_model, "lend": q.lend, "lend_to": q.lend_to,
                           "borrow_limit": q.borrow_limit, "used": s.used, "borrowed": s.borrowed, "lendable": s.lendable, "lent": s.lent})
                })
                .collect();
            outln!("{}", serde_json::to_string_pretty(&quotas)?)
        }
        Format::Table => {
            outln!("{:<16} {:>6} {:>6} {:>9} {:>9} {:>6} {:<6}", "GROUP", "QUOTA", "USED", "BORROWED", "LENDABLE", "LENT", "LENDS");
            for s in &response.quotas {
                let q = s.quota.clone().unwrap_or_default();
                outln!("{:<16} {:>6} {:>6} {:>9} {:>9} {:>6} {:<6}", q.group, q.gpus, s.used, s.borrowed, s.lendable, s.lent, q.lend);
            }
        }
    }
    Ok(())
}

pub async fn usage(client: &Client, format: Format) -> Result<()> {
    let response = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.get_usage(pb::GetUsageRequest {}).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => {
            let lines: Vec<_> = response
                .lines
                .iter()
                .map(|l| json!({"group": l.group, "queue": l.queue, "gpu_seconds": l.gpu_seconds, "gpus_now": l.gpus_now}))
                .collect();
            outln!("{}", serde_json::to_string_pretty(&lines)?)
        }
        Format::Table => {
            outln!("{:<16} {:<10} {:>14} {:>9}", "GROUP", "QUEUE", "GPU_HOURS", "GPUS_NOW");
            for l in &response.lines {
                outln!("{:<16} {:<10} {:>14.2} {:>9}", l.group, l.queue, l.gpu_seconds as f64 / 3600.0, l.gpus_now);
            }
        }
    }
    Ok(())
}

/// `rota alarm list`.
pub async fn alarm_list(client: &Client, format: Format) -> Result<()> {
    let response = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.list_alarms(pb::ListAlarmsRequest {}).await.map(|r| r.into_inner()) }
        })
        .await?;
    print_alarms(&response, format)
}

/// `rota alarm disarm [--replica N]`: clear one replica's alarm, or every one.
pub async fn alarm_disarm(client: &Client, replica_id: u64, kind: &str, format: Format) -> Result<()> {
    let request = pb::SetAlarmRequest { replica_id, kind: kind.to_string(), raised: false };
    let response = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            let request = request.clone();
            async move { cluster.set_alarm(request).await.map(|r| r.into_inner()) }
        })
        .await?;
    print_alarms(&response, format)
}

fn print_alarms(response: &pb::ListAlarmsResponse, format: Format) -> Result<()> {
    match format {
        Format::Json => {
            let alarms: Vec<_> = response.alarms.iter().map(|a| json!({"replica_id": a.replica_id, "kind": a.kind})).collect();
            outln!("{}", serde_json::to_string_pretty(&alarms)?);
        }
        Format::Table if response.alarms.is_empty() => outln!("no alarm raised"),
        Format::Table => {
            outln!("{:>8}  KIND", "REPLICA");
            for alarm in &response.alarms {
                outln!("{:>8}  {}", alarm.replica_id, alarm.kind);
            }
        }
    }
    Ok(())
}
