//! The model's driver on the caller's tokio runtime: one task owns the
//! model and the rtnetlink socket, a thread does discovery, and a handle
//! ([`Watcher`]) asks for snapshots, feeds probe events and forces resyncs.

use std::{
    fs::File,
    os::fd::{AsRawFd, RawFd},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
        mpsc::{SyncSender, TrySendError},
    },
    time::{Duration, SystemTime},
};

use tokio::{
    io::{
        Interest,
        unix::{AsyncFd, AsyncFdReadyGuard},
    },
    sync::{mpsc, oneshot},
    task::JoinHandle,
    time::{Instant, MissedTickBehavior},
};
use tracing::{debug, warn};

use super::{
    snapshot::{ModelSnapshot, NetnsDeath},
    state::{Action, Job, Model, ModelConfig},
    worker::{self, Report, ReportBell},
};
use crate::{
    discovery::{self, DiscoveryError, DiscoveryPaths, MountChanges},
    kernel::events::KernelEvent,
    netlink::{
        Datagram, RECV_BUFFER, RtnlSocket, SocketError, SocketOptions, filter,
        wire::consts::{
            RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV4_ROUTE, RTNLGRP_IPV6_IFADDR, RTNLGRP_IPV6_ROUTE, RTNLGRP_LINK,
            RTNLGRP_NSID,
        },
    },
};

