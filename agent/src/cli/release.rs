//! `netreap release --from-report FILE`: releases exactly the orphaned
//! entries of a reviewed `netreap scan --json` report, each re-verified on
//! fresh evidence first. Delete an entry from the report to spare it.

use std::path::PathBuf;

use anyhow::Context as _;
use netreap::{
    config::{Config, ConfigFlags},
    daemon::oneshot,
    engine::{ScanReport, decide_one},
    release::{Releaser, ReleaserConfig, release_reviewed},
};

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub config: ConfigFlags,
    /// A report written by `netreap scan --json`, reviewed by a person.
    #[arg(long, value_name = "FILE")]
    pub from_report: PathBuf,
    /// Print the outcomes as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: &ReleaseArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config).context("configuration")?;
    let text = std::fs::read_to_string(&args.from_report)
        .with_context(|| format!("reading {}", args.from_report.display()))?;
    let report: ScanReport = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a `netreap scan --json` report", args.from_report.display()))?;
    let mut releaser = Releaser::open(
        &config.state_dir,
        ReleaserConfig {
            dry_run: config.dry_run,
            host_local_dirs: config.host_local_dirs.clone(),
            cni_cache_dir: Some(config.cni_cache_dir.clone()),
            abort_after_intent: false,
            lock_timeout: Some(config.release_lock_timeout),
        },
    )
    .context("opening the release journal (is `netreap run` using this state dir?)")?;
    let (obs, now) = oneshot::observe_blocking(&config).context("observing the kernel")?;
    let policy = oneshot::policy(&config);
    let records = release_reviewed(&report, &mut releaser, |r| decide_one(&obs, r, now, &policy))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&records)?);
        return Ok(());
    }
    if records.is_empty() {
        println!("the report lists no orphaned reservation: nothing to do");
    }
    for r in &records {
        let res = &r.verdict.reservation;
        println!("{} {} ({}): {}", res.network, res.ip, res.container_id, r.outcome);
    }
    Ok(())
}
