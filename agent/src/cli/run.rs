//! `netreap run`: the agent.

use std::time::SystemTime;

use anyhow::Context as _;
use netreap::{
    kernel::{
        events::KernelEvent,
        probes::{ProbeState, Probes},
        stream::KernelStream,
    },
    telemetry::{clock::Clock, stream::EventStream},
};
use tokio::signal::unix::{SignalKind, signal};
use tracing::{info, warn};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Where the JSON event stream goes: `-` for stdout, or a file to append to.
    #[arg(long, env = "NETREAP_EVENTS", default_value = "-")]
    pub events: String,
}

pub fn main(args: RunArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(run(args))
}

pub fn log_probe_status(probes: &Probes) {
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

