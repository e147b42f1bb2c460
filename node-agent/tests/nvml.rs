//! NVML discovery on a host with an NVIDIA GPU and driver. Where none is
//! present the test says so and passes without checking anything; there it
//! checks instead that the agent refuses to start without --fake-gpus.

use std::process::Command;

use rota_agent::inventory::{GpuSource, InventoryError};

#[test]
fn nvml_discovers_the_gpus_or_is_skipped() {
    let source = match GpuSource::open(None) {
        Ok(source) => source,
        Err(InventoryError::NoNvml(reason)) => {
            eprintln!("SKIPPED nvml_discovers_the_gpus_or_is_skipped: no NVIDIA driver or GPU on this host ({reason})");
            return;
        }
        Err(other) => panic!("unexpected error: {other}"),
    };
    let inventory = source.inventory().expect("NVML lists the GPUs");
    assert!(!inventory.is_empty(), "NVML is present but reports no GPU");
    for (i, gpu) in inventory.iter().enumerate() {
        eprintln!("GPU {}: {} {} {} MiB, NVLink peers {:?}", gpu.index, gpu.uuid, gpu.model, gpu.memory_mib, gpu.nvlink_peers);
        assert_eq!(gpu.index as usize, i, "indexes are the physical order");
        assert!(gpu.uuid.starts_with("GPU-"), "uuid {:?}", gpu.uuid);
        assert!(gpu.memory_mib >= 1024, "memory {} MiB", gpu.memory_mib);
        assert!(gpu.model.ends_with("GB") && gpu.model.contains('-'), "model {:?}", gpu.model);
        assert!(!gpu.nvlink_peers.contains(&gpu.index), "a GPU is not its own NVLink peer");
    }
    let samples = source.sample(&inventory);
    assert_eq!(samples.len(), inventory.len());
    for sample in &samples {
        eprintln!(
            "GPU {}: {}% busy, {} MiB used, healthy {}, ECC {}",
            sample.index, sample.utilization_percent, sample.memory_used_mib, sample.healthy, sample.ecc_uncorrected
        );
        assert!(sample.utilization_percent <= 100);
    }
}

#[test]
fn without_nvml_or_fake_gpus_the_agent_exits_with_a_clear_error() {
    if GpuSource::open(None).is_ok() {
        eprintln!("SKIPPED without_nvml_or_fake_gpus_the_agent_exits_with_a_clear_error: this host has NVML");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_rota-agent"))
        // --insecure: no certificates needed to reach the GPU check.
        .args(["--insecure", "--endpoints", "127.0.0.1:1", "--node-name", "n"])
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--fake-gpus") && stderr.contains("NVML"), "stderr: {stderr}");
}

/// The XID event set registers on every GPU with critical XIDs at least,
/// and a wait returns (an event or a timeout) without error. A healthy GPU
/// may answer the wait at once with a clock or power event, which is why
/// the agent filters events by type. Skipped where there is no NVML.
#[test]
fn nvml_event_set_registers_or_is_skipped() {
    let nvml = match nvml_wrapper::Nvml::init() {
        Ok(nvml) => nvml,
        Err(error) => {
            eprintln!("SKIPPED nvml_event_set_registers_or_is_skipped: no NVIDIA driver or GPU on this host ({error})");
            return;
        }
    };
    let (registered, event) = rota_agent::gpu_events::nvml_event_probe(&nvml).expect("the event set registers and waits");
    assert!(!registered.is_empty(), "NVML is present but no GPU registered events");
    const CRITICAL_XID: u64 = 0x8;
    for (gpu, types) in &registered {
        eprintln!("GPU {gpu}: events 0x{types:x} registered");
        assert!(types & CRITICAL_XID != 0, "GPU {gpu} registered no XID events: 0x{types:x}");
    }
    eprintln!("first event types: {event:?}");
}
