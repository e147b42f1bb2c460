//! What GPUs this host has: from NVML (the default), or declared with
//! `--fake-gpus` on hosts without a driver (tests, CI, demos). Telemetry is
//! sampled on every heartbeat; NVML failures at run time are reported as
//! unhealthy GPUs and logged, never a panic.

use std::collections::BTreeSet;

use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::Nvml;

#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("--fake-gpus {0:?}: expected COUNTxMODEL[,COUNTxMODEL...], e.g. 8xH100-80GB (memory from the model's NNGB suffix)")]
    BadFakeSpec(String),
    #[error("no GPU inventory: NVML is not available ({0}); install the NVIDIA driver or declare GPUs with --fake-gpus 8xH100-80GB")]
    NoNvml(String),
    #[error("NVML: {0}")]
    Nvml(String),
}

/// One GPU as registered with the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    /// Normalized model: family and memory rounded to GB, e.g. "H100-80GB".
    pub model: String,
    pub memory_mib: u64,
    pub nvlink_peers: Vec<u32>,
}

/// One sample of a GPU's telemetry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuSample {
    pub index: u32,
    pub utilization_percent: u32,
    pub memory_used_mib: u64,
    pub healthy: bool,
    pub ecc_uncorrected: u64,
    /// Volatile corrected ECC errors (0 where not supported).
    pub ecc_corrected: u64,
    pub last_xid: u64,
    pub temperature_celsius: u32,
    pub power_milliwatts: u32,
}

/// File in the agent's data dir that lists fake GPUs to report unhealthy
/// (comma-separated indexes), so tests and demos can fail a GPU.
pub const FAKE_UNHEALTHY_FILE: &str = "fake-unhealthy-gpus";

/// Where inventory and telemetry come from.
pub enum GpuSource {
    /// Declared GPUs; `unhealthy_file` lists those to report unhealthy.
    Fake {
        gpus: Vec<Gpu>,
        unhealthy_file: Option<std::path::PathBuf>,
        /// `fake-utilization` (see `idle`).
        utilization_file: Option<std::path::PathBuf>,
    },
    Nvml(Box<Nvml>),
}

impl GpuSource {
    /// `--fake-gpus` when given, else NVML; no NVML and no fake GPUs is an error.
    pub fn open(fake: Option<&str>) -> Result<GpuSource, InventoryError> {
        match fake {
            Some(spec) => Ok(GpuSource::Fake { gpus: parse_fake(spec)?, unhealthy_file: None, utilization_file: None }),
            None => Nvml::init().map(|n| GpuSource::Nvml(Box::new(n))).map_err(|e| InventoryError::NoNvml(e.to_string())),
        }
    }

    /// Fake GPUs listed in `path` are reported unhealthy (no effect on NVML).
    pub fn with_fake_unhealthy_file(mut self, path: std::path::PathBuf) -> GpuSource {
        if let GpuSource::Fake { unhealthy_file, .. } = &mut self {
            *unhealthy_file = Some(path);
        }
        self
    }

    /// Fake GPUs read their utilization from `path` (see `idle`).
    pub fn with_fake_utilization_file(mut self, path: std::path::PathBuf) -> GpuSource {
        if let GpuSource::Fake { utilization_file, .. } = &mut self {
            *utilization_file = Some(path);
        }
        self
    }

    /// The fake GPUs' listed utilization (`None` for NVML, whose samples
    /// are real; empty when no file is set or readable).
    pub fn fake_utilization(&self) -> Option<std::collections::BTreeMap<u32, u32>> {
        match self {
            GpuSource::Fake { utilization_file, .. } => Some(
                utilization_file
                    .as_ref()
                    .and_then(|path| crate::datafile::read_capped(path, crate::datafile::MAX_FILE_BYTES).ok())
                    .map(|text| crate::idle::parse_fake_utilization(&text))
                    .unwrap_or_default(),
            ),
            GpuSource::Nvml(_) => None,
        }
    }

    pub fn is_fake(&self) -> bool {
        matches!(self, GpuSource::Fake { .. })
    }

