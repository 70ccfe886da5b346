//! The model as a synchronous state machine: netlink datagrams, probe events
//! and discovery reports go in; netlink requests, discovery jobs and death
//! notices come out as [`Action`]s. No I/O here, so every rule is testable
//! with fabricated messages.
//!
//! Ordering argument: requests, replies, dumps and notifications share one
//! socket, and the kernel queues them in the order things happened. So a
//! GETNSID reply naming nsid 5 can only be read after the `RTM_DELNSID` of
//! the previous holder of nsid 5, and applying messages in arrival order
//! keeps nsid -> netns bindings right across deaths and reuse.

use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    net::IpAddr,
    os::fd::RawFd,
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use tracing::{debug, info, warn};

use super::snapshot::{
    AddrScope, AddressView, Creator, DeathSource, HostRouteView, InterfaceView, LinkRef, ModelSnapshot, ModelStats,
    NetnsDeath, NetnsInode, NetnsRef, NetnsView,
};
use crate::{
    discovery::{Scope, Sighting},
    kernel::events::{KernelEvent, NetnsVia, Task},
    netlink::wire::{self, Header, Message, consts},
    telemetry::clock::Clock,
};

/// Limits and retention of the model.
#[derive(Debug, Clone)]
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

type RecordId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Target {
    Host,
    Record(RecordId),
}

