//! The Debian package (`cargo deb -p rota-cli`, built by deploy/run-tests.sh
//! into `$CARGO_TARGET_DIR/debian/`): it installs, its replica unit's
//! command runs exactly as the unit says (its `ExecStart`, as its `User`,
//! with its `EnvironmentFile`) since systemd is not PID 1 here, the replica
//! takes a submit, and the package purges cleanly.
//!
//! Needs root and the built package; under CI both must be there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::cluster::free_port;
use rota_e2e::wait_until;

const UNIT: &str = "/lib/systemd/system/rota-server.service";
/// Written by this test only: a data directory without it is not ours.
const TEST_MARK: &str = "/var/lib/rota/.written-by-package-test";

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The package, or `None` (skipped) outside CI where it or root is missing.
fn package() -> Result<Option<PathBuf>> {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| PathBuf::from("/var/tmp/rota-target"), PathBuf::from);
    let debs: Vec<PathBuf> = std::fs::read_dir(target.join("debian"))
        .map(|dir| dir.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "deb")).collect())
        .unwrap_or_default();
    let root = unsafe { libc::geteuid() } == 0;
    match (debs.as_slice(), root) {
        ([deb], true) => Ok(Some(deb.clone())),
        _ if under_ci() => {
            bail!("under CI this test needs root and one package in {}/debian (deploy/run-tests.sh builds it): {debs:?}", target.display())
        }
        _ => {
            eprintln!("skipped: needs root and one package built by `cargo deb -p rota-cli --no-build --output $CARGO_TARGET_DIR/debian/`");
            Ok(None)
        }
    }
}

