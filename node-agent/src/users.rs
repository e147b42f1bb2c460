//! Which local user a rank runs as. A job runs as the user who submitted it
//! (the replicated owner of the job, sent with each assignment), mapped to
//! a uid, gid and supplementary groups through the host's user database,
//! as Slurm does; never as root unless the agent allows it, never below a
//! minimum uid, never as rota's own account.

use std::ffi::{CStr, CString};

use serde::{Deserialize, Serialize};

/// The local account rota's services run as; jobs never do.
pub const SERVICE_ACCOUNT: &str = "rota";
/// Default lowest uid a job may run as (system accounts sit below it).
pub const DEFAULT_MIN_UID: u32 = 1000;
/// Most supplementary groups passed to a rank.
const MAX_GROUPS: usize = 256;
/// Buffer for one passwd entry.
const PASSWD_BUFFER_BYTES: usize = 16 * 1024;

/// How the agent picks the user of a rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobUsers {
    /// As the job's owner (the default).
    Owner { min_uid: u32, allow_root: bool },
    /// Every rank as the agent's own user: for a single-user host or tests.
    Agent,
}

/// A resolved local user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunAs {
    pub user: String,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub home: String,
}

/// The user a rank of `owner`'s job runs as (`None`: the agent's own), or
/// why it may not run.
pub fn resolve(policy: &JobUsers, owner: &str) -> Result<Option<RunAs>, String> {
    let JobUsers::Owner { min_uid, allow_root } = policy else { return Ok(None) };
    let agent_uid = unsafe { libc::geteuid() };
    if owner.is_empty() {
        // A cluster without users: the rank would run as the agent.
        if agent_uid == 0 && !allow_root {
            return Err("the job has no user (a cluster started --insecure), and it would run as root; start the agent with --allow-root-jobs or --job-users agent to allow it".into());
        }
        return Ok(None);
    }
    if owner == SERVICE_ACCOUNT {
        return Err(format!("jobs never run as rota's own account {SERVICE_ACCOUNT:?}"));
    }
    let found = lookup(owner)?.ok_or_else(|| format!("no local user {owner:?} on this host"))?;
    check(&found, *min_uid, *allow_root, agent_uid)?;
    Ok(Some(found))
}

/// The rules on a found user, apart from the lookup.
fn check(user: &RunAs, min_uid: u32, allow_root: bool, agent_uid: u32) -> Result<(), String> {
    if user.uid == 0 {
        return if allow_root {
            Ok(())
        } else {
            Err(format!("user {:?} is root (uid 0); the agent refuses root jobs without --allow-root-jobs", user.user))
        };
    }
    if user.uid < min_uid {
        return Err(format!("user {:?} has uid {}, below the minimum {min_uid} (--min-job-uid)", user.user, user.uid));
    }
    if agent_uid != 0 && user.uid == agent_uid {
        return Err(format!("user {:?} is the agent's own account", user.user));
    }
    Ok(())
}

fn lookup(name: &str) -> Result<Option<RunAs>, String> {
    let c_name = CString::new(name).map_err(|_| format!("user {name:?} holds a NUL byte"))?;
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buffer = vec![0 as libc::c_char; PASSWD_BUFFER_BYTES];
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; the buffer outlives the use of `entry`.
    let code = unsafe { libc::getpwnam_r(c_name.as_ptr(), &mut entry, buffer.as_mut_ptr(), buffer.len(), &mut result) };
    if code != 0 {
        return Err(format!("looking up user {name:?}: {}", std::io::Error::from_raw_os_error(code)));
    }
    if result.is_null() {
        return Ok(None);
    }
    // SAFETY: getpwnam_r filled `entry` with strings inside `buffer`.
    let home = unsafe { CStr::from_ptr(entry.pw_dir) }.to_string_lossy().into_owned();
    let groups = groups_of(&c_name, entry.pw_gid);
    Ok(Some(RunAs { user: name.to_string(), uid: entry.pw_uid, gid: entry.pw_gid, groups, home }))
}

/// The user's supplementary groups (getgrouplist), its primary one included.
fn groups_of(name: &CStr, gid: u32) -> Vec<u32> {
    let mut groups = vec![0 as libc::gid_t; MAX_GROUPS];
    let mut count = MAX_GROUPS as libc::c_int;
    // SAFETY: `groups` holds `count` entries; getgrouplist writes at most that many.
    let found = unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
    if found < 0 {
        // More groups than the bound: keep the primary one only.
        return vec![gid];
    }
    groups.truncate(count.max(0) as usize);
    groups
}

/// In the child, before exec: drop to `run_as`. Only async-signal-safe
/// calls, on memory prepared before the fork.
pub fn become_user(run_as: &RunAs) -> std::io::Result<()> {
    let fail = || Err(std::io::Error::last_os_error());
    // SAFETY: plain system calls on a prepared slice.
    unsafe {
        if libc::setgroups(run_as.groups.len(), run_as.groups.as_ptr()) != 0 {
            return fail();
        }
        if libc::setgid(run_as.gid) != 0 {
            return fail();
        }
        if libc::setuid(run_as.uid) != 0 {
            return fail();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(uid: u32) -> RunAs {
        RunAs { user: "x".into(), uid, gid: uid, groups: vec![uid], home: "/home/x".into() }
    }

    #[test]
    fn root_low_uids_and_the_agents_own_account_are_refused() {
        assert!(check(&user(0), 1000, false, 0).unwrap_err().contains("--allow-root-jobs"));
        assert!(check(&user(0), 1000, true, 0).is_ok());
        assert!(check(&user(999), 1000, true, 0).unwrap_err().contains("below the minimum 1000"));
        assert!(check(&user(1000), 1000, false, 0).is_ok());
        assert!(check(&user(1500), 1000, false, 1500).unwrap_err().contains("agent's own"));
    }

    #[test]
    fn owners_resolve_through_the_user_database() {
        let policy = JobUsers::Owner { min_uid: 1000, allow_root: false };
        assert!(resolve(&policy, "rota").unwrap_err().contains("rota's own account"));
        assert!(resolve(&policy, "no-such-user-here").unwrap_err().contains("no local user"));
        assert!(resolve(&policy, "root").is_err(), "root is uid 0 (or absent) and refused");
        assert_eq!(resolve(&JobUsers::Agent, "alice"), Ok(None));
        let root_found = lookup("root").expect("lookup").expect("every host has root");
        assert_eq!(root_found.uid, 0);
        assert!(root_found.groups.contains(&0));
    }
}