#[derive(Debug, thiserror::Error)]
pub enum WatcherError {
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    #[error("cannot start the discovery thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("cannot watch the netlink socket: {0}")]
    Poll(#[source] std::io::Error),
    #[error("the netns model did not finish its first sync within {0:?}")]
    StartTimeout(Duration),
    #[error("the netns model has stopped")]
    Stopped,
}

#[derive(Debug, Clone)]
pub struct WatcherConfig {
    pub model: ModelConfig,
    pub discovery: DiscoveryPaths,
    /// Full resync period: rescan, re-dump, count what drifted.
    pub resync_interval: Duration,
    /// Death notices queued for the consumer before they are dropped (and
    /// counted; the snapshot still has the dead netns).
    pub death_queue: usize,
    /// Kernel receive buffer of the socket.
    pub receive_buffer: usize,
    /// Give up on the first sync after this long.
    pub start_timeout: Duration,
    /// How long the socket goes unread after a read when nothing needs it
    /// sooner (see [`REST`]).
    pub rest: Duration,
}

impl Default for WatcherConfig {
    fn default() -> Self {
        Self {
            model: ModelConfig::default(),
            discovery: DiscoveryPaths::default(),
            resync_interval: Duration::from_mins(1),
            death_queue: 4096,
            receive_buffer: 8 << 20,
            start_timeout: Duration::from_mins(1),
            rest: REST,
        }
    }
}

enum Command {
    Snapshot(oneshot::Sender<ModelSnapshot>),
    Kernel(Vec<KernelEvent>),
    Resync(oneshot::Sender<()>),
    Stop,
}

/// The running model. Dropping it (and every [`ModelHandle`]) stops the
/// model task.
pub struct Watcher {
    handle: ModelHandle,
    task: JoinHandle<Result<(), WatcherError>>,
}

/// A cheap, clonable way to talk to the model from other tasks (the probe
/// reader, the state endpoint).
#[derive(Clone)]
pub struct ModelHandle {
    commands: mpsc::Sender<Command>,
    at_death: AtDeath,
}

/// The snapshot the model took when it last sent deaths, taken before it
/// sent them: one taken from here after a death was received is at least
/// as new as that death and everything the model read before it. Spares a
/// death pass the round trip to the model's task (about 0.2 ms of the
/// release path: the task's turn, the datagrams queued since, a wake-up
/// each way).
type AtDeath = Arc<std::sync::Mutex<Option<Arc<ModelSnapshot>>>>;

/// Datagrams read per wake-up before other work gets a turn.
const DATAGRAMS_PER_WAKE: usize = 256;
const COMMAND_QUEUE: usize = 256;

impl Watcher {
    /// Opens the socket (subscribed before anything is dumped), starts the
    /// discovery thread and the model task on the current runtime, and
    /// returns once the first full sync is done: every netns that exists
    /// now is in the model. The receiver gets one [`NetnsDeath`] per death.
    pub async fn start(config: WatcherConfig) -> Result<(Self, mpsc::Receiver<NetnsDeath>), WatcherError> {
        let own = Path::new("/proc/thread-self/ns/net");
        let host_inode = discovery::inode_of(own)? as u32;
        let socket = RtnlSocket::open(&SocketOptions {
            groups: vec![
                RTNLGRP_LINK,
                RTNLGRP_IPV4_IFADDR,
                RTNLGRP_IPV6_IFADDR,
                RTNLGRP_IPV4_ROUTE,
                RTNLGRP_IPV6_ROUTE,
                RTNLGRP_NSID,
            ],
            listen_all_nsid: true,
            receive_buffer: config.receive_buffer,
            nonblocking: true,
        })?;
        // Without it the model reads the same (the decoder ignores what it
        // drops), only with about twice the wake-ups in a pod cycle.
        if let Err(e) = socket.attach_filter(&filter::model_notifications()) {
            warn!("netlink noise not filtered in the kernel ({e}): every pod's routes wake the agent");
        }
        let bell = open_death_bell()
            .map_err(|e| warn!("no death bell ({e}): the model reads every notification as it comes"))
            .ok();
        let socket = ModelSocket::new(socket, bell, config.rest)?;
        let mount_changes = Arc::new(MountChanges::default());
        let report_bell = Arc::new(ReportBell::default());
        let (jobs, reports) =
            worker::spawn(config.discovery.clone(), Arc::clone(&mount_changes), Arc::clone(&report_bell))
                .map_err(WatcherError::Thread)?;
        let mounts = MountTable::open(&config.discovery.mountinfo);
        if mounts.is_watched() {
            mount_changes.watching();
        }

        let mut model = Model::new(config.model, host_inode, SystemTime::now());
        let own_fd = discovery::open_netns(own, host_inode)?;
        model.query_host_nsid(own_fd.as_raw_fd(), SystemTime::now());
        model.start_resync(false);
        let (deaths_tx, deaths_rx) = mpsc::channel(config.death_queue.max(1));
        let at_death = AtDeath::default();
        let mut io = Io { socket, jobs, deaths: deaths_tx, at_death: Arc::clone(&at_death) };
        io.flush(&mut model)?;
        drop(own_fd);

        let (commands_tx, commands_rx) = mpsc::channel(COMMAND_QUEUE);
        let (ready_tx, ready_rx) = oneshot::channel();
        let driver = Driver {
            model,
            io,
            reports,
            report_bell,
            mounts,
            mount_changes,
            commands: commands_rx,
            ready: Some(ready_tx),
            resync_waiters: Vec::new(),
            resync_interval: config.resync_interval,
        };
        let task = tokio::spawn(driver.run());
        let watcher = Self { handle: ModelHandle { commands: commands_tx, at_death }, task };
        match tokio::time::timeout(config.start_timeout, ready_rx).await {
            Ok(Ok(())) => Ok((watcher, deaths_rx)),
            Ok(Err(_)) => Err(watcher.stop().await.err().unwrap_or(WatcherError::Stopped)),
            Err(_) => {
                watcher.task.abort();
                Err(WatcherError::StartTimeout(config.start_timeout))
            }
        }
    }

    #[must_use]
    pub fn handle(&self) -> ModelHandle {
        self.handle.clone()
    }

    /// The model now.
    pub async fn snapshot(&self) -> Result<ModelSnapshot, WatcherError> {
        self.handle.snapshot().await
    }

    /// See [`ModelHandle::kernel_events`].
    pub async fn kernel_events(&self, events: Vec<KernelEvent>) -> Result<(), WatcherError> {
        self.handle.kernel_events(events).await
    }

    /// See [`ModelHandle::resync`].
    pub async fn resync(&self) -> Result<(), WatcherError> {
        self.handle.resync().await
    }

