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
    let (mut obs, now) = oneshot::observe_blocking(&config).context("observing the kernel")?;
    let stores = oneshot::stores(&config);
    let cache = CniCache::new(config.cni_cache_dir.clone());
    // The Kubernetes source, when configured: the node's pods as evidence,
    // this node's whereabouts allocations as a store.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let cached = cache.scan();
    let kube = runtime
        .block_on(netreap::kube::oneshot::observe(
            config.kubeconfig.as_deref(),
            config.node_name.as_deref(),
            &mut obs,
            &cached.attachments,
        ))
        .context("Kubernetes configuration")?;
    let pools = kube.map(|k| netreap::kube::oneshot::ListedPools(k.pools.scan));
    let mut all = oneshot::as_dyn(&stores);
    if let Some(pools) = &pools {
        all.push(pools);
    }
    let report = scan_report(&all, Some(&cache), &obs, now, &oneshot::policy(&config));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}
