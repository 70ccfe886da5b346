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
        atomic::{AtomicBool, Ordering},
        mpsc::{Receiver, SyncSender, sync_channel},
    },
    thread,
};

use tokio::sync::{Notify, mpsc};
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

/// Wakes the model task for a report, or leaves the report for the
/// model's next turn while its socket rests (the rest's end is one, at
/// most [`super::watcher::REST`] away): a pod's mount scans then cost the
/// agent no wake-up of their own. An opened netns always wakes it: the fd
/// holds that netns alive until the model has sent it and closed it.
#[derive(Debug, Default)]
pub(crate) struct ReportBell {
    notify: Notify,
    resting: AtomicBool,
}

impl ReportBell {
    /// After a report was queued. SeqCst pairs with [`Self::set_resting`]:
    /// either this sees the model watching and wakes it, or the model,
    /// having said so, finds the report queued.
    fn queued(&self, report_opened: bool) {
        if report_opened || !self.resting.load(Ordering::SeqCst) {
            self.notify.notify_one();
        }
    }

    /// Whether the model's socket rests now. Set to false before the
    /// driver looks at the queue once more.
    pub(crate) fn set_resting(&self, resting: bool) {
        self.resting.store(resting, Ordering::SeqCst);
    }

    /// A report that wakes was queued (possibly already taken).
    pub(crate) async fn rang(&self) {
        self.notify.notified().await;
    }
}

/// Queues `report` (waits while the queue is full) and rings. False when
/// the model task is gone.
fn send(reports: &mpsc::Sender<Report>, bell: &ReportBell, report: Report) -> bool {
    let opened = matches!(report, Report::Opened { .. });
    let sent = reports.blocking_send(report).is_ok();
    if sent {
        bell.queued(opened);
    }
    sent
}

/// Jobs waiting for the thread; more than this and the model retries later.
pub(crate) const JOB_QUEUE: usize = 1024;
/// Reports (and so open netns fds) in flight at most.
pub(crate) const REPORT_QUEUE: usize = 32;

/// `changes`: the mount-table changes the driver counts; the thread reads
/// the table again only after one (resyncs always read it).
/// The model takes reports with `try_recv` only (never `recv`, whose
/// waker a send would wake): `bell` says when to look.
pub(crate) fn spawn(
    paths: DiscoveryPaths,
    changes: Arc<MountChanges>,
    bell: Arc<ReportBell>,
) -> std::io::Result<(SyncSender<Job>, mpsc::Receiver<Report>)> {
    let (jobs_tx, jobs_rx) = sync_channel(JOB_QUEUE);
    let (reports_tx, reports_rx) = mpsc::channel(REPORT_QUEUE);
    let mut mounts = MountReader::new(changes);
    thread::Builder::new()
        .name("netreap-netns".into())
        .spawn(move || run(&paths, &mut mounts, &jobs_rx, &reports_tx, &bell))?;
    Ok((jobs_tx, reports_rx))
}

/// Runs until the model task goes away (either channel closes).
fn run(
    paths: &DiscoveryPaths,
    mounts: &mut MountReader,
    jobs: &Receiver<Job>,
    reports: &mpsc::Sender<Report>,
    bell: &ReportBell,
) {
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
                            alive = send(reports, bell, Report::Opened { inode, fd });
                            if !alive {
                                break;
                            }
                        }
                    }
                    alive && send(reports, bell, Report::ScanDone { generation, scope, found })
                }
                Err(e) => send(reports, bell, Report::ScanFailed { generation, error: e.to_string() }),
            },
            Job::Resolve { inode, tgid, tid } => {
                let report = match resolve(paths, mounts, inode, tgid, tid) {
                    Some(fd) => Report::Opened { inode, fd },
                    None => Report::ResolveFailed { inode },
                };
                send(reports, bell, report)
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
