//! Golden scenarios for the policy, as datadriven text files under
//! `tests/golden/`, one `#[test]` per file.
//!
//! A file is a sequence of test cases. A case is a command line, its input
//! lines, a `----` line and the expected output, which ends at the first blank
//! line (or the end of the file). Lines starting with `#` outside a case are
//! comments; inside an input they are ignored. The cases of a file run in
//! order against one cluster, built through `ClusterState::apply_proposal`
//! exactly as the replicated log would build it:
//!
//! ```text
//! # order: a short-queue job goes ahead of an earlier training job.
//!
//! cluster
//! node n1 gpus=8
//! ----
//! ok
//!
//! jobs
//! job busy gpus=6 limit=10h submit=0s
//!   running since=0s on=n1:0-5
//! job quick queue=short gpus=2 limit=20m submit=20s
//! ----
//! job 1 busy: running
//! job 2 quick: pending
//!
//! plan now=30s
//! ----
//! place quick n1:6-7
//! ```
//!
//! Commands (defaults in brackets):
//! - `cluster`: `node NAME gpus=N [rack=r1] [leaf=r1] [model=H100]
//!   [memory_mib=81920] [nvlink=0 (GPUs per NVLink domain, 0 = PCIe only)]
//!   [unhealthy=GPUS] [draining]`.
//! - `queues`: `queue NAME weight=N max_gpus_per_job=N default_runtime=T
//!   max_runtime=T preemptible=BOOL protected_runtime=T`; a queue that exists
//!   (`short`, `training`, `service`) keeps the fields not given.
//! - `quotas`: `quota GROUP gpus=N [per_model=MODEL:N,..] [lend=true]
//!   [lend_to=GROUP,..] [borrow_limit=N]`.
//! - `budgets`: `budget GROUP gpu_hours=H [strict=true]`, for the month
//!   holding the cluster's time (the first raises the cluster version to
//!   the one that meters GPU use).
//! - `tune`: one JSON object of `PolicyConfig` fields, as `rota sim --tune`
//!   takes; it applies to the plans after it.
//! - `policy [canary_queue=Q | canary_group=G]`: one JSON object of policy
//!   document fields (`rota policy apply`), applied as the next version
//!   (staged for that queue's or group's jobs with a canary). The first
//!   raises the cluster version to the one with policy documents; from then
//!   on `plan` runs the leader's pass under the state's documents (not
//!   combined with `tune`).
//! - `jobs`: `job NAME gpus=N (per rank) submit=T [group=a] [queue=training]
//!   [priority=medium] [priority_ttl=T] [replicas=1] [model=M]
//!   [min_memory_mib=N] [limit=T]`, optionally followed by
//!   `running since=T on=NODE:GPUS [on=NODE:GPUS ..] [checkpoint=T]` (one
//!   `on` per rank). The submits, starts and checkpoints are applied in time
//!   order. Prints each job's id (reasons name jobs by id) and state.
//! - `idle`: `queue NAME after=T action=flag|reclaim` sets a queue's idle
//!   rule; `report JOB since=T at=T [rank=0]` is the agent's report, at
//!   `at`, that the job's rank has been idle since `since` (`busy` instead
//!   of `since=T`: it turned busy). The first raises the cluster version to
//!   the one with idle records. Prints each running job's committed idle
//!   time (`JOB idle since T`, `JOB busy`).
//! - `plan now=T`: one pass of the policy; prints the placements
//!   (`place JOB NODE:GPUS ..`), the stops (`stop JOB REASON`) and the notes
//!   of the jobs left pending (`pending JOB [start=T] CODE: DETAIL`), each in
//!   the plan's order (`empty plan` if it has none). The cluster is not
//!   changed.
//!
//! Times and durations take a unit: `90s`, `20m`, `2h`, `1d` (`ms` too where
//! whole seconds are not needed); GPU sets are indexes and ranges: `0-3,6`.
//! Unknown commands and keys, repeated keys and bad values are errors naming
//! the file, the line and the field.
//!
//! To accept the actual output as the new expected output (after a deliberate
//! change of the policy or of the rendering), rewrite the files in place:
//! `ROTA_REWRITE=1 cargo test --release -p rota-core --test policy_golden`,
//! then review the diff.

use std::collections::BTreeMap;
use std::path::PathBuf;

use rota_core::policy::{self, PolicyConfig};
use rota_core::state::auth::Actor;
use rota_core::state::idle::{IdleAction, IdlePolicy, IDLE_FROM_VERSION};
use rota_core::state::policy_doc::{CanaryScope, PolicyDocument, POLICY_DOC_FROM_VERSION};
use rota_core::state::tenancy::{month_of, MS_PER_GPU_HOUR, TENANCY_FROM_VERSION};
use rota_core::state::{
    ClusterState, Command, CommandResult, GpuInfo, GroupQuota, JobId, JobSpec, NodeRegistration, Placement, Plan, Priority, Proposal,
    QueueConfig, RankPlacement,
};

/// Lists every scenario file (without `.txt`) and makes one test of each, so
/// a failure names its scenario.
macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        mod scenario {
            $(
                #[test]
                fn $name() {
                    super::run_scenario_file(stringify!($name));
                }
            )*
        }

        const SCENARIOS: &[&str] = &[$(stringify!($name)),*];
    };
}

scenarios! {
    backfill_behind_reservation,
    budget_exhausted_skips_the_group,
    enforce_runtime_limit,
    feasibility_model_and_memory,
    gang_all_or_nothing,
    idle_reclaim_at_the_queues_time,
    order_priority_expiry,
    order_priority_then_submit,
    order_quota_does_not_reorder,
    order_quota_points,
    order_short_queue_first,
    order_starving_job_first,
    placement_unhealthy_gpus_never_free,
    policy_canary_orders_one_queue,
    preempt_cheapest_victim_lost_work,
    preempt_cheapest_victim_priority,
    preempt_lower_priority_own_group,
    preempt_never_service,
    preempt_only_after_wait,
    preempt_protected_runtime,
    preempt_waits_for_lost_work,
    quota_borrow_idle_guarantee,
    quota_borrow_limit,
    quota_lend_to,
    reclaim_borrowed_guarantee,
    reserve_infeasible_head_yields,
    topology_nvlink_domain,
    topology_smallest_domain,
}

const REWRITE_VAR: &str = "ROTA_REWRITE";

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn rewrite_requested() -> bool {
    std::env::var_os(REWRITE_VAR).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Runs one scenario file: compares every case's output with the expected
/// block, or rewrites the expected blocks when `ROTA_REWRITE` is set.
fn run_scenario_file(name: &str) {
    let path = golden_dir().join(format!("{name}.txt"));
    let label = format!("tests/golden/{name}.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{label}: cannot read: {e}"));
    let outcome = run_document(&label, &text).unwrap_or_else(|e| panic!("{e}"));
    if rewrite_requested() {
        if outcome.rewritten != text {
            std::fs::write(&path, &outcome.rewritten).unwrap_or_else(|e| panic!("{label}: cannot rewrite: {e}"));
        }
        return;
    }
    assert!(
        outcome.mismatches.is_empty(),
        "{}\n\nIf the new output is right, run with {REWRITE_VAR}=1 to rewrite the expected blocks, then review the diff.",
        outcome.mismatches.join("\n\n")
    );
}

