//! GPU events for the replicas: XID errors and completed resets.
//!
//! Where they come from:
//! - NVML (real GPUs): an event set registered for critical XIDs, single-
//!   and double-bit ECC errors, clock and power source changes, where each
//!   GPU supports them, waited on by a thread of its own. Only XID events
//!   go to the replicas (a double-bit ECC error also raises its XID 48);
//!   the rest are logged. A healthy GPU sends events at once (clock and
//!   power state changes), so events are always filtered by type.
//! - Fake GPUs: `fake-xids` in the data dir, lines `GPU_INDEX XID`, each
//!   consumed once (the file is taken away when read).
//! - Resets, on both: `gpu-resets` in the data dir, one GPU index a line,
//!   written by whoever reset the GPU (an operator after `nvidia-smi -r`, a
//!   remediation script). The agent reports the reset only once the GPU
//!   reads healthy, so a reset fence is lifted by a completed reset and a
//!   clean health read.
//!
//! Events wait in a bounded queue until a report commits them (see
//! `outbox`); when it is full the oldest are dropped and logged.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rota_proto::v1 as pb;

use crate::datafile::{read_capped, MAX_FILE_BYTES};
use crate::shared::{GpuEventQueue, Shared, MAX_QUEUED_EVENTS};

/// File of fake XIDs in the agent's data dir: lines `GPU_INDEX XID`.
pub const FAKE_XIDS_FILE: &str = "fake-xids";
/// File of completed GPU resets in the agent's data dir: one index a line.
pub const GPU_RESETS_FILE: &str = "gpu-resets";
/// Lines read from one event file at most.
const MAX_FILE_LINES: usize = 256;
/// How often the files (and the NVML thread's channel) are read.
const POLL_MS: u64 = 250;
/// One NVML wait at most, so the thread notices a dropped receiver.
const NVML_WAIT_MS: u32 = 500;

pub fn xid_event(gpu: u32, xid: u32, at_ms: u64) -> pb::GpuEvent {
    pb::GpuEvent { gpu, at_ms, kind: Some(pb::gpu_event::Kind::Xid(xid)) }
}

pub fn reset_event(gpu: u32, at_ms: u64) -> pb::GpuEvent {
    pb::GpuEvent { gpu, at_ms, kind: Some(pb::gpu_event::Kind::Reset(pb::GpuResetDone {})) }
}

/// `GPU_INDEX XID` lines; blank lines and `#` comments skipped, bad lines
/// logged and skipped.
pub fn parse_fake_xids(text: &str) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).take(MAX_FILE_LINES) {
        let mut words = line.split_whitespace();
        match (words.next().and_then(|w| w.parse().ok()), words.next().and_then(|w| w.parse().ok()), words.next()) {
            (Some(gpu), Some(xid), None) => out.push((gpu, xid)),
            _ => tracing::warn!(line, "{FAKE_XIDS_FILE}: expected `GPU_INDEX XID`; line skipped"),
        }
    }
    out
}

/// One GPU index a line.
pub fn parse_resets(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).take(MAX_FILE_LINES) {
        match line.parse() {
            Ok(gpu) => out.push(gpu),
            Err(_) => tracing::warn!(line, "{GPU_RESETS_FILE}: expected a GPU index; line skipped"),
        }
    }
    out
}

/// Take a file away and read it: each line is acted on once. The rename
/// first, so a writer that renames its file into place is never half read.
fn take_file(path: &Path) -> Option<String> {
    let taken = path.with_extension("taken");
    std::fs::rename(path, &taken).ok()?;
    let text = read_capped(&taken, MAX_FILE_BYTES);
    let _ = std::fs::remove_file(&taken);
    match text {
        Ok(text) => Some(text),
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot read a GPU event file");
            None
        }
    }
}

/// Count an XID the agent saw and queue it for the replicas.
fn record_xid(shared: &Shared, queue: &mut GpuEventQueue, gpu: u32, xid: u32, at_ms: u64) {
    let node = shared.config.node_name.clone();
    metrics::counter!("rota_agent_gpu_xid_errors_total", "node" => node, "gpu" => gpu.to_string(), "xid" => xid.to_string()).increment(1);
    tracing::warn!(gpu, xid, "GPU reported an XID error");
    queue.push(xid_event(gpu, xid, at_ms));
}

