//! The REST/JSON API (`rota server --http-listen`), end to end: a
//! 3-replica cluster with TLS on and a fake-GPU agent, driven with `curl`
//! the way a portal or a script would, with bearer tokens and user
//! certificates. Also: the README's curl examples, and schemathesis
//! against the served OpenAPI document.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{rota_json, wait_access_control, wait_nodes_ready, wait_until};
use rota_tls::IdentityKind;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);
const PROBLEM: &str = "application/problem+json";

/// How a request authenticates.
#[derive(Clone)]
enum Auth {
    None,
    Token(String),
    /// A client certificate of this kind and name.
    Cert(IdentityKind, String),
}

/// An answer: status, content type, body.
#[derive(Debug)]
struct Answer {
    status: u16,
    content_type: String,
    body: String,
}

impl Answer {
    fn json(&self) -> Result<Value> {
        serde_json::from_str(&self.body).with_context(|| format!("not JSON ({}): {}", self.status, self.body))
    }

    /// It is a problem+json of `status`; its JSON.
    fn problem(&self, status: u16) -> Result<Value> {
        ensure!(self.status == status, "expected {status}, got {}: {}", self.status, self.body);
        ensure!(self.content_type.starts_with(PROBLEM), "a problem is {PROBLEM}, got {:?}: {}", self.content_type, self.body);
        let problem = self.json()?;
        ensure!(problem["status"] == status && problem["type"].is_string() && problem["title"].is_string(), "{problem}");
        ensure!(problem["detail"].is_string(), "{problem}");
        Ok(problem)
    }

    fn ok(&self, status: u16) -> Result<Value> {
        ensure!(self.status == status, "expected {status}, got {}: {}", self.status, self.body);
        self.json()
    }
}

struct Rest<'a> {
    cluster: &'a LocalCluster,
}