/// What running a document gave: the document with every expected block
/// replaced by the actual output, and a message per case whose output differs.
struct Outcome {
    rewritten: String,
    mismatches: Vec<String>,
}

/// Runs every case of a document against one fresh cluster. A malformed
/// document or a scenario that cannot be built is an error, not a mismatch:
/// rewriting cannot fix it.
fn run_document(label: &str, text: &str) -> Result<Outcome, String> {
    let at = |e: LineError| format!("{label}:{}: {}", e.line, e.message);
    let document = datadriven::parse(text).map_err(at)?;
    let mut scenario = Scenario::new();
    let mut outputs = Vec::new();
    let mut mismatches = Vec::new();
    for case in &document.cases {
        let actual = scenario.run(case).map_err(at)?;
        if !actual.is_empty() && actual.split('\n').any(str::is_empty) {
            return Err(format!("{label}:{}: {}: output has a blank line, which would end the block", case.line, case.command));
        }
        let expected = case.expected.join("\n");
        if actual != expected {
            mismatches.push(format!(
                "{label}:{}: `{}` output differs\n--- expected\n{expected}\n+++ actual\n{actual}",
                case.line,
                case.command_line.trim()
            ));
        }
        outputs.push(actual);
    }
    Ok(Outcome { rewritten: document.rewrite(&outputs), mismatches })
}

/// An error at one line of a document (1-based).
#[derive(Debug)]
struct LineError {
    line: usize,
    message: String,
}

impl LineError {
    fn new(line: usize, message: impl Into<String>) -> LineError {
        LineError { line, message: message.into() }
    }
}

/// The datadriven file format: cases of a command line, input lines, `----`
/// and an expected block; and the rewrite of expected blocks in place.
mod datadriven {
    use std::ops::Range;

    use super::LineError;

    pub const SEPARATOR: &str = "----";

    pub struct Case<'a> {
        /// Line number (1-based) of the command line.
        pub line: usize,
        pub command_line: &'a str,
        /// The command line's first word.
        pub command: &'a str,
        /// The rest of the command line.
        pub args: &'a str,
        /// Input lines with their numbers; blank and `#` lines left out.
        pub input: Vec<(usize, &'a str)>,
        pub expected: Vec<&'a str>,
        /// Indexes (0-based) of the expected block's lines in the document.
        expected_at: Range<usize>,
    }

    pub struct Document<'a> {
        lines: Vec<&'a str>,
        ends_with_newline: bool,
        pub cases: Vec<Case<'a>>,
    }

    pub fn parse(text: &str) -> Result<Document<'_>, LineError> {
        if let Some(n) = text.lines().position(|l| l.ends_with('\r')) {
            return Err(LineError::new(n + 1, "carriage return: golden files use Unix line ends"));
        }
        let lines: Vec<&str> = text.lines().collect();
        let mut cases = Vec::new();
        let mut i = 0;
        while i < lines.len() {
            let line = lines[i];
            if line.trim().is_empty() || line.starts_with('#') {
                i += 1;
                continue;
            }
            let case = parse_case(&lines, i)?;
            i = case.expected_at.end;
            cases.push(case);
        }
        Ok(Document { lines, ends_with_newline: text.ends_with('\n'), cases })
    }

    /// The case whose command line is `lines[start]`.
    fn parse_case<'a>(lines: &[&'a str], start: usize) -> Result<Case<'a>, LineError> {
        let command_line = lines[start];
        if command_line.starts_with(char::is_whitespace) {
            return Err(LineError::new(start + 1, "a command line must not be indented (is an input line missing its command?)"));
        }
        let (command, args) = command_line.split_once(char::is_whitespace).unwrap_or((command_line, ""));
        let separator = (start + 1..lines.len()).find(|&i| lines[i] == SEPARATOR).ok_or_else(|| {
            LineError::new(start + 1, format!("{command}: no `{SEPARATOR}` line ends its input (a blank line ends the expected output)"))
        })?;
        let input = (start + 1..separator)
            .map(|i| (i + 1, lines[i]))
            .filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
            .collect();
        let end = (separator + 1..lines.len()).find(|&i| lines[i].trim().is_empty()).unwrap_or(lines.len());
        Ok(Case {
            line: start + 1,
            command_line,
            command,
            args,
            input,
            expected: lines[separator + 1..end].to_vec(),
            expected_at: separator + 1..end,
        })
    }

    impl Document<'_> {
        /// The document with each case's expected block replaced by the
        /// corresponding output; every other byte is kept.
        pub fn rewrite(&self, outputs: &[String]) -> String {
            assert_eq!(outputs.len(), self.cases.len(), "one output per case");
            let mut out: Vec<&str> = Vec::with_capacity(self.lines.len());
            let mut next = 0;
            for (case, output) in self.cases.iter().zip(outputs) {
                out.extend_from_slice(&self.lines[next..case.expected_at.start]);
                if !output.is_empty() {
                    out.extend(output.split('\n'));
                }
                next = case.expected_at.end;
            }
            out.extend_from_slice(&self.lines[next..]);
            let mut text = out.join("\n");
            if self.ends_with_newline {
                text.push('\n');
            }
            text
        }
    }
}

/// `key=value` arguments of a command or input line, and the parsing of
/// their values. Messages name the key; callers add the line.
mod args {
    use std::collections::BTreeMap;

