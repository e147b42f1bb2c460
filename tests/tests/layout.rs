//! The workspace's design, kept by the compiler and by these tests:
//! - rota-core is pure: no async runtime, RPC, consensus or storage crate
//!   anywhere in its normal dependency tree;
//! - crates depend only along the arrows of the design (no crate imports
//!   one above it, e.g. the client or the CLI's library from the server);
//! - no module imports a sibling that imports it back (no import circles).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the workspace root").to_path_buf()
}

fn cargo(args: &[&str]) -> Result<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo).args(args).current_dir(workspace_root()).output()?;
    ensure!(output.status.success(), "cargo {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    Ok(String::from_utf8(output.stdout)?)
}

/// Crates the pure core must never reach, directly or through another crate.
const IMPURE: [&str; 10] = ["tokio", "tonic", "openraft", "rocksdb", "librocksdb-sys", "hyper", "h2", "mio", "socket2", "nvml-wrapper"];

#[test]
fn the_core_depends_on_no_runtime_network_or_storage() -> Result<()> {
    let tree = cargo(&["tree", "-p", "rota-core", "-e", "normal", "--prefix", "none", "--offline"])?;
    let names: BTreeSet<&str> = tree.lines().filter_map(|line| line.split_whitespace().next()).collect();
    ensure!(names.contains("rota-core"), "cargo tree printed no rota-core: {tree}");
    let found: Vec<&&str> = IMPURE.iter().filter(|name| names.contains(**name)).collect();
    ensure!(found.is_empty(), "rota-core reaches {found:?}:\n{tree}");
    Ok(())
}

/// What each workspace crate may depend on (normal and build dependencies).
fn allowed() -> BTreeMap<&'static str, &'static [&'static str]> {
    BTreeMap::from([
        ("rota-proto", &[][..]),
        ("rota-core", &[][..]),
        // The binaries' global allocator: it knows only mimalloc.
        ("rota-alloc", &[][..]),
        // Generic over the state machine: knows nothing of jobs.
        ("rota-consensus", &["rota-proto"][..]),
        // Transport security every side shares (certificates, TLS links,
        // identities); knows nothing of rota's API, so it sits below all.
        ("rota-tls", &[][..]),
        ("rota-client", &["rota-core", "rota-proto", "rota-tls"][..]),
        // The consensus crate stays generic: the server injects its TLS
        // channels into it, so rota-consensus does not depend on rota-tls.
        ("rota-server", &["rota-core", "rota-client", "rota-proto", "rota-consensus", "rota-tls"][..]),
        ("rota-agent", &["rota-alloc", "rota-proto", "rota-client", "rota-tls"][..]),
        ("rota-chaos", &["rota-proto", "rota-client", "rota-tls"][..]),
        // The `rota` binary is the composition root: `rota server` starts
        // rota-server; every other command goes through rota-client.
        ("rota-cli", &["rota-alloc", "rota-core", "rota-client", "rota-server", "rota-proto", "rota-tls"][..]),
        ("rota-e2e", &["rota-proto", "rota-client", "rota-chaos", "rota-tls"][..]),
    ])
}

#[test]
fn crates_depend_only_along_the_arrows() -> Result<()> {
    let metadata: serde_json::Value = serde_json::from_str(&cargo(&["metadata", "--format-version", "1", "--no-deps", "--offline"])?)?;
    let packages = metadata["packages"].as_array().context("packages")?;
    let allowed = allowed();
    let members: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let listed: BTreeSet<&str> = allowed.keys().copied().collect();
    ensure!(members == listed, "every workspace crate has a place in the design: members {members:?}, listed {listed:?}");
    let mut wrong = Vec::new();
    for package in packages {
        let name = package["name"].as_str().context("name")?;
        for dep in package["dependencies"].as_array().context("dependencies")? {
            let dep_name = dep["name"].as_str().context("dependency name")?;
            let is_dev = dep["kind"].as_str() == Some("dev");
            if members.contains(dep_name) && !is_dev && !allowed[name].contains(&dep_name) {
                wrong.push(format!("{name} -> {dep_name}"));
            }
        }
    }
    ensure!(wrong.is_empty(), "dependencies against the design: {wrong:?}");
    Ok(())
}

