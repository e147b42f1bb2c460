//! Simulator tests: determinism, and agreement of the fifo/easy baselines
//! with the reference simulator (shared/tools/refsim.py) on a small sample.

use clap::Parser;
use rota_cli::sim::{run_sim, SimArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    sim: SimArgs,
}

fn sim(args: &str) -> serde_json::Value {
    let argv = std::iter::once("sim").chain(args.split_whitespace());
    let cli = Cli::try_parse_from(argv).expect("valid arguments");
    run_sim(&cli.sim).expect("simulation runs")
}

/// `ROTA_SIM_ARGS="--trace ... --policy easy" cargo test --release -p rota-cli
/// --test policy_sim -- --ignored --nocapture`: run any simulation and print it.
#[test]
#[ignore]
fn sim_from_env() {
    let args = std::env::var("ROTA_SIM_ARGS").expect("set ROTA_SIM_ARGS");
    println!("{}", serde_json::to_string_pretty(&sim(&args)).unwrap());
}

const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/philly_days21-24.csv");

fn sample(policy: &str) -> serde_json::Value {
    sim(&format!("--trace {SAMPLE} --from-s 1814400 --to-s 2073600 --nodes 24 --gpus-per-node 8 --policy {policy}"))
}

fn close(got: f64, want: f64, what: &str) {
    assert!((got - want).abs() <= 0.02 * want, "{what}: {got} is not within 2% of refsim's {want}");
}

/// refsim.py on the same sample, window and cluster:
/// `python3 shared/tools/refsim.py --trace tests/data/philly_days21-24.csv --from-s 1814400
/// --to-s 2073600 --nodes 24 --gpus-per-node 8 --policy fifo|easy --json`
#[test]
fn fifo_and_easy_agree_with_the_reference_simulator() {
    let fifo = sample("fifo");
    close(fifo["wait_s"]["mean"].as_f64().unwrap(), 47383.619, "fifo mean wait");
    close(fifo["bounded_slowdown_mean"].as_f64().unwrap(), 664.542, "fifo slowdown");
    close(fifo["utilization"].as_f64().unwrap(), 0.752362, "fifo utilization");
    let easy = sample("easy");
    close(easy["wait_s"]["mean"].as_f64().unwrap(), 10489.870, "easy mean wait");
    close(easy["bounded_slowdown_mean"].as_f64().unwrap(), 80.810, "easy slowdown");
    close(easy["utilization"].as_f64().unwrap(), 0.787949, "easy utilization");
    assert_eq!(easy["finished"], 2480);
    assert_eq!(easy["preemptions"], 0);
    assert_eq!(fifo["rejected_placements"], 0);
    assert_eq!(easy["rejected_placements"], 0);
}

#[test]
fn rota_simulation_is_deterministic_and_finishes_every_job() {
    let strip = |mut v: serde_json::Value| {
        v.as_object_mut().unwrap().remove("timing");
        v
    };
    let first = strip(sample("rota"));
    let second = strip(sample("rota"));
    assert_eq!(first, second);
    assert_eq!(first["finished"], 2480);
    assert_eq!(first["unfinished"], 0);
    assert_eq!(first["rejected_placements"], 0, "apply refused a placement of the policy");
}

/// A guard on the policy's figures, on the committed sample: refsim's EASY
/// with the short partition first (`--order short-first`) gives mean wait
/// 4,436 s and mean bounded slowdown 19.45 there; plain EASY a p99 wait of
/// 77,889 s. Rota must stay at or below 0.7x of the first two and below the
/// third (BENCHMARKS.md has the full-size windows). Utilization is left out
/// here: over a 3-day window with a backlog it mostly measures which jobs
/// are left for after the window.
#[test]
fn rota_beats_short_first_easy_on_the_sample() {
    let rota = sample("rota");
    let mean_wait = rota["wait_s"]["mean"].as_f64().unwrap();
    let slowdown = rota["bounded_slowdown_mean"].as_f64().unwrap();
    let p99_wait = rota["wait_s"]["p99"].as_f64().unwrap();
    assert!(mean_wait <= 0.7 * 4436.334, "mean wait {mean_wait} s");
    assert!(slowdown <= 0.7 * 19.447, "bounded slowdown {slowdown}");
    assert!(p99_wait <= 77889.0, "p99 wait {p99_wait} s");
}