impl Rest<'_> {
    fn url(&self, replica: u64, path: &str) -> String {
        format!("https://{}{path}", self.cluster.replicas[&replica].http_addr)
    }

    /// `curl` a request; `body` goes through stdin (it may be large).
    fn call(&self, replica: u64, method: &str, path: &str, auth: &Auth, headers: &[(&str, &str)], body: Option<&[u8]>) -> Result<Answer> {
        self.call_with(&[], replica, method, path, auth, headers, body)
    }

    /// [`Rest::call`] with extra `curl` arguments.
    #[allow(clippy::too_many_arguments)]
    fn call_with(
        &self,
        curl_args: &[&str],
        replica: u64,
        method: &str,
        path: &str,
        auth: &Auth,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Result<Answer> {
        let mut command = std::process::Command::new("curl");
        command.args(curl_args);
        command
            .args(["-sS", "--max-time", "30", "-X", method, "--cacert"])
            .arg(self.cluster.pki.ca())
            .args(["-w", "\n%{http_code} %{content_type}"]);
        match auth {
            Auth::None => {}
            Auth::Token(token) => {
                command.args(["-H", &format!("Authorization: Bearer {token}")]);
            }
            Auth::Cert(kind, name) => {
                let files = self.cluster.pki.files(*kind, name)?;
                command.arg("--cert").arg(&files.cert).arg("--key").arg(&files.key);
            }
        }
        for (name, value) in headers {
            command.args(["-H", &format!("{name}: {value}")]);
        }
        if body.is_some() {
            command.args(["-H", "Content-Type: application/json", "--data-binary", "@-"]);
        }
        command.arg(self.url(replica, path)).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = command.spawn().context("running curl")?;
        let mut stdin = child.stdin.take().context("curl's stdin")?;
        if let Some(body) = body {
            // curl may stop reading once the server refused the body.
            let _ = stdin.write_all(body);
        }
        drop(stdin);
        let output = child.wait_with_output()?;
        ensure!(output.status.success(), "curl {method} {path} failed: {}", String::from_utf8_lossy(&output.stderr));
        let text = String::from_utf8_lossy(&output.stdout).to_string();
        let (body, trailer) = text.rsplit_once('\n').context("curl's trailer")?;
        let (status, content_type) = trailer.split_once(' ').unwrap_or((trailer, ""));
        Ok(Answer { status: status.parse().context("a status")?, content_type: content_type.to_string(), body: body.to_string() })
    }

    /// POST `body` with a bearer `token`, its body sent only after `delay_ms`
    /// (a slow client): the answer must wait for the body. Answered early
    /// (cancel took no body), the stream was reset under the client still
    /// sending: this failed with "curl: (52) Empty reply from server", and
    /// the board test's cancel once with "(92) Stream error in the HTTP/2
    /// framing layer".
    fn post_late_body(&self, replica: u64, path: &str, token: &str, body: &[u8], delay_ms: u64) -> Result<u16> {
        let mut child = std::process::Command::new("curl")
            .args(["-sS", "--http2", "--max-time", "30", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", "--cacert"])
            .arg(self.cluster.pki.ca())
            // `-T -` streams stdin as it comes (`--data-binary @-` reads it all first).
            .args(["-H", &format!("Authorization: Bearer {token}"), "-H", "Content-Type: application/json", "-T", "-"])
            .arg(self.url(replica, path))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running curl")?;
        let mut stdin = child.stdin.take().context("curl's stdin")?;
        // The slow client's pause, not a wait for a condition.
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = stdin.write_all(body);
        drop(stdin);
        let output = child.wait_with_output()?;
        ensure!(output.status.success(), "curl POST {path} with a late body failed: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).trim().parse().context("a status")
    }

    fn get(&self, replica: u64, path: &str, auth: &Auth) -> Result<Answer> {
        self.call(replica, "GET", path, auth, &[], None)
    }

    fn post(&self, replica: u64, path: &str, auth: &Auth, body: &Value) -> Result<Answer> {
        self.call(replica, "POST", path, auth, &[], Some(body.to_string().as_bytes()))
    }
}

/// A token for `user` (made by the founding admin), once every replica
/// has applied it (a follower behind the leader refuses it until then).
async fn token(cluster: &LocalCluster, user: &str) -> Result<String> {
    let made = rota_json(cluster, &["token", "create", "--user", user, "--ttl", "1h"])?;
    let token = made["token"].as_str().context("a token")?.to_string();
    let rest = Rest { cluster };
    for id in cluster.replicas.keys() {
        wait_until("every replica takes the new token", WAIT, || async {
            Ok((rest.get(*id, "/v1/cluster", &Auth::Token(token.clone()))?.status == 200).then_some(()))
        })
        .await?;
    }
    Ok(token)
}

fn add_user(cluster: &LocalCluster, name: &str, role: &str, groups: &str) -> Result<()> {
    rota_json(cluster, &["auth", "user", "add", name, "--role", role, "--groups", groups]).map(|_| ())
}

async fn leader_and_follower(cluster: &LocalCluster) -> Result<(u64, u64)> {
    let leader = cluster.wait_leader(WAIT).await?;
    let follower = cluster.replicas.keys().copied().find(|id| *id != leader).context("a follower")?;
    Ok((leader, follower))
}

fn submit_body(group: &str, command: &[&str], request_id: Option<&str>) -> Value {
    let mut body = json!({"spec": {"group": group, "queue": "short", "command": command}});
    if let Some(id) = request_id {
        body["request_id"] = json!(id);
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_api_serves_jobs_cluster_and_audit_with_the_grpc_rules() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_access_control(&cluster, WAIT).await?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    add_user(&cluster, "alice", "user", "vision")?;
    add_user(&cluster, "vera", "viewer", "vision")?;
    let (alice, vera, admin) = (
        Auth::Token(token(&cluster, "alice").await?),
        Auth::Token(token(&cluster, "vera").await?),
        Auth::Token(token(&cluster, "harness").await?),
    );
    let rest = Rest { cluster: &cluster };
    let result = serves_jobs_cluster_and_audit(&rest, alice, vera, admin).await;
    if result.is_err() {
        for id in cluster.replicas.keys() {
            eprintln!("--- replica {id}:\n{}", cluster.log_tail(*id, 4_000));
        }
    }
    result
}

async fn serves_jobs_cluster_and_audit(rest: &Rest<'_>, alice: Auth, vera: Auth, admin: Auth) -> Result<()> {
    let cluster = rest.cluster;
    let (leader, follower) = leader_and_follower(cluster).await?;

    // Submit on a follower (forwarded to the leader) and on the leader;
    // a retried POST with the same request id answers the same job.
    let first = rest.post(follower, "/v1/jobs", &alice, &submit_body("vision", &["sh", "-c", "echo hello-rest"], Some("r-1")))?.ok(201)?;
    let job = first["job_id"].as_u64().context("job_id")?;
    let again = rest.post(leader, "/v1/jobs", &alice, &submit_body("vision", &["sh", "-c", "echo hello-rest"], Some("r-1")))?.ok(200)?;
    ensure!(again["job_id"] == job && again["deduplicated"] == true, "a retry answers the first job: {again}");
    let reused = rest.post(leader, "/v1/jobs", &alice, &submit_body("vision", &["true"], Some("r-1")))?;
    ensure!(reused.problem(409)?["field"] == "request_id", "{}", reused.body);

    // Read it back on either replica; it runs on the fake-GPU node; its
    // stdout streams back.
    let shown = rest.get(follower, &format!("/v1/jobs/{job}"), &alice)?.ok(200)?;
    ensure!(shown["owner"] == "alice" && shown["spec"]["group"] == "vision", "{shown}");
    wait_until("the job succeeds", WAIT, || async {
        let shown = rest.get(leader, &format!("/v1/jobs/{job}"), &alice)?.ok(200)?;
        Ok((shown["state"] == "succeeded").then_some(()))
    })
    .await?;
    let logs = rest.get(follower, &format!("/v1/jobs/{job}/logs?rank=0&stream=stdout"), &alice)?;
    ensure!(logs.status == 200 && logs.body.contains("hello-rest"), "logs: {logs:?}");
    rest.get(follower, &format!("/v1/jobs/{job}/logs?rank=7"), &alice)?.problem(404)?;

    // A job too large for the node waits; `why` says so, and it cancels.
    let big = json!({"spec": {"group": "vision", "queue": "short", "gpus_per_replica": 16, "command": ["true"]}});
    let waiting = rest.post(follower, "/v1/jobs", &alice, &big)?.ok(201)?["job_id"].as_u64().context("job_id")?;
    let why = rest.get(follower, &format!("/v1/jobs/{waiting}/why"), &alice)?.ok(200)?;
    ensure!(why["state"] == "pending" && why["code"].as_str().is_some_and(|c| !c.is_empty()), "why: {why}");
    // Its owner lowers its priority, may not raise it, and a bad value names the field.
    let priority = format!("/v1/jobs/{waiting}/priority");
    let lowered = rest.post(follower, &priority, &alice, &json!({"priority": "low"}))?.ok(200)?;
    ensure!(lowered["spec"]["priority"] == "low", "{lowered}");
    rest.post(follower, &priority, &alice, &json!({"priority": "high"}))?.problem(403)?;
    ensure!(rest.post(follower, &priority, &alice, &json!({"priority": "urgent"}))?.problem(400)?["field"] == "priority");
    // The same change sent twice under one request id (a retry after a lost
    // answer) is applied once: one audit record, on the leader that applied
    // both. Before REST requests were served under their caller's id, each
    // send was a change of its own and made a record.
    let once = [("rota-request-id", "rest-lower-once")];
    let medium = json!({"priority": "medium"}).to_string();
    for _ in 0..2 {
        let answer = rest.call(follower, "POST", &priority, &admin, &once, Some(medium.as_bytes()))?;
        ensure!(answer.ok(200)?["spec"]["priority"] == "medium", "a repeat answers as the first did");
    }
    let what = format!("set priority of job {waiting} to medium");
    let audit = rest.get(leader, "/v1/audit?limit=1000", &admin)?.ok(200)?;
    let records = audit["records"].as_array().context("records")?.iter().filter(|r| r["what"] == what.as_str()).count();
    ensure!(records == 1, "{records} audit records of {what:?} for one request id: {audit}");
    let cancelled = rest.post(follower, &format!("/v1/jobs/{waiting}/cancel"), &alice, &json!({}))?.ok(200)?;
    ensure!(cancelled["state"] == "cancelled", "{cancelled}");
    // Cancel takes no body, but one sent late is read before the answer.
    let Auth::Token(alice_token) = &alice else { anyhow::bail!("alice signs in with a token") };
    let late = rest.post_late_body(follower, &format!("/v1/jobs/{waiting}/cancel"), alice_token, b"{}", 300)?;
    ensure!(late == 200 || late == 409, "a cancel with a late body: HTTP {late}");

    // Listing: filters and cursor paging over every job.
    for i in 0..5 {
        rest.post(leader, "/v1/jobs", &alice, &submit_body("vision", &["sleep", "600"], Some(&format!("page-{i}"))))?.ok(201)?;
    }
    let everything = rest.get(follower, "/v1/jobs?limit=500", &alice)?.ok(200)?;
    let all_ids: Vec<u64> = everything["jobs"].as_array().context("jobs")?.iter().filter_map(|j| j["id"].as_u64()).collect();
    ensure!(all_ids.len() == 7 && everything.get("next_cursor").is_none(), "{everything}");
    let mut paged = Vec::new();
    let mut cursor = String::new();
    for _ in 0..10 {
        let page = rest.get(follower, &format!("/v1/jobs?limit=2&cursor={cursor}"), &alice)?.ok(200)?;
        paged.extend(page["jobs"].as_array().context("jobs")?.iter().filter_map(|j| j["id"].as_u64()));
        match page["next_cursor"].as_str() {
            Some(next) => cursor = next.to_string(),
            None => break,
        }
    }
    ensure!(paged == all_ids, "pages {paged:?} != the whole list {all_ids:?}");
    let only_cancelled = rest.get(follower, "/v1/jobs?state=cancelled&queue=short&group=vision&user=alice", &alice)?.ok(200)?;
    let ids: Vec<u64> = only_cancelled["jobs"].as_array().context("jobs")?.iter().filter_map(|j| j["id"].as_u64()).collect();
    ensure!(ids == vec![waiting], "filters: {only_cancelled}");
    ensure!(rest.get(follower, "/v1/jobs?user=nobody", &alice)?.ok(200)?["jobs"].as_array().is_some_and(|j| j.is_empty()));
    ensure!(rest.get(follower, "/v1/jobs?limit=501", &alice)?.problem(400)?["field"] == "limit");
    ensure!(rest.get(follower, "/v1/jobs?state=sideways", &alice)?.problem(400)?["field"] == "state");

    // Nodes, queues, quotas, usage, cluster.
    // (Nodes and the audit trail are read from the answering replica's
    // applied state, which may trail the leader by a moment.)
    let nodes = wait_until("the node on the follower", WAIT, || async {
        let nodes = rest.get(follower, "/v1/nodes", &alice)?.ok(200)?;
        Ok((nodes["nodes"][0]["name"] == "node-a").then_some(nodes))
    })
    .await?;
    ensure!(nodes["nodes"][0]["gpus"].as_array().is_some_and(|g| g.len() == 8), "{nodes}");
    let queues = rest.get(follower, "/v1/queues", &alice)?.ok(200)?;
    ensure!(queues["queues"].as_array().is_some_and(|q| q.iter().any(|q| q["name"] == "training")), "{queues}");
    rest.get(follower, "/v1/quotas", &alice)?.ok(200)?;
    let usage = rest.get(follower, "/v1/usage", &alice)?.ok(200)?;
    ensure!(usage["lines"].is_array(), "{usage}");
    let status = rest.get(follower, "/v1/cluster", &alice)?.ok(200)?;
    ensure!(status["leader_id"] == leader && status["members"].as_array().is_some_and(|m| m.len() == 3), "{status}");
    ensure!(status["version"].as_str().is_some_and(|v| !v.is_empty()), "{status}");

    // Audit: everyone's for operators and admins, one's own for a user.
    wait_until("alice's commands in the follower's audit trail", WAIT, || async {
        let audit = rest.get(follower, "/v1/audit?limit=1000", &admin)?.ok(200)?;
        Ok(audit["records"].as_array().is_some_and(|r| r.iter().any(|r| r["user"] == "alice")).then_some(()))
    })
    .await?;
    rest.get(follower, "/v1/audit", &alice)?.problem(403)?;
    rest.get(follower, "/v1/audit?user=alice", &alice)?.ok(200)?;

    // Bad input names its field; no credentials, no role, too large, unknown job.
    let zero = json!({"spec": {"replicas": 0, "command": ["true"], "group": "vision"}});
    ensure!(rest.post(follower, "/v1/jobs", &alice, &zero)?.problem(400)?["field"] == "spec.replicas");
    let typo = json!({"spec": {"gpus": 2, "command": ["true"]}});
    ensure!(rest.post(follower, "/v1/jobs", &alice, &typo)?.problem(400)?["field"] == "spec.gpus");
    let not_json = rest.call(follower, "POST", "/v1/jobs", &alice, &[], Some(b"{not json"))?;
    ensure!(not_json.problem(400)?["field"].is_string(), "{}", not_json.body);
    rest.get(follower, "/v1/jobs", &Auth::None)?.problem(401)?;
    rest.get(follower, "/v1/jobs", &Auth::Token("rota_000000000000_00".into()))?.problem(401)?;
    rest.post(follower, "/v1/jobs", &vera, &submit_body("vision", &["true"], None))?.problem(403)?;
    rest.get(follower, "/v1/jobs", &Auth::Cert(IdentityKind::User, "mallory".into()))?.problem(403)?;
    let huge = format!(r#"{{"spec": {{"name": "{}"}}}}"#, "x".repeat(2 * 1024 * 1024));
    // Over HTTP/1.1, where curl waits for the server's go-ahead before it
    // sends a large body, and takes the early 413 (over HTTP/2 the server
    // answers early too, then resets the stream, which this curl reports
    // as an error instead of the answer).
    rest.call_with(&["--http1.1"], follower, "POST", "/v1/jobs", &alice, &[], Some(huge.as_bytes()))?.problem(413)?;
    rest.get(follower, "/v1/jobs/999999", &alice)?.problem(404)?;
    ensure!(rest.get(follower, "/v1/jobs/zero", &alice)?.problem(400)?["field"] == "job_id");
    rest.get(follower, "/v2/jobs", &alice)?.problem(404)?;

    // A user certificate works as well as a token.
    let by_cert = rest.get(follower, &format!("/v1/jobs/{job}"), &Auth::Cert(IdentityKind::User, "alice".into()))?.ok(200)?;
    ensure!(by_cert["id"] == job, "{by_cert}");

    // The OpenAPI document is served without credentials.
    let document = rest.get(follower, "/v1/openapi.json", &Auth::None)?.ok(200)?;
    ensure!(document["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "{}", document["openapi"]);
    Ok(())
}

/// `POST /v1/jobs` takes labels and a template as gRPC's SubmitJob does:
/// the template's spec with what the body sets over it, its labels under
/// the body's, the version asked for; a bad label, a version without a
/// template and an unknown template are refused as over gRPC, the field
/// named; the listing filters by label. Before REST took these fields the
/// body's `labels` was an unknown field (400); with them parsed but not
/// passed on to the service, the first submit failed with "expected 201,
/// got 400 ... spec.replicas: must be 1..=4096" (no template was used).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_submit_takes_labels_and_templates_as_grpc_does() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    wait_access_control(&cluster, WAIT).await?;
    add_user(&cluster, "alice", "user", "vision")?;
    wait_until("cluster version 7 or later", WAIT, || async {
        Ok(rota_json(&cluster, &["cluster"]).ok().filter(|c| c["cluster_version"].as_u64() >= Some(7)).map(|_| ()))
    })
    .await?;
    let alice = Auth::Token(token(&cluster, "alice").await?);
    let rest = Rest { cluster: &cluster };
    let (_, follower) = leader_and_follower(&cluster).await?;
    let save = ["template", "save", "asr", "--group", "vision", "--gpus", "2", "--runtime-limit-s", "600", "--label", "team=asr"];
    rota_json(&cluster, &[&save[..], &["--", "sh", "-c", "exit 3"]].concat())?;
    rota_json(&cluster, &[&save[..], &["--", "true"]].concat())?;

    // The latest version, with the body's labels over the template's and
    // its spec over the template's spec.
    let body = json!({"template": "asr", "labels": {"paper": "2026q4", "team": "speech"}, "spec": {"gpus_per_replica": 1}});
    let made = rest.post(follower, "/v1/jobs", &alice, &body)?.ok(201)?["job_id"].as_u64().context("job_id")?;
    let job = rest.get(follower, &format!("/v1/jobs/{made}"), &alice)?.ok(200)?;
    ensure!(job["template"] == "asr" && job["template_version"] == 2, "the job records its template version: {job}");
    let spec = &job["spec"];
    ensure!(spec["group"] == "vision" && spec["gpus_per_replica"] == 1 && spec["runtime_limit_s"] == 600, "template + override: {job}");
    ensure!(spec["command"] == json!(["true"]), "the template's command: {job}");
    ensure!(job["labels"] == json!({"paper": "2026q4", "team": "speech"}), "the body's labels over the template's: {job}");

    // An older version; labels alone, without a template.
    let older = json!({"template": "asr", "template_version": 1});
    let older = rest.post(follower, "/v1/jobs", &alice, &older)?.ok(201)?["job_id"].as_u64().context("job_id")?;
    let older = rest.get(follower, &format!("/v1/jobs/{older}"), &alice)?.ok(200)?;
    ensure!(older["template_version"] == 1 && older["spec"]["command"] == json!(["sh", "-c", "exit 3"]), "{older}");
    let mut plain = submit_body("vision", &["true"], None);
    plain["labels"] = json!({"team": "nlp"});
    let plain = rest.post(follower, "/v1/jobs", &alice, &plain)?.ok(201)?["job_id"].as_u64().context("job_id")?;
    let listed = rest.get(follower, "/v1/jobs?label=team=nlp", &alice)?.ok(200)?;
    let ids: Vec<u64> = listed["jobs"].as_array().context("jobs")?.iter().filter_map(|j| j["id"].as_u64()).collect();
    ensure!(ids == vec![plain], "the label filter: {listed}");
    ensure!(listed["jobs"][0]["labels"] == json!({"team": "nlp"}) && listed["jobs"][0].get("template").is_none(), "{listed}");

    // Refused as over gRPC, naming the field.
    let mut bad_key = submit_body("vision", &["true"], None);
    bad_key["labels"] = json!({"Team": "asr"});
    let refused = rest.post(follower, "/v1/jobs", &alice, &bad_key)?.problem(400)?;
    ensure!(refused["field"] == r#"labels["Team"]"#, "{refused}");
    let mut bad_value = submit_body("vision", &["true"], None);
    bad_value["labels"] = json!({"team": "a b"});
    ensure!(rest.post(follower, "/v1/jobs", &alice, &bad_value)?.problem(400)?["field"] == r#"labels["team"]"#);
    let mut too_many = submit_body("vision", &["true"], None);
    too_many["labels"] = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect::<serde_json::Map<_, _>>().into();
    ensure!(rest.post(follower, "/v1/jobs", &alice, &too_many)?.problem(400)?["field"] == "labels");
    let mut no_template = submit_body("vision", &["true"], None);
    no_template["template_version"] = json!(1);
    ensure!(rest.post(follower, "/v1/jobs", &alice, &no_template)?.problem(400)?["field"] == "template_version");
    rest.post(follower, "/v1/jobs", &alice, &json!({"template": "nope"}))?.problem(404)?;
    let missing = rest.post(follower, "/v1/jobs", &alice, &json!({"template": "asr", "template_version": 9}))?.problem(404)?;
    ensure!(missing["detail"].as_str().is_some_and(|d| d.contains("no version 9")), "{missing}");
    ensure!(rest.post(follower, "/v1/jobs", &alice, &json!({"labels": {"team": 1}}))?.problem(400)?["field"] == "labels.team");

    // The OpenAPI document describes the new fields.
    let document = rest.get(follower, "/v1/openapi.json", &Auth::None)?.ok(200)?;
    let fields = &document["components"]["schemas"]["SubmitRequest"]["properties"];
    ensure!(fields["labels"].is_object() && fields["template"].is_object() && fields["template_version"].is_object(), "{fields}");
    Ok(())
}

/// A REST caller can neither pass the headers replicas trust only from
/// each other nor call as a replica: what a plain user forges is refused or
/// ignored, as over gRPC.
///
/// Shown to fail without each half of the guard (`rest::inbound`): with
/// the REST listener admitting replicas as the gRPC client services do, a
/// replica certificate with `rota-actor-user: harness` read the whole audit
/// trail ("expected 403, got 200"); with every request header handed to the
/// services, alice's forged `rota-forwarded` made the follower answer 503
/// "not the leader" instead of forwarding her request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_callers_cannot_forge_replica_headers_or_identities() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    wait_access_control(&cluster, WAIT).await?;
    add_user(&cluster, "alice", "user", "vision")?;
    let alice = Auth::Token(token(&cluster, "alice").await?);
    let rest = Rest { cluster: &cluster };
    let (leader, follower) = leader_and_follower(&cluster).await?;
    let forged: &[(&str, &str)] = &[
        ("rota-actor-user", "harness"),
        ("rota-actor-impersonator", "harness"),
        ("rota-actor-from", "10.0.0.1:1"),
        ("rota-forwarded", "1"),
    ];

    // A replica's certificate does not make a REST caller a replica (whose
    // forwarded actor the services believe): refused, on the leader as on a follower.
    let as_replica = Auth::Cert(IdentityKind::Replica, "1".into());
    let as_admin: &[(&str, &str)] = &[("rota-actor-user", "harness")];
    for replica in [leader, follower] {
        rest.call(replica, "GET", "/v1/audit", &as_replica, as_admin, None)?.problem(403)?;
        let body = submit_body("admins", &["true"], None).to_string();
        rest.call(replica, "POST", "/v1/jobs", &as_replica, as_admin, Some(body.as_bytes()))?.problem(403)?;
    }
    rest.get(follower, "/v1/jobs", &Auth::Cert(IdentityKind::Agent, "node-a".into()))?.problem(403)?;

    // A plain user's forged actor headers are ignored: still alice, with
    // alice's rights; a forged `rota-forwarded` does not stop the follower
    // from forwarding to the leader.
    rest.call(follower, "GET", "/v1/audit", &alice, forged, None)?.problem(403)?;
    rest.call(follower, "POST", "/v1/jobs", &alice, forged, Some(submit_body("admins", &["true"], None).to_string().as_bytes()))?
        .problem(403)?;
    let job = rest
        .call(follower, "POST", "/v1/jobs", &alice, forged, Some(submit_body("vision", &["true"], None).to_string().as_bytes()))?
        .ok(201)?["job_id"]
        .as_u64()
        .context("job_id")?;
    let shown = rest.call(follower, "GET", &format!("/v1/jobs/{job}"), &alice, forged, None)?.ok(200)?;
    ensure!(shown["owner"] == "alice", "the forged actor took: {shown}");
    let audit = rest.get(follower, "/v1/audit?user=alice", &alice)?.ok(200)?;
    let records = audit["records"].as_array().context("records")?;
    ensure!(records.iter().all(|r| r["impersonator"] == "" && r["from"] != "10.0.0.1:1"), "forged audit fields: {audit}");

    // `rota-as` is honoured as over gRPC: only with the impersonate right.
    rest.call(follower, "GET", "/v1/jobs", &alice, &[("rota-as", "harness")], None)?.problem(403)?;
    Ok(())
}

/// The per-identity request rate applies to REST callers as to gRPC ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_callers_are_rate_limited_per_identity() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let options = ClusterOptions {
        server_args: ["--user-requests-per-s", "5", "--user-burst", "10"].map(String::from).to_vec(),
        ..ClusterOptions::default()
    };
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    wait_access_control(&cluster, WAIT).await?;
    add_user(&cluster, "alice", "user", "vision")?;
    let alice = token(&cluster, "alice").await?;
    let rest = Rest { cluster: &cluster };
    let (_, follower) = leader_and_follower(&cluster).await?;
    // 60 requests on one connection, far faster than 5/s: past the burst
    // (less what waiting for the token took), they are refused with 429
    // and a Retry-After.
    let config = dir.path().join("many.curl");
    let mut lines = String::new();
    for _ in 0..60 {
        lines.push_str(&format!("url = \"{}\"\noutput = \"/dev/null\"\n", rest.url(follower, "/v1/queues")));
    }
    std::fs::write(&config, lines)?;
    let output = std::process::Command::new("curl")
        .args(["-sS", "--cacert"])
        .arg(cluster.pki.ca())
        .args(["-H", &format!("Authorization: Bearer {alice}"), "-w", "%{http_code}\n", "--config"])
        .arg(&config)
        .output()?;
    let codes = String::from_utf8_lossy(&output.stdout).to_string();
    let refused = codes.lines().filter(|c| *c == "429").count();
    let served = codes.lines().filter(|c| *c == "200").count();
    ensure!(refused > 0 && served > 0 && refused + served == 60, "codes: {codes}");
    let limited = rest.get(follower, "/v1/queues", &Auth::Token(alice))?;
    if limited.status == 429 {
        ensure!(limited.problem(429)?["retry_after_ms"].as_u64().is_some(), "{}", limited.body);
    }
    Ok(())
}

/// The README's "Portals" curl examples, run as written against a cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_portal_examples_run() -> Result<()> {
    let examples = readme_examples()?;
    ensure!(examples.len() >= 3, "the README's Portals section has its curl examples: {examples:?}");
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    wait_access_control(&cluster, WAIT).await?;
    add_user(&cluster, "alice", "user", "vision")?;
    let (leader, _) = leader_and_follower(&cluster).await?;
    let env = [
        ("ROTA_URL", format!("https://{}", cluster.replicas[&leader].http_addr)),
        ("ROTA_CA", cluster.pki.ca().display().to_string()),
        ("ROTA_TOKEN", token(&cluster, "alice").await?),
    ];
    let script = format!("set -euo pipefail\n{}\n", examples.join("\n"));
    let output =
        std::process::Command::new("bash").arg("-c").arg(&script).envs(env.iter().map(|(k, v)| (k, v))).current_dir(dir.path()).output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(output.status.success(), "the README's examples failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    ensure!(stdout.contains("\"job_id\"") && stdout.contains("\"cancelled\""), "the examples submit and cancel: {stdout}");
    Ok(())
}

/// The shell blocks of the README's Portals section.
fn readme_examples() -> Result<Vec<String>> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))?;
    let section = readme.split("\n## Portals").nth(1).context("a Portals section")?;
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut blocks = Vec::new();
    for (i, part) in section.split("```").enumerate() {
        if i % 2 == 1 && (part.starts_with("sh\n") || part.starts_with("bash\n")) {
            blocks.push(part.split_once('\n').map(|(_, body)| body.to_string()).unwrap_or_default());
        }
    }
    Ok(blocks)
}

