//! Makes the eBPF toolchain present: rust-src for nightly and a bpf-linker
//! built against nightly's own libLLVM (no LLVM package matches it here).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use crate::{BuildError, Workspace};

/// The nightly toolchain that builds the eBPF programs.
pub const EBPF_TOOLCHAIN: &str = "nightly";
/// The bpf-linker release whose `llvm-<N>` features match nightly's LLVM.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Runs a command, inheriting stdio, and turns failure into a typed error.
pub fn run(cmd: &mut Command) -> Result<(), BuildError> {
    let command = format!("{cmd:?}");
    let status = cmd
        .status()
        .map_err(|source| BuildError::Spawn { program: cmd.get_program().to_string_lossy().into_owned(), source })?;
    if status.success() { Ok(()) } else { Err(BuildError::Failed { command, status: status.to_string() }) }
}

/// Runs a command and returns its stdout.
pub fn output(cmd: &mut Command) -> Result<String, BuildError> {
    let command = format!("{cmd:?}");
    let out = cmd
        .output()
        .map_err(|source| BuildError::Spawn { program: cmd.get_program().to_string_lossy().into_owned(), source })?;
    if !out.status.success() {
        return Err(BuildError::Failed {
            command,
            status: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A `rustup run nightly <program>` command with the outer cargo's
/// build-script environment removed, so nothing of the host build leaks in.
#[must_use]
pub fn nightly(program: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", EBPF_TOOLCHAIN, program]);
    for var in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_MAKEFLAGS",
        "RUSTUP_TOOLCHAIN",
        "CARGO",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// Facts about the nightly compiler that the linker must match.
#[derive(Debug, Clone)]
pub struct NightlyInfo {
    pub sysroot: PathBuf,
    pub llvm_major: u32,
    /// File name of rustc's own libLLVM, e.g. `libLLVM.so.22.1-rust-1.97.0-nightly`.
    pub libllvm: String,
}

impl NightlyInfo {
    pub fn query() -> Result<Self, BuildError> {
        let sysroot = PathBuf::from(output(nightly("rustc").args(["--print", "sysroot"]))?.trim());
        let verbose = output(nightly("rustc").arg("-vV"))?;
        let llvm = verbose
            .lines()
            .find_map(|l| l.strip_prefix("LLVM version: "))
            .ok_or_else(|| BuildError::Toolchain("`rustc +nightly -vV` names no LLVM version".into()))?
            .trim()
            .to_owned();
        let release = verbose
            .lines()
            .find_map(|l| l.strip_prefix("release: "))
            .ok_or_else(|| BuildError::Toolchain("`rustc +nightly -vV` names no release".into()))?
            .trim()
            .to_owned();
        let mut parts = llvm.split('.');
        let major: u32 = parts
            .next()
            .and_then(|m| m.parse().ok())
            .ok_or_else(|| BuildError::Toolchain(format!("unparsable LLVM version {llvm}")))?;
        let minor = parts.next().unwrap_or("0");
        let libllvm = format!("libLLVM.so.{major}.{minor}-rust-{release}");
        if !sysroot.join("lib").join(&libllvm).exists() {
            return Err(BuildError::Toolchain(format!(
                "nightly's libLLVM is not where `rustc -vV` says: {}",
                sysroot.join("lib").join(&libllvm).display()
            )));
        }
        Ok(Self { sysroot, llvm_major: major, libllvm })
    }

    #[must_use]
    pub fn lib_dir(&self) -> PathBuf {
        self.sysroot.join("lib")
    }
}

/// Installs rust-src for nightly when the sysroot lacks it (build-std needs it).
pub fn ensure_rust_src(info: &NightlyInfo) -> Result<(), BuildError> {
    let src = info.sysroot.join("lib/rustlib/src/rust/library/core");
    if src.exists() {
        return Ok(());
    }
    eprintln!("netreap-build: installing rust-src for {EBPF_TOOLCHAIN}");
    run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", EBPF_TOOLCHAIN]))
}

/// Returns the path of a bpf-linker that uses nightly's LLVM, building it
/// once into `target/tools` when missing.
pub fn ensure_bpf_linker(ws: &Workspace, info: &NightlyInfo) -> Result<PathBuf, BuildError> {
    let tools = ws.tools_dir();
    let linker = tools.join("bin/bpf-linker");
    let stamp = tools.join(format!("bpf-linker.llvm-{}.{}", info.llvm_major, info.libllvm));
    if linker.exists() && stamp.exists() {
        return Ok(linker);
    }
    let prefix = tools.join("llvm-prefix");
    let prefix_lib = prefix.join("lib");
    fs::create_dir_all(&prefix_lib).map_err(|source| BuildError::Io { path: prefix_lib.clone(), source })?;
    let real = info.lib_dir().join(&info.libllvm);
    for name in ["libLLVM.so", info.libllvm.as_str()] {
        symlink_fresh(&real, &prefix_lib.join(name))?;
    }
    eprintln!(
        "netreap-build: building bpf-linker {BPF_LINKER_VERSION} against {} (once, cached in {})",
        real.display(),
        tools.display()
    );
    let mut cmd = Command::new("cargo");
    cmd.args(["install", "bpf-linker", "--locked", "--force", "--version", BPF_LINKER_VERSION])
        .args(["--no-default-features", "--features"])
        .arg(format!("llvm-{}", info.llvm_major))
        .arg("--root")
        .arg(&tools)
        .env("LLVM_PREFIX", &prefix)
        .env(format!("LLVM_SYS_{}0_PREFIX", info.llvm_major), &prefix);
    for var in ["CARGO_TARGET_DIR", "RUSTC", "RUSTC_WRAPPER", "RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS", "CARGO_MAKEFLAGS"]
    {
        cmd.env_remove(var);
    }
    run(&mut cmd)?;
    fs::write(&stamp, b"").map_err(|source| BuildError::Io { path: stamp.clone(), source })?;
    Ok(linker)
}

fn symlink_fresh(target: &Path, link: &Path) -> Result<(), BuildError> {
    if fs::read_link(link).is_ok_and(|t| t == target) {
        return Ok(());
    }
    let _ = fs::remove_file(link);
    std::os::unix::fs::symlink(target, link).map_err(|source| BuildError::Io { path: link.to_path_buf(), source })
}