    pub fn is_nvml(&self) -> bool {
        matches!(self, GpuSource::Nvml(_))
    }

    pub fn inventory(&self) -> Result<Vec<Gpu>, InventoryError> {
        match self {
            GpuSource::Fake { gpus, .. } => Ok(gpus.clone()),
            GpuSource::Nvml(nvml) => nvml_inventory(nvml),
        }
    }

    /// One sample per GPU of the inventory. A GPU NVML cannot read is unhealthy.
    pub fn sample(&self, inventory: &[Gpu]) -> Vec<GpuSample> {
        match self {
            GpuSource::Fake { unhealthy_file, .. } => {
                let unhealthy: BTreeSet<u32> = unhealthy_file
                    .as_ref()
                    .and_then(|path| crate::datafile::read_capped(path, crate::datafile::MAX_FILE_BYTES).ok())
                    .map(|text| text.split(',').filter_map(|i| i.trim().parse().ok()).collect())
                    .unwrap_or_default();
                inventory
                    .iter()
                    .map(|g| GpuSample { index: g.index, healthy: !unhealthy.contains(&g.index), ..Default::default() })
                    .collect()
            }
            GpuSource::Nvml(nvml) => inventory.iter().map(|g| nvml_sample(nvml, g.index)).collect(),
        }
    }
}

/// Parse `8xH100-80GB,4xA100-40GB`. GPU indexes are assigned in order.
pub fn parse_fake(spec: &str) -> Result<Vec<Gpu>, InventoryError> {
    let bad = || InventoryError::BadFakeSpec(spec.to_string());
    let mut gpus = Vec::new();
    for group in spec.split(',').map(str::trim).filter(|g| !g.is_empty()) {
        let (count, model) = group.split_once(['x', 'X']).ok_or_else(bad)?;
        let count: u32 = count.trim().parse().map_err(|_| bad())?;
        let model = model.trim();
        let memory_mib = model_memory_mib(model).ok_or_else(bad)?;
        if count == 0 || model.is_empty() {
            return Err(bad());
        }
        for _ in 0..count {
            let index = gpus.len() as u32;
            gpus.push(Gpu { index, uuid: format!("GPU-fake-{index:04}"), model: model.to_string(), memory_mib, nvlink_peers: Vec::new() });
        }
    }
    if gpus.is_empty() || gpus.len() > 64 {
        return Err(bad());
    }
    // Fake GPUs of one group form one NVLink domain, as on an HGX board.
    let all: Vec<(u32, String)> = gpus.iter().map(|g| (g.index, g.model.clone())).collect();
    for gpu in &mut gpus {
        gpu.nvlink_peers = all.iter().filter(|(i, m)| *i != gpu.index && *m == gpu.model).map(|(i, _)| *i).collect();
    }
    Ok(gpus)
}

/// Memory from a model's suffix: "H100-80GB" -> 80 GiB in MiB.
fn model_memory_mib(model: &str) -> Option<u64> {
    let suffix = model.rsplit('-').next()?;
    let gb: u64 = suffix.strip_suffix("GB").or_else(|| suffix.strip_suffix("gb"))?.parse().ok()?;
    Some(gb * 1024)
}

/// "NVIDIA H100 80GB HBM3" with 81559 MiB -> "H100-80GB".
pub fn normalize_model(name: &str, memory_mib: u64) -> String {
    let family = name
        .split_whitespace()
        .find(|w| !w.eq_ignore_ascii_case("nvidia") && !w.eq_ignore_ascii_case("tesla") && !w.eq_ignore_ascii_case("geforce"))
        .and_then(|w| w.split('-').next())
        .unwrap_or("GPU");
    let gb = (memory_mib + 512) / 1024;
    format!("{family}-{gb}GB")
}

fn nvml_error(what: &str, e: impl std::fmt::Display) -> InventoryError {
    InventoryError::Nvml(format!("{what}: {e}"))
}

