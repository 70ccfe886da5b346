//! When the model re-reads the kernel and what it asks discovery for: the
//! phases of a full resync (scan and open every netns, dump the nsid table,
//! dump every table of every netns), and the scan and resolve jobs with
//! their retries. It decides timing only; what the scans and dumps find is
//! applied by the router.

use std::{
    collections::HashSet,
    time::{Duration, SystemTime},
};

use tracing::{debug, info, warn};

use super::{
    super::snapshot::{ModelStats, NetnsInode},
    STUCK, age,
    dumps::Dump,
    records::{NetnsKey, RecordId, Table},
};
use crate::discovery::Scope;

/// A resync that has not finished in this long is started over.
const RESYNC_STUCK: Duration = STUCK.saturating_mul(4);

/// What a scan should cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ScanRequest {
    pub(super) scope: Scope,
    /// Open every netns found, known ones too (a resync); else only those
    /// the registry does not know.
    pub(super) open_all: bool,
}

impl ScanRequest {
    fn merge(self, other: Self) -> Self {
        Self { scope: self.scope.max(other.scope), open_all: self.open_all || other.open_all }
    }
}

/// A scan to hand to discovery now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ScanStart {
    pub(super) generation: u64,
    pub(super) request: ScanRequest,
}

/// What follows the end of a scan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct AfterScan {
    /// Dump the nsid table for the resync (`Some(counting)`).
    pub(super) dump_nsids: Option<bool>,
    /// A scan asked for while this one ran.
    pub(super) next_scan: Option<ScanStart>,
}

/// What the end of one of its dumps means for the resync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ResyncStep {
    Nothing,
    /// The nsid table is read: dump every table of every netns.
    DumpAll(Vec<Dump>),
    /// The resync is complete. `first`: the model is ready now. `again`:
    /// another resync was asked for meanwhile.
    Complete {
        first: bool,
        again: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    WaitingForScan,
    Scanning(u64),
    Nsids,
    Dumps,
}

#[derive(Debug, Clone, Copy)]
struct Run {
    started: SystemTime,
    counting: bool,
    phase: Phase,
    dumps_left: usize,
}

/// The resync's phase and discovery's jobs.
#[derive(Debug)]
pub(super) struct Resync {
    run: Option<Run>,
    /// A resync was asked for while one ran.
    again: bool,
    next_generation: u64,
    scan_in_flight: Option<(u64, ScanRequest)>,
    scan_wanted: Option<ScanRequest>,
    /// Probe-announced netns being opened by discovery.
    resolving: HashSet<NetnsInode>,
    /// A record is known by nsid only: scan for its inode once our queries
    /// have settled.
    unresolved_nsids: bool,
    ready: bool,
    resyncs: u64,
    last_resync_at: Option<SystemTime>,
    unresolved_creations: u64,
}

impl Resync {
    pub(super) fn new() -> Self {
        Self {
            run: None,
            again: false,
            next_generation: 1,
            scan_in_flight: None,
            scan_wanted: None,
            resolving: HashSet::new(),
            unresolved_nsids: false,
            ready: false,
            resyncs: 0,
            last_resync_at: None,
            unresolved_creations: 0,
        }
    }

    /// Adds the resync's counters to `stats`.
    pub(super) fn count_into(&self, stats: &mut ModelStats) {
        stats.ready = self.ready;
        stats.resyncs = self.resyncs;
        stats.last_resync_at = self.last_resync_at;
        stats.unresolved_creations = self.unresolved_creations;
    }

    pub(super) fn is_ready(&self) -> bool {
        self.ready
    }

    pub(super) fn in_progress(&self) -> bool {
        self.run.is_some()
    }

    /// Netns opened now are opened by a counting resync's scan: those new
    /// to the registry count as corrections.
    pub(super) fn counting_scan(&self) -> bool {
        self.run.is_some_and(|r| r.counting && matches!(r.phase, Phase::Scanning(_)))
    }

