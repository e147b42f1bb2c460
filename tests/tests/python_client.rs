//! The Python client (`clients/python`, `rota_client`), end to end: the
//! package is pip-installed from the checkout into a fresh virtualenv (its
//! gRPC stubs generated while it builds), then its pytest suite runs
//! against one 3-replica TLS cluster with two fake-GPU agents: submits and
//! retried submits, filters and pages, a gang on the fake GPUs, logs,
//! cancel, bad input, refused callers, and a leader SIGKILLed in the middle
//! of a stream of submits. Then the README's Python example runs as written.
//!
//! pytest asks this harness to act on the cluster through files in a
//! control directory (`leader-address`, `kill-leader`, `restart`; see the
//! suite's conftest).
//! Python tooling comes from the tools' virtualenv (deploy/setup-debian.sh,
//! `ROTA_VENV`, by default /var/tmp/rota-venv), else from one made here
//! with the pinned versions of deploy/python-tools.txt; without either the
//! test is skipped saying so, except under `CI=true`, where it fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_client::{Client, Credentials};
use rota_e2e::{repo_root, rota_json, wait_access_control, wait_nodes_ready, wait_until};
use rota_proto::v1 as pb;
use rota_tls::IdentityKind;

const WAIT: Duration = Duration::from_secs(30);
/// The whole pytest run, cluster tests and leader kill included.
const PYTEST_LIMIT: Duration = Duration::from_secs(300);
/// Control requests answered at most per poll (pytest sends one at a time).
const MAX_REQUESTS_PER_POLL: usize = 8;
/// What the client's build and tests need from the tools' virtualenv.
const TOOLS: &[&str] = &["grpcio", "grpcio-tools", "protobuf", "pytest", "setuptools"];
/// Checks a Python has them: setuptools imported first (it replaces
/// distutils, which pip imports) and new enough to read the package's
/// license as an SPDX expression.
const TOOLS_CHECK: &str =
    "import setuptools, grpc, grpc_tools, google.protobuf, pytest, pip; assert int(setuptools.__version__.split('.')[0]) >= 77";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_passes_its_suite_against_a_real_cluster() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let Some(tools) = tools_python(scratch.path())? else { return Ok(()) };
    let python = fresh_venv_with_client(&tools, &scratch.path().join("venv"))?;

    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let _agents = [
        LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?,
        LocalAgent::start(dir.path(), "node-b", &cluster.endpoints_csv(), AgentOptions::default())?,
    ];
    wait_access_control(&cluster, WAIT).await?;
    wait_nodes_ready(&cluster, 2, WAIT).await?;
    for (user, role) in [("alice", "user"), ("vera", "viewer")] {
        rota_json(&cluster, &["auth", "user", "add", user, "--role", role, "--groups", "vision"])?;
    }
    // The template the suite submits from (templates need cluster version 7;
    // priority changes 10, the newest).
    let template = ["template", "save", "py-asr", "--group", "vision", "--gpus", "2", "--runtime-limit-s", "600", "--label", "team=asr"];
    wait_until("cluster version 10 or later", WAIT, || async {
        Ok(rota_json(&cluster, &["cluster"]).ok().filter(|c| c["cluster_version"].as_u64() >= Some(11)).map(|_| ()))
    })
    .await?;
    rota_json(&cluster, &[&template[..], &["--", "true"]].concat())?;
    let alice_token = token(&cluster, "alice").await?;
    let viewer_token = token(&cluster, "vera").await?;
    let alice = cluster.pki.files(IdentityKind::User, "alice")?;
    let agent = cluster.pki.files(IdentityKind::Agent, "node-a")?;
    let replica_ids = cluster.replicas.keys().map(u64::to_string).collect::<Vec<_>>().join(",");
    let control = scratch.path().join("control");
    std::fs::create_dir_all(&control)?;
    let env: BTreeMap<&str, String> = [
        ("ROTA_ENDPOINTS", cluster.endpoints_csv()),
        ("ROTA_CA", cluster.pki.ca().display().to_string()),
        ("ROTA_CERT", alice.cert.display().to_string()),
        ("ROTA_KEY", alice.key.display().to_string()),
        ("ROTA_TOKEN", alice_token),
        ("ROTA_VIEWER_TOKEN", viewer_token),
        ("ROTA_CONTROL_DIR", control.display().to_string()),
        ("ROTA_REPLICA_IDS", replica_ids),
        ("ROTA_AGENT_CERT", agent.cert.display().to_string()),
        ("ROTA_AGENT_KEY", agent.key.display().to_string()),
        // Nothing is written into the checkout (pytest's rewritten modules).
        ("PYTHONDONTWRITEBYTECODE", "1".to_string()),
    ]
    .into_iter()
    .collect();

    let outcome = run_pytest(&python, scratch.path(), &env, &mut cluster, &control)
        .await
        .and_then(|()| readme_example_runs(&python, scratch.path(), &env));
    if outcome.is_err() {
        for id in cluster.replicas.keys() {
            eprintln!("--- replica {id}:\n{}", cluster.log_tail(*id, 4_000));
        }
    }
    outcome
}

