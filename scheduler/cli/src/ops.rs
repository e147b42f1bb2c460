//! Operator commands: `rota health` (readiness probes) and `rota snapshot
//! save|restore` (backups).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use rota_client::Client;
use rota_proto::v1 as pb;
use rota_server::backup;
use rota_tls::Security;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::output::Format;

/// How long `rota health` waits for an answer.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// Which replica `rota health` asks.
pub enum HealthTarget {
    Endpoint(String),
    Replica(u64),
}

/// The serving status of the replica at `address` ("" service: the whole replica).
pub async fn serving_status(security: &Security, address: &str) -> Result<ServingStatus> {
    let endpoint = rota_tls::endpoint(address)?.connect_timeout(HEALTH_TIMEOUT).timeout(HEALTH_TIMEOUT);
    let channel = security.connect(endpoint).await.with_context(|| format!("cannot reach {address}"))?;
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest { service: String::new() })
        .await
        .map_err(|s| anyhow::anyhow!("{address}: {}", s.message()))?;
    Ok(ServingStatus::try_from(response.into_inner().status).unwrap_or(ServingStatus::Unknown))
}

/// `rota health`: prints the status; an error (so a non-zero exit) unless SERVING.
pub async fn health(client: Option<&Client>, security: &Security, target: HealthTarget, format: Format) -> Result<()> {
    let address = match target {
        HealthTarget::Endpoint(address) => address,
        HealthTarget::Replica(id) => {
            let client = client.context("--replica: give --endpoints (or ROTA_ENDPOINTS) to find the replica by")?;
            let status = crate::cluster_status(client).await?;
            status
                .members
                .iter()
                .find(|m| m.id == id)
                .map(|m| m.address.clone())
                .with_context(|| format!("--replica {id}: not a member of the cluster"))?
        }
    };
    let status = serving_status(security, &address).await?;
    match format {
        Format::Json => outln!("{}", serde_json::json!({"endpoint": address, "status": status.as_str_name()})),
        Format::Table => outln!("{address}: {}", status.as_str_name()),
    }
    if status != ServingStatus::Serving {
        bail!("{address} is {}", status.as_str_name());
    }
    Ok(())
}

/// `rota snapshot save FILE`: the leader's backup, checked, written whole
/// (a temporary file, synced, then renamed).
pub async fn snapshot_save(client: &Client, file: &Path, format: Format) -> Result<()> {
    let bytes = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i).max_decoding_message_size(2 * backup::CHUNK_BYTES);
            async move {
                let mut stream = cluster.save_snapshot(pb::SaveSnapshotRequest {}).await?.into_inner();
                let mut bytes = Vec::new();
                while let Some(chunk) = stream.message().await? {
                    if bytes.len() + chunk.data.len() > backup::MAX_BACKUP_BYTES {
                        return Err(tonic::Status::resource_exhausted("the backup is larger than this client accepts"));
                    }
                    bytes.extend_from_slice(&chunk.data);
                }
                Ok(bytes)
            }
        })
        .await?;
    let (header, _) = backup::decode_backup(&bytes).context("the leader's backup")?;
    let temp = file.with_extension("partial");
    {
        use std::io::Write;
        let mut out = std::fs::File::create(&temp).with_context(|| format!("{}", temp.display()))?;
        out.write_all(&bytes)?;
        out.sync_all()?;
    }
    std::fs::rename(&temp, file).with_context(|| format!("{}", file.display()))?;
    let checksum = backup::hex(&bytes[bytes.len() - 32..]);
    let report = serde_json::json!({
        "file": file.display().to_string(),
        "cluster_id": header.cluster_id,
        "index": header.index,
        "term": header.term,
        "bytes": bytes.len(),
        "sha256": checksum,
    });
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&report)?),
        Format::Table => outln!(
            "saved {} ({} bytes): state at index {} (term {}) of cluster {}, sha256 {checksum}",
            file.display(),
            bytes.len(),
            header.index,
            header.term,
            header.cluster_id
        ),
    }
    Ok(())
}

/// `rota snapshot restore FILE --data-dir DIR --id N --peers ...`.
pub fn snapshot_restore(
    file: &Path,
    data_dir: &Path,
    id: u64,
    peers: &BTreeMap<u64, String>,
    cluster_id: Option<String>,
    format: Format,
) -> Result<()> {
    let report = backup::restore(file, data_dir, id, peers, cluster_id)?;
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&report)?),
        Format::Table => outln!(
            "restored replica {} of the new cluster {} (from cluster {}): state at index {} with {} jobs; \
             restore the other members with --cluster-id {}",
            report.replica_id,
            report.cluster_id,
            report.from_cluster_id,
            report.index,
            report.jobs,
            report.cluster_id
        ),
    }
    Ok(())
}
