//! `cargo xtask lint`: the style CI enforces, runnable locally. rustfmt's
//! check, clippy with warnings denied on every host target (tests and
//! benches included), and clippy on the eBPF crate built for its own target
//! with nightly, where it actually compiles.

use std::process::Command;

use crate::{
    BuildError, Workspace,
    ebpf::{BPF_TARGET, EBPF_PACKAGE},
    toolchain::{NightlyInfo, ensure_rust_src, nightly, run},
};

/// Runs every check, stopping at the first that fails.
pub fn lint(ws: &Workspace) -> Result<(), BuildError> {
    println!("== cargo fmt --all --check");
    run(Command::new("cargo").current_dir(&ws.root).args(["fmt", "--all", "--check"]))?;

    println!("== cargo clippy (host targets, -D warnings)");
    run(Command::new("cargo").current_dir(&ws.root).args([
        "clippy",
        "--workspace",
        "--exclude",
        EBPF_PACKAGE,
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;

    println!("== cargo +nightly clippy ({EBPF_PACKAGE} for {BPF_TARGET}, -D warnings)");
    let info = NightlyInfo::query()?;
    ensure_rust_src(&info)?;
    let mut cmd = nightly("cargo");
    cmd.current_dir(&ws.root)
        .args(["clippy", "-Z", "build-std=core", "--target", BPF_TARGET, "--package", EBPF_PACKAGE, "--bins"])
        .arg("--target-dir")
        .arg(ws.root.join("target").join("ebpf-clippy"))
        .args(["--", "-D", "warnings"])
        // The same cfg the real build sets (ebpf.rs), so clippy sees the
        // code that is compiled.
        .env("CARGO_ENCODED_RUSTFLAGS", "--cfg=bpf_target_arch=\"x86_64\"");
    run(&mut cmd)
}
