//! The Kubernetes manifests in `deploy/kubernetes`: kustomize renders them
//! (`kubectl kustomize`), every object validates against the API schemas
//! (`kubernetes-validate --strict`, from PyPI), each property a quorum and
//! the running ranks depend on is asserted, and the replica start script
//! keeps a replica's id in its volume.
//!
//! Under CI the tools must be there (deploy/setup-debian.sh installs
//! them); elsewhere a missing tool skips those checks with a message.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace").to_path_buf()
}

fn venv() -> PathBuf {
    std::env::var_os("ROTA_VENV").map_or_else(|| PathBuf::from("/var/tmp/rota-venv"), PathBuf::from)
}

/// `Ok(false)` when `tool` is missing outside CI (the check is skipped).
fn have(tool: &Path, why: &str) -> Result<bool> {
    let found = Command::new(tool).arg("--help").output().is_ok_and(|o| o.status.success());
    if !found && std::env::var("CI").is_ok_and(|v| v == "true") {
        bail!("{} is missing under CI: deploy/setup-debian.sh installs it ({why})", tool.display());
    }
    if !found {
        eprintln!("skipped: {} is not installed ({why}); run deploy/setup-debian.sh", tool.display());
    }
    Ok(found)
}

fn run(command: &mut Command) -> Result<String> {
    let output = command.output().with_context(|| format!("{command:?}"))?;
    ensure!(output.status.success(), "{command:?}: {}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    Ok(String::from_utf8(output.stdout)?)
}

/// The rendered objects, or `None` where the tools are missing.
fn rendered() -> Result<Option<(String, Vec<Value>)>> {
    let python = venv().join("bin/python");
    if !have(Path::new("kubectl"), "it renders the kustomization")? || !have(&python, "a virtualenv with PyYAML")? {
        return Ok(None);
    }
    let yaml = run(Command::new("kubectl").arg("kustomize").arg(repo().join("deploy/kubernetes")))?;
    let to_json = "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))";
    let mut child =
        Command::new(&python).args(["-c", to_json]).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn()?;
    std::io::Write::write_all(child.stdin.as_mut().context("stdin")?, yaml.as_bytes())?;
    let output = child.wait_with_output()?;
    ensure!(output.status.success(), "YAML to JSON failed");
    Ok(Some((yaml, serde_json::from_slice(&output.stdout)?)))
}

fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> Result<&'a Value> {
    objects.iter().find(|o| o["kind"] == kind && o["metadata"]["name"] == name).with_context(|| format!("no {kind} {name}"))
}

#[test]
fn every_rendered_object_validates_against_the_api_schemas() -> Result<()> {
    let Some((yaml, objects)) = rendered()? else { return Ok(()) };
    let validate = venv().join("bin/kubernetes-validate");
    if !have(&validate, "it validates the objects")? {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("rota.yaml");
    std::fs::write(&file, yaml)?;
    let report = run(Command::new(validate).arg("--strict").arg(&file))?;
    let kinds = ["Namespace", "ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget", "DaemonSet"];
    ensure!(objects.len() == kinds.len(), "objects: {}", objects.len());
    for kind in kinds {
        ensure!(report.to_lowercase().contains(&format!("passed for resource {}", kind.to_lowercase())), "{kind} not validated:\n{report}");
    }
    Ok(())
}

#[test]
fn replicas_start_together_keep_a_quorum_and_probe_health_over_tls() -> Result<()> {
    let Some((_, objects)) = rendered()? else { return Ok(()) };
    let service = object(&objects, "Service", "rota")?;
    ensure!(service["spec"]["clusterIP"] == "None", "the Service is headless");
    ensure!(service["spec"]["publishNotReadyAddresses"] == true, "names resolve before readiness (quorum needs them)");
    let set = object(&objects, "StatefulSet", "rota")?;
    let spec = &set["spec"];
    ensure!(spec["replicas"] == 3 && spec["serviceName"] == "rota");
    ensure!(spec["podManagementPolicy"] == "Parallel", "an ordered start never reaches a quorum");
    let pod = &spec["template"]["spec"];
    let anti = &pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0];
    ensure!(anti["topologyKey"] == "kubernetes.io/hostname", "one replica per host");
    let container = &pod["containers"][0];
    let probe = container["readinessProbe"]["exec"]["command"].to_string();
    ensure!(probe.contains("rota health") && probe.contains("--tls-ca"), "readiness is gRPC health over TLS: {probe}");
    ensure!(
        pod["volumes"].as_array().into_iter().flatten().any(|v| v["secret"]["secretName"] == "rota-replica-tls"),
        "certificates from a Secret"
    );
    ensure!(spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data", "a persistent volume per replica");
    let start = object(&objects, "ConfigMap", "rota-replica-start").or_else(|_| {
        objects
            .iter()
            .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"].as_str().is_some_and(|n| n.starts_with("rota-replica-start")))
            .context("the start script")
    })?;
    ensure!(start["data"]["replica-start.sh"].as_str().is_some_and(|s| s.contains("replica-id")), "the id is kept in the volume");
    let budget = object(&objects, "PodDisruptionBudget", "rota")?;
    ensure!(budget["spec"]["maxUnavailable"] == 1, "at most one replica down by choice");
    Ok(())
}

#[test]
fn agent_pods_restart_without_killing_ranks() -> Result<()> {
    let Some((_, objects)) = rendered()? else { return Ok(()) };
    let agents = object(&objects, "DaemonSet", "rota-agent")?;
    let pod = &agents["spec"]["template"]["spec"];
    ensure!(pod["hostPID"] == true, "the host's PID namespace (ranks are found and adopted by PID)");
    let container = &pod["containers"][0];
    ensure!(container["securityContext"]["privileged"] == true, "writes the host's cgroup tree");
    let mounts = container["volumeMounts"].as_array().context("mounts")?;
    let mounted = |path: &str| mounts.iter().any(|m| m["mountPath"] == path);
    ensure!(mounted("/sys/fs/cgroup"), "rank cgroups live in the host's tree, outside the pod's");
    ensure!(mounted("/var/lib/rota-agent"), "rank records outlive the pod");
    let volumes = pod["volumes"].as_array().context("volumes")?;
    for (name, path) in [("cgroup", "/sys/fs/cgroup"), ("data", "/var/lib/rota-agent")] {
        ensure!(volumes.iter().any(|v| v["name"] == name && v["hostPath"]["path"] == path), "{name} is the host's {path}");
    }
    let command = container["command"].to_string();
    ensure!(command.contains("--cgroup-parent") && !command.contains("--no-cgroups"), "ranks in cgroups of their own: {command}");
    Ok(())
}

/// Run the replica start script with a stand-in `rota` that prints its
/// arguments; `Err` carries the script's refusal.
fn start_replica(data: &Path, tls: &Path, join: &Path, pod: &str) -> Result<String> {
    let fake_rota = data.parent().context("a parent")?.join("fake-rota");
    std::fs::write(&fake_rota, "#!/bin/sh\necho \"$@\"\n")?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake_rota, std::fs::Permissions::from_mode(0o755))?;
    }
    let output = Command::new("sh")
        .arg(repo().join("deploy/kubernetes/replica-start.sh"))
        .env("ROTA_DATA", data)
        .env("ROTA_TLS_DIR", tls)
        .env("ROTA_JOIN_DIR", join)
        .env("ROTA_BIN", &fake_rota)
        .env("POD_NAME", pod)
        .env("POD_NAMESPACE", "prod")
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    ensure!(output.status.success(), "refused: {stderr}");
    Ok(String::from_utf8(output.stdout)?)
}

