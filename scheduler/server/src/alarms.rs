//! Alarms: a replica short of disk raises `nospace` in the replicated
//! state, so the whole cluster stops taking new work before any replica
//! fails to write its log (as etcd's NOSPACE alarm does). Reads, agent
//! reports and the scheduling of what is already queued go on. An
//! operator clears the alarm after freeing space; a replica still short
//! raises it again at its next check.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rota_core::state::{AlarmKind, Command, CommandResult};
use rota_proto::v1 as pb;

use crate::Context;

/// How often each replica measures its data directory's free space.
const CHECK_EVERY_MS: u64 = 1_000;
/// Default free space below which a replica raises `nospace`.
pub const DEFAULT_MIN_FREE_BYTES: u64 = 512 * 1024 * 1024;

/// Bytes an unprivileged writer may still use on the file system of `path`.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    if let Some(forced) = test_free_bytes() {
        return Ok(forced);
    }
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a data directory path with a NUL byte"))?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a zeroed statvfs the call fills in.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// TEST ONLY: `ROTA_TEST_FREE_BYTES_FILE` names a file holding the free
/// byte count this replica should believe (read at every check, so a test
/// can "fill" and "free" one replica's disk). Absent file: the real figure.
fn test_free_bytes() -> Option<u64> {
    let path = std::env::var_os("ROTA_TEST_FREE_BYTES_FILE")?;
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether `replica` has `kind` raised in the applied state.
fn raised(ctx: &Context, replica: u64, kind: AlarmKind) -> bool {
    ctx.read(|state| state.alarms.contains(&(replica, kind)))
}

/// Run for the life of the replica: measure, and raise when short.
pub async fn watch_disk(ctx: Arc<Context>, data_dir: PathBuf, min_free_bytes: u64) {
    let me = ctx.replica.status().id;
    loop {
        match free_bytes(&data_dir) {
            Ok(free) => {
                metrics::gauge!("rota_data_dir_free_bytes").set(free as f64);
                if free < min_free_bytes && !raised(&ctx, me, AlarmKind::NoSpace) {
                    tracing::error!(free, min_free_bytes, "data directory short of free space; raising the nospace alarm");
                    if let Err(error) = raise(&ctx, me).await {
                        tracing::warn!(%error, "could not raise the nospace alarm yet; trying again");
                    }
                }
            }
            Err(error) => tracing::warn!(%error, dir = %data_dir.display(), "cannot measure the data directory's free space"),
        }
        metrics::gauge!("rota_alarms_raised").set(ctx.read(|state| state.alarms.len()) as f64);
        tokio::time::sleep(Duration::from_millis(CHECK_EVERY_MS)).await;
    }
}

/// Raise this replica's alarm: proposed here when leading, else sent to the leader.
async fn raise(ctx: &Context, me: u64) -> Result<(), String> {
    let status = ctx.replica.status();
    if status.leader_id == Some(me) {
        return match ctx.proposer.propose(Command::SetAlarm { replica: me, kind: AlarmKind::NoSpace, raised: true }).await {
            Ok((_, CommandResult::Done)) => Ok(()),
            Ok((_, other)) => Err(format!("{other:?}")),
            Err(error) => Err(error.to_string()),
        };
    }
    let leader = status.leader_id.and_then(|id| status.members.iter().find(|m| m.id == id)).ok_or("no leader known")?;
    let mut client = ctx.forwarder.cluster(&leader.addr).map_err(|e| e.to_string())?;
    let request = pb::SetAlarmRequest { replica_id: me, kind: AlarmKind::NoSpace.as_str().into(), raised: true };
    client.set_alarm(request).await.map(|_| ()).map_err(|status| status.message().to_string())
}