    pub struct Arg<'a> {
        pub key: &'a str,
        /// `None` for a bare flag (`draining`).
        pub value: Option<&'a str>,
    }

    /// Splits `words` into arguments; a key may appear once unless it is in
    /// `repeatable`.
    pub fn split<'a>(words: &[&'a str], repeatable: &[&str]) -> Result<Vec<Arg<'a>>, String> {
        let mut seen = Vec::new();
        let mut args = Vec::new();
        for word in words {
            let (key, value) = match word.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (*word, None),
            };
            if key.is_empty() {
                return Err(format!("{word:?} has no key before `=`"));
            }
            if seen.contains(&key) && !repeatable.contains(&key) {
                return Err(format!("{key} is given twice"));
            }
            seen.push(key);
            args.push(Arg { key, value });
        }
        Ok(args)
    }

    pub fn unknown(arg: &Arg, known: &[&str]) -> String {
        format!("unknown key {:?} (known: {})", arg.key, known.join(", "))
    }

    pub fn text<'a>(arg: &Arg<'a>) -> Result<&'a str, String> {
        match arg.value {
            Some(v) if !v.is_empty() => Ok(v),
            _ => Err(format!("{}: expected {}=VALUE", arg.key, arg.key)),
        }
    }

    pub fn number<T: std::str::FromStr>(arg: &Arg) -> Result<T, String> {
        let v = text(arg)?;
        v.parse().map_err(|_| format!("{}: expected a whole number, got {v:?}", arg.key))
    }

    /// `true`/`false`, or a bare key for true.
    pub fn flag(arg: &Arg) -> Result<bool, String> {
        match arg.value {
            None | Some("true") => Ok(true),
            Some("false") => Ok(false),
            Some(v) => Err(format!("{}: expected true or false, got {v:?}", arg.key)),
        }
    }

    /// A time or duration with a unit (`ms`, `s`, `m`, `h`, `d`), in ms.
    pub fn millis(arg: &Arg) -> Result<u64, String> {
        let v = text(arg)?;
        rota_core::state::idle::parse_duration_ms(v)
            .map_err(|_| format!("{}: expected a time with a unit such as 90s, 20m, 2h or 1d, got {v:?}", arg.key))
    }

    /// A duration in whole seconds (the unit of the specs' fields).
    pub fn seconds(arg: &Arg) -> Result<u64, String> {
        let ms = millis(arg)?;
        if ms % 1000 != 0 {
            return Err(format!("{}: must be whole seconds", arg.key));
        }
        Ok(ms / 1000)
    }

    /// GPU indexes and ranges: `0-3,6`.
    pub fn gpu_set(key: &str, v: &str) -> Result<Vec<u32>, String> {
        let bad = || format!("{key}: expected GPU indexes and ranges such as 0-3,6, got {v:?}");
        let mut gpus = Vec::new();
        for item in v.split(',') {
            match item.split_once('-') {
                Some((a, b)) => {
                    let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                    if a > b {
                        return Err(bad());
                    }
                    gpus.extend(a..=b);
                }
                None => gpus.push(item.parse().map_err(|_| bad())?),
            }
        }
        Ok(gpus)
    }

    /// Comma-separated names: `c,d`.
    pub fn names(arg: &Arg) -> Result<Vec<String>, String> {
        let v = text(arg)?;
        if v.split(',').any(str::is_empty) {
            return Err(format!("{}: expected comma-separated names, got {v:?}", arg.key));
        }
        Ok(v.split(',').map(String::from).collect())
    }

    /// GPUs per model: `A100:4,H100:2`.
    pub fn per_model(arg: &Arg) -> Result<BTreeMap<String, u32>, String> {
        let v = text(arg)?;
        let bad = || format!("{}: expected MODEL:GPUS pairs such as A100:4,H100:2, got {v:?}", arg.key);
        let mut map = BTreeMap::new();
        for item in v.split(',') {
            let (model, n) = item.split_once(':').ok_or_else(bad)?;
            if model.is_empty() || map.insert(model.to_string(), n.parse().map_err(|_| bad())?).is_some() {
                return Err(bad());
            }
        }
        Ok(map)
    }

    /// Compact text of a GPU set: runs of consecutive indexes as ranges.
    pub fn render_gpus(gpus: &[u32]) -> String {
        let mut parts: Vec<String> = Vec::new();
        let mut i = 0;
        while i < gpus.len() {
            let mut j = i;
            while j + 1 < gpus.len() && gpus[j + 1] == gpus[j] + 1 {
                j += 1;
            }
            parts.push(if j > i { format!("{}-{}", gpus[i], gpus[j]) } else { gpus[i].to_string() });
            i = j + 1;
        }
        parts.join(",")
    }

    /// A time in ms, in seconds where it is whole seconds.
    pub fn render_millis(ms: u64) -> String {
        if ms.is_multiple_of(1000) {
            format!("{}s", ms / 1000)
        } else {
            format!("{ms}ms")
        }
    }
}

/// An input line: its kind (`node`, `job`, ...), the name after it and its
/// arguments.
struct InputLine<'a> {
    number: usize,
    kind: &'a str,
    name: &'a str,
    words: Vec<&'a str>,
}

