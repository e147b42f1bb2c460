//! Ranks in cgroups v2: the agent's subtree `<cgroup2 mount>/<parent>/`
//! holds one cgroup per rank, `rank-<alloc_id>-<rank>`. The rank's command
//! enters it before it executes, so everything it starts is in it, whatever
//! session or process group it moves to; `cgroup.kill` (Linux 5.14+) ends
//! them all at once, and the cgroup's process list says when none is left.
//!
//! The path logic is pure; the file operations are small functions at the
//! edge.

use std::path::{Component, Path, PathBuf};

use super::ContainError;

/// The prefix of a rank's cgroup name.
const RANK_PREFIX: &str = "rank-";
/// Processes listed from one cgroup at most (bounds the pids signalled per pass).
pub const MAX_LISTED_PIDS: usize = 100_000;

/// The mount point of the cgroup v2 hierarchy in a /proc/mounts image: the
/// unified mount on hybrid hosts, /sys/fs/cgroup on pure v2 ones. The first
/// one wins (mount order), as the kernel has one v2 hierarchy.
pub fn cgroup2_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_source, target, kind) = (fields.next()?, fields.next()?, fields.next()?);
        (kind == "cgroup2").then(|| PathBuf::from(unescape_mount_path(target)))
    })
}

/// /proc/mounts writes space, tab, newline and backslash in paths as octal escapes.
fn unescape_mount_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest.get(at + 1..at + 4).and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(byte) => {
                out.push(char::from(byte));
                rest = &rest[at + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Check `--cgroup-parent`: a relative path of plain names (`rota-agent`,
/// `rota/node-a`), so the agent's subtree stays under the mount.
pub fn parent_path(parent: &str) -> Result<PathBuf, ContainError> {
    let path = Path::new(parent);
    let plain = !parent.is_empty() && path.components().all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        return Err(ContainError::BadParent(parent.to_string()));
    }
    Ok(path.to_path_buf())
}

/// The name of the cgroup of rank `rank` of allocation `alloc_id`.
pub fn rank_name(alloc_id: u64, rank: u32) -> String {
    format!("{RANK_PREFIX}{alloc_id}-{rank}")
}

/// (alloc id, rank) from a name written by `rank_name`.
pub fn parse_rank_name(name: &str) -> Option<(u64, u32)> {
    let (alloc, rank) = name.strip_prefix(RANK_PREFIX)?.split_once('-')?;
    Some((alloc.parse().ok()?, rank.parse().ok()?))
}

/// The pids listed in a `cgroup.procs` image, at most `MAX_LISTED_PIDS`.
pub fn parse_procs(text: &str) -> Vec<u32> {
    text.lines().filter_map(|l| l.trim().parse().ok()).take(MAX_LISTED_PIDS).collect()
}

/// Create `dir` (and its parents) as a cgroup; one that exists is kept.
pub fn create(dir: &Path) -> Result<(), ContainError> {
    std::fs::create_dir_all(dir).map_err(|source| ContainError::Io { path: dir.to_path_buf(), source })
}

/// The processes in cgroup `dir` (none when it does not exist).
pub fn procs(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs")).map(|t| parse_procs(&t)).unwrap_or_default()
}

/// SIGKILL every process in cgroup `dir` and its descendants. Returns
/// false where the kernel has no `cgroup.kill` (before 5.14): the caller
/// then signals the listed processes one by one.
pub fn kill(dir: &Path) -> bool {
    std::fs::write(dir.join("cgroup.kill"), "1").is_ok()
}

/// Remove cgroup `dir` once it is empty. A cgroup with processes left, or
/// gone already, stays as it is.
pub fn remove(dir: &Path) {
    match std::fs::remove_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => tracing::warn!(%error, path = %dir.display(), "cannot remove a rank's cgroup"),
    }
}

/// Every rank cgroup under the agent's subtree `parent_dir`: (alloc id, rank) -> path.
pub fn rank_cgroups(parent_dir: &Path) -> Vec<((u64, u32), PathBuf)> {
    let Ok(entries) = std::fs::read_dir(parent_dir) else { return Vec::new() };
    entries.flatten().filter_map(|e| Some((e.file_name().to_str().and_then(parse_rank_name)?, e.path()))).take(MAX_LISTED_PIDS).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";

    #[test]
    fn the_cgroup2_mount_is_found_on_hybrid_and_pure_hosts() {
        assert_eq!(cgroup2_mount(HYBRID), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(cgroup2_mount("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"), Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(cgroup2_mount("cgroup2 /mnt/with\\040space cgroup2 rw 0 0\n"), Some(PathBuf::from("/mnt/with space")));
    }

    #[test]
    fn no_cgroup2_mount_means_none() {
        let v1_only: String = HYBRID.lines().filter(|l| !l.starts_with("cgroup2")).map(|l| format!("{l}\n")).collect();
        assert_eq!(cgroup2_mount(&v1_only), None);
        assert_eq!(cgroup2_mount(""), None);
        assert_eq!(cgroup2_mount("garbage\n\n"), None);
    }

    #[test]
    fn the_parent_stays_under_the_mount() {
        assert_eq!(parent_path("rota-agent").unwrap(), PathBuf::from("rota-agent"));
        assert_eq!(parent_path("rota/node-a").unwrap(), PathBuf::from("rota/node-a"));
        for bad in ["", "/sys/fs/cgroup", "../escape", "a/../../b", "./a"] {
            let error = parent_path(bad).unwrap_err().to_string();
            assert!(error.contains("--cgroup-parent"), "{bad:?}: {error}");
        }
    }

    #[test]
    fn rank_names_round_trip() {
        assert_eq!(rank_name(42, 3), "rank-42-3");
        assert_eq!(parse_rank_name(&rank_name(42, 3)), Some((42, 3)));
        for other in ["42-3", "rank-x-3", "rank-42", "cgroup.procs", "rank-42-3-1"] {
            assert_eq!(parse_rank_name(other), None, "{other}");
        }
    }

    #[test]
    fn procs_are_parsed_and_bounded() {
        assert_eq!(parse_procs("12\n 7 \n\nx\n"), vec![12, 7]);
        let many: String = (1..=MAX_LISTED_PIDS as u32 + 5).map(|p| format!("{p}\n")).collect();
        assert_eq!(parse_procs(&many).len(), MAX_LISTED_PIDS);
    }
}
