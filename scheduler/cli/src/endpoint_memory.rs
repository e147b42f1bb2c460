//! The replica that answered the last `rota` command, kept between runs:
//! a new command starts there instead of at the first endpoint, which may
//! be down or hung. A cache only: a missing, unreadable or stale file costs
//! one hedged attempt, never a wrong answer.
//!
//! The file is `$XDG_CACHE_HOME/rota/last-endpoint` (else
//! `$HOME/.cache/rota/last-endpoint`): one line per endpoint list, the list
//! as given (comma separated), a space, the endpoint that answered.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Endpoint lists remembered at most; the oldest line goes first.
const MAX_LINES: usize = 32;
/// The file is read only up to this size.
const MAX_FILE_BYTES: u64 = 16 * 1024;

/// Where the memory lives, if the environment names a home for it.
pub fn file() -> Option<PathBuf> {
    let cache = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").filter(|v| !v.is_empty())?).join(".cache"),
    };
    Some(cache.join("rota").join("last-endpoint"))
}

fn key(endpoints: &[String]) -> String {
    endpoints.join(",")
}

fn read_lines(file: &Path) -> Vec<String> {
    use std::io::Read;
    let Ok(opened) = std::fs::File::open(file) else { return Vec::new() };
    let mut text = String::new();
    if opened.take(MAX_FILE_BYTES).read_to_string(&mut text).is_err() {
        return Vec::new();
    }
    text.lines().filter(|l| l.split_once(' ').is_some()).map(str::to_string).collect()
}

/// The endpoint that answered last for this endpoint list, if it is one of them.
pub fn recall(file: &Path, endpoints: &[String]) -> Option<String> {
    let key = key(endpoints);
    let lines = read_lines(file);
    let answered = lines.iter().rev().find_map(|line| line.split_once(' ').filter(|(k, _)| *k == key).map(|(_, e)| e.to_string()))?;
    endpoints.contains(&answered).then_some(answered)
}

/// Remember `answered` for this endpoint list (atomically; errors ignored:
/// it is a cache).
pub fn remember(file: &Path, endpoints: &[String], answered: &str) {
    let key = key(endpoints);
    if key.contains(['\n', ' ']) || answered.contains(['\n', ' ']) {
        return;
    }
    let mut lines: Vec<String> = read_lines(file).into_iter().filter(|line| !line.starts_with(&format!("{key} "))).collect();
    lines.push(format!("{key} {answered}"));
    let skip = lines.len().saturating_sub(MAX_LINES);
    let text: String = lines[skip..].iter().map(|l| format!("{l}\n")).collect();
    let _ = write_atomic(file, text.as_bytes());
}

fn write_atomic(file: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = file.parent().ok_or(std::io::ErrorKind::InvalidInput)?;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let tmp = file.with_extension(format!("tmp.{}", std::process::id()));
    let mut out = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    out.write_all(bytes)?;
    drop(out);
    std::fs::rename(&tmp, file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn an_endpoint_is_recalled_only_for_its_own_list() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rota").join("last-endpoint");
        let three = list(&["a:1", "b:2", "c:3"]);
        assert_eq!(recall(&file, &three), None, "nothing remembered yet");
        remember(&file, &three, "b:2");
        assert_eq!(recall(&file, &three).as_deref(), Some("b:2"));
        assert_eq!(recall(&file, &list(&["a:1", "b:2"])), None, "another list");
        remember(&file, &three, "c:3");
        assert_eq!(recall(&file, &three).as_deref(), Some("c:3"), "the latest answer wins");
        assert_eq!(read_lines(&file).len(), 1, "one line per list");
    }

    #[test]
    fn the_memory_is_bounded_and_ignores_what_it_did_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("last-endpoint");
        for i in 0..100 {
            remember(&file, &list(&[&format!("h{i}:1")]), &format!("h{i}:1"));
        }
        assert_eq!(read_lines(&file).len(), MAX_LINES);
        assert_eq!(recall(&file, &list(&["h99:1"])).as_deref(), Some("h99:1"));
        assert_eq!(recall(&file, &list(&["h0:1"])), None, "the oldest went first");
        std::fs::write(&file, "x:1 evil:6\n").unwrap();
        assert_eq!(recall(&file, &list(&["x:1"])), None, "an endpoint not in the list is never used");
    }
}
