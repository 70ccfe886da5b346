//! The eBPF builder, shared by `cargo xtask build-ebpf` and the agent's
//! `build.rs`, so a fresh clone builds with no manual step.
//!
//! It installs what a fresh machine lacks (rust-src for nightly, bpf-linker
//! linked against nightly's own libLLVM), caching the tools under `target/`.

pub mod ebpf;
pub mod image;
pub mod lint;
pub mod system;
pub mod testrun;
pub mod toolchain;
pub mod vm;

use std::{fmt, io, path::PathBuf};

/// Why a build step failed; each names the command or file involved.
#[derive(Debug)]
pub enum BuildError {
    Spawn { program: String, source: io::Error },
    Failed { command: String, status: String },
    Io { path: PathBuf, source: io::Error },
    Toolchain(String),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Spawn { program, source } => write!(f, "cannot run {program}: {source}"),
            Self::Failed { command, status } => write!(f, "`{command}` failed: {status}"),
            Self::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Self::Toolchain(msg) => write!(f, "toolchain: {msg}"),
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Spawn { source, .. } | Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Paths of the workspace the builder works in.
#[derive(Debug, Clone)]
pub struct Workspace {
    pub root: PathBuf,
    pub target: PathBuf,
}

impl Workspace {
    /// The workspace whose root holds `xtask/` (this crate's parent dir).
    #[must_use]
    pub fn locate() -> Self {
        Self::of_member(std::path::Path::new(env!("CARGO_MANIFEST_DIR")))
    }

    /// The workspace that `member_dir` (a member crate's directory) is in.
    /// A build script passes its own, read when it runs: `locate` holds
    /// the path this crate was compiled at, and cargo keeps that build when
    /// the checkout moves.
    #[must_use]
    pub fn of_member(member_dir: &std::path::Path) -> Self {
        let root = member_dir.parent().map_or_else(|| PathBuf::from("."), std::path::Path::to_path_buf);
        let target = std::env::var_os("NETREAP_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
        Self { root, target }
    }

    /// Where self-built tools (bpf-linker) are cached.
    #[must_use]
    pub fn tools_dir(&self) -> PathBuf {
        self.target.join("tools")
    }

    /// The target dir of the nested eBPF build (apart from the host build's,
    /// whose lock the outer cargo holds while build.rs runs).
    #[must_use]
    pub fn ebpf_target_dir(&self) -> PathBuf {
        self.target.join("ebpf")
    }
}
