//! Why and when the agent reconciles. Deaths and the runtime's events ask
//! at once; a pending verdict carries when time alone may change it (a
//! grace running out), and the agent looks again then, instead of polling
//! while anything is pending.
//!
//! Finished CNI runs come in bursts (a chain, a plugin's helpers, many
//! pods) and are coalesced, and only those that can change a verdict worth
//! acting on ask: a run that failed (leaks come from failures), a run of a
//! container whose verdict the last reconcile left waiting on its runs (or
//! of a container the kernel could not name, while any verdict waits), and
//! any run after a netns died while runs of its containers were in flight
//! (what they wrote may not have been there to see). A successful ADD or
//! DEL of a healthy pod asks for nothing soon: its reservation is judged at
//! the next reconcile, within a second.
//!
//! Why a run of another container need not ask: the ledger is kept per
//! container, and the engine reads a reservation's runs only through its
//! own container ID (a run the kernel could not name concerns every
//! container, and is treated so). And a verdict that some live evidence
//! holds in use stays in use when a run ends: the run is one more reason
//! to keep, never the only one. Whatever a run's end changes is judged at
//! the next reconcile either way; this only chooses how soon.

use std::{
    collections::HashSet,
    time::{Duration, SystemTime},
};

use tokio::time::Instant;

use crate::engine::{Fact, Policy, Status, Verdict};

/// How long CNI exits are gathered before the reconcile they trigger.
pub const CNI_EXIT_COALESCE: Duration = Duration::from_millis(20);
/// Successful CNI runs that can change no verdict still bring their new
/// reservations into `/state`, `scan` and the events: at most one reconcile
/// a second for all of them.
pub const QUIET_EXIT_COALESCE: Duration = Duration::from_secs(1);

/// A quiet reconcile (one nothing waits on: a healthy pod's run ended, or
/// the follow-up of a death pass) comes at least this many times the last
/// full pass's cost after it. A full pass costs in proportion to the node
/// and its recent history; under pod churn one a second took most of a core
/// (session 18), while this keeps the quiet ones within 5 % of one.
const QUIET_COST_RATIO: u32 = 19;
/// ... and never later than this after it.
const MAX_QUIET_GAP: Duration = Duration::from_secs(10);

/// A requeue is never sooner than this after the reconcile that set it: a
/// grace that "ran out" by a clock step must not make the loop spin.
const MIN_REQUEUE: Duration = Duration::from_millis(100);

/// Past the moment a grace runs out, so the next decide sees it passed.
const REQUEUE_SLACK: Duration = Duration::from_millis(10);

/// What started a reconcile (a log field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Startup,
    /// The resync interval: a full look even when nothing was heard.
    Interval,
    /// A pending verdict's grace ran out.
    Requeue,
    /// CNI runs finished (coalesced).
    CniExit,
    /// CNI runs whose processes vanished without an exit record.
    CniExitUnobserved,
    NetnsDied,
    RuntimeEvent,
    /// A release batch ended while orphans waited for it.
    ReleaseDone,
    /// A failed release's back-off ran out.
    ReleaseRetry,
}

impl Reason {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Startup => "startup",
            Self::Interval => "interval",
            Self::Requeue => "requeue",
            Self::CniExit => "cni_exit",
            Self::CniExitUnobserved => "cni_exit_unobserved",
            Self::NetnsDied => "netns_died",
            Self::RuntimeEvent => "runtime_event",
            Self::ReleaseDone => "release_done",
            Self::ReleaseRetry => "release_retry",
        }
    }
}

/// The deadlines the event loop sleeps towards.
#[derive(Debug, Default)]
pub struct Triggers {
    /// CNI exits are gathered until then.
    coalesced_at: Option<Instant>,
    /// The earliest moment a pending verdict may change by time alone.
    requeue_at: Option<Instant>,
    /// Whose runs the verdicts of the last reconcile (and targeted passes
    /// since) wait on.
    waiting: Waiting,
    /// A netns died while CNI runs of its containers were in flight, and no
    /// reconcile has run since with none in flight.
    death_during_runs: bool,
    /// The earliest moment for a quiet reconcile ([`QUIET_COST_RATIO`]).
    quiet_not_before: Option<Instant>,
}

impl Triggers {
    /// A CNI run finished (`container`: the container it ran for, None when
    /// the kernel could not name it whole; `failed`: it did not succeed):
    /// reconcile soon, with whatever else finishes meanwhile, when that can
    /// change a verdict; within a second otherwise.
    pub fn cni_exited(&mut self, container: Option<&str>, failed: bool) {
        let soon = Instant::now() + CNI_EXIT_COALESCE;
        if failed || self.death_during_runs || self.waiting.concerns(container) {
            // Sooner than a quiet exit's reconcile already armed.
            self.coalesced_at = Some(self.coalesced_at.map_or(soon, |at| at.min(soon)));
        } else {
            self.arm_quiet();
        }
    }

