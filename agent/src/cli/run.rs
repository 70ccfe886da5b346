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
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(daemon::run(config))
}