    /// Stops the model task (other handles notwithstanding) and reports how
    /// it ended.
    pub async fn stop(self) -> Result<(), WatcherError> {
        let _ = self.handle.commands.send(Command::Stop).await;
        drop(self.handle);
        match self.task.await {
            Ok(result) => result,
            Err(_) => Err(WatcherError::Stopped),
        }
    }
}

impl ModelHandle {
    /// The model now.
    pub async fn snapshot(&self) -> Result<ModelSnapshot, WatcherError> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Snapshot(tx)).await.map_err(|_| WatcherError::Stopped)?;
        rx.await.map_err(|_| WatcherError::Stopped)
    }

    /// The snapshot the model took as it sent its latest deaths, if no one
    /// took it yet (see [`AtDeath`]); taken after a death was received, it
    /// is not older than that death. None: ask for [`Self::snapshot`].
    #[must_use]
    pub fn snapshot_at_death(&self) -> Option<Arc<ModelSnapshot>> {
        self.at_death.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }

    /// Feeds decoded probe events (creators, netns to discover, `__put_net`
    /// deaths). Waits when the model is behind.
    pub async fn kernel_events(&self, events: Vec<KernelEvent>) -> Result<(), WatcherError> {
        self.commands.send(Command::Kernel(events)).await.map_err(|_| WatcherError::Stopped)
    }

    /// Runs a full resync now and returns when it has completed.
    pub async fn resync(&self) -> Result<(), WatcherError> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Resync(tx)).await.map_err(|_| WatcherError::Stopped)?;
        rx.await.map_err(|_| WatcherError::Stopped)
    }
}

/// The model's outputs.
struct Io {
    socket: ModelSocket,
    jobs: SyncSender<Job>,
    deaths: mpsc::Sender<NetnsDeath>,
    at_death: AtDeath,
}

impl Io {
    /// Carries out every action the model produced, in order. Returns
    /// whether it sent a death.
    fn flush(&mut self, model: &mut Model) -> Result<bool, WatcherError> {
        let mut sent_death = false;
        loop {
            let actions = model.take_actions();
            // Taken once per batch of actions that sends deaths, before the
            // first is sent (a later batch's deaths get a later one).
            let mut snapshot_taken = false;
            if actions.is_empty() {
                return Ok(sent_death);
            }
            for action in actions {
                match action {
                    Action::Send { request, dump_seq } => {
                        if let Err(e) = self.socket.get().send(&request) {
                            warn!("netlink request not sent: {e}");
                            model.send_failed(dump_seq);
                        }
                    }
                    Action::Job(job) => match self.jobs.try_send(job) {
                        Ok(()) => {}
                        Err(TrySendError::Full(job)) => model.job_rejected(&job),
                        Err(TrySendError::Disconnected(_)) => return Err(WatcherError::Stopped),
                    },
                    Action::Death(death) => {
                        if !snapshot_taken && !self.deaths.is_closed() {
                            snapshot_taken = true;
                            let snapshot = Arc::new(model.snapshot(SystemTime::now()));
                            *self.at_death.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(snapshot);
                        }
                        match self.deaths.try_send(death) {
                            Ok(()) => sent_death = true,
                            // Closed: nobody listens (e.g. a one-shot `netreap netns`).
                            Err(mpsc::error::TrySendError::Closed(_)) => {}
                            Err(mpsc::error::TrySendError::Full(d)) => {
                                warn!(inode = ?d.inode, "death notice dropped: consumer is behind");
                                model.count_dropped_death();
                            }
                        }
                    }
                }
            }
        }
    }
}

/// How long the model's socket rests after a read before it is read
/// again, unless something needs it sooner: a death (the bell), a snapshot,
/// or an answer to the model's own request. A pod's creation and teardown
/// send a dozen notifications spread over tens of milliseconds; read as they
/// come, each woke the agent. Nothing that decides reads the model without
/// a snapshot, and a snapshot reads what is queued first (the one kept
/// for a death pass, what was queued up to the deaths: the bell's read);
/// nothing in the model depends on reading promptly either (notifications
/// are read in order, whenever that is), so resting only changes how often
/// it wakes.
pub const REST: Duration = Duration::from_millis(20);

/// How often the socket is read when it cannot be put back in the epoll
/// set.
const WATCH_RETRY: Duration = Duration::from_millis(2);

/// The model's socket's fd, for the runtime's epoll set while it is
/// watched. It does not own the fd: [`ModelSocket`] owns the socket and
/// drops its registration first.
struct SocketFd(RawFd);

impl AsRawFd for SocketFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// The model's socket, watched (read when a datagram arrives) or resting
/// (out of the epoll set, read when the rest ends, the death bell rings,
/// or a snapshot is asked for).
struct ModelSocket {
    /// Field order matters: the registration goes before the socket.
    watch: Option<AsyncFd<SocketFd>>,
    rest_until: Option<Instant>,
    rest: Duration,
    /// Hears `RTM_DELNSID` only, and wakes the model at once for it. The
    /// model socket can rest only while it rings.
    bell: Option<AsyncFd<RtnlSocket>>,
    /// Deaths the bell heard that no read has taken yet: a read goes on
    /// until it has them (see `read_datagrams`).
    /// (Atomic only because the socket is borrowed across the select's
    /// awaits; one task uses it.)
    deaths_heard: AtomicUsize,
    socket: RtnlSocket,
}

