//! The systemd units in `deploy/systemd`: `systemd-analyze verify` accepts
//! them (pointed at the built binaries), and they say what matters: the
//! replica hardened with its data directory the only place it writes; the
//! agent never stopping running ranks when it stops or restarts, and
//! hardened by nothing that every rank would inherit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::cluster::{binary, rota_bin};

fn unit_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/systemd").join(name)
}

/// `Key=value` lines of a unit, by section; repeated keys keep every value.
fn parse_unit(text: &str) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let mut sections: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_string();
        } else if let Some((key, value)) = line.split_once('=') {
            sections.entry(section.clone()).or_default().entry(key.to_string()).or_default().push(value.to_string());
        }
    }
    sections
}

fn service(name: &str) -> Result<BTreeMap<String, Vec<String>>> {
    let text = std::fs::read_to_string(unit_path(name))?;
    parse_unit(&text).remove("Service").with_context(|| format!("{name} has a [Service] section"))
}

fn value<'a>(service: &'a BTreeMap<String, Vec<String>>, key: &str) -> Option<&'a str> {
    service.get(key).and_then(|v| v.last()).map(String::as_str)
}

#[test]
fn the_replica_unit_is_hardened_and_writes_only_its_data_directory() -> Result<()> {
    let unit = service("rota-server.service")?;
    for (key, want) in [
        ("User", "rota"),
        ("ProtectSystem", "strict"),
        ("StateDirectory", "rota"),
        ("ReadWritePaths", "/var/lib/rota"),
        ("NoNewPrivileges", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectHome", "yes"),
        ("Restart", "on-failure"),
        ("EnvironmentFile", "/etc/rota/server.env"),
        ("RestartPreventExitStatus", "78"),
    ] {
        ensure!(value(&unit, key) == Some(want), "rota-server.service: {key}={want}, found {:?}", value(&unit, key));
    }
    let nofile: u64 = value(&unit, "LimitNOFILE").context("LimitNOFILE")?.parse()?;
    ensure!(nofile >= 65_536, "LimitNOFILE {nofile}");
    let exec = value(&unit, "ExecStart").context("ExecStart")?;
    ensure!(exec.starts_with("/usr/bin/rota server ") && exec.contains("--data-dir /var/lib/rota/"), "{exec}");
    Ok(())
}

#[test]
fn the_agent_unit_never_stops_running_ranks_and_passes_no_sandbox_to_them() -> Result<()> {
    let unit = service("rota-agent.service")?;
    ensure!(value(&unit, "KillMode") == Some("process"), "only the agent's own process is signalled");
    ensure!(value(&unit, "Delegate") == Some("yes"), "the agent manages its ranks' cgroups");
    ensure!(value(&unit, "Restart") == Some("on-failure"));
    for inherited in ["NoNewPrivileges", "PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateDevices", "CapabilityBoundingSet", "User"] {
        ensure!(!unit.contains_key(inherited), "rota-agent.service sets {inherited}, which every rank would inherit");
    }
    let exec = value(&unit, "ExecStart").context("ExecStart")?;
    ensure!(exec.starts_with("/usr/bin/rota-agent ") && exec.contains("--cgroup-parent"), "{exec}");
    Ok(())
}

/// systemd-analyze, or why not. Under CI it must be there (setup-debian.sh installs it).
fn systemd_analyze() -> Result<Option<PathBuf>> {
    for dir in ["/usr/bin", "/bin"] {
        let path = Path::new(dir).join("systemd-analyze");
        if path.is_file() {
            return Ok(Some(path));
        }
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        bail!("systemd-analyze is missing under CI: deploy/setup-debian.sh installs the systemd package");
    }
    eprintln!("skipped: systemd-analyze is not installed (deploy/setup-debian.sh installs it)");
    Ok(None)
}

#[test]
fn systemd_analyze_verifies_both_units() -> Result<()> {
    let Some(analyze) = systemd_analyze()? else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    // verify checks that ExecStart's program exists: point it at the built ones.
    let rota = rota_bin()?.display().to_string();
    let agent = binary("ROTA_AGENT_BIN", "rota-agent")?.display().to_string();
    let mut units = Vec::new();
    for name in ["rota-server.service", "rota-agent.service"] {
        let text = std::fs::read_to_string(unit_path(name))?;
        let text = text.replace("/usr/bin/rota-agent ", &format!("{agent} ")).replace("/usr/bin/rota ", &format!("{rota} "));
        let path = dir.path().join(name);
        std::fs::write(&path, text)?;
        units.push(path);
    }
    let output = Command::new(analyze).args(["verify", "--man=no"]).args(&units).output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(output.status.success(), "systemd-analyze verify failed: {stderr}");
    // Unknown or misspelt keys are only warnings there; here they fail.
    let complaints: Vec<&str> = stderr.lines().filter(|l| l.contains(".service")).collect();
    ensure!(complaints.is_empty(), "systemd-analyze complains: {complaints:?}");
    Ok(())
}
