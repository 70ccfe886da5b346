//! `netreap scan`: a one-shot report of every reservation, its verdict and
//! the evidence that decided it, with totals per network.

use anyhow::Context as _;
use netreap::{
    config::{Config, ConfigFlags},
    daemon::oneshot,
    ipam::cnicache::CniCache,
    release::scan_report,
};

#[derive(Debug, clap::Args)]
pub struct ScanArgs {
    #[command(flatten)]
    pub config: ConfigFlags,
    /// Print the report as JSON (the input of `netreap release --from-report`).
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: &ScanArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config).context("configuration")?;
    let (obs, now) = oneshot::observe_blocking(&config).context("observing the kernel")?;
    let stores = oneshot::stores(&config);
    let cache = CniCache::new(config.cni_cache_dir.clone());
    let report = scan_report(&oneshot::as_dyn(&stores), Some(&cache), &obs, now, &oneshot::policy(&config));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}
