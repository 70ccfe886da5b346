//! `cargo xtask <command>`: developer commands for netreap.

use std::process::ExitCode;


use xtask::{BuildError, Workspace, ebpf, system, toolchain};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  build-ebpf      build the eBPF object (installs rust-src and bpf-linker when missing)
  install-tools   only install rust-src for nightly and build bpf-linker into target/tools
  test            install what the tests need (apt packages, eBPF toolchain), then run
                  every test of the workspace (as root: kernel tests load real probes)
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
        Some("test") => test(&ws, &args[1..]),
        Some("vm-test") => return xtask::vm::main(&ws, &args[1..]),
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
