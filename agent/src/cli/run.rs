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
    let config = Config::load(&args.config).context("configuration")?;
    logging::init(&config.log);
    // One runtime. The agent's event loop runs on this thread (block_on);
    // spawned tasks (the HTTP server above all) on one worker thread, so a
    // long reconcile never delays a health probe; blocking work (releases,
    // scans, /state) on tokio's blocking pool.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("netreap-rt")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(daemon::run(config))
}
