//! Builds the `netreap-ebpf` crate for the BPF target with nightly.

use std::{path::PathBuf, process::Command};

use crate::{
    BuildError, Workspace,
    toolchain::{NightlyInfo, ensure_bpf_linker, ensure_rust_src, nightly, run},
};

/// The eBPF package and its binary (one object holding every program).
pub const EBPF_PACKAGE: &str = "netreap-ebpf";
pub const BPF_TARGET: &str = "bpfel-unknown-none";

/// Builds the eBPF object (installing missing tools first) and returns its path.
pub fn build(ws: &Workspace) -> Result<PathBuf, BuildError> {
    let info = NightlyInfo::query()?;
    ensure_rust_src(&info)?;
    let linker = ensure_bpf_linker(ws, &info)?;
    let linker_dir = linker.parent().map(PathBuf::from).unwrap_or_default();

    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![linker_dir];
    dirs.extend(std::env::split_paths(&path));
    let path = std::env::join_paths(dirs).map_err(|e| BuildError::Toolchain(format!("cannot extend PATH: {e}")))?;
    let ld_path = std::env::join_paths(
        std::iter::once(info.lib_dir())
            .chain(std::env::split_paths(&std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default())),
    )
    .map_err(|e| BuildError::Toolchain(format!("cannot extend LD_LIBRARY_PATH: {e}")))?;

    // bpf_target_arch lets aya-ebpf pick the right pt_regs layout; --btf
    // makes bpf-linker emit BTF so the kernel can check the programs.
    let rustflags = ["--cfg=bpf_target_arch=\"x86_64\"", "-Cdebuginfo=2", "-Clink-arg=--btf"].join("\x1f");

    let mut cmd: Command = nightly("cargo");
    cmd.current_dir(&ws.root)
        .args(["build", "--release", "-Z", "build-std=core", "--target", BPF_TARGET])
        .args(["--package", EBPF_PACKAGE, "--bin", EBPF_PACKAGE])
        .arg("--target-dir")
        .arg(ws.ebpf_target_dir())
        .env("PATH", path)
        .env("LD_LIBRARY_PATH", ld_path)
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags)
        // Not the agent's fat LTO and single codegen unit (Cargo.toml):
        // cargo's release defaults, so the programs the kernel matrix's
        // verifiers accepted keep the same instructions (checked with
        // llvm-objdump -d; only symbol hashes in the debug info differ).
        // The eBPF crate keeps its own codegen-units = 1.
        .env("CARGO_PROFILE_RELEASE_LTO", "false")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16");
    run(&mut cmd)?;
    Ok(object_path(ws))
}

/// Where [`build`] leaves the object.
#[must_use]
pub fn object_path(ws: &Workspace) -> PathBuf {
    ws.ebpf_target_dir().join(BPF_TARGET).join("release").join(EBPF_PACKAGE)
}

/// Source paths whose change must rebuild the object (for build.rs).
#[must_use]
pub fn source_paths(ws: &Workspace) -> Vec<PathBuf> {
    vec![ws.root.join("agent-ebpf"), ws.root.join("common"), ws.root.join("Cargo.toml")]
}
