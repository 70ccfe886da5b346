//! The model as a synchronous state machine: netlink datagrams, probe events
//! and discovery reports go in; netlink requests, discovery jobs and death
//! notices come out as [`Action`]s. No I/O here, so every rule is testable
//! with fabricated messages.
//!
//! [`Model`] only routes: it feeds each input to the part whose job it is
//! and turns what the parts return into actions and into inputs of the
//! other parts (this file: discovery, probes, timers, and the births and
//! deaths of records; `netlink_input`: the socket's messages). The parts
//! own their state and never call each other:
//! - `registry`: every netns, its links, addresses and routes (`records`:
//!   what a record holds, and the names the parts share);
//! - `nsid_query`: the nsid requests and their answers;
//! - `dumps`: the dump queue and its mark-and-sweep;
//! - `resync`: the resync's phases and the discovery jobs;
//! - `view`: snapshots, and the views of the recently dead.
//!
//! Deaths are decided by the router only, on the kernel's word only:
//! `RTM_DELNSID`, `__put_net` (not earlier than the record's first sight),
//! an nsid or inode given to another netns, or a dump aimed at the record's
//! nsid refused once such dumps are known to work. Absence from a dump is
//! never death.
//!
//! Ordering argument: requests, replies, dumps and notifications share one
//! socket, and the kernel queues them in the order things happened. So a
//! GETNSID reply naming nsid 5 can only be read after the `RTM_DELNSID` of
//! the previous holder of nsid 5, and applying messages in arrival order
//! keeps nsid -> netns bindings right across deaths and reuse.

mod dumps;
mod netlink_input;
mod nsid_query;
mod records;
mod registry;
mod resync;
mod view;

use std::{
    collections::{BTreeMap, HashSet},
    os::fd::RawFd,
    sync::Arc,
    time::{Duration, SystemTime},
};

use tracing::{debug, info, warn};

use self::{
    dumps::{Dump, DumpEnd, DumpQueue},
    nsid_query::{NsidQueries, QueryTarget},
    records::{Entry, NetnsKey, RecordId, Table},
    registry::{BindPlan, Registry},
    resync::{Resync, ResyncStep, ScanRequest, ScanStart},
    view::{DeadViews, Views},
};
use super::snapshot::{DeathSource, ModelSnapshot, ModelStats, NetnsDeath, NetnsInode};
use crate::{
    discovery::{Scope, Sighting},
    kernel::events::{KernelEvent, NetnsVia, Task},
    telemetry::clock::Clock,
};

/// Limits and retention of the model.
#[derive(Debug, Clone, Copy)]
pub struct ModelConfig {
    /// How long a dead netns stays in snapshots.
    pub dead_retention: Duration,
    /// At most this many dead netns are kept.
    pub max_dead: usize,
    /// A probe-announced netns not found within this long is forgotten.
    pub creator_ttl: Duration,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self { dead_retention: Duration::from_mins(10), max_dead: 4096, creator_ttl: Duration::from_mins(5) }
    }
}

/// Work for the discovery thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Job {
    /// Scan, and open every netns found except those in `skip`.
    Scan { generation: u64, scope: Scope, skip: Arc<HashSet<NetnsInode>> },
    /// Open netns `inode` through the task that entered it, else through
    /// a bind mount.
    Resolve { inode: NetnsInode, tgid: u32, tid: u32 },
}

/// What the model asks its driver to do.
#[derive(Debug)]
pub enum Action {
    /// Send this request on the socket. `dump_seq` is set for dump
    /// requests: report a failed send with [`Model::send_failed`].
    Send {
        request: Vec<u8>,
        dump_seq: Option<u32>,
    },
    Job(Job),
    Death(NetnsDeath),
}

/// A dump or query unanswered this long was lost.
const STUCK: Duration = Duration::from_secs(30);

fn age(now: SystemTime, then: SystemTime) -> Duration {
    now.duration_since(then).unwrap_or_default()
}

