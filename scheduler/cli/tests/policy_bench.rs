//! `ROTA_BENCH_ARGS="--pending 50000 --running 8000" cargo test --release -p rota-cli
//! --test policy_bench -- --ignored --nocapture`: the plan-pass benchmark (what
//! `rota bench plan` runs). Ignored by default: timings belong in BENCHMARKS.md,
//! not in assertions. The small test below checks the synthetic cluster and
//! that a pass over it is valid.

use clap::Parser;
use rota_cli::sim::{run_bench_plan, BenchPlanArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchPlanArgs,
}

fn bench(args: &str) -> serde_json::Value {
    let argv = std::iter::once("bench").chain(args.split_whitespace());
    run_bench_plan(&Cli::try_parse_from(argv).expect("valid arguments").bench).expect("bench runs")
}

#[test]
#[ignore]
fn bench_plan_from_env() {
    let args = std::env::var("ROTA_BENCH_ARGS").unwrap_or_default();
    println!("{}", serde_json::to_string_pretty(&bench(&args)).unwrap());
}

#[test]
fn small_bench_cluster_plans() {
    let out = bench("--nodes 40 --pending 2000 --running 250 --iterations 1");
    assert_eq!(out["nodes"], 40);
    assert!(out["running"].as_u64().unwrap() > 200);
    assert!(out["pending"].as_u64().unwrap() >= 1990);
    assert!(out["first_pass"]["notes"].as_u64().unwrap() > 1000, "{out}");
}