impl<'a> InputLine<'a> {
    /// Splits a line of the form `KIND NAME key=value ...`.
    fn named(number: usize, text: &'a str, kind: &str) -> Result<InputLine<'a>, LineError> {
        let line = InputLine::unnamed(number, text)?;
        if line.kind != kind {
            return Err(LineError::new(number, format!("expected a `{kind} NAME ...` line, got {:?}", line.kind)));
        }
        let Some((name, words)) = line.words.split_first() else {
            return Err(LineError::new(number, format!("{kind}: a name must follow `{kind}`")));
        };
        if name.contains('=') {
            return Err(LineError::new(number, format!("{kind}: a name must follow `{kind}`, got {name:?}")));
        }
        Ok(InputLine { number, kind: line.kind, name, words: words.to_vec() })
    }

    /// Splits a line of the form `KIND key=value ...`.
    fn unnamed(number: usize, text: &'a str) -> Result<InputLine<'a>, LineError> {
        let mut words = text.split_whitespace();
        let kind = words.next().ok_or_else(|| LineError::new(number, "empty line"))?;
        Ok(InputLine { number, kind, name: "", words: words.collect() })
    }

    fn args(&self, repeatable: &[&str]) -> Result<Vec<args::Arg<'a>>, LineError> {
        args::split(&self.words, repeatable).map_err(|e| self.error(e))
    }

    /// An error at this line, prefixed with what the line declares.
    fn error(&self, message: impl std::fmt::Display) -> LineError {
        if self.name.is_empty() {
            LineError::new(self.number, format!("{}: {message}", self.kind))
        } else {
            LineError::new(self.number, format!("{} {}: {message}", self.kind, self.name))
        }
    }
}

const NODE_KEYS: &[&str] = &["gpus", "rack", "leaf", "model", "memory_mib", "nvlink", "unhealthy", "draining"];

struct NodeDef {
    registration: NodeRegistration,
    unhealthy: Vec<u32>,
    draining: bool,
}

fn parse_node(line: &InputLine) -> Result<NodeDef, LineError> {
    let (mut gpus, mut rack, mut leaf, mut model) = (None, "r1", "r1", "H100");
    let (mut memory_mib, mut nvlink, mut unhealthy, mut draining) = (81_920, 0, Vec::new(), false);
    for arg in line.args(&[])? {
        let parsed = match arg.key {
            "gpus" => args::number(&arg).map(|n| gpus = Some(n)),
            "rack" => args::text(&arg).map(|v| rack = v),
            "leaf" => args::text(&arg).map(|v| leaf = v),
            "model" => args::text(&arg).map(|v| model = v),
            "memory_mib" => args::number(&arg).map(|n| memory_mib = n),
            "nvlink" => args::number(&arg).map(|n| nvlink = n),
            "unhealthy" => args::text(&arg).and_then(|v| args::gpu_set(arg.key, v)).map(|g| unhealthy = g),
            "draining" => args::flag(&arg).map(|b| draining = b),
            _ => Err(args::unknown(&arg, NODE_KEYS)),
        };
        parsed.map_err(|e| line.error(e))?;
    }
    let gpus: u32 = gpus.ok_or_else(|| line.error("gpus=N is required"))?;
    let gpu = |i: u32| GpuInfo {
        index: i,
        uuid: format!("GPU-{}-{i}", line.name),
        model: model.to_string(),
        memory_mib,
        healthy: true,
        nvlink_domain: (nvlink > 0).then(|| i / nvlink),
    };
    let registration = NodeRegistration {
        name: line.name.to_string(),
        address: "127.0.0.1".into(),
        rack: rack.to_string(),
        leaf: leaf.to_string(),
        gpus: (0..gpus).map(gpu).collect(),
    };
    Ok(NodeDef { registration, unhealthy, draining })
}

const QUOTA_KEYS: &[&str] = &["gpus", "per_model", "lend", "lend_to", "borrow_limit"];

fn parse_quota(line: &InputLine) -> Result<GroupQuota, LineError> {
    let mut quota = GroupQuota { group: line.name.to_string(), lend: true, ..GroupQuota::default() };
    let mut gpus = None;
    for arg in line.args(&[])? {
        let parsed = match arg.key {
            "gpus" => args::number(&arg).map(|n| gpus = Some(n)),
            "per_model" => args::per_model(&arg).map(|m| quota.per_model = m),
            "lend" => args::flag(&arg).map(|b| quota.lend = b),
            "lend_to" => args::names(&arg).map(|n| quota.lend_to = n),
            "borrow_limit" => args::number(&arg).map(|n| quota.borrow_limit = Some(n)),
            _ => Err(args::unknown(&arg, QUOTA_KEYS)),
        };
        parsed.map_err(|e| line.error(e))?;
    }
    quota.gpus = gpus.ok_or_else(|| line.error("gpus=N is required"))?;
    Ok(quota)
}

const QUEUE_KEYS: &[&str] = &["weight", "max_gpus_per_job", "default_runtime", "max_runtime", "preemptible", "protected_runtime"];

/// A queue line; fields not given keep `existing`'s values, and a new queue
/// must give them all.
fn parse_queue(line: &InputLine, existing: Option<&QueueConfig>) -> Result<QueueConfig, LineError> {
    let mut weight = existing.map(|q| q.weight);
    let mut max_gpus_per_job = existing.map(|q| q.max_gpus_per_job);
    let mut default_runtime_s = existing.map(|q| q.default_runtime_s);
    let mut max_runtime_s = existing.map(|q| q.max_runtime_s);
    let mut preemptible = existing.map(|q| q.preemptible);
    let mut protected_runtime_s = existing.map(|q| q.protected_runtime_s);
    for arg in line.args(&[])? {
        let parsed = match arg.key {
            "weight" => args::number(&arg).map(|n| weight = Some(n)),
            "max_gpus_per_job" => args::number(&arg).map(|n| max_gpus_per_job = Some(n)),
            "default_runtime" => args::seconds(&arg).map(|s| default_runtime_s = Some(s)),
            "max_runtime" => args::seconds(&arg).map(|s| max_runtime_s = Some(s)),
            "preemptible" => args::flag(&arg).map(|b| preemptible = Some(b)),
            "protected_runtime" => args::seconds(&arg).map(|s| protected_runtime_s = Some(s)),
            _ => Err(args::unknown(&arg, QUEUE_KEYS)),
        };
        parsed.map_err(|e| line.error(e))?;
    }
    let needs = |key: &str| line.error(format!("a new queue needs {key} (it needs all of: {})", QUEUE_KEYS.join(", ")));
    Ok(QueueConfig {
        name: line.name.to_string(),
        weight: weight.ok_or_else(|| needs("weight"))?,
        max_gpus_per_job: max_gpus_per_job.ok_or_else(|| needs("max_gpus_per_job"))?,
        default_runtime_s: default_runtime_s.ok_or_else(|| needs("default_runtime"))?,
        max_runtime_s: max_runtime_s.ok_or_else(|| needs("max_runtime"))?,
        preemptible: preemptible.ok_or_else(|| needs("preemptible"))?,
        protected_runtime_s: protected_runtime_s.ok_or_else(|| needs("protected_runtime"))?,
    })
}

const JOB_KEYS: &[&str] = &["group", "queue", "priority", "priority_ttl", "replicas", "gpus", "model", "min_memory_mib", "limit", "submit"];
const RUNNING_KEYS: &[&str] = &["since", "on", "checkpoint"];

struct JobDef {
    line: usize,
    spec: JobSpec,
    submit_ms: u64,
    running: Option<RunningDef>,
}

struct RunningDef {
    line: usize,
    since_ms: u64,
    ranks: Vec<RankPlacement>,
    checkpoint_ms: Option<u64>,
}

fn parse_job(line: &InputLine) -> Result<JobDef, LineError> {
    let mut spec = JobSpec { name: line.name.to_string(), group: "a".into(), ..JobSpec::simple(&["train.py"]) };
    let (mut gpus, mut submit_ms) = (None, None);
    for arg in line.args(&[])? {
        let parsed = match arg.key {
            "group" => args::text(&arg).map(|v| spec.group = v.to_string()),
            "queue" => args::text(&arg).map(|v| spec.queue = v.to_string()),
            "priority" => args::text(&arg).and_then(|v| {
                Priority::parse(v).map(|p| spec.priority = p).ok_or_else(|| format!("priority: expected low, medium or high, got {v:?}"))
            }),
            "priority_ttl" => args::seconds(&arg).map(|s| spec.priority_ttl_s = s),
            "replicas" => args::number(&arg).map(|n| spec.replicas = n),
            "gpus" => args::number(&arg).map(|n| gpus = Some(n)),
            "model" => args::text(&arg).map(|v| spec.gpu_model = Some(Box::from(v))),
            "min_memory_mib" => args::number(&arg).map(|n| spec.min_gpu_memory_mib = n),
            "limit" => args::seconds(&arg).map(|s| spec.runtime_limit_s = s),
            "submit" => args::millis(&arg).map(|ms| submit_ms = Some(ms)),
            _ => Err(args::unknown(&arg, JOB_KEYS)),
        };
        parsed.map_err(|e| line.error(e))?;
    }
    spec.gpus_per_replica = gpus.ok_or_else(|| line.error("gpus=N (per rank) is required"))?;
    let submit_ms = submit_ms.ok_or_else(|| line.error("submit=TIME is required"))?;
    Ok(JobDef { line: line.number, spec, submit_ms, running: None })
}

fn parse_running(line: &InputLine) -> Result<RunningDef, LineError> {
    let (mut since_ms, mut ranks, mut checkpoint_ms) = (None, Vec::new(), None);
    for arg in line.args(&["on"])? {
        let parsed = match arg.key {
            "since" => args::millis(&arg).map(|ms| since_ms = Some(ms)),
            "on" => parse_rank(&arg).map(|r| ranks.push(r)),
            "checkpoint" => args::millis(&arg).map(|ms| checkpoint_ms = Some(ms)),
            _ => Err(args::unknown(&arg, RUNNING_KEYS)),
        };
        parsed.map_err(|e| line.error(e))?;
    }
    let since_ms = since_ms.ok_or_else(|| line.error("since=TIME is required"))?;
    if ranks.is_empty() {
        return Err(line.error("on=NODE:GPUS is required (one per rank)"));
    }
    if checkpoint_ms.is_some_and(|c| c < since_ms) {
        return Err(line.error("checkpoint: must not be before since"));
    }
    Ok(RunningDef { line: line.number, since_ms, ranks, checkpoint_ms })
}

/// One rank's GPUs: `NODE:GPUS`.
fn parse_rank(arg: &args::Arg) -> Result<RankPlacement, String> {
    let v = args::text(arg)?;
    let (node, gpus) =
        v.split_once(':').filter(|(n, _)| !n.is_empty()).ok_or_else(|| format!("on: expected NODE:GPUS such as n1:0-3, got {v:?}"))?;
    Ok(RankPlacement { node: node.to_string(), gpus: args::gpu_set("on", gpus)? })
}

/// The jobs of a `jobs` block: `job` lines, each optionally followed by one
/// `running` line.
fn parse_jobs(input: &[(usize, &str)]) -> Result<Vec<JobDef>, LineError> {
    let mut jobs: Vec<JobDef> = Vec::new();
    for &(number, text) in input {
        let kind = InputLine::unnamed(number, text)?.kind;
        match kind {
            "job" => jobs.push(parse_job(&InputLine::named(number, text, "job")?)?),
            "running" => {
                let line = InputLine::unnamed(number, text)?;
                let running = parse_running(&line)?;
                let job = jobs.last_mut().ok_or_else(|| line.error("no `job` line above it"))?;
                if job.running.is_some() {
                    return Err(line.error(format!("job {} already has a running line", job.spec.name)));
                }
                if running.since_ms < job.submit_ms {
                    return Err(line.error(format!("since: job {} cannot start before it is submitted", job.spec.name)));
                }
                job.running = Some(running);
            }
            other => return Err(LineError::new(number, format!("expected a `job` or `running` line, got {other:?}"))),
        }
    }
    Ok(jobs)
}

/// What happens to a job at one time; ordered by time, then submit before
/// start before checkpoint, then the order of the jobs in the block.
enum Event<'a> {
    Submit(&'a JobDef),
    Start(&'a JobDef, &'a RunningDef),
    Checkpoint(&'a JobDef, &'a RunningDef, u64),
}

impl Event<'_> {
    /// The input line the event comes from.
    fn line(&self) -> usize {
        match self {
            Event::Submit(job) => job.line,
            Event::Start(_, run) | Event::Checkpoint(_, run, _) => run.line,
        }
    }
}