#[test]
fn a_replica_id_lives_in_its_volume_not_in_its_pod_name() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (tls, join) = (dir.path().join("tls"), dir.path().join("join"));
    std::fs::create_dir_all(&tls)?;
    std::fs::create_dir_all(&join)?;
    for id in [2, 4] {
        std::fs::write(tls.join(format!("replica-{id}.pem")), "")?;
        std::fs::write(tls.join(format!("replica-{id}-key.pem")), "")?;
    }
    let volume = dir.path().join("rota-1-volume");
    let first = start_replica(&volume, &tls, &join, "rota-1")?;
    let peers = "1=rota-0.rota.prod.svc:7000,2=rota-1.rota.prod.svc:7000,3=rota-2.rota.prod.svc:7000";
    ensure!(first.contains("--id 2 ") && first.contains(peers) && !first.contains("--join"), "founding start: {first}");
    ensure!(std::fs::read_to_string(volume.join("replica-id"))?.trim() == "2");
    std::fs::create_dir_all(volume.join("replica"))?;
    ensure!(start_replica(&volume, &tls, &join, "rota-1")? == first, "a restart keeps its id");

    // The volume is lost: the pod does not come back as replica 2 ...
    let wiped = dir.path().join("rota-1-new-volume");
    std::fs::create_dir_all(wiped.join("replica"))?;
    let refused = start_replica(&wiped, &tls, &join, "rota-1").expect_err("data without an id is refused");
    ensure!(refused.to_string().contains("replica-id"), "{refused}");
    std::fs::remove_dir_all(wiped.join("replica"))?;
    // ... but joins under the id the operator gave it.
    std::fs::write(join.join("rota-1"), "4\n")?;
    let rejoined = start_replica(&wiped, &tls, &join, "rota-1")?;
    ensure!(
        rejoined.contains("--id 4 ")
            && rejoined.contains("--peers 4=rota-1.rota.prod.svc:7000,1=rota-0.rota.prod.svc:7000,3=rota-2.rota.prod.svc:7000 ")
            && rejoined.contains("--join"),
        "{rejoined}"
    );
    std::fs::remove_file(join.join("rota-1"))?;
    ensure!(start_replica(&wiped, &tls, &join, "rota-1")? == rejoined, "the joined id is kept once written");

    let extra = start_replica(&dir.path().join("rota-3-volume"), &tls, &join, "rota-3").expect_err("past the founders");
    ensure!(extra.to_string().contains("rota-replica-join"), "{extra}");
    let no_cert = start_replica(&dir.path().join("rota-0-volume"), &tls, &join, "rota-0").expect_err("replica 1 has no certificate");
    ensure!(no_cert.to_string().contains("no certificate for replica 1"), "{no_cert}");
    Ok(())
}
