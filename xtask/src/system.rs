//! System packages the build, the tests and the demo use: iproute2 (`ip`),
//! util-linux (`unshare`, `nsenter`, `flock`), Debian's real CNI plugins,
//! protoc (the CRI protos are compiled at build time), promtool
//! (`prometheus`), and for the CRI tests the real containerd with runc, gcc
//! (a static pause binary) and python3 (a test CNI plugin; the Kubernetes
//! tests' stand-in API server and whereabouts plugin).

use std::{path::Path, process::Command};

use crate::{BuildError, toolchain::run};

/// (a file that proves the package is installed, the Debian package).
const PACKAGES: &[(&str, &str)] = &[
    ("/usr/lib/cni/host-local", "containernetworking-plugins"),
    ("/usr/lib/cni/bridge", "containernetworking-plugins"),
    ("/usr/sbin/ip", "iproute2"),
    ("/usr/bin/unshare", "util-linux"),
    ("/usr/bin/nsenter", "util-linux"),
    ("/usr/bin/protoc", "protobuf-compiler"),
    ("/usr/bin/containerd", "containerd"),
    ("/usr/bin/ctr", "containerd"),
    ("/usr/sbin/runc", "runc"),
    ("/usr/bin/gcc", "gcc"),
    ("/usr/lib/x86_64-linux-gnu/libc.a", "libc6-dev"),
    ("/usr/bin/python3", "python3"),
    // promtool checks /metrics (agent/tests/http.rs).
    ("/usr/bin/promtool", "prometheus"),
];

/// What `cargo xtask image` and `daemonset-test` need: a Debian root file
/// system without a registry (mmdebstrap), and an engine to build, save and
/// run OCI images (podman; runc, because crun refuses this kind of host's
/// hybrid cgroups).
pub const IMAGE_PACKAGES: &[(&str, &str)] = &[
    ("/usr/bin/mmdebstrap", "mmdebstrap"),
    ("/usr/bin/podman", "podman"),
    ("/usr/sbin/runc", "runc"),
    // The release build compiles the CRI protos.
    ("/usr/bin/protoc", "protobuf-compiler"),
];

/// Installs the missing packages the tests need with apt-get (root, Debian).
pub fn ensure_packages() -> Result<(), BuildError> {
    ensure(PACKAGES)
}

/// Installs the missing packages of `list` ((a file that proves it, the
/// Debian package)) with apt-get.
pub fn ensure(list: &[(&str, &str)]) -> Result<(), BuildError> {
    let mut missing: Vec<&str> =
        list.iter().filter(|(file, _)| !Path::new(file).exists()).map(|(_, pkg)| *pkg).collect();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=600", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}