fn run(command: &mut Command) -> Result<String> {
    let output = command.output().with_context(|| format!("{command:?}"))?;
    ensure!(output.status.success(), "{command:?}: {}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    Ok(String::from_utf8_lossy(&output.stdout).to_string())
}

/// `KEY=VALUE` lines of the [Service] section.
fn unit_setting(unit: &str, key: &str) -> Result<String> {
    unit.lines().find_map(|line| line.strip_prefix(&format!("{key}="))).map(str::to_string).with_context(|| format!("{UNIT} has no {key}"))
}

/// `ExecStart` as systemd expands it: `${VAR}` is one word, `$VAR` splits on spaces.
fn expand(exec_start: &str, env: &BTreeMap<String, String>) -> Result<Vec<String>> {
    let mut argv = Vec::new();
    for word in exec_start.split_whitespace() {
        if let Some(name) = word.strip_prefix("${").and_then(|w| w.strip_suffix('}')) {
            argv.push(env.get(name).with_context(|| format!("{name} is not set"))?.clone());
        } else if let Some(name) = word.strip_prefix('$') {
            argv.extend(env.get(name).map(|v| v.split_whitespace().map(str::to_string).collect::<Vec<_>>()).unwrap_or_default());
        } else {
            argv.push(word.to_string());
        }
    }
    Ok(argv)
}

struct Replica(Child);

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn certificates(dir: &Path) -> Result<()> {
    for args in [&["ca", "create"][..], &["cert", "create", "--server", "1"], &["cert", "create", "--client", "tester"]] {
        run(Command::new("/usr/bin/rota").arg("tls").args(args).arg("--dir").arg(dir))?;
    }
    // The replica runs as `rota`: it reads its key through its group.
    run(Command::new("chgrp").args(["-R", "rota"]).arg(dir))?;
    run(Command::new("chmod").args(["-R", "g+rX"]).arg(dir))?;
    run(Command::new("chmod").arg("o+x").arg(dir.parent().context("a parent")?))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_package_installs_runs_its_unit_command_and_purges() -> Result<()> {
    let Some(deb) = package()? else { return Ok(()) };
    if Path::new("/var/lib/rota/replica").exists() && !Path::new(TEST_MARK).exists() {
        bail!("/var/lib/rota/replica holds a replica this test did not write: not touching it");
    }
    run(Command::new("dpkg").arg("-i").arg(&deb).env("DEBIAN_FRONTEND", "noninteractive"))?;
    for path in ["/usr/bin/rota", "/usr/bin/rota-agent", UNIT, "/lib/systemd/system/rota-agent.service", "/etc/rota/server.env"] {
        ensure!(Path::new(path).exists(), "the package installed {path}");
    }
    run(Command::new("getent").args(["passwd", "rota"]))?;
    let unit = std::fs::read_to_string(UNIT)?;
    let (exec_start, user, env_file) =
        (unit_setting(&unit, "ExecStart")?, unit_setting(&unit, "User")?, unit_setting(&unit, "EnvironmentFile")?);
    ensure!(user == "rota" && env_file == "/etc/rota/server.env", "{user} {env_file}");

    let dir = tempfile::tempdir()?;
    let pki = dir.path().join("pki");
    std::fs::create_dir(&pki)?;
    certificates(&pki)?;
    let port = free_port()?;
    let pem = |name: &str| pki.join(name).display().to_string();
    let settings = [
        ("ROTA_ID", "1".to_string()),
        ("ROTA_LISTEN", format!("127.0.0.1:{port}")),
        ("ROTA_PEERS", format!("1=127.0.0.1:{port}")),
        ("ROTA_CA", pem("ca.pem")),
        ("ROTA_CERT", pem("replica-1.pem")),
        ("ROTA_KEY", pem("replica-1-key.pem")),
        ("ROTA_SERVER_FLAGS", "--bootstrap-admin tester".to_string()),
    ];
    let env: BTreeMap<String, String> = settings.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    std::fs::write(&env_file, settings.iter().map(|(k, v)| format!("{k}={v}\n")).collect::<String>())?;
    let _ = std::fs::remove_dir_all("/var/lib/rota/replica");
    std::fs::write(TEST_MARK, "")?;

    let argv = expand(&exec_start, &env)?;
    ensure!(argv[0] == "/usr/bin/rota" && argv.contains(&"--bootstrap-admin".to_string()), "{argv:?}");
    let replica = Replica(
        Command::new("setpriv")
            .args(["--reuid", &user, "--regid", &user, "--init-groups", "--"])
            .args(&argv)
            .envs(&env)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("replica.log"))?)
            .spawn()?,
    );
    let client = |subcommand: &str, args: &[&str]| {
        let mut command = Command::new("/usr/bin/rota");
        command.arg(subcommand).args(["--endpoints", &format!("127.0.0.1:{port}"), "--timeout-s", "2"]).args(args);
        command.env("ROTA_CA", pem("ca.pem")).env("ROTA_CERT", pem("user-tester.pem")).env("ROTA_KEY", pem("user-tester-key.pem"));
        command
    };
    let log = dir.path().join("replica.log");
    let submitted = wait_until("a submit to the packaged replica", Duration::from_secs(60), || {
        let output = client("submit", &["--request-id", "package-1", "--", "true"]).output();
        async move { Ok(output.ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())) }
    })
    .await
    .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    ensure!(!submitted.is_empty(), "the submit printed the job id");
    let data_owner = run(Command::new("stat").args(["-c", "%U", "/var/lib/rota/replica"]))?;
    ensure!(data_owner.trim() == "rota", "the replica wrote its data as rota: {data_owner}");
    drop(replica);

    run(Command::new("dpkg").args(["--purge", "rota"]).env("DEBIAN_FRONTEND", "noninteractive"))?;
    for path in ["/usr/bin/rota", "/usr/bin/rota-agent", UNIT, "/etc/rota/server.env"] {
        ensure!(!Path::new(path).exists(), "purge removed {path}");
    }
    ensure!(Command::new("getent").args(["passwd", "rota"]).output()?.status.code() == Some(2), "purge removed the rota user");
    let _ = std::fs::remove_dir_all("/var/lib/rota/replica");
    let _ = std::fs::remove_file(TEST_MARK);
    Ok(())
}