/// Where a link's `IFLA_LINK` points, in the agent's frame of reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LinkNetns {
    Same,
    /// nsid as the agent's netns numbers it.
    Nsid(i32),
    /// Only an event from inside the netns said so, in that netns's own
    /// numbering (or not at all): a dump will tell.
    Unverified,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct LinkState {
    name: Option<String>,
    kind: Option<String>,
    flags: u32,
    mac: Option<Vec<u8>>,
    link: Option<u32>,
    link_netns: LinkNetns,
    master: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct AddrKey {
    ifindex: u32,
    ip: IpAddr,
    prefix_len: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct RouteKey {
    dst: IpAddr,
    dst_len: u8,
    table: u32,
    priority: u32,
    oif: u32,
}

#[derive(Debug, Clone)]
struct Netns {
    inode: Option<NetnsInode>,
    nsid: Option<i32>,
    first_seen: SystemTime,
    /// Last time the kernel showed it alive (an event from it, a dump part
    /// about it, an nsid reply): the earliest it can have died.
    last_alive: SystemTime,
    /// Model epoch at creation: a sweep only judges records older than it.
    born: u64,
    creator: Option<Creator>,
    /// Where it was last seen bind-mounted: `ip netns del` unmounts before
    /// the netns dies, and a death notice should still name the path a CNI
    /// runtime knew it by.
    last_mounts: Vec<PathBuf>,
    links: BTreeMap<u32, LinkState>,
    addresses: BTreeMap<AddrKey, u8>,
    routes: BTreeMap<RouteKey, u8>,
}

impl Netns {
    fn new(inode: Option<NetnsInode>, nsid: Option<i32>, now: SystemTime, born: u64) -> Self {
        Self {
            inode,
            nsid,
            first_seen: now,
            last_alive: now,
            born,
            creator: None,
            last_mounts: Vec::new(),
            links: BTreeMap::new(),
            addresses: BTreeMap::new(),
            routes: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DumpWhat {
    Links,
    Addresses,
    Routes,
    Nsids,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dump {
    target: Target,
    what: DumpWhat,
    /// Differences found count as corrections (periodic resync only).
    counting: bool,
    for_resync: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Seen {
    Link(u32),
    Addr(AddrKey),
    Route(RouteKey),
    Nsid(i32),
}

#[derive(Debug)]
struct ActiveDump {
    seq: u32,
    dump: Dump,
    /// The nsid the request targeted (records only).
    nsid: Option<i32>,
    seen: HashSet<Seen>,
    interrupted: bool,
    started_epoch: u64,
    started_at: SystemTime,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QueryKind {
    Assign,
    Get,
}

#[derive(Debug, Clone, Copy)]
struct Query {
    target: QueryTarget,
    kind: QueryKind,
    sent: SystemTime,
    counting: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QueryTarget {
    Host,
    Inode(NetnsInode),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    WaitingForScan,
    Scanning(u64),
    Nsids,
    Dumps,
}

#[derive(Debug, Clone, Copy)]
struct Resync {
    started: SystemTime,
    counting: bool,
    phase: Phase,
    dumps_left: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ScanRequest {
    scope: Scope,
    open_all: bool,
}

impl ScanRequest {
    fn merge(self, other: Self) -> Self {
        Self { scope: self.scope.max(other.scope), open_all: self.open_all || other.open_all }
    }
}

/// The node's network namespaces, as evidence has shown them.
pub struct Model {
    config: ModelConfig,
    clock: Clock,
    host: Netns,
    live: HashMap<RecordId, Netns>,
    by_nsid: HashMap<i32, RecordId>,
    by_inode: HashMap<NetnsInode, RecordId>,
    dead: VecDeque<NetnsView>,
    sightings: BTreeMap<NetnsInode, Sighting>,
    pending_creators: HashMap<NetnsInode, Creator>,
    resolving: HashSet<NetnsInode>,
    next_id: RecordId,
    epoch: u64,
    next_seq: u32,
    queries: HashMap<u32, Query>,
    dumps: VecDeque<Dump>,
    active: Option<ActiveDump>,
    next_generation: u64,
    scan_in_flight: Option<(u64, ScanRequest)>,
    scan_wanted: Option<ScanRequest>,
    resync: Option<Resync>,
    resync_again: bool,
    unresolved_nsids: bool,
    /// A dump aimed at an nsid has succeeded: the kernel supports target
    /// nsids, so an EINVAL for one means the nsid is gone.
    targeted_dumps_work: bool,
    stats: ModelStats,
    actions: Vec<Action>,
    /// Time of the latest input, for state that records when it started.
    last_now: SystemTime,
}

fn creator_of(clock: &Clock, task: &Task, via: NetnsVia) -> Creator {
    Creator {
        pid: task.tgid,
        tid: task.pid,
        comm: task.comm.clone(),
        cgroup_id: task.cgroup_id,
        via,
        at: clock.wall(task.ktime_ns),
    }
}

fn is_host_route(r: &wire::Route) -> bool {
    let full = match r.family {
        consts::AF_INET => 32,
        consts::AF_INET6 => 128,
        _ => return false,
    };
    r.route_type == consts::RTN_UNICAST
        && r.table == consts::RT_TABLE_MAIN
        && r.dst_len == full
        && r.dst.is_some()
        && r.oif.is_some()
}

fn route_key(r: &wire::Route) -> Option<RouteKey> {
    Some(RouteKey { dst: r.dst?, dst_len: r.dst_len, table: r.table, priority: r.priority.unwrap_or(0), oif: r.oif? })
}

fn addr_key(a: &wire::Address) -> AddrKey {
    AddrKey { ifindex: a.ifindex, ip: a.ip, prefix_len: a.prefix_len }
}

impl Model {
    /// `host_inode`: inode of the agent's own netns.
    #[must_use]
    pub fn new(config: ModelConfig, host_inode: NetnsInode, now: SystemTime) -> Self {
        Self {
            config,
            clock: Clock::new(),
            host: Netns::new(Some(host_inode), None, now, 0),
            live: HashMap::new(),
            by_nsid: HashMap::new(),
            by_inode: HashMap::new(),
            dead: VecDeque::new(),
            sightings: BTreeMap::new(),
            pending_creators: HashMap::new(),
            resolving: HashSet::new(),
            next_id: 1,
            epoch: 1,
            next_seq: 1,
            queries: HashMap::new(),
            dumps: VecDeque::new(),
            active: None,
            next_generation: 1,
            scan_in_flight: None,
            scan_wanted: None,
            resync: None,
            resync_again: false,
            unresolved_nsids: false,
            targeted_dumps_work: false,
            stats: ModelStats::default(),
            actions: Vec::new(),
            last_now: now,
        }
    }

    /// Actions produced since the last call, in order.
    pub fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    #[must_use]
    pub fn stats(&self) -> &ModelStats {
        &self.stats
    }

    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.stats.ready
    }

    #[must_use]
    pub fn resync_in_progress(&self) -> bool {
        self.resync.is_some()
    }

    pub fn count_dropped_death(&mut self) {
        self.stats.deaths_dropped += 1;
    }

    fn seq(&mut self) -> u32 {
        let s = self.next_seq;
        // Zero is what notifications carry; never use it for a request.
        self.next_seq = self.next_seq.wrapping_add(1).max(1);
        s
    }

    fn bump_epoch(&mut self) -> u64 {
        self.epoch += 1;
        self.epoch
    }

    // ---- startup and resync -------------------------------------------

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
        if self.resync.is_some() {
            self.resync_again = true;
            return;
        }
        if counting {
            debug!("netns model: full resync");
        } else {
            info!("netns model: first full sync");
        }
        self.resync = Some(Resync { started: self.last_now, counting, phase: Phase::WaitingForScan, dumps_left: 0 });
        self.request_scan(ScanRequest { scope: Scope::Full, open_all: true });
    }

    /// ENOBUFS: notifications were lost. Replies to our queries may be
    /// among them; those left pending are pruned as stale.
    pub fn overrun(&mut self) {
        self.stats.overruns += 1;
        if self.resync.is_some() {
            debug!(overruns = self.stats.overruns, "netlink overrun during a resync");
        } else {
            warn!(overruns = self.stats.overruns, "netlink overrun: notifications lost, resyncing");
        }
        self.start_resync(true);
    }

    fn request_scan(&mut self, req: ScanRequest) {
        if self.scan_in_flight.is_some() {
            self.scan_wanted = Some(self.scan_wanted.map_or(req, |w| w.merge(req)));
            return;
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        let skip: HashSet<NetnsInode> =
            if req.open_all { HashSet::new() } else { self.by_inode.keys().copied().chain(self.host.inode).collect() };
        if req.open_all
            && req.scope == Scope::Full
            && let Some(r) = &mut self.resync
            && r.phase == Phase::WaitingForScan
        {
            r.phase = Phase::Scanning(generation);
        }
        self.scan_in_flight = Some((generation, req));
        self.actions.push(Action::Job(Job::Scan { generation, scope: req.scope, skip: Arc::new(skip) }));
    }

    /// The mount table changed: a netns may have been bind-mounted.
    pub fn mounts_changed(&mut self) {
        self.request_scan(ScanRequest { scope: Scope::Mounts, open_all: false });
    }

    /// The driver could not queue a job (channel full): retry later.
    pub fn job_rejected(&mut self, job: &Job) {
        match job {
            Job::Scan { generation, .. } => {
                if let Some((_, req)) = self.scan_in_flight.take() {
                    self.scan_wanted = Some(self.scan_wanted.map_or(req, |w| w.merge(req)));
                }
                if let Some(r) = &mut self.resync
                    && r.phase == Phase::Scanning(*generation)
                {
                    r.phase = Phase::WaitingForScan;
                }
            }
            Job::Resolve { inode, .. } => {
                self.resolving.remove(inode);
                self.request_scan(ScanRequest { scope: Scope::Full, open_all: false });
            }
        }
    }

    /// A request could not be sent. A dump that never started must not
    /// block the ones queued behind it.
    pub fn send_failed(&mut self, dump_seq: Option<u32>) {
        if let Some(seq) = dump_seq
            && self.active.as_ref().is_some_and(|a| a.seq == seq)
            && let Some(active) = self.active.take()
        {
            self.dumps.push_back(active.dump);
        }
    }

    /// Periodic housekeeping: retention, stale queries, retries.
    pub fn tick(&mut self, now: SystemTime) {
        self.last_now = now;
        // The kernel always finishes a dump we read; one that does not is a
        // lost request: let the queue move on.
        if self.active.as_ref().is_some_and(|a| age(now, a.started_at) > STUCK) {
            warn!("netlink dump unanswered; moving on");
            self.end_dump(DumpEnd::Lost, now);
        }
        if self.resync.is_some_and(|r| age(now, r.started) > STUCK * 4) {
            warn!("netns resync did not finish; starting over");
            self.resync = None;
            self.start_resync(true);
        }
        let retention = self.config.dead_retention;
        while self.dead.len() > self.config.max_dead
            || self.dead.front().and_then(|d| d.died_at).is_some_and(|t| age(now, t) > retention)
        {
            self.dead.pop_front();
        }
        let ttl = self.config.creator_ttl;
        self.pending_creators.retain(|_, c| age(now, c.at) <= ttl);
        self.queries.retain(|_, q| age(now, q.sent) <= STUCK);
        if self.scan_in_flight.is_none()
            && let Some(req) = self.scan_wanted.take()
        {
            self.request_scan(req);
        }
        // A netns known only by nsid (the kernel assigned it, e.g. for a
        // veth peer): find its inode once our own queries have settled.
        if self.unresolved_nsids && self.queries.is_empty() && self.live.values().any(|r| r.inode.is_none()) {
            self.unresolved_nsids = false;
            self.request_scan(ScanRequest { scope: Scope::Full, open_all: false });
        }
    }

    // ---- discovery reports -----------------------------------------------

    /// The discovery thread opened netns `inode`: ask the kernel for its
    /// nsid, assigning one if it has none. The driver sends the requests
    /// and closes the fd right after: the kernel resolves the fd while
    /// handling sendmsg, so no reference outlives that call.
    pub fn netns_opened(&mut self, inode: NetnsInode, fd: RawFd, now: SystemTime) {
        self.last_now = now;
        self.resolving.remove(&inode);
        let counting = self.resync.is_some_and(|r| r.counting && matches!(r.phase, Phase::Scanning(_)));
        let target = if Some(inode) == self.host.inode { QueryTarget::Host } else { QueryTarget::Inode(inode) };
        let known = match target {
            QueryTarget::Host => self.host.nsid.is_some(),
            QueryTarget::Inode(i) => self.by_inode.contains_key(&i),
        };
        self.query_nsid(target, fd, now, counting, !known);
    }

    fn query_nsid(&mut self, target: QueryTarget, fd: RawFd, now: SystemTime, counting: bool, assign: bool) {
        if assign {
            let seq = self.seq();
            self.queries.insert(seq, Query { target, kind: QueryKind::Assign, sent: now, counting });
            self.actions.push(Action::Send { request: wire::assign_nsid(seq, fd), dump_seq: None });
        }
        let seq = self.seq();
        self.queries.insert(seq, Query { target, kind: QueryKind::Get, sent: now, counting });
        self.actions.push(Action::Send { request: wire::get_nsid(seq, fd), dump_seq: None });
    }

    /// A probe-announced netns could not be opened: gone already, or held
    /// only by an fd we cannot see.
    pub fn resolve_failed(&mut self, inode: NetnsInode) {
        self.resolving.remove(&inode);
        self.stats.unresolved_creations += 1;
        debug!(inode, "announced netns could not be opened");
    }

    pub fn scan_done(&mut self, generation: u64, scope: Scope, found: BTreeMap<NetnsInode, Sighting>) {
        match scope {
            Scope::Full => self.sightings = found,
            Scope::Mounts => {
                for s in self.sightings.values_mut() {
                    s.bind_mounts.clear();
                }
                for (inode, s) in found {
                    self.sightings.entry(inode).or_default().bind_mounts = s.bind_mounts;
                }
                self.sightings.retain(|_, s| !s.bind_mounts.is_empty() || s.process_count > 0);
            }
        }
        self.remember_mounts();
        self.scan_finished(generation);
    }

    fn remember_mounts(&mut self) {
        for rec in self.live.values_mut() {
            if let Some(s) = rec.inode.and_then(|i| self.sightings.get(&i))
                && !s.bind_mounts.is_empty()
            {
                rec.last_mounts.clone_from(&s.bind_mounts);
            }
        }
    }

    pub fn scan_failed(&mut self, generation: u64, error: &str) {
        warn!("netns discovery scan failed: {error}");
        self.scan_finished(generation);
    }

    fn scan_finished(&mut self, generation: u64) {
        if self.scan_in_flight.is_some_and(|(g, _)| g == generation) {
            self.scan_in_flight = None;
        }
        if let Some(r) = &mut self.resync
            && r.phase == Phase::Scanning(generation)
        {
            // Every GETNSID of this scan was sent before this dump request,
            // so its replies are read before the dump.
            r.phase = Phase::Nsids;
            let counting = r.counting;
            self.queue_dump(Dump { target: Target::Host, what: DumpWhat::Nsids, counting, for_resync: true });
        }
        if let Some(req) = self.scan_wanted.take() {
            self.request_scan(req);
        }
    }

    // ---- probe events ----------------------------------------------------

    pub fn kernel_event(&mut self, event: &KernelEvent, now: SystemTime) {
        self.last_now = now;
        self.stats.kernel_events += 1;
        match event {
            KernelEvent::NetnsEntered { task, netns_inode, via, .. } => {
                let creation = matches!(via, NetnsVia::Unshare | NetnsVia::Clone | NetnsVia::Clone3);
                self.netns_event(task, *netns_inode, creation.then_some(*via));
            }
            KernelEvent::NetnsCreated { task, netns_inode, via } => self.netns_event(task, *netns_inode, Some(*via)),
            KernelEvent::NetnsFreed { task, netns_inode } => {
                // The record must be this very incarnation: a late record of
                // an earlier netns with the same inode (reused at once)
                // predates the current one's first sight.
                let freed_at = self.clock.wall(task.ktime_ns);
                if let Some(&id) = self.by_inode.get(netns_inode)
                    && self.live.get(&id).is_some_and(|r| freed_at >= r.first_seen)
                {
                    self.die(id, DeathSource::PutNet, freed_at);
                } else if self.by_inode.contains_key(netns_inode) {
                    debug!(inode = netns_inode, "__put_net of an earlier netns with a reused inode: ignored");
                }
            }
            KernelEvent::CniExec { .. } | KernelEvent::CniExit { .. } => {}
        }
    }

    fn netns_event(&mut self, task: &Task, inode: NetnsInode, created_via: Option<NetnsVia>) {
        if Some(inode) == self.host.inode {
            return;
        }
        if let Some(via) = created_via {
            let creator = creator_of(&self.clock, task, via);
            match self.by_inode.get(&inode).and_then(|id| self.live.get_mut(id)) {
                Some(rec) if rec.creator.is_none() => rec.creator = Some(creator),
                // The record is an older netns with a reused inode whose
                // death is still queued: keep this for the new one.
                Some(_) | None => {
                    self.pending_creators.insert(inode, creator);
                }
            }
        }
        if !self.by_inode.contains_key(&inode) && self.resolving.insert(inode) {
            self.actions.push(Action::Job(Job::Resolve { inode, tgid: task.tgid, tid: task.pid }));
        }
    }

    // ---- netlink ---------------------------------------------------------

    /// One datagram from the socket. `origin_nsid` is its
    /// `NETLINK_LISTEN_ALL_NSID` control message.
    pub fn datagram(&mut self, origin_nsid: Option<i32>, bytes: &[u8], now: SystemTime) {
        self.last_now = now;
        for item in wire::messages(bytes) {
            match item {
                Err(e) => {
                    self.stats.malformed_messages += 1;
                    warn!("malformed netlink datagram, rest skipped: {e}");
                    break;
                }
                Ok((header, payload)) => match wire::decode(&header, payload) {
                    Ok(message) => self.message(origin_nsid, &header, message, now),
                    Err(e) => {
                        self.stats.malformed_messages += 1;
                        warn!(kind = header.kind, "malformed netlink message skipped: {e}");
                    }
                },
            }
        }
    }

    fn origin(&self, origin_nsid: Option<i32>) -> Origin {
        match origin_nsid {
            None => Origin::Host,
            Some(n) if Some(n) == self.host.nsid => Origin::Host,
            Some(n) => self.by_nsid.get(&n).map_or(Origin::Unknown(n), |&id| Origin::Record(id)),
        }
    }

    fn message(&mut self, origin_nsid: Option<i32>, header: &Header, message: Message, now: SystemTime) {
        let origin = self.origin(origin_nsid);
        if origin == Origin::Host && header.seq != 0 {
            if self.active.as_ref().is_some_and(|a| a.seq == header.seq) {
                self.dump_part(header, message, now);
                return;
            }
            if let Some(query) = self.queries.get(&header.seq).copied() {
                match message {
                    Message::NewNsid { nsid } => {
                        self.queries.remove(&header.seq);
                        if let Some(n) = nsid {
                            self.bind(query.target, n, query.counting, now);
                        } else {
                            warn!(target = ?query.target, "netns still has no nsid after assignment");
                        }
                        return;
                    }
                    Message::Error { errno, .. } => {
                        self.queries.remove(&header.seq);
                        if !(errno == libc::EEXIST && query.kind == QueryKind::Assign) && errno != 0 {
                            warn!(target = ?query.target, errno, "nsid request failed");
                        }
                        return;
                    }
                    _ => {}
                }
            }
        }
        match message {
            // Never the host's own nsid: a late reply to a pruned query can
            // carry it.
            Message::NewNsid { nsid: Some(n) } if origin == Origin::Host && Some(n) != self.host.nsid => {
                self.nsid_appeared(n, now);
            }
            Message::DelNsid { nsid: Some(n) } if origin == Origin::Host => {
                if let Some(&id) = self.by_nsid.get(&n) {
                    self.die(id, DeathSource::RtmDelnsid, now);
                } else {
                    debug!(nsid = n, "RTM_DELNSID for an nsid the model never bound");
                }
            }
            Message::NewLink(_)
            | Message::DelLink(_)
            | Message::NewAddress(_)
            | Message::DelAddress(_)
            | Message::NewRoute(_)
            | Message::DelRoute(_) => {
                let target = match origin {
                    Origin::Host => Target::Host,
                    Origin::Record(id) => Target::Record(id),
                    // An event can beat the RTM_NEWNSID that announces its
                    // netns; the nsid is valid, so start the record here.
                    Origin::Unknown(n) => Target::Record(self.nsid_appeared(n, now)),
                };
                self.event(target, message, now);
            }
            Message::Error { errno, request_seq } if errno != 0 => {
                debug!(errno, ?request_seq, "netlink error for a request no longer tracked");
            }
            // Other netns numbering their peers (not our frame of reference),
            // stray acknowledgements, types we did not ask for.
            Message::NewNsid { .. }
            | Message::DelNsid { .. }
            | Message::Done { .. }
            | Message::Error { .. }
            | Message::Other => {}
        }
    }

    /// An nsid the model may not know: a new record (inode found later).
    fn nsid_appeared(&mut self, nsid: i32, now: SystemTime) -> RecordId {
        if let Some(&id) = self.by_nsid.get(&nsid) {
            self.note_seen(Target::Host, DumpWhat::Nsids, Seen::Nsid(nsid));
            self.touch(Target::Record(id), now);
            return id;
        }
        self.unresolved_nsids = true;
        self.create(None, nsid, now)
    }

    fn create(&mut self, inode: Option<NetnsInode>, nsid: i32, now: SystemTime) -> RecordId {
        let id = self.next_id;
        self.next_id += 1;
        let born = self.bump_epoch();
        let mut rec = Netns::new(inode, Some(nsid), now, born);
        if let Some(i) = inode {
            rec.creator = self.pending_creators.remove(&i);
            rec.last_mounts = self.sightings.get(&i).map(|s| s.bind_mounts.clone()).unwrap_or_default();
            self.by_inode.insert(i, id);
        }
        self.by_nsid.insert(nsid, id);
        self.live.insert(id, rec);
        self.note_seen(Target::Host, DumpWhat::Nsids, Seen::Nsid(nsid));
        debug!(?inode, nsid, "netns tracked");
        for what in [DumpWhat::Links, DumpWhat::Addresses] {
            self.queue_dump(Dump { target: Target::Record(id), what, counting: false, for_resync: false });
        }
        id
    }

    /// The kernel says netns `target` has nsid `nsid`.
    fn bind(&mut self, target: QueryTarget, nsid: i32, counting: bool, now: SystemTime) {
        let inode = match target {
            QueryTarget::Inode(i) if Some(i) != self.host.inode => i,
            _ => {
                // A record made for this nsid before we knew it was ours.
                if let Some(id) = self.by_nsid.remove(&nsid) {
                    self.live.remove(&id);
                }
                if self.host.nsid != Some(nsid) {
                    debug!(nsid, "the agent's own netns has an nsid for itself");
                }
                self.host.nsid = Some(nsid);
                return;
            }
        };
        let holder = self.by_nsid.get(&nsid).copied();
        let by_inode = self.by_inode.get(&inode).copied();
        match holder {
            Some(id) if by_inode == Some(id) => self.touch(Target::Record(id), now),
            Some(id) if self.live.get(&id).is_some_and(|r| r.inode.is_none()) => {
                // One live netns has one nsid: another record claiming this
                // inode is an older netns whose inode was reused.
                if let Some(old) = by_inode {
                    self.die_superseded(old);
                }
                let pending = self.pending_creators.remove(&inode);
                let mounts = self.sightings.get(&inode).map(|s| s.bind_mounts.clone()).unwrap_or_default();
                if let Some(rec) = self.live.get_mut(&id) {
                    rec.inode = Some(inode);
                    rec.last_mounts = mounts;
                    if rec.creator.is_none() {
                        rec.creator = pending;
                    }
                }
                self.by_inode.insert(inode, id);
            }
            Some(id) => {
                // nsid reused: its previous holder died unannounced.
                self.die_superseded(id);
                if let Some(old) = self.by_inode.get(&inode).copied() {
                    self.die_superseded(old);
                }
                self.stats.nsids_assigned += 1;
                self.create(Some(inode), nsid, now);
            }
            None => {
                if let Some(old) = by_inode {
                    self.die_superseded(old);
                }
                self.stats.nsids_assigned += 1;
                if counting {
                    self.stats.corrections.netns_found += 1;
                }
                self.create(Some(inode), nsid, now);
            }
        }
    }

    /// Its nsid or inode now names another netns: dead since it was last
    /// known alive.
    fn die_superseded(&mut self, id: RecordId) {
        if let Some(at) = self.live.get(&id).map(|r| r.last_alive) {
            self.die(id, DeathSource::Superseded, at);
        }
    }

    /// Records the kernel's word that netns `id` died at `now` (for sources
    /// that cannot tell the time, the earliest it can have happened).
    fn die(&mut self, id: RecordId, source: DeathSource, now: SystemTime) {
        if !self.live.contains_key(&id) {
            return;
        }
        if matches!(source, DeathSource::NsidGone | DeathSource::Superseded) {
            self.stats.corrections.netns_lost += 1;
        }
        // The view needs the record still in place to name its peers.
        let resolver = Resolver::new(self);
        let Some(rec) = self.live.get(&id) else {
            return;
        };
        let mut view = self.view(&resolver, Target::Record(id), rec, now);
        view.alive = false;
        if view.bind_mounts.is_empty() {
            view.bind_mounts.clone_from(&rec.last_mounts);
        }
        view.died_at = Some(now);
        view.death_source = Some(source);
        if let Some(rec) = self.live.remove(&id) {
            if let Some(n) = rec.nsid
                && self.by_nsid.get(&n) == Some(&id)
            {
                self.by_nsid.remove(&n);
            }
            if let Some(i) = rec.inode
                && self.by_inode.get(&i) == Some(&id)
            {
                self.by_inode.remove(&i);
                // The inode may be reused; its old mounts are not the new
                // netns's.
                self.sightings.remove(&i);
            }
        }
        self.stats.deaths += 1;
        let death = NetnsDeath::from_view(&view, now, source);
        // Logged (once) where it is reported: the daemon's publish.
        debug!(
            inode = ?death.inode,
            nsid = ?death.nsid,
            source = ?source,
            addresses = ?death.addresses.iter().map(|a| a.ip).collect::<Vec<_>>(),
            "netns died"
        );
        self.actions.push(Action::Death(death));
        self.dead.push_back(view);
        if self.dead.len() > self.config.max_dead {
            self.dead.pop_front();
        }
    }

    /// The kernel just showed `target` alive.
    fn touch(&mut self, target: Target, now: SystemTime) {
        if let Some(ns) = self.netns_mut(target)
            && ns.last_alive < now
        {
            ns.last_alive = now;
        }
    }

    fn netns_mut(&mut self, target: Target) -> Option<&mut Netns> {
        match target {
            Target::Host => Some(&mut self.host),
            Target::Record(id) => self.live.get_mut(&id),
        }
    }

    fn note_seen(&mut self, target: Target, what: DumpWhat, key: Seen) {
        if let Some(a) = &mut self.active
            && a.dump.target == target
            && a.dump.what == what
        {
            a.seen.insert(key);
        }
    }

    /// A notification about `target` (not a dump part).
    fn event(&mut self, target: Target, message: Message, now: SystemTime) {
        self.touch(target, now);
        match message {
            Message::NewLink(l) => {
                let ifindex = l.ifindex;
                let needs_dump = self.upsert_link(target, l, target == Target::Host, false);
                self.note_seen(target, DumpWhat::Links, Seen::Link(ifindex));
                if needs_dump {
                    self.queue_dump(Dump { target, what: DumpWhat::Links, counting: false, for_resync: false });
                }
            }
            Message::DelLink(l) => {
                if let Some(ns) = self.netns_mut(target) {
                    ns.links.remove(&l.ifindex);
                    ns.addresses.retain(|k, _| k.ifindex != l.ifindex);
                    ns.routes.retain(|k, _| k.oif != l.ifindex);
                }
            }
            Message::NewAddress(a) => {
                let key = addr_key(&a);
                if let Some(ns) = self.netns_mut(target) {
                    ns.addresses.insert(key, a.scope);
                }
                self.note_seen(target, DumpWhat::Addresses, Seen::Addr(key));
            }
            Message::DelAddress(a) => {
                if let Some(ns) = self.netns_mut(target) {
                    ns.addresses.remove(&addr_key(&a));
                }
            }
            Message::NewRoute(r) if target == Target::Host && is_host_route(&r) => {
                if let Some(key) = route_key(&r) {
                    self.host.routes.insert(key, r.protocol);
                    self.note_seen(target, DumpWhat::Routes, Seen::Route(key));
                }
            }
            Message::DelRoute(r) if target == Target::Host => {
                if let Some(key) = route_key(&r) {
                    self.host.routes.remove(&key);
                }
            }
            _ => {}
        }
    }

    /// Stores a link; returns whether its netns should be re-dumped to
    /// learn where its peer lives. Counts a correction when a counting dump
    /// finds it new or different.
    fn upsert_link(&mut self, target: Target, l: wire::Link, our_frame: bool, counting: bool) -> bool {
        let Some(ns) = self.netns_mut(target) else {
            return false;
        };
        let old = ns.links.get(&l.ifindex);
        let mut needs_dump = false;
        let link_netns = match (our_frame, l.link_netnsid, l.link) {
            (true, Some(n), _) => LinkNetns::Nsid(n),
            (true, None, _) | (false, _, None) => LinkNetns::Same,
            (false, _, Some(p)) => match old {
                Some(o) if o.link == Some(p) && o.link_netns != LinkNetns::Unverified => o.link_netns,
                _ => {
                    needs_dump = true;
                    LinkNetns::Unverified
                }
            },
        };
        let state = LinkState {
            name: l.name,
            kind: l.kind,
            flags: l.flags,
            mac: l.mac,
            link: l.link,
            link_netns,
            master: l.master,
        };
        let changed = old != Some(&state);
        ns.links.insert(l.ifindex, state);
        if counting && changed {
            self.stats.corrections.links += 1;
        }
        needs_dump
    }

    // ---- dumps -----------------------------------------------------------

    fn queue_dump(&mut self, dump: Dump) {
        let duplicate = self.dumps.iter_mut().find(|d| d.target == dump.target && d.what == dump.what);
        match duplicate {
            Some(d) if !dump.for_resync || d.for_resync => d.counting |= dump.counting,
            _ => self.dumps.push_back(dump),
        }
        self.start_next_dump();
    }

    fn start_next_dump(&mut self) {
        while self.active.is_none() {
            let Some(dump) = self.dumps.pop_front() else {
                return;
            };
            let nsid = match dump.target {
                Target::Host => None,
                Target::Record(id) => {
                    let Some(n) = self.live.get(&id).and_then(|r| r.nsid) else {
                        // Died while queued.
                        self.dump_finished(dump);
                        continue;
                    };
                    Some(n)
                }
            };
            let seq = self.seq();
            let request = match dump.what {
                DumpWhat::Links => wire::dump_links(seq, nsid),
                DumpWhat::Addresses => wire::dump_addresses(seq, nsid),
                DumpWhat::Routes => wire::dump_routes(seq),
                DumpWhat::Nsids => wire::dump_nsids(seq),
            };
            let started_epoch = self.bump_epoch();
            self.active = Some(ActiveDump {
                seq,
                dump,
                nsid,
                seen: HashSet::new(),
                interrupted: false,
                started_epoch,
                started_at: self.last_now,
            });
            self.actions.push(Action::Send { request, dump_seq: Some(seq) });
        }
    }

    fn dump_part(&mut self, header: &Header, message: Message, now: SystemTime) {
        let Some(active) = &mut self.active else {
            return;
        };
        if header.dump_interrupted() {
            active.interrupted = true;
        }
        let (dump, nsid) = (active.dump, active.nsid);
        // Parts for a record that died mid-dump describe whoever holds the
        // nsid now: drop them, that netns gets its own dump.
        let target_alive = match dump.target {
            Target::Host => true,
            Target::Record(id) => self.live.get(&id).is_some_and(|r| r.nsid == nsid),
        };
        if target_alive && !matches!(message, Message::Done { .. } | Message::Error { .. }) {
            self.touch(dump.target, now);
        }
        match message {
            Message::Done { error: 0 } => self.end_dump(DumpEnd::Complete, now),
            Message::Done { error } => self.end_dump(DumpEnd::Refused(error.saturating_neg()), now),
            Message::Error { errno, .. } => self.end_dump(DumpEnd::Refused(errno), now),
            Message::NewLink(l) if dump.what == DumpWhat::Links && target_alive => {
                let ifindex = l.ifindex;
                self.upsert_link(dump.target, l, true, dump.counting);
                self.note_seen(dump.target, DumpWhat::Links, Seen::Link(ifindex));
            }
            Message::NewAddress(a) if dump.what == DumpWhat::Addresses && target_alive => {
                let key = addr_key(&a);
                if let Some(ns) = self.netns_mut(dump.target) {
                    let old = ns.addresses.insert(key, a.scope);
                    if dump.counting && old != Some(a.scope) {
                        self.stats.corrections.addresses += 1;
                    }
                }
                self.note_seen(dump.target, DumpWhat::Addresses, Seen::Addr(key));
            }
            Message::NewRoute(r) if dump.what == DumpWhat::Routes => {
                if is_host_route(&r)
                    && let Some(key) = route_key(&r)
                {
                    let old = self.host.routes.insert(key, r.protocol);
                    if dump.counting && old.is_none() {
                        self.stats.corrections.routes += 1;
                    }
                    self.note_seen(Target::Host, DumpWhat::Routes, Seen::Route(key));
                }
            }
            Message::NewNsid { nsid: Some(n) } if dump.what == DumpWhat::Nsids => {
                if Some(n) != self.host.nsid {
                    let known = self.by_nsid.contains_key(&n);
                    self.nsid_appeared(n, now);
                    if !known && dump.counting {
                        self.stats.corrections.netns_found += 1;
                    }
                }
                self.note_seen(Target::Host, DumpWhat::Nsids, Seen::Nsid(n));
            }
            _ => {}
        }
    }

    fn end_dump(&mut self, end: DumpEnd, _now: SystemTime) {
        let Some(active) = self.active.take() else {
            return;
        };
        let dump = active.dump;
        let ok = end == DumpEnd::Complete;
        if ok && active.nsid.is_some() {
            self.targeted_dumps_work = true;
        }
        if let DumpEnd::Refused(errno) = end {
            self.dump_refused(&active, errno);
        }
        if ok && active.interrupted {
            // The kernel says the dump may be inconsistent: do it again
            // rather than sweep on it.
            self.dumps.push_front(dump);
        } else {
            if ok {
                self.sweep(&active);
            }
            self.dump_finished(dump);
        }
        self.start_next_dump();
    }

    /// A refused dump aimed at a record's nsid is the kernel saying that
    /// nsid no longer exists (EINVAL from `rtnl_get_net_ns_capable`): it is
    /// removed only when its netns is destroyed. Only trusted once a dump
    /// by target nsid has worked here (older kernels refuse them all).
    fn dump_refused(&mut self, active: &ActiveDump, errno: i32) {
        let Target::Record(id) = active.dump.target else {
            debug!(errno, what = ?active.dump.what, "dump refused");
            return;
        };
        let same_life = self.live.get(&id).is_some_and(|r| r.nsid.is_some() && r.nsid == active.nsid);
        if errno == libc::EINVAL && same_life && self.targeted_dumps_work {
            if let Some(at) = self.live.get(&id).map(|r| r.last_alive) {
                self.die(id, DeathSource::NsidGone, at);
            }
        } else {
            debug!(errno, what = ?active.dump.what, nsid = ?active.nsid, "dump refused");
        }
    }

    /// Removes what existed before the dump started but was in neither the
    /// dump nor a notification since: changes whose events were lost.
    fn sweep(&mut self, active: &ActiveDump) {
        let dump = active.dump;
        let seen = &active.seen;
        if dump.what == DumpWhat::Nsids {
            // Absence from this dump is never death: the kernel sends it in
            // parts and resumes by position, so with many netns (about
            // 1,300, fewer with fragmented memory) live ones go missing.
            // Each record gets a dump aimed at its own nsid next (the
            // resync's per-netns dumps); a refusal of that is the kernel's
            // word (`dump_refused`).
            let absent = self
                .live
                .values()
                .filter(|r| r.born < active.started_epoch && r.nsid.is_some_and(|n| !seen.contains(&Seen::Nsid(n))))
                .count();
            if absent > 0 {
                debug!(absent, "netns missing from the nsid dump; each is checked by its own nsid");
            }
            return;
        }
        if let Target::Record(id) = dump.target
            && self.live.get(&id).is_none_or(|r| r.nsid != active.nsid)
        {
            return;
        }
        let counting = dump.counting;
        let Some(ns) = self.netns_mut(dump.target) else {
            return;
        };
        let removed = match dump.what {
            DumpWhat::Links => {
                let before = ns.links.len();
                ns.links.retain(|k, _| seen.contains(&Seen::Link(*k)));
                let links = ns.links.keys().copied().collect::<HashSet<_>>();
                ns.addresses.retain(|k, _| links.contains(&k.ifindex));
                before - ns.links.len()
            }
            DumpWhat::Addresses => {
                let before = ns.addresses.len();
                ns.addresses.retain(|k, _| seen.contains(&Seen::Addr(*k)));
                before - ns.addresses.len()
            }
            DumpWhat::Routes => {
                let before = ns.routes.len();
                ns.routes.retain(|k, _| seen.contains(&Seen::Route(*k)));
                before - ns.routes.len()
            }
            DumpWhat::Nsids => 0,
        } as u64;
        if counting {
            match dump.what {
                DumpWhat::Links => self.stats.corrections.links += removed,
                DumpWhat::Addresses => self.stats.corrections.addresses += removed,
                DumpWhat::Routes => self.stats.corrections.routes += removed,
                DumpWhat::Nsids => {}
            }
        }
    }

    /// Bookkeeping of the resync's phases.
    fn dump_finished(&mut self, dump: Dump) {
        if !dump.for_resync {
            return;
        }
        let Some(mut r) = self.resync else { return };
        match (r.phase, dump.what) {
            (Phase::Nsids, DumpWhat::Nsids) => {
                let mut dumps = vec![
                    Dump { target: Target::Host, what: DumpWhat::Links, counting: r.counting, for_resync: true },
                    Dump { target: Target::Host, what: DumpWhat::Addresses, counting: r.counting, for_resync: true },
                    Dump { target: Target::Host, what: DumpWhat::Routes, counting: r.counting, for_resync: true },
                ];
                let mut ids: Vec<RecordId> = self.live.keys().copied().collect();
                ids.sort_unstable();
                for id in ids {
                    for what in [DumpWhat::Links, DumpWhat::Addresses] {
                        dumps.push(Dump { target: Target::Record(id), what, counting: r.counting, for_resync: true });
                    }
                }
                r.phase = Phase::Dumps;
                r.dumps_left = dumps.len();
                self.resync = Some(r);
                for d in dumps {
                    // Drop a plain queued duplicate; the resync one replaces it.
                    self.dumps.retain(|q| !(q.target == d.target && q.what == d.what && !q.for_resync));
                    self.dumps.push_back(d);
                }
            }
            (Phase::Dumps, _) => {
                r.dumps_left = r.dumps_left.saturating_sub(1);
                self.resync = Some(r);
                if r.dumps_left == 0 {
                    self.resync_complete();
                }
            }
            _ => {}
        }
    }

    fn resync_complete(&mut self) {
        self.resync = None;
        self.stats.resyncs += 1;
        self.stats.last_resync_at = Some(self.last_now);
        if !self.stats.ready {
            info!(netns = self.live.len(), "netns model ready");
        }
        self.stats.ready = true;
        if std::mem::take(&mut self.resync_again) {
            self.start_resync(true);
        }
    }

    // ---- views -----------------------------------------------------------

    fn view(&self, resolver: &Resolver, target: Target, ns: &Netns, now: SystemTime) -> NetnsView {
        let sighting = ns.inode.and_then(|i| self.sightings.get(&i));
        let interfaces: Vec<InterfaceView> = ns
            .links
            .iter()
            .map(|(&ifindex, l)| InterfaceView {
                ifindex,
                name: l.name.clone(),
                kind: l.kind.clone(),
                up: l.flags & consts::IFF_UP != 0,
                mac: l
                    .mac
                    .as_ref()
                    .filter(|m| !m.is_empty())
                    .map(|m| m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")),
                master: l.master,
                link: l.link.map(|p| resolver.link_ref(target, ifindex, p)),
            })
            .collect();
        let addresses = ns
            .addresses
            .iter()
            .map(|(k, &scope)| AddressView {
                ip: k.ip,
                prefix_len: k.prefix_len,
                ifindex: k.ifindex,
                ifname: ns.links.get(&k.ifindex).and_then(|l| l.name.clone()),
                scope: AddrScope::from_raw(scope),
            })
            .collect();
        let host_routes = resolver.routes_into.get(&target).cloned().unwrap_or_default();
        NetnsView {
            inode: ns.inode,
            nsid: ns.nsid,
            host: target == Target::Host,
            alive: true,
            first_seen: ns.first_seen,
            age_secs: age(now, ns.first_seen).as_secs(),
            died_at: None,
            death_source: None,
            creator: ns.creator.clone(),
            bind_mounts: sighting.map(|s| s.bind_mounts.clone()).unwrap_or_default(),
            process_count: sighting.map_or(0, |s| s.process_count),
            processes: sighting.map(|s| s.processes.clone()).unwrap_or_default(),
            interfaces,
            addresses,
            host_routes,
        }
    }

    #[must_use]
    pub fn snapshot(&self, now: SystemTime) -> ModelSnapshot {
        let resolver = Resolver::new(self);
        let mut netns = vec![self.view(&resolver, Target::Host, &self.host, now)];
        let mut live: Vec<(&RecordId, &Netns)> = self.live.iter().collect();
        live.sort_by_key(|(id, r)| (r.first_seen, **id));
        netns.extend(live.into_iter().map(|(&id, r)| self.view(&resolver, Target::Record(id), r, now)));
        netns.extend(self.dead.iter().map(|d| {
            let mut d = d.clone();
            d.age_secs = age(now, d.first_seen).as_secs();
            d
        }));
        let host_routes = self
            .host
            .routes
            .iter()
            .map(|(k, &protocol)| {
                let link = self.host.links.get(&k.oif);
                HostRouteView {
                    dst: k.dst,
                    prefix_len: k.dst_len,
                    oif: k.oif,
                    ifname: link.and_then(|l| l.name.clone()),
                    table: k.table,
                    protocol,
                    netns: link.and_then(|l| l.link).and_then(|p| resolver.link_ref(Target::Host, k.oif, p).netns),
                }
            })
            .collect();
        ModelSnapshot { taken_at: now, netns, host_routes, stats: self.stats.clone() }
    }
}

/// How a dump ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DumpEnd {
    Complete,
    /// Refused with this errno (positive).
    Refused(i32),
    /// Never finished.
    Lost,
}

/// A dump or query unanswered this long was lost.
const STUCK: Duration = Duration::from_secs(30);

fn age(now: SystemTime, then: SystemTime) -> Duration {
    now.duration_since(then).unwrap_or_default()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Host,
    Record(RecordId),
    Unknown(i32),
}

/// Resolves `IFLA_LINK` references across namespaces for one view.
struct Resolver {
    refs: HashMap<Target, NetnsRef>,
    by_nsid: HashMap<i32, Target>,
    names: HashMap<(Target, u32), Option<String>>,
    /// (netns, ifindex) -> (netns, ifindex) of the other end, for links
    /// whose own message placed the peer.
    forward: HashMap<(Target, u32), (Target, u32)>,
    reverse: HashMap<(Target, u32), (Target, u32)>,
    /// Host routes by the netns their interface leads into.
    routes_into: HashMap<Target, Vec<IpAddr>>,
}

impl Resolver {
    fn new(model: &Model) -> Self {
        let mut r = Self {
            refs: HashMap::new(),
            by_nsid: HashMap::new(),
            names: HashMap::new(),
            forward: HashMap::new(),
            reverse: HashMap::new(),
            routes_into: HashMap::new(),
        };
        let all = std::iter::once((Target::Host, &model.host))
            .chain(model.live.iter().map(|(&id, rec)| (Target::Record(id), rec)));
        let all: Vec<(Target, &Netns)> = all.collect();
        for &(t, ns) in &all {
            r.refs.insert(t, NetnsRef { inode: ns.inode, nsid: ns.nsid, host: t == Target::Host });
            if let Some(n) = ns.nsid {
                r.by_nsid.insert(n, t);
            }
            for (&ifindex, l) in &ns.links {
                r.names.insert((t, ifindex), l.name.clone());
            }
        }
        for &(t, ns) in &all {
            for (&ifindex, l) in &ns.links {
                let Some(p) = l.link else { continue };
                let other = match l.link_netns {
                    LinkNetns::Same => Some(t),
                    LinkNetns::Nsid(n) => r.by_nsid.get(&n).copied(),
                    LinkNetns::Unverified => None,
                };
                if let Some(o) = other {
                    r.forward.insert((t, ifindex), (o, p));
                    r.reverse.insert((o, p), (t, ifindex));
                }
            }
        }
        for k in model.host.routes.keys() {
            let Some(p) = model.host.links.get(&k.oif).and_then(|l| l.link) else {
                continue;
            };
            if let Some((o, _)) = r.place(Target::Host, k.oif, p)
                && o != Target::Host
            {
                r.routes_into.entry(o).or_default().push(k.dst);
            }
        }
        r
    }

    /// Where the other end of link `ifindex` of `t` is.
    fn place(&self, t: Target, ifindex: u32, peer_ifindex: u32) -> Option<(Target, u32)> {
        self.forward.get(&(t, ifindex)).copied().or_else(|| {
            // The other end placed us: a veth pair names each other.
            self.reverse.get(&(t, ifindex)).copied().filter(|&(ot, oi)| oi == peer_ifindex && ot != t)
        })
    }

    fn link_ref(&self, t: Target, ifindex: u32, peer_ifindex: u32) -> LinkRef {
        match self.place(t, ifindex, peer_ifindex) {
            Some((o, p)) => LinkRef {
                ifindex: p,
                ifname: self.names.get(&(o, p)).cloned().flatten(),
                netns: self.refs.get(&o).copied(),
            },
            None => LinkRef { ifindex: peer_ifindex, ifname: None, netns: None },
        }
    }
}

#[cfg(test)]
mod tests;
