//! Labelled metrics recorded on every request or entry, through handles
//! each thread keeps. `metrics::histogram!(name, "kind" => label)` builds
//! the key and looks it up in the recorder's registry (hashing and
//! comparing the name and labels) at every call: on a leader at 24,000
//! submits/s that cost more than the work some of them measure. A thread
//! asks the recorder once per (name, label) and keeps the handle.
//!
//! A handle made before the process installs its recorder records nowhere,
//! for as long as its thread lives: `rota server` installs the recorder
//! before the replica starts, so before any of these calls.
//!
//! The names, label keys and values are `'static` strings from the code,
//! so each thread holds a handful of handles; past `MAX_HANDLES` (a label
//! made at run time by mistake) a call goes to the recorder as before
//! rather than growing the list.

use std::cell::RefCell;

/// Handles one thread keeps, of every labelled metric together.
const MAX_HANDLES: usize = 128;

/// Which metric and label a handle is for.
type Which = (&'static str, &'static str, &'static str);

thread_local! {
    static HISTOGRAMS: RefCell<Vec<(Which, metrics::Histogram)>> = const { RefCell::new(Vec::new()) };
    static COUNTERS: RefCell<Vec<(Which, metrics::Counter)>> = const { RefCell::new(Vec::new()) };
}

/// Record `value` in the histogram `name` labelled `key=label`.
pub fn record(name: &'static str, key: &'static str, label: &'static str, value: f64) {
    HISTOGRAMS.with(|handles| {
        with_handle(&mut handles.borrow_mut(), (name, key, label), || metrics::histogram!(name, key => label), |h| h.record(value))
    });
}

/// Add `by` to the counter `name` labelled `key=label`.
pub fn increment(name: &'static str, key: &'static str, label: &'static str, by: u64) {
    COUNTERS.with(|handles| {
        with_handle(&mut handles.borrow_mut(), (name, key, label), || metrics::counter!(name, key => label), |c| c.increment(by))
    });
}

fn with_handle<H>(handles: &mut Vec<(Which, H)>, which: Which, make: impl FnOnce() -> H, used: impl FnOnce(&H)) {
    match handles.iter().find(|(held, _)| *held == which) {
        Some((_, handle)) => used(handle),
        None if handles.len() < MAX_HANDLES => {
            handles.push((which, make()));
            used(&handles.last().expect("just pushed").1);
        }
        None => used(&make()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_label_gets_one_handle_and_the_list_is_bounded() {
        let before = HISTOGRAMS.with(|h| h.borrow().len());
        for _ in 0..3 {
            record("rota_test_seconds", "kind", "a", 1.0);
            record("rota_test_seconds", "kind", "b", 1.0);
        }
        assert_eq!(HISTOGRAMS.with(|h| h.borrow().len()), before + 2);
        let made: Vec<&'static str> = (0..2 * MAX_HANDLES).map(|i| &*Box::leak(format!("l{i}").into_boxed_str())).collect();
        for label in &made {
            increment("rota_test_total", "kind", label, 1);
        }
        assert_eq!(COUNTERS.with(|c| c.borrow().len()), MAX_HANDLES);
    }
}
