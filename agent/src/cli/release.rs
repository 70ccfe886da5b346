//! `netreap release --from-report FILE`: releases exactly the orphaned
//! entries of a reviewed `netreap scan --json` report, each re-verified on
//! fresh evidence first. Delete an entry from the report to spare it.

use std::path::PathBuf;

use anyhow::Context as _;
use netreap::{
    config::{Config, ConfigFlags},
    daemon::oneshot,
    engine::{ScanReport, decide_one},
    release::{Journal, Releaser, ReleaserConfig, release_reviewed},
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
    let (mut obs, now) = oneshot::observe_blocking(&config).context("observing the kernel")?;
    let policy = oneshot::policy(&config);
    // The Kubernetes source, when configured: pods as evidence for every
    // re-verification, and the pools for the whereabouts entries.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let cache = netreap::ipam::cnicache::CniCache::new(config.cni_cache_dir.clone()).scan();
    let shot = runtime
        .block_on(netreap::kube::oneshot::observe(
            config.kubeconfig.as_deref(),
            config.node_name.as_deref(),
            &mut obs,
            &cache.attachments,
        ))
        .context("Kubernetes configuration")?;
    // whereabouts entries go to the whereabouts releaser, the rest to the
    // host-local one.
    let (whereabouts, local): (Vec<_>, Vec<_>) =
        report.verdicts.iter().cloned().partition(|v| netreap::kube::agent::is_whereabouts(&v.reservation.store));
    let local_report = ScanReport { verdicts: local, ..report };
    let mut records = release_reviewed(&local_report, &mut releaser, |r| decide_one(&obs, r, now, &policy))?;
    if whereabouts.iter().any(|v| v.status == netreap::engine::Status::Orphaned) {
        let shot =
            shot.context("the report lists whereabouts allocations but the Kubernetes source is off (--kubeconfig)")?;
        let mut journal = Journal::open(&config.state_dir.join(netreap::kube::agent::JOURNAL_SUBDIR))
            .context("opening the whereabouts release journal (is `netreap run` using this state dir?)")?;
        records.extend(runtime.block_on(netreap::kube::oneshot::release_reviewed(
            &shot,
            &mut journal,
            &whereabouts,
            config.dry_run,
            |r| decide_one(&obs, r, now, &policy),
            // No model in a one-shot command: every netns the kernel lists.
            &mut netreap::release::lastlook::KernelLook::default(),
        ))?);
    }
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
