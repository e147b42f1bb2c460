//! A reader that closes the pipe early (`rota ... | head -1`) ends the CLI
//! quietly with success, not with a panic about printing.

use std::process::{Command, Stdio};

#[test]
fn a_closed_standard_output_ends_the_cli_quietly() {
    // Building 20,000 pending jobs takes the CLI milliseconds: the pipe's
    // reading end is gone well before it prints.
    let mut child = Command::new(env!("CARGO_BIN_EXE_rota"))
        .args(["bench", "plan", "--nodes", "4", "--gpus-per-node", "8", "--pending", "20000", "--running", "0", "--iterations", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the CLI starts");
    drop(child.stdout.take());
    let output = child.wait_with_output().expect("the CLI ends");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "the CLI panicked: {stderr}");
    assert!(output.status.success(), "exit status {:?}, stderr: {stderr}", output.status);
}
