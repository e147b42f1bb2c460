//! The `rota` CLI run as named users of a TLS cluster, each with its own
//! certificate, against every replica; JSON output parsed.

use std::collections::BTreeMap;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{rota_bin, LocalCluster};
use rota_tls::IdentityKind;
use serde_json::Value;

pub struct UserCli {
    endpoints: String,
    credentials: BTreeMap<String, Vec<String>>,
}

impl UserCli {
    /// Certificates for `users` (and `harness`, the cluster's founding admin).
    pub fn new(cluster: &LocalCluster, users: &[&str]) -> Result<UserCli> {
        let mut credentials = BTreeMap::new();
        for user in users.iter().chain(&["harness"]) {
            credentials.insert(user.to_string(), cluster.pki.flags(IdentityKind::User, user)?);
        }
        Ok(UserCli { endpoints: cluster.endpoints_csv(), credentials })
    }

    pub fn run(&self, user: &str, args: &[&str]) -> Result<std::process::Output> {
        std::process::Command::new(rota_bin()?)
            .args(self.credentials.get(user).with_context(|| format!("no certificate for {user}"))?)
            .args(["--endpoints", &self.endpoints, "--output", "json", "--timeout-s", "30"])
            .args(args)
            .env_remove("ROTA_TOKEN")
            .env_remove("ROTA_AS")
            .output()
            .context("running rota")
    }

    /// It must succeed; its JSON output (or its text as a JSON string).
    pub fn ok(&self, user: &str, args: &[&str]) -> Result<Value> {
        let output = self.run(user, args)?;
        ensure!(output.status.success(), "rota {args:?} as {user} failed: {}", String::from_utf8_lossy(&output.stderr));
        let stdout = String::from_utf8_lossy(&output.stdout);
        Ok(serde_json::from_str(&stdout).unwrap_or(Value::String(stdout.trim().to_string())))
    }

    /// It must fail, saying each of `why` on stderr; returns stderr.
    pub fn refused(&self, user: &str, args: &[&str], why: &[&str]) -> Result<String> {
        let output = self.run(user, args)?;
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        ensure!(!output.status.success(), "rota {args:?} as {user} was allowed: {}", String::from_utf8_lossy(&output.stdout));
        for part in why {
            ensure!(stderr.contains(part), "rota {args:?} as {user} failed without saying {part:?}: {stderr}");
        }
        Ok(stderr)
    }
}