/// Collect GPU events into the shared queue, forever.
pub async fn event_loop(shared: Arc<Shared>) {
    let data_dir: PathBuf = shared.config.data_dir.clone();
    let nvml_events = shared.gpus.lock().expect("gpu source lock").is_nvml().then(nvml_thread);
    let mut pending_resets: Vec<u32> = Vec::new();
    loop {
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        let now_ms = crate::rankdir::now_ms();
        let mut xids: Vec<(u32, u32)> = Vec::new();
        if shared.gpus.lock().expect("gpu source lock").is_fake() {
            if let Some(text) = take_file(&data_dir.join(FAKE_XIDS_FILE)) {
                xids.extend(parse_fake_xids(&text));
            }
        }
        if let Some(receiver) = &nvml_events {
            xids.extend(receiver.try_iter().take(MAX_QUEUED_EVENTS));
        }
        if let Some(text) = take_file(&data_dir.join(GPU_RESETS_FILE)) {
            for gpu in parse_resets(&text) {
                if !pending_resets.contains(&gpu) && pending_resets.len() < MAX_FILE_LINES {
                    pending_resets.push(gpu);
                }
            }
        }
        let known = |gpu: u32| shared.inventory.iter().any(|g| g.index == gpu);
        let mut queue = shared.gpu_events.lock().expect("gpu events lock");
        for (gpu, xid) in xids {
            if known(gpu) {
                record_xid(&shared, &mut queue, gpu, xid, now_ms);
            } else {
                tracing::warn!(gpu, xid, "XID for a GPU this node does not have; ignored");
            }
        }
        if !pending_resets.is_empty() {
            // A reset counts once the GPU reads healthy.
            let samples = shared.gpus.lock().expect("gpu source lock").sample(&shared.inventory);
            pending_resets.retain(|&gpu| {
                let healthy = samples.iter().any(|s| s.index == gpu && s.healthy);
                if healthy {
                    tracing::info!(gpu, "GPU reset and reads healthy");
                    queue.push(reset_event(gpu, now_ms));
                }
                !healthy && known(gpu)
            });
        }
    }
}

/// The NVML event thread: its own NVML handle (an event set borrows it and
/// is not `Send`), an event set on every GPU for the types it supports,
/// XIDs sent on the channel as `(gpu index, xid)`. Ends when the receiver
/// is gone; an NVML failure is logged and retried after a pause.
fn nvml_thread() -> std::sync::mpsc::Receiver<(u32, u32)> {
    let (sender, receiver) = std::sync::mpsc::sync_channel(MAX_QUEUED_EVENTS);
    let spawned = std::thread::Builder::new().name("nvml-events".into()).spawn(move || loop {
        match nvml_watch(&sender) {
            Ok(()) => return,
            Err(error) => {
                tracing::error!(%error, "NVML event set failed; registering again in 10 s");
                std::thread::sleep(Duration::from_secs(10));
            }
        }
    });
    if let Err(error) = spawned {
        tracing::error!(%error, "cannot start the NVML event thread; XIDs are not collected");
    }
    receiver
}

/// The event types rota asks for, where a GPU supports them.
fn wanted_types() -> nvml_wrapper::bitmasks::event::EventTypes {
    use nvml_wrapper::bitmasks::event::EventTypes;
    EventTypes::CRITICAL_XID_ERROR
        | EventTypes::SINGLE_BIT_ECC_ERROR
        | EventTypes::DOUBLE_BIT_ECC_ERROR
        | EventTypes::CLOCK_CHANGE
        | EventTypes::POWER_SOURCE_CHANGE
}

/// An event set with every GPU registered for the wanted types it
/// supports; with the types registered per GPU index.
type Registered<'nvml> = (nvml_wrapper::EventSet<'nvml>, Vec<(u32, nvml_wrapper::bitmasks::event::EventTypes)>);

fn register(nvml: &nvml_wrapper::Nvml) -> Result<Registered<'_>, nvml_wrapper::error::NvmlError> {
    use nvml_wrapper::bitmasks::event::EventTypes;
    let mut set = nvml.create_event_set()?;
    let mut registered = Vec::new();
    for i in 0..nvml.device_count()? {
        let device = nvml.device_by_index(i)?;
        let types = device.supported_event_types().map(|t| t & wanted_types()).unwrap_or(EventTypes::CRITICAL_XID_ERROR);
        set = device.register_events(types, set).map_err(|e| e.error)?;
        registered.push((device.index().unwrap_or(i), types));
    }
    Ok((set, registered))
}