/// A socket on the nsid group of the agent's own netns, filtered to
/// `RTM_DELNSID`: what makes resting safe for the death path.
fn open_death_bell() -> Result<AsyncFd<RtnlSocket>, WatcherError> {
    let bell = RtnlSocket::open(&SocketOptions {
        groups: vec![RTNLGRP_NSID],
        listen_all_nsid: false,
        receive_buffer: 256 << 10,
        nonblocking: true,
    })?;
    // Unfiltered it also rings for each new nsid: more wake-ups, no harm.
    if let Err(e) = bell.attach_filter(&filter::nsid_deaths()) {
        warn!("death bell not filtered ({e}): it rings for new nsids too");
    }
    // SAFETY: the AsyncFd owns the socket, whose fd is fixed for its life.
    unsafe { AsyncFd::register_with_interest(bell, Interest::READABLE) }.map_err(|e| WatcherError::Poll(e.into()))
}

/// Why the model socket was read this turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// It was watched and a datagram arrived.
    Ready,
    /// Its rest ended.
    Rested,
    /// The death bell rang.
    Bell,
    /// A snapshot was asked for.
    Snapshot,
}

/// What one read of the model socket did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Read {
    /// At least one datagram (or an overrun) was read.
    any: bool,
    /// It ended on "nothing queued" (not on a death or the turn's limit).
    drained: bool,
    /// It stopped on the deaths it was to read, which go out before the
    /// rest is read.
    death: bool,
}

/// What the model socket does after a turn: keep watching, or rest until
/// when. `can_rest`: the bell rings, the model is synced and waits for no
/// answer of its own (its dump parts come only as it reads, and its answers
/// are queued by the time its request is sent).
fn next_mode(
    read: Option<(Cause, Read)>,
    can_rest: bool,
    resting: Option<Instant>,
    now: Instant,
    rest: Duration,
) -> Option<Instant> {
    if !can_rest {
        return None;
    }
    let Some((cause, read)) = read else {
        return resting;
    };
    if !read.drained {
        // More is queued behind a death or the turn's limit: read it soon.
        return None;
    }
    match cause {
        Cause::Ready => Some(now + rest),
        // Quiet through a whole rest: watch until the next notification.
        Cause::Rested if read.any => Some(now + rest),
        Cause::Rested => None,
        // The death's RTM_DELNSID was not there yet (the bell heard it
        // first): watch for it.
        Cause::Bell if !read.death => None,
        Cause::Bell | Cause::Snapshot => resting,
    }
}

impl ModelSocket {
    fn new(socket: RtnlSocket, bell: Option<AsyncFd<RtnlSocket>>, rest: Duration) -> Result<Self, WatcherError> {
        let mut this = Self { watch: None, rest_until: None, rest, bell, deaths_heard: AtomicUsize::new(0), socket };
        this.watch()?;
        Ok(this)
    }

    /// Reads what is queued into `model`, up to the deaths the bell heard
    /// (at least one).
    fn read(&self, model: &mut Model, buf: &mut [u8]) -> Result<Read, WatcherError> {
        let heard = self.deaths_heard.load(Ordering::Relaxed);
        let read = read_datagrams(&self.socket, model, buf, heard)?;
        self.deaths_heard.store(deaths_left(heard, read, model.deaths_pending()), Ordering::Relaxed);
        Ok(read)
    }

    /// The bell heard `deaths` more.
    fn heard(&self, deaths: usize) {
        let heard = self.deaths_heard.load(Ordering::Relaxed);
        self.deaths_heard.store(heard.saturating_add(deaths), Ordering::Relaxed);
    }

    fn get(&self) -> &RtnlSocket {
        &self.socket
    }

    fn watch(&mut self) -> Result<(), WatcherError> {
        self.rest_until = None;
        if self.watch.is_none() {
            // SAFETY: the fd is the socket's, which this struct owns and
            // drops after the registration (field order); it never changes.
            let registered =
                unsafe { AsyncFd::register_with_interest(SocketFd(self.socket.as_raw_fd()), Interest::READABLE) };
            self.watch = Some(registered.map_err(|e| WatcherError::Poll(e.into()))?);
        }
        Ok(())
    }