fn events(jobs: &[JobDef]) -> Vec<(u64, Event<'_>)> {
    let mut events: Vec<(u64, u8, Event)> = Vec::new();
    for job in jobs {
        events.push((job.submit_ms, 0, Event::Submit(job)));
        if let Some(run) = &job.running {
            events.push((run.since_ms, 1, Event::Start(job, run)));
            if let Some(at) = run.checkpoint_ms {
                events.push((at, 2, Event::Checkpoint(job, run, at)));
            }
        }
    }
    events.sort_by_key(|(t, kind, _)| (*t, *kind));
    events.into_iter().map(|(t, _, e)| (t, e)).collect()
}

/// The cluster the cases of one file build up, and the policy settings.
struct Scenario {
    state: ClusterState,
    index: u64,
    /// Time of the latest applied proposal; time only moves forward.
    clock_ms: u64,
    config: PolicyConfig,
    ids: BTreeMap<String, JobId>,
}

impl Scenario {
    fn new() -> Scenario {
        Scenario { state: ClusterState::default(), index: 0, clock_ms: 0, config: PolicyConfig::default(), ids: BTreeMap::new() }
    }

    fn run(&mut self, case: &datadriven::Case) -> Result<String, LineError> {
        let no_args = |case: &datadriven::Case| {
            if case.args.trim().is_empty() {
                Ok(())
            } else {
                Err(LineError::new(case.line, format!("{}: takes no arguments, got {:?}", case.command, case.args.trim())))
            }
        };
        match case.command {
            "cluster" => no_args(case).and_then(|()| self.cluster(&case.input)),
            "queues" => no_args(case).and_then(|()| self.queues(&case.input)),
            "quotas" => no_args(case).and_then(|()| self.quotas(&case.input)),
            "tune" => no_args(case).and_then(|()| self.tune(case)),
            "jobs" => no_args(case).and_then(|()| self.jobs(&case.input)),
            "budgets" => no_args(case).and_then(|()| self.budgets(&case.input)),
            "idle" => no_args(case).and_then(|()| self.idle(&case.input)),
            "policy" => self.policy(case),
            "plan" => self.plan(case),
            other => Err(LineError::new(
                case.line,
                format!("unknown command {other:?} (known: cluster, queues, quotas, tune, jobs, budgets, idle, policy, plan)"),
            )),
        }
    }

    /// Applies one command at `now_ms` as its own log entry.
    fn apply(&mut self, now_ms: u64, command: Command) -> CommandResult {
        self.index += 1;
        self.clock_ms = self.clock_ms.max(now_ms);
        let proposal = Proposal { now_ms, commands: vec![command] };
        self.state.apply_proposal(self.index, &proposal).remove(0)
    }

    /// Applies a command that must succeed; a rejection is the line's error.
    fn apply_ok(&mut self, now_ms: u64, command: Command, line: &InputLine) -> Result<(), LineError> {
        match self.apply(now_ms, command) {
            CommandResult::Rejected(r) => Err(line.error(format!("rejected: {r}"))),
            _ => Ok(()),
        }
    }

    fn cluster(&mut self, input: &[(usize, &str)]) -> Result<String, LineError> {
        for &(number, text) in input {
            let line = InputLine::named(number, text, "node")?;
            let node = parse_node(&line)?;
            let name = node.registration.name.clone();
            self.apply_ok(self.clock_ms, Command::RegisterNode(node.registration), &line)?;
            if !node.unhealthy.is_empty() {
                self.apply_ok(self.clock_ms, Command::NodeHealth { node: name.clone(), unhealthy_gpus: node.unhealthy }, &line)?;
            }
            if node.draining {
                self.apply_ok(self.clock_ms, Command::DrainNode { node: name, drain: true }, &line)?;
            }
        }
        Ok("ok".into())
    }