/// Run the client's pytest suite, answering its control requests, and
/// check that every test ran and passed.
async fn run_pytest(python: &Path, scratch: &Path, env: &BTreeMap<&str, String>, cluster: &mut LocalCluster, control: &Path) -> Result<()> {
    let tests = repo_root().join("clients/python/tests");
    let log = scratch.join("pytest.log");
    let mut child = Command::new(python)
        .args(["-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs"])
        .arg(&tests)
        // Not the package's directory: `rota_client` must be the installed one.
        .current_dir(scratch)
        .envs(env)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::fs::File::options().append(true).open(&log)?)
        .spawn()
        .context("running pytest")?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > PYTEST_LIMIT {
            child.kill()?;
            child.wait()?;
            bail!("pytest ran past {PYTEST_LIMIT:?}:\n{}", std::fs::read_to_string(&log)?);
        }
        answer_control_requests(cluster, control).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let output = std::fs::read_to_string(&log)?;
    ensure!(status.success(), "pytest failed ({status}):\n{output}");
    let expected = count_tests(&tests)?;
    let summary = output.lines().rev().find(|l| l.contains(" passed")).with_context(|| format!("no pytest summary:\n{output}"))?;
    ensure!(summary.contains(&format!("{expected} passed")), "every one of the {expected} tests passes, none skipped: {summary}\n{output}");
    for word in ["skipped", "failed", "error", "deselected", "xfail", "xpass"] {
        ensure!(!summary.contains(word), "pytest's summary says {word}: {summary}\n{output}");
    }
    eprintln!("pytest: {summary}");
    Ok(())
}

/// The tests the suite defines (`def test_` in its files), so a test that
/// is silently not collected fails the run.
fn count_tests(dir: &Path) -> Result<usize> {
    let mut count = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "py") {
            count += std::fs::read_to_string(&path)?.lines().filter(|l| l.starts_with("def test_")).count();
        }
    }
    ensure!(count > 0, "no tests in {}", dir.display());
    Ok(count)
}

/// Answer pytest's requests: `N.request` holding a command, answered by
/// `N.done` (what was done) or `N.failed` (why not), each written whole.
async fn answer_control_requests(cluster: &mut LocalCluster, control: &Path) -> Result<()> {
    let mut requests: Vec<PathBuf> = std::fs::read_dir(control)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "request"))
        .collect();
    requests.sort();
    for request in requests.into_iter().take(MAX_REQUESTS_PER_POLL) {
        let command = std::fs::read_to_string(&request)?;
        let (suffix, text) = match act(cluster, command.trim()).await {
            Ok(done) => ("done", done),
            Err(error) => ("failed", format!("{error:#}")),
        };
        let staged = request.with_extension("staged");
        std::fs::write(&staged, text)?;
        std::fs::rename(&staged, request.with_extension(suffix))?;
        std::fs::remove_file(&request)?;
    }
    Ok(())
}

async fn act(cluster: &mut LocalCluster, command: &str) -> Result<String> {
    match command {
        "leader-address" => {
            let leader = cluster.wait_leader(WAIT).await?;
            Ok(cluster.replicas[&leader].addr.clone())
        }
        "kill-leader" => {
            let leader = cluster.wait_leader(WAIT).await?;
            cluster.kill(leader)?;
            Ok(format!("killed {leader}"))
        }
        "restart" => {
            let stopped: Vec<u64> = cluster.replicas.iter().filter(|(_, r)| !r.is_running()).map(|(id, _)| *id).collect();
            for id in &stopped {
                cluster.restart(*id)?;
            }
            cluster.wait_leader(WAIT).await?;
            Ok(format!("restarted {stopped:?}"))
        }
        other => bail!("unknown command {other:?}"),
    }
}

/// The README's Python example (the `python` blocks of its Portals
/// section), run as written with the installed client.
fn readme_example_runs(python: &Path, scratch: &Path, env: &BTreeMap<&str, String>) -> Result<()> {
    let readme = std::fs::read_to_string(repo_root().join("README.md"))?;
    let section = readme.split("\n## Portals").nth(1).context("a Portals section")?;
    let section = section.split("\n## ").next().unwrap_or(section);
    let blocks: Vec<&str> =
        section.split("```").enumerate().filter(|(i, _)| i % 2 == 1).filter_map(|(_, b)| b.strip_prefix("python\n")).collect();
    ensure!(!blocks.is_empty(), "the README's Portals section has a Python example");
    let script = scratch.join("readme_example.py");
    std::fs::write(&script, blocks.join("\n"))?;
    let output = Command::new(python).arg(&script).current_dir(scratch).envs(env).output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(output.status.success(), "the README's Python example failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    ensure!(
        stdout.contains("succeeded") && stdout.contains("hello from rank 0 on GPUs 0,1,2,3,4,5,6,7"),
        "the example's job runs and its log comes back: {stdout}"
    );
    Ok(())
}