    /// A quiet reconcile: within a second, spaced after a costly full pass.
    fn arm_quiet(&mut self) {
        let quiet = (Instant::now() + QUIET_EXIT_COALESCE).max(self.quiet_not_before.unwrap_or_else(Instant::now));
        self.coalesced_at.get_or_insert(quiet);
    }

    /// A full reconcile just ended; it took `cost` (observing included).
    pub fn full_pass_took(&mut self, cost: Duration) {
        self.quiet_not_before = Some(Instant::now() + cost.saturating_mul(QUIET_COST_RATIO).min(MAX_QUIET_GAP));
    }

    /// Netns died; `runs_concerned`: a CNI run of a container bound to one
    /// of them (or of an unknown container) was in flight.
    pub fn netns_died(&mut self, runs_concerned: bool) {
        self.death_during_runs |= runs_concerned;
    }

    /// A targeted pass ran (the death path): it judged only what the deaths
    /// concern, so a full reconcile follows within a second (for `/state`,
    /// the metrics and what the targeted pass could not find), sooner when a
    /// quiet exit's is armed already. `waiting`: whose runs its verdicts
    /// wait on ([`Waiting::of`]).
    pub fn targeted(&mut self, waiting: Waiting) {
        self.waiting.merge(waiting);
        self.arm_quiet();
    }

    /// A reconcile ran: it saw every exit ingested before it. `requeue` is
    /// when its pending verdicts want another look; `waiting` whose runs its
    /// verdicts wait on ([`Waiting::of`]); `runs_in_flight` whether the
    /// ledger has any.
    pub fn reconciled(&mut self, requeue: Option<SystemTime>, waiting: Waiting, runs_in_flight: bool) {
        self.coalesced_at = None;
        self.waiting = waiting;
        self.death_during_runs &= runs_in_flight;
        self.requeue_at = requeue.map(|at| {
            let wait = at.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO) + REQUEUE_SLACK;
            Instant::now() + wait.max(MIN_REQUEUE)
        });
    }

    #[must_use]
    pub fn coalesced_at(&self) -> Option<Instant> {
        self.coalesced_at
    }

    #[must_use]
    pub fn requeue_at(&self) -> Option<Instant> {
        self.requeue_at
    }
}

/// Whether the end of a CNI run of its container may change this verdict's
/// status: it is pending (a run in flight holds it, or a grace runs), or a
/// run in flight is all that keeps an IP live in another container's netns
/// from being a conflict. An in-use verdict with live evidence of its own
/// (its IP in its netns, a live binding, the runtime's or the API's word)
/// stays in use when a run ends, so it does not wait.
#[must_use]
pub fn waits_on_runs(v: &Verdict) -> bool {
    let has = |pred: fn(&Fact) -> bool| v.evidence.iter().any(|e| pred(&e.fact));
    v.status == Status::Pending
        || (has(|f| matches!(f, Fact::CniOpInFlight { .. })) && has(|f| matches!(f, Fact::IpInOtherLiveNetns { .. })))
}

/// Whose CNI runs the verdicts of a pass wait on ([`waits_on_runs`]): the
/// containers of those verdicts, and whether one of them waits on a run the
/// kernel could not name (that run's end concerns them all).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Waiting {
    containers: HashSet<String>,
    /// A waiting verdict has a run in flight that names no container.
    unnamed_run: bool,
}

impl Waiting {
    /// What these verdicts wait on.
    #[must_use]
    pub fn of(verdicts: &[Verdict]) -> Self {
        let mut waiting = Self::default();
        for v in verdicts.iter().filter(|v| waits_on_runs(v)) {
            waiting.containers.insert(v.reservation.container_id.to_string());
            waiting.unnamed_run |=
                v.evidence.iter().any(|e| matches!(e.fact, Fact::CniOpInFlight { container_id: None, .. }));
        }
        waiting
    }

    /// Both passes' waits.
    pub fn merge(&mut self, other: Self) {
        self.containers.extend(other.containers);
        self.unnamed_run |= other.unnamed_run;
    }

    /// Whether the end of a run of `container` (None: not named whole by
    /// the kernel, so maybe any) may change a waiting verdict.
    #[must_use]
    pub fn concerns(&self, container: Option<&str>) -> bool {
        let anything = self.unnamed_run || !self.containers.is_empty();
        match container {
            None => anything,
            Some(c) => self.unnamed_run || self.containers.contains(c),
        }
    }
}