/// The schemathesis command: from `ROTA_SCHEMATHESIS` (a path), the
/// virtualenv deploy/setup-debian.sh makes (`ROTA_VENV`, by default
/// /var/tmp/rota-venv), or one made here with `pip install schemathesis`.
/// None when none can be had.
fn schemathesis(dir: &Path) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ROTA_SCHEMATHESIS") {
        return Some(PathBuf::from(path));
    }
    let shared = std::env::var_os("ROTA_VENV").map_or_else(|| PathBuf::from("/var/tmp/rota-venv"), PathBuf::from).join("bin/schemathesis");
    if shared.exists() {
        return Some(shared);
    }
    let venv = dir.join("venv");
    let made = std::process::Command::new("python3").arg("-m").arg("venv").arg(&venv).status().ok()?.success()
        && std::process::Command::new(venv.join("bin/pip")).args(["install", "--quiet", "schemathesis"]).status().ok()?.success();
    made.then(|| venv.join("bin/schemathesis"))
}

/// schemathesis drives every operation of the served OpenAPI document with
/// generated input (valid and not), as an admin: no answer is a 5xx, and
/// every answer matches the document's schemas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_errors_or_schema_violations() -> Result<()> {
    let tools = tempfile::tempdir()?;
    let Some(schemathesis) = schemathesis(tools.path()) else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            bail!("schemathesis could not be installed (pip install schemathesis), and CI must run it");
        }
        eprintln!("skipped: schemathesis could not be installed (pip install schemathesis)");
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_access_control(&cluster, WAIT).await?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let admin = token(&cluster, "harness").await?;
    let (_, follower) = leader_and_follower(&cluster).await?;
    let base = format!("https://{}", cluster.replicas[&follower].http_addr);
    let output = std::process::Command::new(&schemathesis)
        .args(["run", &format!("{base}/v1/openapi.json"), "--url", &base])
        .args(["--header", &format!("Authorization: Bearer {admin}")])
        .args(["--checks", "not_a_server_error,response_schema_conformance,content_type_conformance"])
        // The event stream never ends by itself (its answers are tested by events.rs).
        .args(["--exclude-path", "/v1/events"])
        .arg("--tls-verify")
        .arg(cluster.pki.ca())
        // Bounded: examples per operation, seconds per request and in all.
        .args(["--max-examples", "10", "--request-timeout", "20", "--max-time", "90", "--max-failures", "5"])
        .args(["--phases", "examples,coverage,fuzzing", "--seed", "1"])
        .env("NO_COLOR", "1")
        .current_dir(tools.path())
        .output()
        .context("running schemathesis")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(output.status.success(), "schemathesis found failures:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    Ok(())
}