fn nvml_inventory(nvml: &Nvml) -> Result<Vec<Gpu>, InventoryError> {
    let count = nvml.device_count().map_err(|e| nvml_error("device count", e))?;
    let mut gpus = Vec::new();
    let mut bus_ids = Vec::new();
    for i in 0..count {
        let device = nvml.device_by_index(i).map_err(|e| nvml_error("device", e))?;
        let index = device.index().unwrap_or(i);
        let uuid = device.uuid().map_err(|e| nvml_error("uuid", e))?;
        let name = device.name().map_err(|e| nvml_error("name", e))?;
        let memory_mib = device.memory_info().map_err(|e| nvml_error("memory", e))?.total / (1024 * 1024);
        bus_ids.push(device.pci_info().map(|p| p.bus_id.to_lowercase()).unwrap_or_default());
        gpus.push(Gpu { index, uuid, model: normalize_model(&name, memory_mib), memory_mib, nvlink_peers: Vec::new() });
    }
    for (i, gpu) in gpus.iter_mut().enumerate() {
        let Ok(device) = nvml.device_by_index(i as u32) else {
            continue;
        };
        let mut peers = BTreeSet::new();
        // NVML_NVLINK_MAX_LINKS is 18 on Hopper.
        for link in 0..18 {
            let wrapper = device.link_wrapper_for(link);
            if !wrapper.is_active().unwrap_or(false) {
                continue;
            }
            let Ok(remote) = wrapper.remote_pci_info() else {
                continue;
            };
            let remote = remote.bus_id.to_lowercase();
            if let Some(peer) = bus_ids.iter().position(|b| !b.is_empty() && *b == remote) {
                peers.insert(peer as u32);
            }
        }
        gpu.nvlink_peers = peers.into_iter().collect();
    }
    Ok(gpus)
}

fn nvml_sample(nvml: &Nvml, index: u32) -> GpuSample {
    let device = match nvml.device_by_index(index) {
        Ok(device) => device,
        Err(error) => {
            tracing::warn!(index, %error, "NVML cannot open the GPU; reporting it unhealthy");
            return GpuSample { index, healthy: false, ..Default::default() };
        }
    };
    let utilization_percent = device.utilization_rates().map(|u| u.gpu).unwrap_or(0);
    let memory_used_mib = device.memory_info().map(|m| m.used / (1024 * 1024)).unwrap_or(0);
    let ecc = device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile);
    let (ecc_uncorrected, ecc_readable) = match ecc {
        Ok(n) => (n, true),
        // Not supported (consumer GPUs, ECC off) is not a fault.
        Err(nvml_wrapper::error::NvmlError::NotSupported) => (0, true),
        Err(error) => {
            tracing::warn!(index, %error, "NVML cannot read ECC errors");
            (0, false)
        }
    };
    let ecc_corrected = device.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile).unwrap_or(0);
    let temperature_celsius = device.temperature(TemperatureSensor::Gpu).unwrap_or(0);
    let power_milliwatts = device.power_usage().unwrap_or(0);
    GpuSample {
        index,
        utilization_percent,
        memory_used_mib,
        healthy: ecc_readable && ecc_uncorrected == 0,
        ecc_uncorrected,
        ecc_corrected,
        last_xid: 0,
        temperature_celsius,
        power_milliwatts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_gpus_parse() {
        let gpus = parse_fake("8xH100-80GB,2xA100-40GB").unwrap();
        assert_eq!(gpus.len(), 10);
        assert_eq!(gpus[0].model, "H100-80GB");
        assert_eq!(gpus[0].memory_mib, 80 * 1024);
        assert_eq!(gpus[9].index, 9);
        assert_eq!(gpus[9].memory_mib, 40 * 1024);
        assert_eq!(gpus[0].nvlink_peers.len(), 7);
        for bad in ["", "8", "xH100-80GB", "0xH100-80GB", "8xH100", "100xH100-80GB"] {
            assert!(parse_fake(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn nvml_names_normalize() {
        assert_eq!(normalize_model("NVIDIA H100 80GB HBM3", 81_559), "H100-80GB");
        assert_eq!(normalize_model("NVIDIA A100-SXM4-40GB", 40_960), "A100-40GB");
        assert_eq!(normalize_model("Tesla T4", 15_360), "T4-15GB");
    }
}