    fn queues(&mut self, input: &[(usize, &str)]) -> Result<String, LineError> {
        for &(number, text) in input {
            let line = InputLine::named(number, text, "queue")?;
            let queue = parse_queue(&line, self.state.queues.get(line.name))?;
            self.apply_ok(self.clock_ms, Command::SetQueue(queue), &line)?;
        }
        Ok("ok".into())
    }

    fn quotas(&mut self, input: &[(usize, &str)]) -> Result<String, LineError> {
        for &(number, text) in input {
            let line = InputLine::named(number, text, "quota")?;
            let quota = parse_quota(&line)?;
            self.apply_ok(self.clock_ms, Command::SetQuota(quota), &line)?;
        }
        Ok("ok".into())
    }

    /// Budgets of the month holding the cluster's time; the first raises
    /// the cluster version to the one that meters GPU use.
    fn budgets(&mut self, input: &[(usize, &str)]) -> Result<String, LineError> {
        for &(number, text) in input {
            let line = InputLine::named(number, text, "budget")?;
            if self.state.cluster_version() < TENANCY_FROM_VERSION {
                self.apply_ok(self.clock_ms, Command::SetClusterVersion { version: TENANCY_FROM_VERSION }, &line)?;
            }
            let mut gpu_hours: Option<f64> = None;
            let mut strict = false;
            for arg in line.args(&[])? {
                let parsed = match arg.key {
                    "gpu_hours" => args::number(&arg).map(|h| gpu_hours = Some(h)),
                    "strict" => args::flag(&arg).map(|b| strict = b),
                    _ => Err(args::unknown(&arg, &["gpu_hours", "strict"])),
                };
                parsed.map_err(|e| line.error(e))?;
            }
            let gpu_hours = gpu_hours.ok_or_else(|| line.error("gpu_hours=H is required"))?;
            let command = Command::SetBudget {
                group: line.name.to_string(),
                month: month_of(self.clock_ms),
                gpu_ms: Some((gpu_hours * MS_PER_GPU_HOUR as f64).round() as u64),
                strict,
            };
            let audited = Command::Audited { actor: Actor::unchecked("golden"), command: Box::new(command) };
            self.apply_ok(self.clock_ms, audited, &line)?;
        }
        Ok("ok".into())
    }

    /// Queue idle rules and agents' idle reports (see the module docs).
    fn idle(&mut self, input: &[(usize, &str)]) -> Result<String, LineError> {
        for &(number, text) in input {
            let kind = InputLine::unnamed(number, text)?.kind;
            if kind != "queue" && kind != "report" {
                return Err(LineError::new(number, format!("idle: expected `queue NAME ..` or `report JOB ..`, got {kind:?}")));
            }
            let line = InputLine::named(number, text, kind)?;
            if self.state.cluster_version() < IDLE_FROM_VERSION {
                self.apply_ok(self.clock_ms, Command::SetClusterVersion { version: IDLE_FROM_VERSION }, &line)?;
            }
            let (mut after, mut action, mut since, mut at, mut rank, mut busy) = (None, None, None, None, 0u32, false);
            for arg in line.args(&[])? {
                let parsed = match arg.key {
                    "after" if kind == "queue" => args::millis(&arg).map(|v| after = Some(v)),
                    "action" if kind == "queue" => IdleAction::parse(arg.value.unwrap_or(""))
                        .map(|a| action = Some(a))
                        .ok_or_else(|| format!("action: {:?} is not flag or reclaim", arg.value)),
                    "since" if kind == "report" => args::millis(&arg).map(|v| since = Some(v)),
                    "at" if kind == "report" => args::millis(&arg).map(|v| at = Some(v)),
                    "rank" if kind == "report" => args::number(&arg).map(|v: f64| rank = v as u32),
                    "busy" if kind == "report" => args::flag(&arg).map(|b| busy = b),
                    _ => Err(args::unknown(&arg, &["after", "action", "since", "at", "rank", "busy"])),
                };
                parsed.map_err(|e| line.error(e))?;
            }
            let command = match kind {
                "queue" => {
                    let queue = self.state.queues.get(line.name).cloned().ok_or_else(|| line.error(format!("no queue {}", line.name)))?;
                    let idle_after_ms = after.ok_or_else(|| line.error("after=T is required"))?;
                    let idle = IdlePolicy { idle_after_ms, action: action.ok_or_else(|| line.error("action= is required"))? };
                    Command::Audited { actor: Actor::unchecked("golden"), command: Box::new(Command::SetQueueIdle { queue, idle }) }
                }
                "report" => {
                    let job_id = *self.ids.get(line.name).ok_or_else(|| line.error(format!("no job {}", line.name)))?;
                    let alloc_id = self.state.jobs[&job_id].alloc.ok_or_else(|| line.error(format!("job {} is not running", line.name)))?;
                    let at = at.ok_or_else(|| line.error("at=T is required"))?;
                    if at < self.clock_ms {
                        return Err(line.error(format!("at: is before the cluster's time {}", args::render_millis(self.clock_ms))));
                    }
                    self.clock_ms = at;
                    let idle_for_ms = match (busy, since) {
                        (true, None) => None,
                        (false, Some(since)) if since <= at => Some(at - since),
                        _ => return Err(line.error("one of since=T (not after at) or busy=true")),
                    };
                    Command::AllocIdle { alloc_id, rank, idle_for_ms }
                }
                _ => unreachable!("checked above"),
            };
            self.apply_ok(self.clock_ms, command, &line)?;
        }
        let mut lines = Vec::new();
        for alloc in self.state.allocs.values() {
            let name = self.job_name(alloc.job_id);
            match self.state.alloc_idle_since_ms(alloc.id) {
                Some(since) => lines.push(format!("{name} idle since {}", args::render_millis(since))),
                None => lines.push(format!("{name} busy")),
            }
        }
        Ok(if lines.is_empty() { "ok".into() } else { lines.join("\n") })
    }

    fn policy(&mut self, case: &datadriven::Case) -> Result<String, LineError> {
        let line = InputLine::unnamed(case.line, case.command_line)?;
        let mut canary = None;
        for arg in line.args(&[])? {
            let parsed = match arg.key {
                "canary_queue" => args::text(&arg).map(|v| canary = Some(CanaryScope::Queue(v.to_string()))),
                "canary_group" => args::text(&arg).map(|v| canary = Some(CanaryScope::Group(v.to_string()))),
                _ => Err(args::unknown(&arg, &["canary_queue", "canary_group"])),
            };
            parsed.map_err(|e| line.error(e))?;
        }
        if self.config != PolicyConfig::default() {
            return Err(line.error("policy: not combined with tune (the leader's pass reads the state's documents)"));
        }
        let first = case.input.first().map_or(case.line, |(n, _)| *n);
        let text: Vec<&str> = case.input.iter().map(|(_, t)| *t).collect();
        let value: serde_json::Value = serde_json::from_str(&text.join("\n"))
            .map_err(|e| LineError::new(first, format!("policy: expected one JSON object of policy fields: {e}")))?;
        let document = PolicyDocument::from_json(&value).map_err(|e| LineError::new(first, format!("policy: {e}")))?;
        let input = InputLine::unnamed(first, text.first().copied().unwrap_or("{}"))?;
        if self.state.cluster_version() < POLICY_DOC_FROM_VERSION {
            self.apply_ok(self.clock_ms, Command::SetClusterVersion { version: POLICY_DOC_FROM_VERSION }, &input)?;
        }
        let command = Command::ApplyPolicy { document, comment: String::new(), canary };
        let audited = Command::Audited { actor: Actor::unchecked("golden"), command: Box::new(command) };
        self.apply_ok(self.clock_ms, audited, &input)?;
        Ok(format!("version {}", self.state.policy.last_version))
    }

