//! `deploy/setup-debian.sh` decides which system packages a fresh machine
//! still needs. It runs here against fake roots, in `--check` mode (prints
//! the packages it would install, installs nothing).
//!
//! The script before this test existed took any `libclang*.so*` under
//! `/usr/lib/llvm-*/lib` as libclang, so a machine with only
//! `libclang-cpp14` (common on images) skipped `libclang-dev`, and the first
//! build failed in librocksdb-sys's bindgen. `only_libclang_cpp_still_needs_libclang_dev`
//! is that machine.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/setup-debian.sh")
}

/// A fake root holding `files` (empty files; paths relative to the root).
fn fake_root(files: &[&str]) -> Result<tempfile::TempDir> {
    let root = tempfile::tempdir()?;
    for file in files {
        let path = root.path().join(file);
        std::fs::create_dir_all(path.parent().context("a parent")?)?;
        std::fs::write(&path, b"")?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    Ok(root)
}

/// The packages the script would install on that root.
fn missing_packages(root: &Path) -> Result<Vec<String>> {
    let output = Command::new("bash").arg(script()).arg("--check").env("ROTA_SETUP_ROOT", root).output()?;
    ensure!(output.status.success(), "setup --check failed: {}", String::from_utf8_lossy(&output.stderr));
    Ok(String::from_utf8(output.stdout)?.split_whitespace().map(str::to_string).collect())
}

const TOOLS: [&str; 8] = [
    "usr/bin/protoc",
    "usr/bin/c++",
    "usr/bin/systemd-analyze",
    "usr/bin/kubectl",
    "usr/bin/promtool",
    "usr/bin/prometheus",
    "usr/bin/curl",
    "usr/bin/chromium",
];

#[test]
fn only_libclang_cpp_still_needs_libclang_dev() -> Result<()> {
    let root = fake_root(&[
        TOOLS[0],
        TOOLS[1],
        TOOLS[2],
        TOOLS[3],
        TOOLS[4],
        TOOLS[5],
        TOOLS[6],
        TOOLS[7],
        "usr/lib/llvm-14/lib/libclang-cpp.so.14",
        "usr/lib/x86_64-linux-gnu/libclang-cpp.so.14",
        "usr/lib/llvm-14/lib/libclangBasic.a",
    ])?;
    let missing = missing_packages(root.path())?;
    ensure!(missing == ["libclang-dev"], "libclang-cpp is not libclang: {missing:?}");
    Ok(())
}

#[test]
fn the_real_libclang_is_enough() -> Result<()> {
    for library in ["usr/lib/llvm-14/lib/libclang-14.so.1", "usr/lib/llvm-16/lib/libclang.so", "usr/lib/x86_64-linux-gnu/libclang-14.so.1"]
    {
        let mut files = TOOLS.to_vec();
        files.extend(["usr/lib/llvm-14/lib/libclang-cpp.so.14", library]);
        let root = fake_root(&files)?;
        let missing = missing_packages(root.path())?;
        ensure!(missing.is_empty(), "{library} is libclang, nothing to install: {missing:?}");
    }
    Ok(())
}

#[test]
fn a_bare_machine_needs_every_package() -> Result<()> {
    let root = fake_root(&[])?;
    let missing = missing_packages(root.path())?;
    let expected = ["protobuf-compiler", "g++", "libclang-dev", "systemd", "kubernetes-client", "prometheus", "curl", "chromium"];
    ensure!(missing == expected, "{missing:?}");
    Ok(())
}
