//! `rota template ...` and `rota budget ...`.

use anyhow::{Context as _, Result};
use rota_client::Client;
use rota_proto::v1 as pb;
use serde_json::{json, Value};

use crate::output::Format;
use crate::SpecArgs;

#[derive(Debug, clap::Subcommand)]
pub enum TemplateAction {
    /// Save a new version of a template of --group (its members may; the
    /// first save creates it).
    Save {
        name: String,
        #[command(flatten)]
        spec: Box<SpecArgs>,
    },
    /// Every template with its latest version.
    List,
    /// One template with every kept version.
    Show { name: String },
    /// Delete a template with all its versions.
    Delete { name: String },
    /// Let jobs of another group use the template (its group's group-admins
    /// and operators), or stop them with --revoke.
    Grant {
        name: String,
        #[arg(long = "to", value_name = "GROUP")]
        group: String,
        #[arg(long)]
        revoke: bool,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum BudgetAction {
    /// Set a group's GPU-hour budget of a month (operators).
    Set {
        group: String,
        /// GPU-hours; fractions allowed (0.001 is 3.6 GPU-seconds).
        #[arg(long)]
        gpu_hours: f64,
        /// YYYY-MM (UTC) [default: this month].
        #[arg(long)]
        month: Option<String>,
        /// Refuse a submit whose worst case (runtime limit x GPUs) would pass the budget.
        #[arg(long)]
        strict: bool,
    },
    /// Remove a group's budget of a month (operators).
    Remove {
        group: String,
        #[arg(long)]
        month: Option<String>,
    },
    /// Budgets of a month: used, left and the projected use at the month's end.
    Show {
        #[arg(long)]
        month: Option<String>,
        #[arg(long)]
        group: Option<String>,
    },
}

fn template_json(template: &pb::Template) -> Value {
    let versions: Vec<Value> = template
        .versions
        .iter()
        .map(|v| {
            let spec = v.spec.clone().unwrap_or_default();
            json!({
                "version": v.version,
                "saved_at": v.saved_at_ms,
                "saved_by": v.saved_by,
                "labels": v.labels,
                "queue": spec.queue,
                "replicas": spec.replicas,
                "gpus": spec.gpus_per_replica,
                "runtime_limit_s": spec.runtime_limit_s,
                "command": spec.command,
                "env": spec.env,
            })
        })
        .collect();
    json!({
        "name": template.name,
        "group": template.group,
        "latest_version": template.latest_version,
        "grants": template.grants,
        "versions": versions,
    })
}

fn print_template(template: &pb::Template, every_version: bool) {
    let grants = if template.grants.is_empty() { "none".to_string() } else { template.grants.join(",") };
    outln!("template {}  group {}  latest version {}  granted to {}", template.name, template.group, template.latest_version, grants);
    let shown =
        if every_version { template.versions.iter().collect::<Vec<_>>() } else { template.versions.iter().last().into_iter().collect() };
    for v in shown {
        let spec = v.spec.clone().unwrap_or_default();
        let mut labels: Vec<String> = v.labels.iter().map(|(k, value)| format!("{k}={value}")).collect();
        labels.sort();
        outln!(
            "  version {:>3}  {} x {} GPU  queue {}  limit {} s  by {}  labels [{}]  command {:?}",
            v.version,
            spec.replicas,
            spec.gpus_per_replica,
            spec.queue,
            spec.runtime_limit_s,
            if v.saved_by.is_empty() { "-" } else { &v.saved_by },
            labels.join(" "),
            spec.command
        );
    }
}

async fn list_templates(client: &Client, name: &str) -> Result<Vec<pb::Template>> {
    let request = pb::ListTemplatesRequest { name: name.to_string() };
    let response = client
        .retrying(|i| {
            let mut jobs = client.jobs_at(i);
            let request = request.clone();
            async move { jobs.list_templates(request).await.map(|r| r.into_inner()) }
        })
        .await?;
    Ok(response.templates)
}

fn show_templates(templates: &[pb::Template], every_version: bool, format: Format) -> Result<()> {
    match format {
        Format::Json => {
            let all: Vec<Value> = templates.iter().map(template_json).collect();
            outln!("{}", serde_json::to_string_pretty(&json!({ "templates": all }))?);
        }
        Format::Table => templates.iter().for_each(|t| print_template(t, every_version)),
    }
    Ok(())
}

pub async fn template(client: &Client, action: TemplateAction, format: Format) -> Result<()> {
    match action {
        TemplateAction::Save { name, spec } => {
            let request = pb::SaveTemplateRequest { name, spec: Some(spec.whole(&[])?), labels: spec.labels()?.into_iter().collect() };
            let saved = client
                .retrying(|i| {
                    let mut jobs = client.jobs_at(i);
                    let request = request.clone();
                    async move { jobs.save_template(request).await.map(|r| r.into_inner()) }
                })
                .await?;
            match format {
                Format::Json => outln!("{}", serde_json::to_string_pretty(&template_json(&saved))?),
                Format::Table => outln!("template {} version {}", saved.name, saved.latest_version),
            }
            Ok(())
        }
        TemplateAction::List => show_templates(&list_templates(client, "").await?, false, format),
        TemplateAction::Show { name } => {
            let found = list_templates(client, &name).await?;
            anyhow::ensure!(!found.is_empty(), "template {name} not found");
            show_templates(&found, true, format)
        }
        TemplateAction::Delete { name } => {
            let request = pb::DeleteTemplateRequest { name: name.clone() };
            client
                .retrying(|i| {
                    let mut jobs = client.jobs_at(i);
                    let request = request.clone();
                    async move { jobs.delete_template(request).await.map(|r| r.into_inner()) }
                })
                .await?;
            match format {
                Format::Json => outln!("{}", json!({ "deleted": name })),
                Format::Table => outln!("template {name} deleted"),
            }
            Ok(())
        }
        TemplateAction::Grant { name, group, revoke } => {
            let request = pb::GrantTemplateRequest { name, group, granted: !revoke };
            let template = client
                .retrying(|i| {
                    let mut jobs = client.jobs_at(i);
                    let request = request.clone();
                    async move { jobs.grant_template(request).await.map(|r| r.into_inner()) }
                })
                .await?;
            show_templates(&[template], false, format)
        }
    }
}

fn budget_json(budget: &pb::BudgetStatus) -> Value {
    json!({
        "group": budget.group,
        "month": budget.month,
        "budget_gpu_hours": budget.budget_gpu_hours,
        "strict": budget.strict,
        "used_gpu_hours": budget.used_gpu_hours,
        "left_gpu_hours": budget.left_gpu_hours,
        "projected_gpu_hours": budget.projected_gpu_hours,
        "used_ratio": budget.used_ratio,
        "exhausted": budget.exhausted,
    })
}

fn show_budgets(budgets: &[pb::BudgetStatus], format: Format) -> Result<()> {
    match format {
        Format::Json => {
            let all: Vec<Value> = budgets.iter().map(budget_json).collect();
            outln!("{}", serde_json::to_string_pretty(&json!({ "budgets": all }))?);
        }
        Format::Table => {
            outln!(
                "{:<16} {:<8} {:>14} {:>14} {:>14} {:>14} {:>6}  STATE",
                "GROUP",
                "MONTH",
                "BUDGET",
                "USED",
                "LEFT",
                "PROJECTED",
                "USED%"
            );
            for b in budgets {
                let state = match (b.exhausted, b.strict) {
                    (true, _) => "exhausted",
                    (false, true) => "strict",
                    (false, false) => "",
                };
                outln!(
                    "{:<16} {:<8} {:>14.3} {:>14.3} {:>14.3} {:>14.3} {:>6.1}  {state}",
                    b.group,
                    b.month,
                    b.budget_gpu_hours,
                    b.used_gpu_hours,
                    b.left_gpu_hours,
                    b.projected_gpu_hours,
                    b.used_ratio * 100.0
                );
            }
        }
    }
    Ok(())
}

pub async fn budget(client: &Client, action: BudgetAction, format: Format) -> Result<()> {
    let set = |request: pb::SetBudgetRequest| async move {
        client
            .retrying(|i| {
                let mut cluster = client.cluster_at(i);
                let request = request.clone();
                async move { cluster.set_budget(request).await.map(|r| r.into_inner()) }
            })
            .await
            .context("set the budget")
    };
    match action {
        BudgetAction::Set { group, gpu_hours, month, strict } => {
            let request = pb::SetBudgetRequest { group, month: month.unwrap_or_default(), gpu_hours, strict, remove: false };
            show_budgets(&[set(request).await?], format)
        }
        BudgetAction::Remove { group, month } => {
            let request =
                pb::SetBudgetRequest { group: group.clone(), month: month.unwrap_or_default(), remove: true, ..Default::default() };
            set(request).await?;
            match format {
                Format::Json => outln!("{}", json!({ "removed": group })),
                Format::Table => outln!("budget of {group} removed"),
            }
            Ok(())
        }
        BudgetAction::Show { month, group } => {
            let request = pb::ListBudgetsRequest { month: month.unwrap_or_default(), group: group.unwrap_or_default() };
            let response = client
                .retrying(|i| {
                    let mut cluster = client.cluster_at(i);
                    let request = request.clone();
                    async move { cluster.list_budgets(request).await.map(|r| r.into_inner()) }
                })
                .await?;
            show_budgets(&response.budgets, format)
        }
    }
}