    fn tune(&mut self, case: &datadriven::Case) -> Result<String, LineError> {
        let line = case.input.first().map_or(case.line, |(n, _)| *n);
        let text: Vec<&str> = case.input.iter().map(|(_, t)| *t).collect();
        let changes: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text.join("\n"))
            .map_err(|e| LineError::new(line, format!("tune: expected one JSON object of policy settings: {e}")))?;
        self.config = self.config.with_changes(&changes).map_err(|e| LineError::new(line, format!("tune: {e}")))?;
        Ok("ok".into())
    }

    fn jobs(&mut self, input: &[(usize, &str)]) -> Result<String, LineError> {
        let jobs = parse_jobs(input)?;
        for (i, job) in jobs.iter().enumerate() {
            if self.ids.contains_key(&job.spec.name) || jobs[..i].iter().any(|j| j.spec.name == job.spec.name) {
                return Err(LineError::new(job.line, format!("job {}: a job of that name exists already", job.spec.name)));
            }
        }
        let events = events(&jobs);
        if let Some((t, event)) = events.first().filter(|(t, _)| *t < self.clock_ms) {
            let (at, now) = (args::render_millis(*t), args::render_millis(self.clock_ms));
            return Err(LineError::new(event.line(), format!("jobs: {at} is before the cluster's time {now}; time only moves forward")));
        }
        for (t, event) in events {
            self.run_event(t, event)?;
        }
        let lines: Vec<String> = jobs
            .iter()
            .map(|job| {
                let id = self.ids[&job.spec.name];
                format!("job {id} {}: {}", job.spec.name, self.state.jobs[&id].state.as_str())
            })
            .collect();
        Ok(lines.join("\n"))
    }

    fn run_event(&mut self, t: u64, event: Event) -> Result<(), LineError> {
        match event {
            Event::Submit(job) => match self.apply(t, Command::SubmitJob { request_id: None, spec: job.spec.clone() }) {
                CommandResult::Submitted { job_id, .. } => {
                    self.ids.insert(job.spec.name.clone(), job_id);
                    Ok(())
                }
                CommandResult::Rejected(r) => Err(LineError::new(job.line, format!("job {}: submit rejected: {r}", job.spec.name))),
                other => Err(LineError::new(job.line, format!("job {}: submit gave {other:?}", job.spec.name))),
            },
            Event::Start(job, run) => {
                let placement = Placement { job_id: self.ids[&job.spec.name], ranks: run.ranks.clone() };
                let refused = |why: String| LineError::new(run.line, format!("running: job {} cannot start there: {why}", job.spec.name));
                self.state.check_placement(&placement).map_err(|r| refused(r.to_string()))?;
                match self.apply(t, Command::ApplyPlan(Plan { placements: vec![placement], ..Plan::default() })) {
                    CommandResult::PlanApplied { placed: 1, .. } => Ok(()),
                    other => Err(refused(format!("{other:?}"))),
                }
            }
            Event::Checkpoint(job, run, at_ms) => {
                let alloc_id = self.state.jobs[&self.ids[&job.spec.name]].alloc.expect("a started job holds an allocation");
                match self.apply(t, Command::Checkpoint { alloc_id, at_ms }) {
                    CommandResult::Rejected(r) => Err(LineError::new(run.line, format!("checkpoint: rejected: {r}"))),
                    _ => Ok(()),
                }
            }
        }
    }

    fn plan(&mut self, case: &datadriven::Case) -> Result<String, LineError> {
        let line = InputLine::unnamed(case.line, case.command_line)?;
        let mut now_ms = None;
        for arg in line.args(&[])? {
            match arg.key {
                "now" => now_ms = Some(args::millis(&arg).map_err(|e| line.error(e))?),
                _ => return Err(line.error(args::unknown(&arg, &["now"]))),
            }
        }
        let now_ms = now_ms.ok_or_else(|| line.error("now=TIME is required"))?;
        if let Some((number, _)) = case.input.first() {
            return Err(LineError::new(*number, "plan: takes no input lines"));
        }
        if now_ms < self.clock_ms {
            return Err(line.error(format!("now: is before the cluster's time {}", args::render_millis(self.clock_ms))));
        }
        let plan = self.pass(now_ms);
        self.check_plan(&plan, now_ms).map_err(|e| line.error(e))?;
        Ok(self.render_plan(&plan))
    }

    /// One pass: the leader's, under the state's documents, once one was
    /// applied; else under the tuned settings.
    fn pass(&self, now_ms: u64) -> Plan {
        if self.state.policy.last_version > 0 {
            policy::plan(&self.state, now_ms)
        } else {
            policy::plan_with(&self.state, now_ms, &self.config)
        }
    }

    /// Properties every plan has, whatever the scenario expects of it.
    fn check_plan(&self, plan: &Plan, now_ms: u64) -> Result<(), String> {
        if self.pass(now_ms) != *plan {
            return Err("a second pass over the same state planned differently".into());
        }
        for placement in &plan.placements {
            if let Err(e) = self.state.check_placement(placement) {
                return Err(format!("apply refuses the placement of {}: {e}", self.job_name(placement.job_id)));
            }
        }
        Ok(())
    }

    fn job_name(&self, id: JobId) -> String {
        self.ids.iter().find(|(_, &i)| i == id).map_or_else(|| format!("job-{id}"), |(name, _)| name.clone())
    }

    fn render_plan(&self, plan: &Plan) -> String {
        let mut lines = Vec::new();
        for placement in &plan.placements {
            let ranks: Vec<String> = placement.ranks.iter().map(|r| format!("{}:{}", r.node, args::render_gpus(&r.gpus))).collect();
            lines.push(format!("place {} {}", self.job_name(placement.job_id), ranks.join(" ")));
        }
        for stop in &plan.stops {
            let job = self.state.allocs.get(&stop.alloc_id).map_or_else(|| format!("alloc-{}", stop.alloc_id), |a| self.job_name(a.job_id));
            lines.push(format!("stop {job} {}", stop.reason.as_str()));
        }
        for note in &plan.pending {
            let start = note.estimated_start_ms.map(|ms| format!(" start={}", args::render_millis(ms))).unwrap_or_default();
            lines.push(format!("pending {}{start} {}", self.job_name(note.job_id), note.reason));
        }
        if lines.is_empty() {
            return "empty plan".into();
        }
        lines.join("\n")
    }
}