/// When time alone may change this verdict: for a pending one, the moment
/// its last grace runs out (`decided_at` is when it was decided). None when
/// only an event can (a CNI run in flight ends with its exit record).
#[must_use]
pub fn recheck_at(v: &Verdict, decided_at: SystemTime, policy: &Policy) -> Option<SystemTime> {
    if v.status != Status::Pending {
        return None;
    }
    let left = |age: &Duration, grace: &Duration| decided_at + grace.saturating_sub(*age);
    v.evidence
        .iter()
        .filter_map(|e| match &e.fact {
            Fact::Young { age, grace } | Fact::AwaitingOrphanGrace { age, grace } => Some(left(age, grace)),
            Fact::UnresolvedBinding { seen_at, .. } => Some(*seen_at + policy.orphan_grace),
            _ => None,
        })
        .max()
}

/// The earliest [`recheck_at`] of a reconcile's verdicts, no later than
/// `poll` when given (an optional witness without events may end a grace
/// early: the runtime saying a sandbox is gone).
#[must_use]
pub fn next_recheck(
    verdicts: &[Verdict],
    decided_at: SystemTime,
    policy: &Policy,
    poll: Option<Duration>,
) -> Option<SystemTime> {
    let by_time = verdicts.iter().filter_map(|v| recheck_at(v, decided_at, policy)).min();
    let pending = verdicts.iter().any(|v| v.status == Status::Pending);
    let by_poll = poll.filter(|_| pending).map(|p| decided_at + p);
    by_time.into_iter().chain(by_poll).min()
}

