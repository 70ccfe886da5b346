//! The discovery thread: scans mountinfo and /proc and opens the netns it
//! finds, off the async runtime (file-system work blocks). Opened fds go
//! straight back to the model task, which sends the nsid request and
//! closes them; the bounded report channel caps how many are open at once.

use std::{
    collections::BTreeMap,
    os::fd::OwnedFd,
    path::PathBuf,
    sync::{
        Arc,
        mpsc::{Receiver, SyncSender, sync_channel},
    },
    thread,
};

use tokio::sync::mpsc;
use tracing::debug;

use super::state::Job;
use crate::discovery::{self, DiscoveryPaths, MountChanges, MountReader, Scope, Sighting};

/// Reports from the discovery thread.
#[derive(Debug)]
pub(crate) enum Report {
    Opened { inode: u32, fd: OwnedFd },
    ResolveFailed { inode: u32 },
    ScanDone { generation: u64, scope: Scope, found: BTreeMap<u32, Sighting> },
    ScanFailed { generation: u64, error: String },
}

/// Jobs waiting for the thread; more than this and the model retries later.
pub(crate) const JOB_QUEUE: usize = 1024;
/// Reports (and so open netns fds) in flight at most.
pub(crate) const REPORT_QUEUE: usize = 32;

/// `changes`: the mount-table changes the driver counts; the thread reads
/// the table again only after one (resyncs always read it).
pub(crate) fn spawn(
    paths: DiscoveryPaths,
    changes: Arc<MountChanges>,
) -> std::io::Result<(SyncSender<Job>, mpsc::Receiver<Report>)> {
    let (jobs_tx, jobs_rx) = sync_channel(JOB_QUEUE);
    let (reports_tx, reports_rx) = mpsc::channel(REPORT_QUEUE);
    let mut mounts = MountReader::new(changes);
    thread::Builder::new()
        .name("netreap-netns".into())
        .spawn(move || run(&paths, &mut mounts, &jobs_rx, &reports_tx))?;
    Ok((jobs_tx, reports_rx))
}

/// Runs until the model task goes away (either channel closes).
fn run(paths: &DiscoveryPaths, mounts: &mut MountReader, jobs: &Receiver<Job>, reports: &mpsc::Sender<Report>) {
    while let Ok(job) = jobs.recv() {
        let alive = match job {
            Job::Scan { generation, scope, skip } => match mounts.scan(paths, scope) {
                Ok(found) => {
                    let mut alive = true;
                    for (&inode, sighting) in &found {
                        if skip.contains(&inode) {
                            continue;
                        }
                        let candidates = discovery::candidate_paths(paths, sighting);
                        if let Some((fd, _)) = discovery::open_any(inode, &candidates) {
                            alive = reports.blocking_send(Report::Opened { inode, fd }).is_ok();
                            if !alive {
                                break;
                            }
                        }
                    }
                    alive && reports.blocking_send(Report::ScanDone { generation, scope, found }).is_ok()
                }
                Err(e) => reports.blocking_send(Report::ScanFailed { generation, error: e.to_string() }).is_ok(),
            },
            Job::Resolve { inode, tgid, tid } => {
                let report = match resolve(paths, mounts, inode, tgid, tid) {
                    Some(fd) => Report::Opened { inode, fd },
                    None => Report::ResolveFailed { inode },
                };
                reports.blocking_send(report).is_ok()
            }
        };
        if !alive {
            break;
        }
    }
    debug!(mount_table_reads = mounts.reads(), "netns discovery thread done");
}

/// Opens a netns a probe announced: through the task while it is still
/// in it, else through a bind mount (`ip netns add` exits at once), as the
/// mount table was last read unless it changed since: a mount not yet
/// counted is found by the scan its change asks for.
fn resolve(paths: &DiscoveryPaths, mounts: &mut MountReader, inode: u32, process: u32, thread: u32) -> Option<OwnedFd> {
    let proc_root = &paths.proc_root;
    let via_task: [PathBuf; 2] =
        [proc_root.join(format!("{process}/task/{thread}/ns/net")), proc_root.join(format!("{process}/ns/net"))];
    if let Some((fd, _)) = discovery::open_any(inode, &via_task) {
        return Some(fd);
    }
    let sighting = mounts.mounts(paths, false).ok()?.get(&inode)?;
    discovery::open_any(inode, &discovery::mount_candidates(paths, &sighting.bind_mounts)).map(|(fd, _)| fd)
}
