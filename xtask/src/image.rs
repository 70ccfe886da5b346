//! `cargo xtask image`: the agent's container image, built on this machine
//! with no registry.
//!
//! 1. The agent is built here (`cargo build --release`; build.rs embeds the
//!    eBPF object), linked against this machine's glibc.
//! 2. The base is a Debian root file system made by `mmdebstrap` from the
//!    apt mirror, holding only what the binary links against (`libc6`,
//!    `libgcc-s1`, extracted, not installed): no shell, no package manager,
//!    distroless-style. It is
//!    made for this machine's Debian release (so its glibc is the one the
//!    binary was linked against) and imported as
//!    `localhost/netreap-base:<release>`.
//! 3. `deploy/Containerfile` is built with podman on that base, with a
//!    context holding only the binary, and tagged `netreap:<version>`.
//! 4. An OCI archive is saved as `target/netreap-<version>.oci.tar`, for
//!    `podman load` / `ctr -n k8s.io images import` / `skopeo copy`.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use crate::{BuildError, Workspace, system, toolchain};

/// What the binary links against: the whole base.
const BASE_PACKAGES: &str = "libc6,libgcc-s1";

/// The image `cargo xtask image` built.
#[derive(Debug, Clone)]
pub struct Image {
    /// `netreap:<version>` (podman stores it as `localhost/netreap:<version>`).
    pub tag: String,
    pub archive: PathBuf,
}

/// The agent's version, from the workspace's Cargo.toml.
pub fn version(ws: &Workspace) -> Result<String, BuildError> {
    let manifest = ws.root.join("Cargo.toml");
    let text =
        std::fs::read_to_string(&manifest).map_err(|source| BuildError::Io { path: manifest.clone(), source })?;
    text.lines()
        .skip_while(|l| l.trim() != "[workspace.package]")
        .find_map(|l| l.strip_prefix("version = ").map(|v| v.trim().trim_matches('"').to_owned()))
        .ok_or_else(|| BuildError::Toolchain(format!("no [workspace.package] version in {}", manifest.display())))
}

/// This machine's Debian release (`VERSION_CODENAME`).
fn debian_release() -> Result<String, BuildError> {
    let path = Path::new("/etc/os-release");
    let text = std::fs::read_to_string(path).map_err(|source| BuildError::Io { path: path.into(), source })?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|v| v.trim_matches('"').to_owned())
        .filter(|v| !v.is_empty())
        .ok_or_else(|| BuildError::Toolchain("no VERSION_CODENAME in /etc/os-release (not Debian?)".into()))
}

/// Builds the image and its archive; see the module documentation.
pub fn build(ws: &Workspace) -> Result<Image, BuildError> {
    system::ensure(system::IMAGE_PACKAGES)?;
    let info = toolchain::NightlyInfo::query()?;
    toolchain::ensure_rust_src(&info)?;
    toolchain::ensure_bpf_linker(ws, &info)?;
    let version = version(ws)?;
    let release = debian_release()?;
    let work = ws.target.join("image");
    mkdir(&work)?;

    eprintln!("xtask image: building the agent (release)");
    toolchain::run(Command::new("cargo").current_dir(&ws.root).args([
        "build",
        "--release",
        "--locked",
        "-p",
        "netreap",
    ]))?;
    let binary = ws.target.join("release/netreap");

    let base_image = format!("localhost/netreap-base:{release}");
    let base_rootfs = work.join(format!("base-{release}.tar"));
    if base_rootfs.exists() {
        eprintln!("xtask image: base root file system {} (cached; delete it to rebuild)", base_rootfs.display());
    } else {
        eprintln!("xtask image: making the base root file system with mmdebstrap ({release}: {BASE_PACKAGES})");
        let partial = work.join(format!("base-{release}.tar.partial"));
        toolchain::run(
            Command::new("mmdebstrap")
                .args(["--mode=root", "--variant=extract", "--quiet", "--format=tar"])
                .arg(format!("--include={BASE_PACKAGES}"))
                // Extracted, not installed: no dpkg, no maintainer scripts run
                // in the image; documentation is of no use to the agent.
                .args(["--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*"])
                .arg(&release)
                .arg(&partial),
        )?;
        rename(&partial, &base_rootfs)?;
    }
    toolchain::run(Command::new("podman").args(["import", "--quiet"]).arg(&base_rootfs).arg(&base_image))?;

    let context = work.join("context");
    let _ = std::fs::remove_dir_all(&context);
    mkdir(&context)?;
    let staged = context.join("netreap");
    std::fs::copy(&binary, &staged).map_err(|source| BuildError::Io { path: staged.clone(), source })?;

    let tag = format!("netreap:{version}");
    eprintln!("xtask image: podman build -f deploy/Containerfile -t {tag}");
    toolchain::run(
        Command::new("podman")
            .args(["build", "--quiet", "--pull=never", "--build-arg"])
            .arg(format!("BASE={base_image}"))
            .arg("--file")
            .arg(ws.root.join("deploy/Containerfile"))
            .args(["--tag", &tag])
            .arg(&context),
    )?;

    let archive = ws.target.join(format!("netreap-{version}.oci.tar"));
    let _ = std::fs::remove_file(&archive);
    toolchain::run(
        Command::new("podman").args(["save", "--quiet", "--format", "oci-archive", "--output"]).arg(&archive).arg(&tag),
    )?;
    eprintln!("xtask image: {tag} built; OCI archive {}", archive.display());
    Ok(Image { tag, archive })
}

fn mkdir(path: &Path) -> Result<(), BuildError> {
    std::fs::create_dir_all(path).map_err(|source| BuildError::Io { path: path.to_owned(), source })
}

fn rename(from: &Path, to: &Path) -> Result<(), BuildError> {
    std::fs::rename(from, to).map_err(|source| BuildError::Io { path: to.to_owned(), source })
}