pub async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::ipam::{Reservation, StoreRef};

    fn reservation() -> Reservation {
        crate::ipam::ReservationData {
            store: StoreRef::HostLocal { data_dir: "/d".into() }.into(),
            network: "n".into(),
            ip: "10.0.0.2".parse().expect("an IP"),
            container_id: "c".into(),
            ifname: None,
            created_at: SystemTime::UNIX_EPOCH,
            path: "/d/n/10.0.0.2".into(),
            inode: 1,
        }
        .into()
    }

    const POLICY: Policy = Policy { in_flight_grace: Duration::from_secs(30), orphan_grace: Duration::from_mins(10) };

    #[test]
    fn a_pending_verdict_is_looked_at_again_when_its_grace_runs_out() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let young = Fact::Young { age: Duration::from_secs(10), grace: Duration::from_secs(30) };
        let v = Verdict::new(&reservation(), Status::Pending, vec![young]);
        assert_eq!(recheck_at(&v, now, &POLICY), Some(now + Duration::from_secs(20)));
        let waiting = Fact::AwaitingOrphanGrace { age: Duration::from_secs(100), grace: Duration::from_mins(10) };
        let v2 = Verdict::new(&reservation(), Status::Pending, vec![waiting]);
        assert_eq!(next_recheck(&[v.clone(), v2], now, &POLICY, None), Some(now + Duration::from_secs(20)));
        assert_eq!(
            next_recheck(std::slice::from_ref(&v), now, &POLICY, Some(Duration::from_secs(5))),
            Some(now + Duration::from_secs(5))
        );
        let kept = Verdict::new(&reservation(), Status::InUse, vec![Fact::IpInNoLiveNetns]);
        assert_eq!(next_recheck(&[kept], now, &POLICY, Some(Duration::from_secs(5))), None);
    }

    #[test]
    fn a_requeue_never_spins() {
        let mut t = Triggers::default();
        t.reconciled(Some(SystemTime::UNIX_EPOCH), Waiting::default(), false);
        let at = t.requeue_at().expect("a requeue");
        assert!(at >= Instant::now() + MIN_REQUEUE - Duration::from_millis(5));
        t.cni_exited(Some("c"), true);
        assert!(t.coalesced_at().is_some());
        t.reconciled(None, Waiting::default(), false);
        assert_eq!((t.coalesced_at(), t.requeue_at()), (None, None));
    }

    /// A reconcile soon (the coalescing window), not a quiet exit's.
    fn soon(t: &Triggers) -> bool {
        t.coalesced_at().is_some_and(|at| at <= Instant::now() + CNI_EXIT_COALESCE)
    }

    /// A reconcile only within a second (a quiet exit's).
    fn quiet(t: &Triggers) -> bool {
        t.coalesced_at().is_some_and(|at| at > Instant::now() + QUIET_EXIT_COALESCE / 2)
    }

    fn in_flight(container_id: Option<&str>) -> Fact {
        Fact::CniOpInFlight {
            container_id: container_id.map(Box::from),
            command: "ADD".into(),
            plugin: "/opt/cni/bin/bridge".into(),
            started_at: SystemTime::UNIX_EPOCH,
        }
    }

    /// A verdict of container "c" that a run in flight holds pending.
    fn waiting_on_c() -> Waiting {
        Waiting::of(&[Verdict::new(&reservation(), Status::Pending, vec![in_flight(Some("c"))])])
    }

    #[test]
    fn only_runs_that_can_change_a_verdict_ask_for_a_reconcile_soon() {
        let mut t = Triggers::default();
        t.cni_exited(Some("c"), false);
        assert!(quiet(&t), "a healthy pod's ADD or DEL asks for one within a second, for /state");
        t.cni_exited(Some("c"), true);
        assert!(soon(&t), "a failed run asks soon, even after a quiet one");
        // A verdict waits on a run of its container: its end matters.
        t.reconciled(None, waiting_on_c(), true);
        t.cni_exited(Some("c"), false);
        assert!(soon(&t));
        // A death while runs were in flight: what they wrote was not seen.
        t.reconciled(None, Waiting::default(), true);
        t.netns_died(true);
        t.cni_exited(Some("other"), false);
        assert!(soon(&t));
        t.reconciled(None, Waiting::default(), true);
        t.cni_exited(Some("other"), false);
        assert!(soon(&t), "until a reconcile runs with no run in flight");
        t.reconciled(None, Waiting::default(), false);
        t.cni_exited(Some("c"), false);
        assert!(quiet(&t));
    }

    #[test]
    fn a_run_of_another_container_does_not_ask_soon_but_an_unnamed_one_does() {
        let mut t = Triggers::default();
        t.reconciled(None, waiting_on_c(), true);
        t.cni_exited(Some("other"), false);
        assert!(quiet(&t), "another pod's run cannot change c's verdict");
        t.cni_exited(None, false);
        assert!(soon(&t), "a run the kernel could not name may be c's");
        // A waiting verdict held by a run that names no container: any run's
        // end may be that one's.
        let unnamed = Verdict::new(&reservation(), Status::Pending, vec![in_flight(None)]);
        t.reconciled(None, Waiting::of(&[unnamed]), true);
        t.cni_exited(Some("other"), false);
        assert!(soon(&t));
        // Nothing waits: an unnamed run's end asks for nothing soon.
        t.reconciled(None, Waiting::default(), true);
        t.cni_exited(None, false);
        assert!(quiet(&t));
    }

    #[test]
    fn a_costly_full_pass_spaces_the_quiet_reconciles_but_not_those_a_verdict_waits_for() {
        let mut t = Triggers::default();
        t.reconciled(None, Waiting::default(), false);
        t.full_pass_took(Duration::from_millis(200));
        t.cni_exited(Some("c"), false);
        let at = t.coalesced_at().expect("a quiet reconcile");
        assert!(at >= Instant::now() + Duration::from_millis(3500), "19 times the pass's 200 ms after it");
        t.cni_exited(Some("c"), true);
        assert!(soon(&t), "a failed run still asks soon");
        // A cheap pass: the usual second.
        t.reconciled(None, Waiting::default(), false);
        t.full_pass_took(Duration::from_millis(1));
        t.targeted(Waiting::default());
        assert!(quiet(&t));
        assert!(t.coalesced_at().is_some_and(|at| at <= Instant::now() + QUIET_EXIT_COALESCE));
        // However costly, never later than the cap.
        t.reconciled(None, Waiting::default(), false);
        t.full_pass_took(Duration::from_mins(1));
        t.targeted(Waiting::default());
        assert!(t.coalesced_at().is_some_and(|at| at <= Instant::now() + MAX_QUIET_GAP));
        assert!(t.coalesced_at().is_some_and(|at| at > Instant::now() + MAX_QUIET_GAP / 2));
    }

    #[test]
    fn a_targeted_pass_adds_its_waits_to_the_last_reconciles() {
        let mut t = Triggers::default();
        t.reconciled(None, Waiting::default(), true);
        t.targeted(waiting_on_c());
        t.cni_exited(Some("other"), false);
        assert!(quiet(&t));
        t.cni_exited(Some("c"), false);
        assert!(soon(&t));
    }

    #[test]
    fn in_use_on_its_own_evidence_waits_on_no_run_but_a_possible_conflict_does() {
        let own = Fact::IpInOwnLiveNetns { netns: crate::identity::NetnsId::default(), paths: Arc::from([]) };
        let kept = Verdict::new(&reservation(), Status::InUse, vec![own, in_flight(Some("c"))]);
        assert!(!waits_on_runs(&kept), "its own live netns keeps it whatever the run does");
        assert_eq!(Waiting::of(&[kept]), Waiting::default());
        let elsewhere = Fact::IpInOtherLiveNetns {
            netns: crate::identity::NetnsId::default(),
            containers: Arc::from([]),
            paths: Arc::from([]),
        };
        let maybe_conflict = Verdict::new(&reservation(), Status::InUse, vec![elsewhere, in_flight(Some("c"))]);
        assert!(waits_on_runs(&maybe_conflict), "when the run ends it may be a conflict");
        let pending = Verdict::new(&reservation(), Status::Pending, vec![in_flight(Some("c"))]);
        assert!(waits_on_runs(&pending));
    }
}
