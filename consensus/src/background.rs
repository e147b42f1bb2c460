//! Threads for work that must not take CPU from the commit path.
//!
//! A replica's acknowledgements wait on its Raft core, its log appends and
//! its apply: short steps that must run when they are due. A snapshot's
//! encoding (seconds at a million jobs) and a scheduling pass are long and
//! can wait. On a host short of cores, running them at a higher niceness
//! lets the scheduler of the operating system give the short steps the CPU
//! first, so a snapshot no longer shows up as acknowledgement latency or as
//! a missed heartbeat (and an election) on the followers.
//!
//! Only work that holds no lock the commit path takes belongs here: a
//! low-priority thread preempted while holding such a lock would stall the
//! path it is meant to spare. Freeze the state first, then hand the frozen
//! copy over.

/// Niceness of background threads (0 = as the rest of the replica; 19 the
/// lowest). At 10 a busy background thread gets about a tenth of a core
/// that normal threads also want.
pub const BACKGROUND_NICENESS: i32 = 10;

/// Raise the calling thread's niceness to [`BACKGROUND_NICENESS`] unless
/// it is higher already (Linux sets niceness per thread). A thread cannot
/// lower it again without privileges: call it on threads that stay in the
/// background.
pub fn lower_this_thread_priority() -> std::io::Result<()> {
    // SAFETY: plain syscalls on the calling thread; no memory is handed over.
    let result = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        // getpriority may return -1 as a value: errno tells it from a failure.
        *libc::__errno_location() = 0;
        let current = libc::getpriority(libc::PRIO_PROCESS, tid);
        let current = if current == -1 && *libc::__errno_location() != 0 { 0 } else { current };
        libc::setpriority(libc::PRIO_PROCESS, tid, current.max(BACKGROUND_NICENESS))
    };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Run `work` on a new thread named `name` at background priority and
/// await its result. Err when the thread could not start or `work`
/// panicked (the panic is reported in the error's text).
pub(crate) async fn run<T, F>(name: &str, work: F) -> Result<T, String>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (reply, answer) = tokio::sync::oneshot::channel();
    let thread_name = name.to_string();
    std::thread::Builder::new()
        .name(thread_name.clone())
        .spawn(move || {
            if let Err(e) = lower_this_thread_priority() {
                tracing::debug!(thread = %thread_name, error = %e, "background thread keeps the default priority");
            }
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).map_err(|payload| panic_text(&*payload));
            let _ = reply.send(outcome);
        })
        .map_err(|e| format!("start thread {name}: {e}"))?;
    match answer.await {
        Ok(outcome) => outcome.map_err(|panic| format!("thread {name} panicked: {panic}")),
        Err(_) => Err(format!("thread {name} ended without an answer")),
    }
}

/// The message of a caught panic (`catch_unwind`'s payload).
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        return (*text).to_string();
    }
    payload.downcast_ref::<String>().cloned().unwrap_or_else(|| "a panic without a message".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn this_thread_niceness() -> i32 {
        // SAFETY: plain syscalls on the calling thread.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            *libc::__errno_location() = 0;
            libc::getpriority(libc::PRIO_PROCESS, tid)
        }
    }

    #[tokio::test]
    async fn background_work_runs_at_a_higher_niceness_and_leaves_the_caller_as_it_was() {
        let caller_before = this_thread_niceness();
        let inside = run("rota-test-bg", this_thread_niceness).await.expect("the work answers");
        assert_eq!(inside, BACKGROUND_NICENESS.max(caller_before), "the background thread runs at its own niceness");
        assert_eq!(this_thread_niceness(), caller_before, "the caller's thread is not lowered");
    }

    #[tokio::test]
    async fn a_panic_in_background_work_is_an_error_not_a_hang() {
        let outcome: Result<(), String> = run("rota-test-bg", || panic!("on purpose")).await;
        let error = outcome.expect_err("a panic is reported");
        assert!(error.contains("on purpose"), "{error}");
    }
}