    /// Takes the socket out of the epoll set until `until` (never without
    /// a bell).
    fn rest(&mut self, until: Instant) {
        if self.bell.is_some() {
            self.watch = None;
            self.rest_until = Some(until);
        }
    }

    fn settle(&mut self, read: Option<(Cause, Read)>, can_rest: bool, now: Instant) {
        let can_rest = can_rest && self.bell.is_some() && !self.rest.is_zero();
        match next_mode(read, can_rest, self.rest_until, now, self.rest) {
            Some(until) => self.rest(until),
            None => {
                if let Err(e) = self.watch() {
                    // The epoll set is full (a resource limit): read on a
                    // short timer instead until it has room again.
                    warn!("model socket not watched ({e}); read every {WATCH_RETRY:?} instead");
                    self.rest_until = Some(now + WATCH_RETRY);
                }
            }
        }
    }

    async fn readable(&self) -> std::io::Result<AsyncFdReadyGuard<'_, SocketFd>> {
        match &self.watch {
            Some(w) => w.readable().await,
            None => std::future::pending().await,
        }
    }

    /// Empties the bell (what it heard is read again from the model
    /// socket, in order). Returns how many deaths it heard (an overrun, a
    /// turn's worth), or None when it no longer works.
    async fn bell_rang(&self) -> Option<usize> {
        // Nsid messages are a few dozen bytes.
        let mut buf = [0u8; 1024];
        let Some(bell) = &self.bell else {
            return std::future::pending().await;
        };
        let Ok(mut guard) = bell.readable().await else {
            return None;
        };
        let mut heard = 0_usize;
        loop {
            match guard.get_inner().recv(&mut buf) {
                Ok(Some(_)) => heard = heard.saturating_add(1),
                Err(SocketError::Overrun) => heard = heard.saturating_add(DATAGRAMS_PER_WAKE),
                Ok(None) => {
                    guard.clear_ready();
                    return Some(heard);
                }
                Err(e) => {
                    warn!("death bell failed ({e}): the model reads every notification as it comes");
                    return None;
                }
            }
        }
    }
}

/// Where the model's datagrams are read from: its socket (a queue of
/// datagrams in tests).
trait Datagrams {
    fn recv(&self, buf: &mut [u8]) -> Result<Option<Datagram>, SocketError>;
    fn grow_receive_buffer(&self) -> Result<usize, SocketError>;
}

impl Datagrams for RtnlSocket {
    fn recv(&self, buf: &mut [u8]) -> Result<Option<Datagram>, SocketError> {
        Self::recv(self, buf)
    }

    fn grow_receive_buffer(&self) -> Result<usize, SocketError> {
        Self::grow_receive_buffer(self)
    }
}