    /// Starts a full resync (or asks for another after the one under way).
    pub(super) fn start(&mut self, counting: bool, now: SystemTime) -> Option<ScanStart> {
        if self.run.is_some() {
            self.again = true;
            return None;
        }
        if counting {
            debug!("netns model: full resync");
        } else {
            info!("netns model: first full sync");
        }
        self.run = Some(Run { started: now, counting, phase: Phase::WaitingForScan, dumps_left: 0 });
        self.request_scan(ScanRequest { scope: Scope::Full, open_all: true })
    }

    /// A scan is wanted: the one to start now, or none while another runs
    /// (it starts when that one ends).
    pub(super) fn request_scan(&mut self, req: ScanRequest) -> Option<ScanStart> {
        if self.scan_in_flight.is_some() {
            self.scan_wanted = Some(self.scan_wanted.map_or(req, |w| w.merge(req)));
            return None;
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        if req.open_all
            && req.scope == Scope::Full
            && let Some(r) = &mut self.run
            && r.phase == Phase::WaitingForScan
        {
            r.phase = Phase::Scanning(generation);
        }
        self.scan_in_flight = Some((generation, req));
        Some(ScanStart { generation, request: req })
    }

    /// The driver could not queue scan `generation`: retry later.
    pub(super) fn scan_rejected(&mut self, generation: u64) {
        if let Some((_, req)) = self.scan_in_flight.take() {
            self.scan_wanted = Some(self.scan_wanted.map_or(req, |w| w.merge(req)));
        }
        if let Some(r) = &mut self.run
            && r.phase == Phase::Scanning(generation)
        {
            r.phase = Phase::WaitingForScan;
        }
    }

    /// Scan `generation` ended (found something or failed).
    pub(super) fn scan_finished(&mut self, generation: u64) -> AfterScan {
        let mut after = AfterScan::default();
        if self.scan_in_flight.is_some_and(|(g, _)| g == generation) {
            self.scan_in_flight = None;
        }
        if let Some(r) = &mut self.run
            && r.phase == Phase::Scanning(generation)
        {
            // Every GETNSID of this scan was sent before the nsid dump's
            // request, so its replies are read before the dump.
            r.phase = Phase::Nsids;
            after.dump_nsids = Some(r.counting);
        }
        if let Some(req) = self.scan_wanted.take() {
            after.next_scan = self.request_scan(req);
        }
        after
    }

    /// Discovery should open `inode` for a probe: false when it is already
    /// at it.
    pub(super) fn resolve(&mut self, inode: NetnsInode) -> bool {
        self.resolving.insert(inode)
    }

    /// Discovery opened `inode`.
    pub(super) fn resolved(&mut self, inode: NetnsInode) {
        self.resolving.remove(&inode);
    }

    /// The driver could not queue the resolve job for `inode`: a scan
    /// will find it instead.
    pub(super) fn resolve_rejected(&mut self, inode: NetnsInode) -> Option<ScanStart> {
        self.resolving.remove(&inode);
        self.request_scan(ScanRequest { scope: Scope::Full, open_all: false })
    }

    /// A probe-announced netns could not be opened.
    pub(super) fn resolve_failed(&mut self, inode: NetnsInode) {
        self.resolving.remove(&inode);
        self.unresolved_creations += 1;
        debug!(inode, "announced netns could not be opened");
    }

    /// A record was made for an nsid whose inode is not known.
    pub(super) fn nsid_without_inode(&mut self) {
        self.unresolved_nsids = true;
    }

    /// Dump `dump` finished (or was dropped): the resync's bookkeeping.
    /// `record_ids`: the registry's live records, oldest first, asked for
    /// when the nsid table has been read.
    pub(super) fn dump_finished(
        &mut self,
        dump: &Dump,
        now: SystemTime,
        record_ids: impl FnOnce() -> Vec<RecordId>,
    ) -> ResyncStep {
        if !dump.for_resync {
            return ResyncStep::Nothing;
        }
        let Some(r) = &mut self.run else {
            return ResyncStep::Nothing;
        };
        match (r.phase, dump.table) {
            (Phase::Nsids, Table::Nsids) => {
                let counting = r.counting;
                let for_resync = |target, table| Dump { target, table, counting, for_resync: true };
                let mut dumps = vec![
                    for_resync(NetnsKey::Host, Table::Links),
                    for_resync(NetnsKey::Host, Table::Addresses),
                    for_resync(NetnsKey::Host, Table::Routes),
                ];
                for id in record_ids() {
                    for table in [Table::Links, Table::Addresses] {
                        dumps.push(for_resync(NetnsKey::Record(id), table));
                    }
                }
                r.phase = Phase::Dumps;
                r.dumps_left = dumps.len();
                ResyncStep::DumpAll(dumps)
            }
            (Phase::Dumps, _) => {
                r.dumps_left = r.dumps_left.saturating_sub(1);
                if r.dumps_left > 0 {
                    return ResyncStep::Nothing;
                }
                self.run = None;
                self.resyncs += 1;
                self.last_resync_at = Some(now);
                let first = !self.ready;
                self.ready = true;
                ResyncStep::Complete { first, again: std::mem::take(&mut self.again) }
            }
            _ => ResyncStep::Nothing,
        }
    }

    /// Periodic retries: a resync that did not finish starts over, a scan
    /// wanted while another ran starts, and records known by nsid only get
    /// a scan for their inode once `queries_idle` (the answers to our own
    /// requests have been read). Returns the scans to start.
    pub(super) fn tick(
        &mut self,
        now: SystemTime,
        queries_idle: bool,
        any_without_inode: impl FnOnce() -> bool,
    ) -> Vec<ScanStart> {
        let mut scans = Vec::new();
        if self.run.is_some_and(|r| age(now, r.started) > RESYNC_STUCK) {
            warn!("netns resync did not finish; starting over");
            self.run = None;
            scans.extend(self.start(true, now));
        }
        if self.scan_in_flight.is_none()
            && let Some(req) = self.scan_wanted.take()
        {
            scans.extend(self.request_scan(req));
        }
        // A netns known only by nsid (the kernel assigned it, e.g. for a
        // veth peer): find its inode once our own queries have settled.
        if self.unresolved_nsids && queries_idle && any_without_inode() {
            self.unresolved_nsids = false;
            scans.extend(self.request_scan(ScanRequest { scope: Scope::Full, open_all: false }));
        }
        scans
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: SystemTime = SystemTime::UNIX_EPOCH;

    #[test]
    fn a_resync_goes_scan_then_nsid_dump_then_every_table_then_ready() {
        let mut r = Resync::new();
        let scan = r.start(false, T0).expect("a scan");
        assert_eq!(scan.request, ScanRequest { scope: Scope::Full, open_all: true });
        assert!(r.start(true, T0).is_none(), "a second resync waits for the first");
        let after = r.scan_finished(scan.generation);
        assert_eq!(after.dump_nsids, Some(false));
        let nsids = Dump { target: NetnsKey::Host, table: Table::Nsids, counting: false, for_resync: true };
        let ResyncStep::DumpAll(dumps) = r.dump_finished(&nsids, T0, || vec![4, 9]) else { panic!("no dumps") };
        assert_eq!(dumps.len(), 3 + 2 * 2, "host links, addresses, routes; links and addresses of each record");
        for (i, d) in dumps.iter().enumerate() {
            let step = r.dump_finished(d, T0, Vec::new);
            if i + 1 < dumps.len() {
                assert_eq!(step, ResyncStep::Nothing);
            } else {
                assert_eq!(step, ResyncStep::Complete { first: true, again: true });
            }
        }
        assert!(r.is_ready() && !r.in_progress());
    }

    #[test]
    fn a_rejected_scan_is_retried_and_a_stuck_resync_starts_over() {
        let mut r = Resync::new();
        let scan = r.start(true, T0).expect("a scan");
        r.scan_rejected(scan.generation);
        let retried = r.tick(T0, true, || false);
        assert_eq!(retried.len(), 1);
        assert!(retried[0].request.open_all && r.counting_scan(), "the retry is the resync's scan");
        let later = T0 + RESYNC_STUCK + Duration::from_secs(1);
        assert_eq!(r.scan_finished(retried[0].generation).dump_nsids, Some(true));
        let restarted = r.tick(later, true, || false);
        assert_eq!(restarted.iter().map(|s| s.request.open_all).collect::<Vec<_>>(), vec![true]);
        assert!(r.in_progress() && !r.is_ready());
    }
}