/// The node's network namespaces, as evidence has shown them.
pub struct Model {
    creator_ttl: Duration,
    clock: Clock,
    registry: Registry,
    queries: NsidQueries,
    dumps: DumpQueue,
    resync: Resync,
    dead: DeadViews,
    /// The live netns's views, kept for the next snapshot.
    views: Views,
    next_seq: u32,
    actions: Vec<Action>,
    /// Records whose links' notifications named a peer in their own frame:
    /// dumped (to place it in ours) only if, once what was read is applied,
    /// no host link places it (see [`Registry::has_unplaced_peer`]).
    peer_checks: Vec<RecordId>,
    /// Time of the latest input, for state that records when it started.
    last_now: SystemTime,
    /// The router's own counters (the parts keep theirs).
    counts: ModelStats,
}

impl Model {
    /// `host_inode`: inode of the agent's own netns.
    #[must_use]
    pub fn new(config: ModelConfig, host_inode: NetnsInode, now: SystemTime) -> Self {
        Self {
            creator_ttl: config.creator_ttl,
            clock: Clock::new(),
            registry: Registry::new(host_inode, now),
            queries: NsidQueries::default(),
            dumps: DumpQueue::default(),
            resync: Resync::new(),
            dead: DeadViews::new(config.dead_retention, config.max_dead),
            views: Views::default(),
            next_seq: 1,
            actions: Vec::new(),
            peer_checks: Vec::new(),
            last_now: now,
            counts: ModelStats::default(),
        }
    }

    /// Actions produced since the last call, in order.
    pub fn take_actions(&mut self) -> Vec<Action> {
        self.check_peers();
        std::mem::take(&mut self.actions)
    }

    /// Asks for the link dumps that placing peers still needs. Judged when
    /// the actions are taken (after a whole read), not per notification: a
    /// pod's veth shows its pod side first, and the host side, which names
    /// it back in our frame, a few messages later in the same read.
    fn check_peers(&mut self) {
        for id in std::mem::take(&mut self.peer_checks) {
            if self.registry.has_unplaced_peer(id) {
                let dump =
                    Dump { target: NetnsKey::Record(id), table: Table::Links, counting: false, for_resync: false };
                self.queue_dump(dump);
            }
        }
    }

    /// Deaths among the actions not yet taken.
    #[must_use]
    pub fn deaths_pending(&self) -> usize {
        self.actions.iter().filter(|a| matches!(a, Action::Death(_))).count()
    }

