//! The `netreap` command line.

use std::{process::ExitCode, time::SystemTime};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use netreap::{
    kernel::{
        events::KernelEvent,
        probes::{ProbeState, Probes},
        stream::KernelStream,
    },
    telemetry::{clock::Clock, logging, stream::EventStream},
};
use tokio::signal::unix::{SignalKind, signal};
use tracing::{info, warn};

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
    /// Run the agent until SIGINT or SIGTERM: load the probes and write
    /// every kernel event as a JSON line.
    Run(RunArgs),
    /// Report which probes load on this kernel, and why the others do not.
    Probes(ProbesArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Where the JSON event stream goes: `-` for stdout, or a file to append to.
    #[arg(long, env = "NETREAP_EVENTS", default_value = "-")]
    events: String,
}

#[derive(Debug, clap::Args)]
struct ProbesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init("info");
    let result = match cli.command {
        Command::Run(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")
            .and_then(|rt| rt.block_on(run(args))),
        Command::Probes(args) => probes(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("netreap: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn log_probe_status(probes: &Probes) {
    for s in &probes.status {
        match &s.state {
            ProbeState::Active => info!(probe = s.spec.program, attach = %s.spec.attach, "probe active"),
            ProbeState::Unavailable(reason) => warn!(
                probe = s.spec.program,
                attach = %s.spec.attach,
                fallback = s.spec.fallback,
                "probe unavailable on this kernel: {reason}"
            ),
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut out = EventStream::open(&args.events).context("opening the event stream")?;
    let mut probes = Probes::load().context("loading the eBPF probes")?;
    log_probe_status(&probes);
    let mut kernel = KernelStream::new(&mut probes)?;
    let clock = Clock::new();
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut drop_check = tokio::time::interval(std::time::Duration::from_secs(1));
    info!("netreap running; events to {}", args.events);
    loop {
        tokio::select! {
            _ = sigterm.recv() => { info!("SIGTERM: detaching probes"); break; }
            _ = sigint.recv() => { info!("SIGINT: detaching probes"); break; }
            batch = kernel.next_batch() => {
                for record in batch? {
                    match record {
                        Ok(event) => {
                            log_event(&event);
                            out.emit(clock.wall(event.task().ktime_ns), event.name(), &event)?;
                        }
                        Err(e) => {
                            warn!("malformed kernel record skipped: {e}");
                            out.emit(SystemTime::now(), "malformed_record", &serde_json::json!({ "error": e.to_string() }))?;
                        }
                    }
                }
            }
            _ = drop_check.tick() => {
                let dropped = kernel.new_drops()?;
                if dropped > 0 {
                    warn!(dropped, "ring buffer full: kernel records lost");
                    out.emit(SystemTime::now(), "records_dropped", &serde_json::json!({ "dropped": dropped }))?;
                }
            }
        }
    }
    drop(kernel);
    drop(probes);
    info!("probes detached; bye");
    Ok(())
}

fn log_event(event: &KernelEvent) {
    let t = event.task();
    match event {
        KernelEvent::NetnsEntered { netns_inode, via, .. } | KernelEvent::NetnsCreated { netns_inode, via, .. } => {
            info!(netns = netns_inode, ?via, pid = t.tgid, comm = %t.comm, "netns");
        }
        KernelEvent::NetnsFreed { netns_inode, .. } => info!(netns = netns_inode, "netns freed"),
        KernelEvent::CniExec { exec, .. } => info!(
            command = %exec.command.value,
            plugin = %exec.binary.value,
            container = exec.container_id.as_ref().map_or("", |v| v.value.as_str()),
            netns = exec.netns.as_ref().map_or("", |v| v.value.as_str()),
            pid = t.tgid,
            "cni exec"
        ),
        KernelEvent::CniExit { exit, .. } => {
            info!(pid = t.tgid, exit_code = ?exit.exit_code, signal = ?exit.signal, "cni exit");
        }
    }
}

fn probes(args: &ProbesArgs) -> anyhow::Result<()> {
    let probes = Probes::survey().context("surveying the eBPF probes")?;
    if args.json {
        let report = serde_json::json!({ "offsets": format!("{:?}", probes.offsets), "probes": probes.status });
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("kernel struct offsets from BTF: {:?}", probes.offsets);
    println!("{:<24} {:<42} {:<12} detail", "probe", "attach point", "state");
    for s in &probes.status {
        let (state, detail) = match &s.state {
            ProbeState::Active => ("active", s.spec.observes.to_owned()),
            ProbeState::Unavailable(reason) if s.spec.required => ("FAILED", reason.clone()),
            ProbeState::Unavailable(reason) => {
                ("unavailable", format!("{reason}; fallback: {}", s.spec.fallback))
            }
        };
        println!("{:<24} {:<42} {:<12} {detail}", s.spec.program, s.spec.attach.to_string(), state);
    }
    Ok(())
}