/// The source folder of every workspace crate.
fn crate_sources() -> Result<Vec<PathBuf>> {
    let metadata: serde_json::Value = serde_json::from_str(&cargo(&["metadata", "--format-version", "1", "--no-deps", "--offline"])?)?;
    let mut sources = Vec::new();
    for package in metadata["packages"].as_array().context("packages")? {
        let manifest = PathBuf::from(package["manifest_path"].as_str().context("manifest_path")?);
        let src = manifest.parent().context("manifest folder")?.join("src");
        if src.is_dir() {
            sources.push(src);
        }
    }
    Ok(sources)
}

/// Module path of a source file: `policy/order.rs` -> [policy, order],
/// `policy/mod.rs` -> [policy], `lib.rs` -> [].
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = relative.iter().map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// Module paths a file names through `crate::a::b` or `super::a`, with
/// test modules (after `#[cfg(test)]`) left out.
fn referenced_paths(module: &[String], text: &str) -> Vec<Vec<String>> {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    let mut paths = Vec::new();
    for (prefix, base) in [("crate::", Vec::new()), ("super::", module[..module.len().saturating_sub(1)].to_vec())] {
        for (at, _) in code.match_indices(prefix) {
            let preceded_by_ident = code[..at].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
            if preceded_by_ident {
                continue;
            }
            let rest = &code[at + prefix.len()..];
            let mut path = Vec::new();
            for segment in rest.split("::").take(8) {
                let ident: String = segment.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if ident.is_empty() {
                    break;
                }
                let path_goes_on = ident.len() == segment.len();
                path.push(ident);
                if !path_goes_on {
                    break;
                }
            }
            let mut full = base.clone();
            full.extend(path);
            paths.push(full);
        }
    }
    paths
}

/// Edges between sibling modules: `from` (a file's module) -> the sibling
/// under their common parent that it names.
fn sibling_edges(src: &Path) -> Result<BTreeSet<(Vec<String>, Vec<String>)>> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_path(src, f)).collect();
    let mut edges = BTreeSet::new();
    for file in &files {
        let from = module_path(src, file);
        let text = std::fs::read_to_string(file)?;
        for target in referenced_paths(&from, &text) {
            let common = from.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common >= from.len() || common >= target.len() {
                continue; // a module naming itself, its parent's items or its own children
            }
            let from_sibling = from[..=common].to_vec();
            let to_sibling = target[..=common].to_vec();
            if modules.contains(&to_sibling) && from_sibling != to_sibling {
                edges.insert((from_sibling, to_sibling));
            }
        }
    }
    Ok(edges)
}

fn find_cycle(edges: &BTreeSet<(Vec<String>, Vec<String>)>) -> Option<Vec<Vec<String>>> {
    let mut graph: BTreeMap<&Vec<String>, Vec<&Vec<String>>> = BTreeMap::new();
    for (from, to) in edges {
        graph.entry(from).or_default().push(to);
    }
    // Depth-first search with colours; bounded by the number of modules.
    fn visit<'a>(
        node: &'a Vec<String>,
        graph: &BTreeMap<&'a Vec<String>, Vec<&'a Vec<String>>>,
        done: &mut BTreeSet<&'a Vec<String>>,
        stack: &mut Vec<&'a Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        if let Some(at) = stack.iter().position(|n| *n == node) {
            return Some(stack[at..].iter().map(|n| (*n).clone()).chain([node.clone()]).collect());
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node);
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, done, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node);
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, &graph, &mut done, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

#[test]
fn no_module_imports_a_sibling_that_imports_it_back() -> Result<()> {
    let mut circles = Vec::new();
    for src in crate_sources()? {
        if let Some(cycle) = find_cycle(&sibling_edges(&src)?) {
            let shown: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
            circles.push(format!("{}: {}", src.display(), shown.join(" -> ")));
        }
    }
    ensure!(circles.is_empty(), "import circles:\n{}", circles.join("\n"));
    Ok(())
}

#[test]
fn the_circle_finder_finds_circles() {
    let m = |s: &str| s.split("::").map(str::to_string).collect::<Vec<_>>();
    let edges: BTreeSet<_> =
        [(m("policy::order"), m("policy::quota")), (m("policy::quota"), m("policy::view")), (m("policy::view"), m("policy::order"))].into();
    let cycle = find_cycle(&edges).expect("a circle");
    assert_eq!(cycle.first(), cycle.last());
    assert_eq!(cycle.len(), 4);
    let text = "use crate::policy::quota::QuotaBook;\nuse super::view::View;\n#[cfg(test)]\nuse super::order::X;";
    let paths = referenced_paths(&m("policy::order"), text);
    assert_eq!(paths, vec![m("policy::quota::QuotaBook"), m("policy::view::View")]);
}
