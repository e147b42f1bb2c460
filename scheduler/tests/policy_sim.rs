//! Simulator tests: determinism, and agreement of the fifo/easy baselines
//! with the reference simulator (shared/tools/refsim.py) on a small sample.

use clap::Parser;
use rota_scheduler::sim::{run_sim, SimArgs};

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

/// `ROTA_SIM_ARGS="--trace ... --policy easy" cargo test --release -p rota-scheduler
/// --test policy_sim -- --ignored --nocapture`: run any simulation and print it.
#[test]
#[ignore]
fn sim_from_env() {
    let args = std::env::var("ROTA_SIM_ARGS").expect("set ROTA_SIM_ARGS");
    println!("{}", serde_json::to_string_pretty(&sim(&args)).unwrap());
}
