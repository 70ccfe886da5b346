//! `cargo xtask <command>`: developer commands for netreap.

use std::process::ExitCode;

use xtask::{BuildError, Workspace, ebpf, system, toolchain};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  build-ebpf      build the eBPF object (installs rust-src and bpf-linker when missing)
  install-tools   only install rust-src for nightly and build bpf-linker into target/tools
  lint            cargo fmt --check, clippy -D warnings on host targets, and clippy on the eBPF
                  crate for its BPF target (nightly): what CI enforces
  test            install what the tests need (apt packages, eBPF toolchain), then run
                  every test of the workspace (as root: kernel tests load real probes)
  bench           run the benchmarks as root (netns_death, reclaim) and print their tables:
                  bench [netns_death] [lastlook] [latency] [overhead] [scale] [burst] [down] [rest] (none named: all but lastlook)
  image           build the agent's container image with no registry: a distroless Debian base from
                  mmdebstrap, deploy/Containerfile built with podman, tagged netreap:<version>,
                  saved as target/netreap-<version>.oci.tar
  daemonset-test  build the image, then run deploy/daemonset.yaml's pod template with podman the
                  way kubelet would (agent/tests/daemonset.rs) on real namespaces and plugins
  vm-test         run the kernel-facing tests in Debian 6.1/6.12 kernels under qemu and on
                  this host: vm-test [--kernel 6.1|6.12|host|all] [--timeout SECS]
";

fn main() -> ExitCode {
    let ws = Workspace::locate();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("build-ebpf") => ebpf::build(&ws).map(|obj| println!("{}", obj.display())),
        Some("install-tools") => toolchain::NightlyInfo::query().and_then(|info| {
            toolchain::ensure_rust_src(&info)?;
            let linker = toolchain::ensure_bpf_linker(&ws, &info)?;
            println!("{}", linker.display());
            Ok(())
        }),
        Some("lint") => xtask::lint::lint(&ws),
        Some("test") => test(&ws, &args[1..]),
        Some("bench") => bench(&ws, &args[1..]),
        Some("vm-test") => return xtask::vm::main(&ws, &args[1..]),
        Some("image") => xtask::image::build(&ws).map(|_| ()),
        Some("daemonset-test") => daemonset_test(&ws),
        Some("-h" | "--help" | "help") => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprint!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo xtask test [-- cargo test args]`: the README's test command.
fn test(ws: &Workspace, extra: &[String]) -> Result<(), BuildError> {
    system::ensure_packages()?;
    let info = toolchain::NightlyInfo::query()?;
    toolchain::ensure_rust_src(&info)?;
    toolchain::ensure_bpf_linker(ws, &info)?;
    xtask::testrun::cargo_test(&ws.root, extra)
}

/// `cargo xtask daemonset-test`: the image, then the DaemonSet's pod spec
/// run in podman on this host (agent/tests/daemonset.rs, ignored by a plain
/// `cargo test` because it needs the image).
fn daemonset_test(ws: &Workspace) -> Result<(), BuildError> {
    system::ensure_packages()?;
    xtask::image::build(ws)?;
    toolchain::run(std::process::Command::new("cargo").current_dir(&ws.root).args([
        "test",
        "-p",
        "netreap",
        "--test",
        "daemonset",
        "--",
        "--ignored",
        "--nocapture",
    ]))
}

/// `cargo xtask bench [netns_death] [latency|overhead|scale|burst|down|rest]...`:
/// the issue 6 and 13 benchmarks. Item names go to the reclaim bench; netns_death runs
/// when named or when nothing is. Root: they create namespaces and load probes.
fn bench(ws: &Workspace, extra: &[String]) -> Result<(), BuildError> {
    // std only: the effective uid from /proc rather than libc::geteuid.
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Uid:").map(|u| u.split_whitespace().nth(1) == Some("0"))))
        .unwrap_or(false);
    if !root {
        let status = "needs root (network namespaces, eBPF probes)".to_owned();
        return Err(BuildError::Failed { command: "cargo xtask bench".into(), status });
    }
    let all = extra.is_empty();
    let reclaim_args: Vec<&String> =
        extra.iter().filter(|a| !["netns_death", "lastlook"].contains(&a.as_str())).collect();
    if all || extra.iter().any(|a| a == "netns_death") {
        toolchain::run(std::process::Command::new("cargo").current_dir(&ws.root).args([
            "bench",
            "-p",
            "netreap",
            "--bench",
            "netns_death",
        ]))?;
    }
    // The last look alone at 200 and 1000 netns (issue 13.4): only when named.
    if extra.iter().any(|a| a == "lastlook") {
        toolchain::run(
            std::process::Command::new("cargo")
                .current_dir(&ws.root)
                .args(["bench", "-p", "netreap", "--bench", "lastlook"]),
        )?;
    }
    if all || !reclaim_args.is_empty() {
        toolchain::run(
            std::process::Command::new("cargo")
                .current_dir(&ws.root)
                .args(["bench", "-p", "netreap", "--bench", "reclaim", "--"])
                .args(reclaim_args),
        )?;
    }
    Ok(())
}
