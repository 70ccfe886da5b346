//! The `netreap` command line: one module per subcommand under `cli/`.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use netreap::telemetry::logging;

/// netreap watches network namespaces being born and destroyed in the
/// kernel (eBPF) and releases pod IP reservations whose namespace is gone.
///
/// Needs root (CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN, CAP_SYS_ADMIN) and a
/// kernel with BTF (/sys/kernel/btf/vmlinux). Logs go to stderr, filtered by
/// NETREAP_LOG (e.g. `NETREAP_LOG=debug`).
#[derive(Debug, Parser)]
#[command(name = "netreap", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the agent until SIGINT or SIGTERM: load the probes, watch every
    /// netns, and release reservations whose netns is gone (journaled, with
    /// their evidence as JSON lines in the event stream).
    Run(cli::run::RunArgs),
    /// Report which probes load on this kernel, and why the others do not.
    Probes(cli::probes::ProbesArgs),
    /// Print every network namespace with its interfaces, addresses, age
    /// and creator (`--json`: the model snapshot).
    Netns(cli::netns::NetnsArgs),
    /// One-shot report: every reservation with its verdict and the evidence
    /// that decided it, totals per network (`--json` for release --from-report).
    Scan(cli::scan::ScanArgs),
    /// Release exactly the orphaned entries of a reviewed scan report, each
    /// re-verified first.
    Release(cli::release::ReleaseArgs),
    /// The running agent's attachment ledger: container, netns and every CNI
    /// operation seen (failed ones included).
    Attachments(cli::attachments::AttachmentsArgs),
    /// A self-contained demo on real namespaces and Debian's CNI plugins: leaks
    /// made like containerd #12130, released by the real agent as the netns die.
    Demo(cli::demo::DemoArgs),
    /// Every source of evidence (kernel probes, netlink, IPAM stores, CNI
    /// cache, container runtime, Kubernetes API): active or not, and why.
    Sources(cli::sources::SourcesArgs),
    /// Print the default configuration (`--print-default`) or check a file (`--check FILE`).
    Config(cli::config::ConfigArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `run` sets up logging from its configuration.
    if !matches!(cli.command, Command::Run(_)) {
        logging::init("info");
    }
    // The commands that only read and print end quietly when their reader
    // goes away (`netreap attachments | head`), as other Unix tools do,
    // instead of a panic on the failed write. The agent, a demo and a
    // release keep Rust's default (SIGPIPE ignored): a closed pipe must not
    // stop them half-way.
    if matches!(
        cli.command,
        Command::Probes(_)
            | Command::Sources(_)
            | Command::Netns(_)
            | Command::Config(_)
            | Command::Scan(_)
            | Command::Attachments(_)
    ) {
        // SAFETY: sets SIGPIPE's disposition for the process to the default;
        // no handler of ours runs.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Run(args) => cli::run::main(&args),
        Command::Probes(args) => cli::probes::main(&args),
        Command::Sources(args) => cli::sources::main(&args),
        Command::Netns(args) => cli::netns::main(&args),
        Command::Config(args) => cli::config::main(&args),
        Command::Scan(args) => cli::scan::main(&args),
        Command::Demo(args) => cli::demo::main(&args),
        Command::Release(args) => cli::release::main(&args),
        Command::Attachments(args) => cli::attachments::main(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("netreap: {}", render(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line; a cause whose text its parent
/// already quotes is not repeated.
fn render(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}
