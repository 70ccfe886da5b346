//! `netreap sources`: which optional sources of evidence are on, and why
//! not when they are off. (The Kubernetes row; the container runtime's row
//! comes with issue 11.)

use anyhow::Context as _;
use netreap::config::{Config, ConfigFlags};

#[derive(Debug, clap::Args)]
pub struct SourcesArgs {
    #[command(flatten)]
    pub config: ConfigFlags,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: &SourcesArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config).context("configuration")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let kube = runtime.block_on(netreap::kube::status(
        config.kubeconfig.as_deref(),
        config.node_name.as_deref(),
    ));
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "kubernetes": kube }))?
        );
    } else {
        println!("{kube}");
    }
    Ok(())
}