/// A token for `user`, once every replica takes it (a follower behind the
/// leader refuses it until it has applied it).
async fn token(cluster: &LocalCluster, user: &str) -> Result<String> {
    let made = rota_json(cluster, &["token", "create", "--user", user, "--ttl", "1h"])?;
    let token = made["token"].as_str().context("a token")?.to_string();
    for replica in cluster.replicas.values() {
        let client = Client::new(std::slice::from_ref(&replica.addr), &cluster.pki.anonymous()?)?
            .with_credentials(Credentials::new(Some(&token), None)?);
        wait_until(&format!("replica {} takes {user}'s token", replica.id), WAIT, || async {
            let answer = client.auth_at(0).who_am_i(pb::WhoAmIRequest {}).await;
            Ok(answer.ok().filter(|a| a.get_ref().user == user).map(|_| ()))
        })
        .await?;
    }
    Ok(token)
}

/// A Python with the tools the client's build and tests need: the tools'
/// virtualenv's, else a virtualenv made in `scratch` from the pinned
/// versions; None (skip) where neither can be had, except under CI.
fn tools_python(scratch: &Path) -> Result<Option<PathBuf>> {
    let venv = std::env::var_os("ROTA_VENV").map_or_else(|| PathBuf::from("/var/tmp/rota-venv"), PathBuf::from);
    let shared = venv.join("bin/python");
    if has_tools(&shared) {
        return Ok(Some(shared));
    }
    let own = scratch.join("tools");
    let pins = pinned_tools()?;
    let made = Command::new("python3").args(["-m", "venv"]).arg(&own).status().is_ok_and(|s| s.success())
        && Command::new(own.join("bin/pip")).args(["install", "--quiet"]).args(&pins).status().is_ok_and(|s| s.success());
    if made && has_tools(&own.join("bin/python")) {
        return Ok(Some(own.join("bin/python")));
    }
    let why = format!(
        "no Python with {} (the tools' virtualenv {} lacks them, and pip install {} failed); deploy/setup-debian.sh installs them",
        TOOLS.join(", "),
        venv.display(),
        pins.join(" ")
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        bail!("{why}; CI must run the Python client's tests");
    }
    eprintln!("skipped: {why}");
    Ok(None)
}

fn has_tools(python: &Path) -> bool {
    python.exists() && Command::new(python).args(["-c", TOOLS_CHECK]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// The `NAME==VERSION` lines of deploy/python-tools.txt for [`TOOLS`].
fn pinned_tools() -> Result<Vec<String>> {
    let list = std::fs::read_to_string(repo_root().join("deploy/python-tools.txt"))?;
    let pins: Vec<String> = list
        .lines()
        .filter(|l| l.split_once("==").is_some_and(|(name, _)| TOOLS.contains(&name.trim())))
        .map(|l| l.trim().to_string())
        .collect();
    ensure!(pins.len() == TOOLS.len(), "deploy/python-tools.txt pins each of {TOOLS:?}: {pins:?}");
    Ok(pins)
}

/// A new virtualenv holding the client, installed from the checkout with
/// `pip install`; its dependencies and build tools come from `tools`'s
/// environment (linked in with a .pth file), so nothing is downloaded.
/// Its Python.
fn fresh_venv_with_client(tools: &Path, venv: &Path) -> Result<PathBuf> {
    // Without a pip of its own: the tools' pip and setuptools serve it.
    run(Command::new(tools).args(["-m", "venv", "--without-pip"]).arg(venv))?;
    let python = venv.join("bin/python");
    let paths = |python: &Path| -> Result<Vec<String>> {
        let printed = run(
            Command::new(python).args(["-c", "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['platlib'])"])
        )?;
        Ok(printed.lines().map(str::to_string).collect())
    };
    let tool_paths = paths(tools)?;
    let site = paths(&python)?.into_iter().next().context("the new virtualenv's site-packages")?;
    std::fs::write(Path::new(&site).join("rota-tools.pth"), format!("{}\n", tool_paths.join("\n")))?;
    let package = repo_root().join("clients/python");
    run(Command::new(&python).args(["-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-index"]).arg(&package))?;
    let installed =
        run(Command::new(&python).args(["-c", "import rota_client._proto.rota_pb2_grpc, rota_client; print(rota_client.__file__)"]))?;
    ensure!(Path::new(installed.trim()).starts_with(venv), "rota_client is imported from the new virtualenv, not {installed}");
    Ok(python)
}

/// Run a command to success; its stdout.
fn run(command: &mut Command) -> Result<String> {
    let output = command.output().with_context(|| format!("running {command:?}"))?;
    ensure!(
        output.status.success(),
        "{command:?} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
