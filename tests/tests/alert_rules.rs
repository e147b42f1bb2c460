//! The shipped Prometheus alert rules are valid (`promtool check rules`)
//! and pass their unit tests (`promtool test rules`): each alert fires when
//! it should and stays quiet when it should not.
//!
//! Needs promtool (Debian package `prometheus`, which CI installs); without
//! it the test fails under `CI=true` and is skipped otherwise.

use anyhow::{ensure, Result};
use rota_e2e::{prometheus_tool, repo_root, rule_metric_names};

fn promtool(args: &[&str]) -> Result<Option<String>> {
    let Some(promtool) = prometheus_tool("promtool")? else { return Ok(None) };
    let output = std::process::Command::new(promtool).args(args).current_dir(repo_root().join("deploy/prometheus")).output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    ensure!(output.status.success(), "promtool {args:?} failed:\n{text}");
    Ok(Some(text))
}

#[test]
fn alert_rules_are_valid() -> Result<()> {
    if let Some(text) = promtool(&["check", "rules", "rota-alerts.yml"])? {
        ensure!(text.contains("SUCCESS"), "{text}");
    }
    Ok(())
}

#[test]
fn every_alert_has_a_unit_test_and_the_tests_pass() -> Result<()> {
    let rules = std::fs::read_to_string(repo_root().join("deploy/prometheus/rota-alerts.yml"))?;
    let tests = std::fs::read_to_string(repo_root().join("deploy/prometheus/rota-alerts.test.yml"))?;
    let runbook = std::fs::read_to_string(repo_root().join("docs/runbook.md"))?;
    let alerts: Vec<&str> = rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    ensure!(alerts.len() >= 17, "only {} alerts found", alerts.len());
    for alert in &alerts {
        ensure!(tests.contains(&format!("alertname: {alert}\n")), "{alert} has no promtool test");
    }
    // Each alert points at a section of the runbook: `#anchor` is a heading
    // in lower case, as Markdown renderers make anchors.
    let anchors: Vec<String> =
        runbook.lines().filter_map(|l| l.strip_prefix("## ")).map(|heading| heading.trim().to_lowercase().replace(' ', "-")).collect();
    let pointers: Vec<&str> = rules.lines().filter_map(|l| l.trim().strip_prefix("runbook_url: docs/runbook.md#")).collect();
    ensure!(pointers.len() == alerts.len(), "{} alerts but {} runbook_url pointers", alerts.len(), pointers.len());
    for pointer in pointers {
        ensure!(anchors.iter().any(|a| a == pointer), "docs/runbook.md has no section for #{pointer}");
    }
    ensure!(rule_metric_names(&rules).contains(&"rota_job_wait_seconds_bucket".to_string()));
    if let Some(text) = promtool(&["test", "rules", "rota-alerts.test.yml"])? {
        ensure!(text.contains("SUCCESS"), "{text}");
    }
    Ok(())
}
