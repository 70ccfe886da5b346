//! `netreap sources`: every source of evidence, active or not, and why.

use anyhow::Context as _;
use netreap::{
    config::{Config, ConfigFlags},
    sources,
};

#[derive(Debug, clap::Args)]
pub struct SourcesArgs {
    #[command(flatten)]
    pub config: ConfigFlags,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: &SourcesArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config).context("configuration")?;
    let rows = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(sources::survey(&config));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("{:<24} {:<8} {:<9} detail", "source", "role", "state");
    for row in &rows {
        println!("{row}");
    }
    Ok(())
}
