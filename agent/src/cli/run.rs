//! `netreap run`: the agent (see `netreap::daemon`).

use anyhow::Context as _;
use netreap::{
    config::{Config, ConfigFlags},
    daemon,
    telemetry::logging,
};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub config: ConfigFlags,
}

pub fn main(args: &RunArgs) -> anyhow::Result<()> {
    one_malloc_arena();
    let config = Config::load(&args.config).context("configuration")?;
    logging::init(&config.log);
    // One runtime, on this thread: the event loop, the netns model and the
    // HTTP server take turns here, so handing a death or a snapshot from
    // one to the other wakes no other thread (with a worker thread, a pod
    // cycle cost ~45 cross-thread wakes: a quarter of the agent's CPU, and
    // ~0.2 ms of each release's latency, issue 13). Blocking work
    // (releases, scans, /state) goes to tokio's blocking pool; what stays
    // here is short (a full pass's decide over 100k reservations is
    // ~60 ms), well within any health probe's timeout.
    tokio::runtime::Builder::new_current_thread()
        .thread_name("netreap-blocking")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(daemon::run(config))
}

/// glibc gives each thread that allocates its own malloc arena (up to 8 per
/// core) and keeps what is freed there for that arena: the runtime's
/// threads, each in turn building a reconcile's worth of data, held one
/// copy of the agent's peak each (issue 13, 1,000-netns burst: agent VmHWM
/// 123 MiB with the default, 74 MiB with one arena, same build and load).
/// The agent's few threads seldom allocate at the same instant.
///
/// Large blocks (128 KiB and up: a /state response, a scan's buffers) are
/// mapped on their own and unmapped when freed. glibc's default raises that
/// threshold to the largest block freed so far (up to 32 MiB), after which
/// such blocks come from the heap and their pages stay with the process:
/// the next large block then adds to that instead of reusing it (VmHWM).
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: sets malloc tunables; called first thing, before the runtime
    // starts any thread. A failure (0) leaves glibc's default.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}