/// Reads what is queued on the model socket, up to a turn's worth; stops
/// once `deaths` deaths are read, so that they go out before the datagrams
/// behind them. One death at a time, each with its own snapshot and pass,
/// took 2.7 ms per death in a burst of 1,000 (a death is at most one
/// `RTM_DELNSID` the bell heard, and those are queued already); a lone
/// death still stops the read at once.
fn read_datagrams(
    socket: &impl Datagrams,
    model: &mut Model,
    buf: &mut [u8],
    deaths: usize,
) -> Result<Read, WatcherError> {
    let mut read = Read::default();
    for _ in 0..DATAGRAMS_PER_WAKE {
        match socket.recv(buf) {
            Ok(Some(d)) => {
                read.any = true;
                model.datagram(d.origin_nsid, &buf[..d.len], SystemTime::now());
                if model.deaths_pending() >= deaths.max(1) {
                    read.death = true;
                    return Ok(read);
                }
            }
            Ok(None) => {
                read.drained = true;
                return Ok(read);
            }
            Err(SocketError::Overrun) => {
                read.any = true;
                model.overrun();
                match socket.grow_receive_buffer() {
                    Ok(size) => debug!(size, "netlink receive buffer grown after an overrun"),
                    Err(e) => warn!("cannot grow the netlink receive buffer: {e}"),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(read)
}

/// The deaths the bell heard that the next read is still to take, after a
/// read of `read_now` of the `heard`: the rest of them when the read stopped
/// short (a burst fills more than a turn), none once the queue is empty (a
/// death heard but not queued yet, the bell may hear it first, is read as
/// it comes, alone).
fn deaths_left(heard: usize, read: Read, read_now: usize) -> usize {
    if read.drained { 0 } else { heard.saturating_sub(read_now) }
}

struct Driver {
    model: Model,
    io: Io,
    reports: mpsc::Receiver<Report>,
    report_bell: Arc<ReportBell>,
    mounts: MountTable,
    /// Changes counted for the discovery thread (it re-reads the table
    /// only after one).
    mount_changes: Arc<MountChanges>,
    commands: mpsc::Receiver<Command>,
    ready: Option<oneshot::Sender<()>>,
    resync_waiters: Vec<oneshot::Sender<()>>,
    resync_interval: Duration,
}

/// The mount table's change signal (`POLLPRI` on mountinfo), polled once
/// per turn of the model instead of watched (but for the turns of a
/// death and of snapshots, which decisions wait on): the model's
/// one-second housekeeping tick makes a turn at least that often, and a
/// pod's CNI runs and netlink notices make them far oftener.
/// Watched, `ip netns add` and `del` each woke the agent, and then a
/// debounce timer did. A bind mount found up to a second later is no risk:
/// absence is never death, the probes and netlink find most netns first,
/// and the last look reads the table itself.
struct MountTable(Option<File>);

impl MountTable {
    fn open(mountinfo: &Path) -> Self {
        match File::open(mountinfo) {
            Ok(table) => Self(Some(table)),
            Err(e) => {
                warn!("mount changes not watched ({e}); new bind mounts wait for the next resync");
                Self(None)
            }
        }
    }

    fn is_watched(&self) -> bool {
        self.0.is_some()
    }

    /// Whether the table changed since the last poll.
    fn changed(&self) -> std::io::Result<bool> {
        self.0.as_ref().map_or(Ok(false), discovery::mount_table_changed)
    }
}

async fn sleep_until_due(due: Option<Instant>) {
    match due {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Driver {
    async fn run(mut self) -> Result<(), WatcherError> {
        let mut buf = vec![0u8; RECV_BUFFER];
        let period = self.resync_interval.max(Duration::from_secs(1));
        let mut resync = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        resync.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut housekeeping = tokio::time::interval(Duration::from_secs(1));
        housekeeping.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let mut turn: Option<(Cause, Read)> = None;
            tokio::select! {
                // Commands first: a death's pass waits on a snapshot here,
                // and what one turn of the event loop queued is bounded
                // (it runs only when this task yields), so the socket is
                // never starved.
                biased;
                command = self.commands.recv() => match command {
                    Some(Command::Stop) | None => break,
                    Some(Command::Snapshot(reply)) => {
                        // The model as of now: what is queued first.
                        let read = self.io.socket.read(&mut self.model, &mut buf)?;
                        turn = Some((Cause::Snapshot, read));
                        let _ = reply.send(self.model.snapshot(SystemTime::now()));
                    }
                    Some(c) => self.command(c),
                },
                heard = self.io.socket.bell_rang() => {
                    match heard {
                        Some(deaths) => self.io.socket.heard(deaths),
                        None => self.io.socket.bell = None,
                    }
                    let read = self.io.socket.read(&mut self.model, &mut buf)?;
                    turn = Some((Cause::Bell, read));
                }
                guard = self.io.socket.readable() => {
                    let mut guard = guard.map_err(WatcherError::Poll)?;
                    let read = self.io.socket.read(&mut self.model, &mut buf)?;
                    if read.drained {
                        guard.clear_ready();
                    }
                    turn = Some((Cause::Ready, read));
                }
                () = sleep_until_due(self.io.socket.rest_until) => {
                    let read = self.io.socket.read(&mut self.model, &mut buf)?;
                    turn = Some((Cause::Rested, read));
                }
                // The reports themselves are taken below, every turn.
                () = self.report_bell.rang() => {}
                _ = resync.tick() => self.model.start_resync(true),
                _ = housekeeping.tick() => self.model.tick(SystemTime::now()),
            }
            self.take_reports()?;
            // Not on a death's turns (the bell, the pass's snapshot): the
            // scan a change asks for would take a core from the release.
            // The next turn looks (the housekeeping tick at the latest).
            let decides = matches!(turn, Some((Cause::Bell | Cause::Snapshot, _) | (_, Read { death: true, .. })));
            match if decides { Ok(false) } else { self.mounts.changed() } {
                Ok(true) => {
                    // Counted before the scan is asked for, so the
                    // discovery thread's read sees it.
                    self.mount_changes.changed();
                    self.model.mounts_changed();
                }
                Ok(false) => {}
                Err(e) => {
                    warn!("mount changes no longer watched: {e}");
                    self.mounts = MountTable(None);
                    self.mount_changes.unwatched();
                    self.model.mounts_changed();
                }
            }
            let mut sent_death = self.io.flush(&mut self.model)?;
            loop {
                self.io.socket.settle(turn.take(), self.model.can_rest(), Instant::now());
                if !self.follow_socket()? {
                    break;
                }
                // What that took may need the socket watched (an answer due).
                sent_death |= self.io.flush(&mut self.model)?;
            }
            self.notify();
            if sent_death {
                // The event loop shares this thread: let it take the death
                // now rather than after the rest of the datagrams queued.
                tokio::task::yield_now().await;
            }
        }
        debug!("netns model stopped");
        Ok(())
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Kernel(events) => {
                let now = SystemTime::now();
                for event in &events {
                    self.model.kernel_event(event, now);
                }
            }
            Command::Resync(reply) => {
                self.model.start_resync(true);
                self.resync_waiters.push(reply);
            }
            Command::Snapshot(_) | Command::Stop => {}
        }
    }

    /// Takes every report queued (the bell only says when to look).
    /// Returns whether there was any.
    fn take_reports(&mut self) -> Result<bool, WatcherError> {
        let mut any = false;
        loop {
            match self.reports.try_recv() {
                Ok(report) => {
                    any = true;
                    self.report(report)?;
                }
                Err(mpsc::error::TryRecvError::Empty) => return Ok(any),
                Err(mpsc::error::TryRecvError::Disconnected) => return Err(WatcherError::Stopped),
            }
        }
    }

    /// The reports follow the socket's mode (see [`ReportBell`]).
    /// Returns whether it took any then, whose actions are to be carried
    /// out.
    fn follow_socket(&mut self) -> Result<bool, WatcherError> {
        let resting = self.io.socket.rest_until.is_some();
        self.report_bell.set_resting(resting);
        if resting {
            return Ok(false);
        }
        // Queued while the bell still said "resting": take them now.
        self.take_reports()
    }

    fn report(&mut self, report: Report) -> Result<(), WatcherError> {
        match report {
            Report::Opened { inode, fd } => {
                self.model.netns_opened(inode, fd.as_raw_fd(), SystemTime::now());
                // The kernel resolved the fd while handling the send: close
                // it now, no reference to the netns outlives this.
                self.io.flush(&mut self.model)?;
                drop(fd);
            }
            Report::ResolveFailed { inode } => self.model.resolve_failed(inode),
            Report::ScanDone { generation, scope, found } => self.model.scan_done(generation, scope, found),
            Report::ScanFailed { generation, error } => self.model.scan_failed(generation, &error),
        }
        Ok(())
    }

    fn notify(&mut self) {
        if self.model.is_ready()
            && let Some(ready) = self.ready.take()
        {
            let _ = ready.send(());
        }
        if !self.model.resync_in_progress() {
            for waiter in self.resync_waiters.drain(..) {
                let _ = waiter.send(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{cell::RefCell, collections::VecDeque};

    use super::*;
    use crate::netlink::wire::{consts::RTM_DELNSID, fake};

    /// Datagrams queued as the kernel queued them.
    struct Queue(RefCell<VecDeque<Vec<u8>>>);

    impl Datagrams for Queue {
        fn recv(&self, buf: &mut [u8]) -> Result<Option<Datagram>, SocketError> {
            let Some(d) = self.0.borrow_mut().pop_front() else { return Ok(None) };
            buf[..d.len()].copy_from_slice(&d);
            Ok(Some(Datagram { len: d.len(), origin_nsid: None }))
        }

        fn grow_receive_buffer(&self) -> Result<usize, SocketError> {
            Ok(0)
        }
    }

    fn deaths(model: &mut Model) -> Vec<Option<i32>> {
        crate::model::state::tests::deaths(&model.take_actions()).iter().map(|d| d.nsid).collect()
    }

    #[test]
    fn a_read_takes_the_deaths_the_bell_heard_together_and_stops_after_them() {
        let mut model = crate::model::state::tests::synced_with(&[(100, 1), (101, 2), (102, 3), (103, 4)]);
        model.take_actions();
        // Three deaths queued at once (one `ip -batch`), the fourth later.
        let queue =
            Queue(RefCell::new([1, 2, 3, 4].map(|nsid| fake::nsid(RTM_DELNSID, 0, nsid)).into_iter().collect()));
        let mut buf = vec![0u8; 4096];
        // The bell heard three: the three go out together.
        let read = read_datagrams(&queue, &mut model, &mut buf, 3).unwrap();
        assert_eq!(read, Read { any: true, drained: false, death: true });
        assert_eq!(deaths(&mut model), [Some(1), Some(2), Some(3)]);
        assert_eq!(queue.0.borrow().len(), 1, "read past the deaths the bell heard");
        // A lone death stops the read at once, as before.
        queue.0.borrow_mut().push_back(fake::nsid(RTM_DELNSID, 0, 9));
        let read = read_datagrams(&queue, &mut model, &mut buf, 1).unwrap();
        assert_eq!(read, Read { any: true, drained: false, death: true });
        assert_eq!(deaths(&mut model), [Some(4)]);
        // Fewer deaths queued than heard (an nsid the model does not know
        // rang too): read to the end, and the socket is watched for more.
        let read = read_datagrams(&queue, &mut model, &mut buf, 2).unwrap();
        assert_eq!(read, Read { any: true, drained: true, death: false });
        assert!(deaths(&mut model).is_empty());
        let now = Instant::now();
        assert_eq!(next_mode(Some((Cause::Bell, read)), true, Some(now), now, REST), None);
    }

    #[test]
    fn deaths_heard_beyond_a_turn_are_read_together_in_the_next() {
        let at_limit = Read { any: true, drained: false, death: false };
        let at_deaths = Read { any: true, drained: false, death: true };
        let drained = Read { any: true, drained: true, death: false };
        // 1,000 heard, 60 of them in a turn's datagrams: the next read goes on
        // for the other 940.
        assert_eq!(deaths_left(1000, at_limit, 60), 940);
        assert_eq!(deaths_left(3, at_deaths, 3), 0);
        // Not all queued yet: the rest come alone.
        assert_eq!(deaths_left(3, drained, 2), 0);
    }

    #[test]
    fn the_socket_rests_after_a_drained_read_and_watches_when_anything_needs_it() {
        let now = Instant::now();
        let later = now + REST / 2;
        let drained = Read { any: true, drained: true, death: false };
        let quiet = Read { any: false, drained: true, death: false };
        let at_death = Read { any: true, drained: false, death: true };
        let at_limit = Read { any: true, drained: false, death: false };
        // Watched, read dry: rest.
        assert_eq!(next_mode(Some((Cause::Ready, drained)), true, None, now, REST), Some(now + REST));
        // Not while the model waits for its own answers, or is not synced.
        assert_eq!(next_mode(Some((Cause::Ready, drained)), false, None, now, REST), None);
        assert_eq!(next_mode(None, false, Some(later), now, REST), None, "a request sent while resting");
        // Stopped short (a death first, or the turn's limit): more is queued.
        for cause in [Cause::Ready, Cause::Rested, Cause::Bell, Cause::Snapshot] {
            assert_eq!(next_mode(Some((cause, at_death)), true, Some(later), now, REST), None, "{cause:?}");
            assert_eq!(next_mode(Some((cause, at_limit)), true, Some(later), now, REST), None, "{cause:?}");
        }
        // The rest ended: another if it found something, else watch.
        assert_eq!(next_mode(Some((Cause::Rested, drained)), true, Some(now), now, REST), Some(now + REST));
        assert_eq!(next_mode(Some((Cause::Rested, quiet)), true, Some(now), now, REST), None);
        // The bell rang but the RTM_DELNSID was not queued yet: watch for it.
        assert_eq!(next_mode(Some((Cause::Bell, quiet)), true, Some(later), now, REST), None);
        // A snapshot's read keeps the rest as it was.
        assert_eq!(next_mode(Some((Cause::Snapshot, drained)), true, Some(later), now, REST), Some(later));
        assert_eq!(next_mode(Some((Cause::Snapshot, drained)), true, None, now, REST), None);
        // A turn that did not read changes nothing.
        assert_eq!(next_mode(None, true, Some(later), now, REST), Some(later));
        assert_eq!(next_mode(None, true, None, now, REST), None);
    }
}