    #[must_use]
    pub fn stats(&self) -> ModelStats {
        let mut stats = self.counts.clone();
        self.registry.count_into(&mut stats);
        self.resync.count_into(&mut stats);
        stats
    }

    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.resync.is_ready()
    }

    /// Whether its socket may go unread for a while: synced, and no dump
    /// or nsid request of its own waits for an answer (a dump's next part
    /// is made only as the last one is read).
    #[must_use]
    pub fn can_rest(&self) -> bool {
        self.is_ready() && !self.dumps.busy() && self.queries.is_idle()
    }

    #[must_use]
    pub fn resync_in_progress(&self) -> bool {
        self.resync.in_progress()
    }

    pub fn count_dropped_death(&mut self) {
        self.counts.deaths_dropped += 1;
    }

    fn seq(&mut self) -> u32 {
        let s = self.next_seq;
        // Zero is what notifications carry; never use it for a request.
        self.next_seq = self.next_seq.wrapping_add(1).max(1);
        s
    }

    // ---- startup, resync and discovery -----------------------------------

    /// Learns (and fixes) the agent's own nsid through an fd of its own
    /// netns. The kernel gives the host netns an nsid for itself as soon as
    /// a dump shows a link whose peer is in it; knowing it up front means
    /// no message from the host is ever mistaken for one from another netns.
    pub fn query_host_nsid(&mut self, own_netns_fd: RawFd, now: SystemTime) {
        self.query_nsid(QueryTarget::Host, own_netns_fd, now, false, true);
    }

    /// Starts a full resync: scan and open every netns, compare the kernel's
    /// nsid table, re-dump everything. `counting` makes differences count as
    /// corrections (false for the first sync, where everything is new).
    pub fn start_resync(&mut self, counting: bool) {
        let scan = self.resync.start(counting, self.last_now);
        self.start_scan(scan);
    }

    /// ENOBUFS: notifications were lost. Replies to our queries may be
    /// among them; those left pending are pruned as stale.
    pub fn overrun(&mut self) {
        self.counts.overruns += 1;
        if self.resync.in_progress() {
            debug!(overruns = self.counts.overruns, "netlink overrun during a resync");
        } else {
            warn!(overruns = self.counts.overruns, "netlink overrun: notifications lost, resyncing");
        }
        self.start_resync(true);
    }

    /// Hands scan `scan` to discovery.
    fn start_scan(&mut self, scan: Option<ScanStart>) {
        let Some(ScanStart { generation, request }) = scan else {
            return;
        };
        let skip = if request.open_all { HashSet::new() } else { self.registry.known_inodes() };
        self.actions.push(Action::Job(Job::Scan { generation, scope: request.scope, skip: Arc::new(skip) }));
    }

    /// The mount table changed: a netns may have been bind-mounted.
    pub fn mounts_changed(&mut self) {
        let scan = self.resync.request_scan(ScanRequest { scope: Scope::Mounts, open_all: false });
        self.start_scan(scan);
    }

    /// The driver could not queue a job (channel full): retry later.
    pub fn job_rejected(&mut self, job: &Job) {
        match job {
            Job::Scan { generation, .. } => self.resync.scan_rejected(*generation),
            Job::Resolve { inode, .. } => {
                let scan = self.resync.resolve_rejected(*inode);
                self.start_scan(scan);
            }
        }
    }

    /// A request could not be sent. A dump that never started must not
    /// block the ones queued behind it.
    pub fn send_failed(&mut self, dump_seq: Option<u32>) {
        if let Some(seq) = dump_seq {
            self.dumps.unsent(seq);
        }
    }

    /// Periodic housekeeping: retention, stale queries, retries.
    pub fn tick(&mut self, now: SystemTime) {
        self.last_now = now;
        if self.dumps.stuck(now) {
            warn!("netlink dump unanswered; moving on");
            self.end_dump(DumpEnd::Lost);
        }
        self.dead.forget_old(now);
        self.registry.forget_stale_creators(now, self.creator_ttl);
        self.queries.prune(now);
        let registry = &self.registry;
        let scans = self.resync.tick(now, self.queries.is_idle(), || registry.any_without_inode());
        for scan in scans {
            self.start_scan(Some(scan));
        }
    }

    /// The discovery thread opened netns `inode`: ask the kernel for its
    /// nsid, assigning one if it has none. The driver sends the requests
    /// and closes the fd right after: the kernel resolves the fd while
    /// handling sendmsg, so no reference outlives that call.
    pub fn netns_opened(&mut self, inode: NetnsInode, fd: RawFd, now: SystemTime) {
        self.last_now = now;
        self.resync.resolved(inode);
        let counting = self.resync.counting_scan();
        let (target, known) = if self.registry.is_host_inode(inode) {
            (QueryTarget::Host, self.registry.host_nsid().is_some())
        } else {
            (QueryTarget::Inode(inode), self.registry.by_inode(inode).is_some())
        };
        self.query_nsid(target, fd, now, counting, !known);
    }

    fn query_nsid(&mut self, target: QueryTarget, fd: RawFd, now: SystemTime, counting: bool, assign: bool) {
        if assign {
            let seq = self.seq();
            let request = self.queries.assign(target, seq, fd, now, counting);
            self.actions.push(Action::Send { request, dump_seq: None });
        }
        let seq = self.seq();
        let request = self.queries.get(target, seq, fd, now, counting);
        self.actions.push(Action::Send { request, dump_seq: None });
    }

    /// A probe-announced netns could not be opened: gone already, or held
    /// only by an fd we cannot see.
    pub fn resolve_failed(&mut self, inode: NetnsInode) {
        self.resync.resolve_failed(inode);
    }

    pub fn scan_done(&mut self, generation: u64, scope: Scope, found: BTreeMap<NetnsInode, Sighting>) {
        self.registry.apply_scan(scope, found);
        self.scan_finished(generation);
    }

    pub fn scan_failed(&mut self, generation: u64, error: &str) {
        warn!("netns discovery scan failed: {error}");
        self.scan_finished(generation);
    }

    fn scan_finished(&mut self, generation: u64) {
        let after = self.resync.scan_finished(generation);
        if let Some(counting) = after.dump_nsids {
            self.queue_dump(Dump { target: NetnsKey::Host, table: Table::Nsids, counting, for_resync: true });
        }
        self.start_scan(after.next_scan);
    }

    // ---- probe events ----------------------------------------------------

    pub fn kernel_event(&mut self, event: &KernelEvent, now: SystemTime) {
        self.last_now = now;
        self.counts.kernel_events += 1;
        match event {
            KernelEvent::NetnsEntered { task, netns_inode, via, .. } => {
                let creation = matches!(via, NetnsVia::Unshare | NetnsVia::Clone | NetnsVia::Clone3);
                self.netns_event(task, *netns_inode, creation.then_some(*via));
            }
            KernelEvent::NetnsCreated { task, netns_inode, via } => self.netns_event(task, *netns_inode, Some(*via)),
            KernelEvent::NetnsFreed { task, netns_inode } => {
                // Only this very incarnation's record counts (`Registry::freed`).
                let freed_at = self.clock.wall(task.ktime_ns);
                if let Some(id) = self.registry.freed(*netns_inode, freed_at) {
                    self.die(id, DeathSource::PutNet, freed_at);
                }
            }
            KernelEvent::CniExec { .. } | KernelEvent::CniExit { .. } => {}
        }
    }

    fn netns_event(&mut self, task: &Task, inode: NetnsInode, created_via: Option<NetnsVia>) {
        if self.registry.is_host_inode(inode) {
            return;
        }
        if let Some(via) = created_via {
            self.registry.note_creator(inode, task, via, self.clock.wall(task.ktime_ns));
        }
        if self.registry.by_inode(inode).is_none() && self.resync.resolve(inode) {
            self.actions.push(Action::Job(Job::Resolve { inode, tgid: task.tgid, tid: task.pid }));
        }
    }

    // ---- records: birth, binding, death ----------------------------------

    /// An nsid the model may not know: a new record (inode found later).
    fn nsid_appeared(&mut self, nsid: i32, now: SystemTime) -> RecordId {
        if let Some(id) = self.registry.by_nsid(nsid) {
            self.dumps.mark(NetnsKey::Host, Entry::Nsid(nsid));
            self.registry.touch(NetnsKey::Record(id), now);
            return id;
        }
        self.resync.nsid_without_inode();
        self.create(None, nsid, now)
    }

    /// A new record, dumped right away.
    fn create(&mut self, inode: Option<NetnsInode>, nsid: i32, now: SystemTime) -> RecordId {
        let id = self.registry.create(inode, nsid, now);
        self.dumps.mark(NetnsKey::Host, Entry::Nsid(nsid));
        for table in [Table::Links, Table::Addresses] {
            self.queue_dump(Dump { target: NetnsKey::Record(id), table, counting: false, for_resync: false });
        }
        id
    }

    /// The kernel says netns `target` has nsid `nsid`.
    fn bind(&mut self, target: QueryTarget, nsid: i32, counting: bool, now: SystemTime) {
        let inode = match target {
            QueryTarget::Inode(i) if !self.registry.is_host_inode(i) => i,
            _ => return self.registry.bind_host(nsid),
        };
        match self.registry.plan_bind(inode, nsid) {
            BindPlan::Known(id) => self.registry.touch(NetnsKey::Record(id), now),
            BindPlan::Attach { record, superseded } => {
                if let Some(old) = superseded {
                    self.die_superseded(old);
                }
                self.registry.attach_inode(record, inode);
            }
            BindPlan::Create { superseded, nsid_was_free } => {
                for old in superseded {
                    self.die_superseded(old);
                }
                self.registry.count_assignment(counting && nsid_was_free);
                self.create(Some(inode), nsid, now);
            }
        }
    }

    /// Its nsid or inode now names another netns: dead since it was last
    /// known alive.
    fn die_superseded(&mut self, id: RecordId) {
        if let Some(at) = self.registry.last_alive(id) {
            self.die(id, DeathSource::Superseded, at);
        }
    }

    /// Records the kernel's word that netns `id` died at `at` (for sources
    /// that cannot tell the time, the earliest it can have happened).
    fn die(&mut self, id: RecordId, source: DeathSource, at: SystemTime) {
        // The view needs the record still in place to name its peers.
        let Some(view) = view::dying(&self.registry, id, source, at) else {
            return;
        };
        self.registry.remove(id, source);
        let death = NetnsDeath::from_view(&view, at, source);
        // Logged (once) where it is reported: the daemon's publish.
        debug!(
            inode = ?death.inode,
            nsid = ?death.nsid,
            source = ?source,
            addresses = ?death.addresses.iter().map(|a| a.ip).collect::<Vec<_>>(),
            "netns died"
        );
        self.actions.push(Action::Death(death));
        self.dead.push(view);
    }

    // ---- dumps -----------------------------------------------------------

    fn queue_dump(&mut self, dump: Dump) {
        self.dumps.queue(dump);
        self.start_next_dump();
    }

    fn start_next_dump(&mut self) {
        while !self.dumps.busy() {
            let Some(dump) = self.dumps.next_queued() else {
                return;
            };
            let nsid = match dump.target {
                NetnsKey::Host => None,
                NetnsKey::Record(id) => {
                    let Some(n) = self.registry.nsid(id) else {
                        // Died while queued.
                        self.dump_finished(dump);
                        continue;
                    };
                    Some(n)
                }
            };
            let seq = self.seq();
            let epoch = self.registry.bump_epoch();
            let request = self.dumps.start(dump, nsid, seq, epoch, self.last_now);
            self.actions.push(Action::Send { request, dump_seq: Some(seq) });
        }
    }

    /// The resync's bookkeeping of a finished dump.
    fn dump_finished(&mut self, dump: Dump) {
        let registry = &self.registry;
        match self.resync.dump_finished(&dump, self.last_now, || registry.record_ids()) {
            ResyncStep::Nothing => {}
            ResyncStep::DumpAll(dumps) => self.dumps.queue_for_resync(dumps),
            ResyncStep::Complete { first, again } => {
                if first {
                    info!(netns = self.registry.len(), "netns model ready");
                }
                if again {
                    self.start_resync(true);
                }
            }
        }
    }

    // ---- views -----------------------------------------------------------

    /// The whole model at `now`. Costs in proportion to what changed since
    /// the previous snapshot: the views of netns that did not change are
    /// shared with it. (In debug builds, checked against a snapshot built
    /// from nothing.)
    pub fn snapshot(&mut self, now: SystemTime) -> ModelSnapshot {
        let changes = self.registry.take_changes();
        let stats = self.stats();
        let snapshot = self.views.snapshot(&self.registry, &changes, &self.dead, stats, now);
        debug_assert_eq!(snapshot, self.fresh_snapshot(now), "an incremental snapshot differs from a fresh one");
        snapshot
    }

    /// The whole model at `now`, every view built anew: what
    /// [`Model::snapshot`] must equal.
    #[must_use]
    pub fn fresh_snapshot(&self, now: SystemTime) -> ModelSnapshot {
        view::fresh_snapshot(&self.registry, &self.dead, self.stats(), now)
    }
}

#[cfg(test)]
pub(super) mod tests;
