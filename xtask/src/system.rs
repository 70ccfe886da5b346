//! System packages the tests and the demo use: iproute2 (`ip`), util-linux
//! (`unshare`, `nsenter`), Debian's real CNI plugins and promtool (`prometheus`).

use std::{path::Path, process::Command};

use crate::{BuildError, toolchain::run};

/// (a file that proves the package is installed, the Debian package).
const PACKAGES: &[(&str, &str)] = &[
    ("/usr/lib/cni/host-local", "containernetworking-plugins"),
    ("/usr/lib/cni/bridge", "containernetworking-plugins"),
    ("/usr/sbin/ip", "iproute2"),
    ("/usr/bin/unshare", "util-linux"),
    ("/usr/bin/nsenter", "util-linux"),
    // promtool checks /metrics (agent/tests/http.rs).
    ("/usr/bin/promtool", "prometheus"),
];

/// Installs the missing packages with apt-get (root, Debian).
pub fn ensure_packages() -> Result<(), BuildError> {
    let mut missing: Vec<&str> =
        PACKAGES.iter().filter(|(file, _)| !Path::new(file).exists()).map(|(_, pkg)| *pkg).collect();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}
