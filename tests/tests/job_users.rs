//! Ranks run as the local user who submitted them: real local accounts
//! (useradd), a replica with users, an agent started `--job-users owner`.
//! Needs root (to create accounts and change user); CI runs as root, and
//! there the test never skips.
//!
//! Prevents every job running as the agent (root): before, a job of any
//! user ran as root (checked on commit 6c59791: `id -u` printed 0 for
//! alice's job), and a user named after a system account got its rights.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{rota_bin, ClusterOptions, LocalCluster};
use rota_e2e::{wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use rota_tls::IdentityKind;

const WAIT: Duration = Duration::from_secs(60);

/// Local accounts made for the test, removed when it ends.
struct Accounts(Vec<String>);

impl Accounts {
    fn add(&mut self, name: &str, system: bool) -> Result<u32> {
        let _ = Command::new("userdel").arg(name).output();
        let mut useradd = Command::new("useradd");
        useradd.args(["--no-create-home", "--shell", "/bin/sh"]);
        if system {
            useradd.arg("--system");
        }
        let output = useradd.arg(name).output().context("running useradd (package passwd)")?;
        ensure!(output.status.success(), "useradd {name}: {}", String::from_utf8_lossy(&output.stderr));
        self.0.push(name.to_string());
        let id = Command::new("id").args(["-u", name]).output()?;
        Ok(String::from_utf8_lossy(&id.stdout).trim().parse()?)
    }
}

impl Drop for Accounts {
    fn drop(&mut self) {
        for name in &self.0 {
            let _ = Command::new("userdel").arg(name).output();
        }
    }
}

fn rota_as(cluster: &LocalCluster, user: &str, args: &[&str]) -> Result<Output> {
    Ok(Command::new(rota_bin()?)
        .args(cluster.pki.flags(IdentityKind::User, user)?)
        .args(["--endpoints", &cluster.endpoints_csv(), "--output", "json"])
        .args(args)
        .output()?)
}

fn ok(output: Output, what: &str) -> Result<serde_json::Value> {
    ensure!(output.status.success(), "{what}: {}", String::from_utf8_lossy(&output.stderr));
    Ok(serde_json::from_slice(&output.stdout).unwrap_or(serde_json::Value::Null))
}

fn submit(cluster: &LocalCluster, user: &str, marks: &Path) -> Result<u64> {
    let script = format!("id -u > {0}/uid-$ROTA_JOB_ID; id -G > {0}/groups-$ROTA_JOB_ID; touch exit.json stop.json", marks.display());
    let submitted = ok(rota_as(cluster, user, &["submit", "--group", "vision", "--gpus", "1", "--", "sh", "-c", &script])?, "submit")?;
    submitted["job_id"].as_u64().context("job id")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ranks_run_as_their_owners_and_never_as_root_or_a_system_account() -> Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            bail!("this test needs root (it creates local users); CI runs as root");
        }
        eprintln!("skipped: needs root to create local users");
        return Ok(());
    }
    let suffix = std::process::id() % 100_000;
    let (alice, system) = (format!("rota-alice-{suffix}"), format!("rota-sys-{suffix}"));
    let mut accounts = Accounts(Vec::new());
    let alice_uid = accounts.add(&alice, false)?;
    let system_uid = accounts.add(&system, true)?;
    ensure!(alice_uid >= 1_000 && system_uid < 1_000, "uids {alice_uid} and {system_uid}");

    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    std::fs::set_permissions(&marks, std::fs::Permissions::from_mode(0o777))?;
    let cluster = LocalCluster::start(dir.path(), 1, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let options = AgentOptions { job_users: "owner".into(), ..AgentOptions::default() };
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), options)?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    rota_e2e::wait_access_control(&cluster, WAIT).await?;
    for user in [alice.as_str(), system.as_str(), "root"] {
        ok(rota_as(&cluster, "harness", &["auth", "user", "add", user, "--role", "user", "--groups", "vision"])?, "auth user add")?;
    }
    let any = AnyReplica::new(&cluster)?;

    // Alice's job runs as alice, with her groups; the control-file names
    // it writes in its working directory change nothing.
    let job_id = submit(&cluster, &alice, &marks)?;
    let job = any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    ensure!(job.owner == alice, "the job is alice's: {job:?}");
    let uid = std::fs::read_to_string(marks.join(format!("uid-{job_id}")))?;
    ensure!(uid.trim() == alice_uid.to_string(), "the rank ran as uid {uid}, not alice's {alice_uid}");

    // A system account (uid below 1000) and root are refused, with why on
    // the rank's stderr; neither ran a thing.
    for (user, why) in [(system.as_str(), "below the minimum 1000"), ("root", "refuses root jobs")] {
        let job_id = submit(&cluster, user, &marks)?;
        let job = any.wait_job_state(job_id, pb::JobState::Failed, WAIT).await?;
        ensure!(job.exit_code == Some(126), "{user}'s refused rank exits 126: {job:?}");
        ensure!(!marks.join(format!("uid-{job_id}")).exists(), "{user}'s job ran");
        let logs = wait_until("the refusal in the rank's stderr", WAIT, || async {
            let output = rota_as(&cluster, "harness", &["logs", &job_id.to_string(), "--stderr"])?;
            let text = String::from_utf8_lossy(&output.stdout).to_string();
            Ok(text.contains(why).then_some(text))
        })
        .await?;
        ensure!(logs.contains("not started"), "{logs}");
    }
    Ok(())
}

/// `--runtime-prefix` runs each rank under a container runtime, which must
/// get the environment rota sets (rank, world, GPUs) to pass into the
/// container. A fake runtime records what it got, then runs the command.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runtime_prefix_gets_the_ranks_environment() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let runtime = dir.path().join("fake-runtime");
    std::fs::write(
        &runtime,
        "#!/bin/sh\nenv > \"$MARK_DIR/runtime-env.tmp\" && mv \"$MARK_DIR/runtime-env.tmp\" \"$MARK_DIR/runtime-env\"\nexec \"$@\"\n",
    )?;
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o755))?;
    let cluster = LocalCluster::start(dir.path(), 1, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let options = AgentOptions { extra_args: vec!["--runtime-prefix".into(), runtime.display().to_string()], ..AgentOptions::default() };
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), options)?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;
    let job_id = any.submit(rota_e2e::shell_job(1, 2, &marks, "echo ran > \"$MARK_DIR/ran\"")).await?.job_id;
    any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    ensure!(marks.join("ran").exists(), "the command ran under the runtime");
    let env = rota_e2e::read_env(&marks.join("runtime-env"))?;
    for name in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ROTA_JOB_ID"] {
        ensure!(env.contains_key(name), "the runtime did not get {name}: {env:?}");
    }
    ensure!(env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"], "{env:?}");
    ensure!(env["ROTA_JOB_ID"] == job_id.to_string());
    Ok(())
}