/// What `nvml_event_probe` found: the registered types (raw bits) per GPU
/// index, and the types of the event one wait returned, if any.
pub type EventProbe = (Vec<(u32, u64)>, Option<u64>);

/// For the NVML test: register the event set on this host's GPUs and wait
/// once.
pub fn nvml_event_probe(nvml: &nvml_wrapper::Nvml) -> Result<EventProbe, nvml_wrapper::error::NvmlError> {
    let (set, registered) = register(nvml)?;
    let event = match set.wait(NVML_WAIT_MS) {
        Ok(data) => Some(data.event_type.bits()),
        Err(nvml_wrapper::error::NvmlError::Timeout) => None,
        Err(error) => return Err(error),
    };
    Ok((registered.into_iter().map(|(gpu, types)| (gpu, types.bits())).collect(), event))
}

/// Register and wait on the event set until the receiver is gone (Ok) or
/// NVML fails (Err).
fn nvml_watch(sender: &std::sync::mpsc::SyncSender<(u32, u32)>) -> Result<(), nvml_wrapper::error::NvmlError> {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    use nvml_wrapper::error::NvmlError;
    let nvml = nvml_wrapper::Nvml::init()?;
    let (set, registered) = register(&nvml)?;
    for (gpu, types) in registered {
        tracing::info!(gpu, types = ?types, "NVML events registered");
    }
    loop {
        let data = match set.wait(NVML_WAIT_MS) {
            Ok(data) => data,
            Err(NvmlError::Timeout) => continue,
            Err(error) => return Err(error),
        };
        let gpu = data.device.index().unwrap_or(u32::MAX);
        if !data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
            // ECC, clock and power events: logged; an ECC fault that needs
            // action also raises its XID.
            tracing::debug!(gpu, event = ?data.event_type, "NVML event");
            continue;
        }
        let xid = match data.event_data {
            Some(XidError::Value(xid)) => u32::try_from(xid).unwrap_or(u32::MAX),
            // An XID event without its code: the table's unknown default.
            Some(XidError::Unknown) | None => u32::MAX,
        };
        if sender.send((gpu, xid)).is_err() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_file_of_any_size_is_read_only_up_to_its_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FAKE_XIDS_FILE);
        let line = "3 79\n";
        std::fs::write(&path, line.repeat(1 << 20)).expect("a 5 MiB file");
        let text = take_file(&path).expect("taken");
        assert_eq!(text.len() as u64, MAX_FILE_BYTES, "only the cap is read");
        assert!(!path.exists(), "the file is taken away");
        assert_eq!(parse_fake_xids(&text).len(), MAX_FILE_LINES, "and only so many lines act");
    }

    #[test]
    fn fake_xid_lines_parse_and_bad_lines_are_skipped() {
        assert_eq!(parse_fake_xids("3 79\n\n# note\n1 94\nbad\n2 x\n4 5 6\n"), vec![(3, 79), (1, 94)]);
        assert_eq!(parse_resets("1\n x\n7\n"), vec![1, 7]);
    }

    #[test]
    fn the_queue_is_bounded_and_drops_the_oldest() {
        let mut queue = GpuEventQueue::default();
        for xid in 0..(MAX_QUEUED_EVENTS as u32 + 5) {
            queue.push(xid_event(0, xid, 1));
        }
        assert_eq!(queue.len(), MAX_QUEUED_EVENTS);
        assert_eq!(queue.pending()[0].kind, Some(pb::gpu_event::Kind::Xid(5)));
        queue.committed(MAX_QUEUED_EVENTS - 1);
        assert_eq!(queue.pending(), vec![xid_event(0, MAX_QUEUED_EVENTS as u32 + 4, 1)]);
    }

    #[test]
    fn a_taken_file_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FAKE_XIDS_FILE);
        std::fs::write(&path, "0 79\n").unwrap();
        assert_eq!(take_file(&path).as_deref(), Some("0 79\n"));
        assert_eq!(take_file(&path), None);
    }
}