/// A file in the folder that no test lists would never run.
#[test]
fn every_scenario_file_is_listed() {
    let mut unlisted = Vec::new();
    let mut present = Vec::new();
    for entry in std::fs::read_dir(golden_dir()).expect("tests/golden is readable") {
        let name = entry.expect("tests/golden entry").file_name().to_string_lossy().into_owned();
        match name.strip_suffix(".txt") {
            Some(stem) if SCENARIOS.contains(&stem) => present.push(stem.to_string()),
            _ => unlisted.push(name),
        }
    }
    assert!(unlisted.is_empty(), "tests/golden holds files no test runs (add each to `scenarios!`): {unlisted:?}");
    let missing: Vec<&str> = SCENARIOS.iter().copied().filter(|s| !present.iter().any(|p| p.as_str() == *s)).collect();
    assert!(missing.is_empty(), "listed scenarios without a file: {missing:?}");
}

/// Rewriting a file whose expected blocks are right changes no byte.
#[test]
fn rewrite_of_unchanged_files_is_byte_identical() {
    // The scenario tests may be rewriting these files right now.
    if rewrite_requested() {
        return;
    }
    for name in SCENARIOS {
        let label = format!("tests/golden/{name}.txt");
        let text = std::fs::read_to_string(golden_dir().join(format!("{name}.txt"))).expect("scenario file is readable");
        let outcome = run_document(&label, &text).unwrap_or_else(|e| panic!("{e}"));
        if outcome.mismatches.is_empty() {
            assert!(outcome.rewritten == text, "{label}: rewrite changed a file whose cases all pass");
        }
    }
}

/// Rewrite replaces the stale and empty expected blocks and keeps comments,
/// blank lines and the right blocks as they were; a second rewrite is a no-op.
#[test]
fn rewrite_replaces_only_expected_blocks() {
    let stale =
        "# header\n\ncluster\nnode n1 gpus=2\n----\nok\n\n# jobs\njobs\njob a gpus=1 submit=0s\n----\nstale\nlines\n\nplan now=10s\n----";
    let fixed = "# header\n\ncluster\nnode n1 gpus=2\n----\nok\n\n# jobs\njobs\njob a gpus=1 submit=0s\n----\njob 1 a: pending\n\nplan now=10s\n----\nplace a n1:0";
    let first = run_document("stale.txt", stale).expect("valid document");
    assert_eq!(first.mismatches.len(), 2, "{:?}", first.mismatches);
    assert_eq!(first.rewritten, fixed);
    let second = run_document("fixed.txt", fixed).expect("valid document");
    assert!(second.mismatches.is_empty(), "{:?}", second.mismatches);
    assert_eq!(second.rewritten, fixed);
}

/// Each malformed document is refused with its line and the field at fault.
#[test]
fn bad_lines_name_file_line_and_field() {
    let cases = [
        ("cluster\nnode n1 gpus=eight\n----\nok\n", "t.txt:2: node n1: gpus: expected a whole number, got \"eight\""),
        ("cluster\nnode n1 gpus=8 colour=red\n----\nok\n", "t.txt:2: node n1: unknown key \"colour\" (known: gpus,"),
        ("cluster\nnode n1 gpus=8 gpus=4\n----\nok\n", "t.txt:2: node n1: gpus is given twice"),
        ("cluster\nnode n1\n----\nok\n", "t.txt:2: node n1: gpus=N is required"),
        ("cluster\nnode n1 gpus=8 unhealthy=3-1\n----\nok\n", "t.txt:2: node n1: unhealthy: expected GPU indexes"),
        ("quotas\nquota a gpus=8 lend=maybe\n----\nok\n", "t.txt:2: quota a: lend: expected true or false, got \"maybe\""),
        ("queues\nqueue batch weight=1\n----\nok\n", "t.txt:2: queue batch: a new queue needs max_gpus_per_job"),
        ("jobs\njob a gpus=1 submit=10\n----\n", "t.txt:2: job a: submit: expected a time with a unit"),
        ("jobs\njob a gpus=1 submit=0s priority=urgent\n----\n", "t.txt:2: job a: priority: expected low, medium or high"),
        ("jobs\n  running since=0s on=n1:0\n----\n", "t.txt:2: running: no `job` line above it"),
        ("jobs\njob a gpus=1 submit=0s\njob a gpus=2 submit=0s\n----\n", "t.txt:3: job a: a job of that name exists already"),
        ("jobs\njob a gpus=0 submit=0s\n----\n", "t.txt:2: job a: submit rejected: "),
        (
            "cluster\nnode n1 gpus=1\n----\nok\n\njobs\njob a gpus=1 submit=0s\n  running since=0s on=n2:0\n----\n",
            "t.txt:8: running: job a cannot start there",
        ),
        ("jobs\njob a gpus=1 submit=0s\n  running since=0s on=n1\n----\n", "t.txt:3: running: on: expected NODE:GPUS"),
        ("tune\n{\"speed\": 1}\n----\nok\n", "t.txt:2: tune: unknown field speed"),
        ("plan\n----\n", "t.txt:1: plan: now=TIME is required"),
        ("schedule\n----\n", "t.txt:1: unknown command \"schedule\""),
        ("cluster\nnode n1 gpus=8\n", "t.txt:1: cluster: no `----` line ends its input"),
    ];
    for (document, want) in cases {
        match run_document("t.txt", document) {
            Ok(_) => panic!("accepted:\n{document}"),
            Err(e) => assert!(e.starts_with(want), "for\n{document}\ngot:  {e}\nwant: {want}..."),
        }
    }
}

/// A queue line changes the fields it gives of an existing queue and defines
/// a new queue from all of them.
#[test]
fn queue_lines_override_or_define_queues() {
    let text = "queues\nqueue short protected_runtime=1h\n\
                queue batch weight=1 max_gpus_per_job=0 default_runtime=1h max_runtime=2d preemptible=false protected_runtime=0s\n\
                ----\nok\n";
    let document = datadriven::parse(text).expect("valid document");
    let mut scenario = Scenario::new();
    for case in &document.cases {
        assert_eq!(scenario.run(case).expect("valid queues"), "ok");
    }
    let default_short = QueueConfig::defaults().into_iter().find(|q| q.name == "short").expect("a default short queue");
    let short = &scenario.state.queues["short"];
    assert_eq!(*short, QueueConfig { protected_runtime_s: 3600, ..default_short });
    let batch = &scenario.state.queues["batch"];
    let want = QueueConfig {
        name: "batch".into(),
        weight: 1,
        max_gpus_per_job: 0,
        default_runtime_s: 3600,
        max_runtime_s: 2 * 86_400,
        preemptible: false,
        protected_runtime_s: 0,
    };
    assert_eq!(*batch, want);
}
