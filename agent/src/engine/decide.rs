//! The decision rule (README, "What it does"), as a pure function of (observations,
//! reservation, now, policy).
//!
//! IN USE if: its IP is configured in a live netns; its container is bound
//! to a live netns; a CNI operation for its container is in flight (pending);
//! the runtime lists its sandbox; it is younger than the in-flight grace
//! (pending). ORPHANED only when none holds and either its bound netns was
//! seen to die, or (never seen bound) it is older than the orphan grace and
//! its IP is in no live netns. An IP configured in a live netns of another
//! container while the owner is dead is a CONFLICT: reported, never released.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, SystemTime},
};

use super::{
    claim::Claim,
    index::{BindingLink, Index},
    observations::{DeadNetns, LiveNetns, Observations},
    policy::Policy,
    verdict::{BoundBy, Evidence, Fact, Status, Verdict},
};

/// How far apart two wall-clock times from different sources (a death
/// stamped from `CLOCK_MONOTONIC`, a file mtime from the coarse kernel clock)
/// may be and still be taken in the order they claim.
pub const CLOCK_SLACK: Duration = Duration::from_secs(1);

/// How far a file's mtime (the coarse clock, a jiffy behind at most) may
/// precede the exec record of the run that wrote it.
pub const WATCH_SLACK: Duration = Duration::from_millis(100);

/// Most threads a decision uses: the agent shares the node with its pods.
const DECIDE_THREADS: usize = 2;
/// Below this many reservations a second thread costs more than it saves
/// (a verdict takes about a microsecond, a thread tens of them).
pub(super) const PARALLEL_DECIDE_MIN: usize = 4096;

/// One verdict per reservation, in the same order. Many reservations are
/// judged on up to [`DECIDE_THREADS`] threads against one shared index:
/// judging is a pure function of the index and the reservation, so the
/// verdicts are those of one thread.
#[must_use]
pub fn decide<R: Claim + Clone + Send + Sync>(
    obs: &Observations,
    reservations: &[R],
    now: SystemTime,
    policy: &Policy,
) -> Vec<Verdict<R>> {
    let parallel = reservations.len() >= PARALLEL_DECIDE_MIN && crate::cpus::available().min(DECIDE_THREADS) >= 2;
    decide_on(obs, reservations, now, policy, parallel)
}

/// [`decide`], on two threads when `parallel` (whatever the size: tests
/// take this path with a few reservations). The index is built on both
/// (the addresses' map on a helper), then each container is judged on the
/// thread its ID hashes to: what is found once per container is found
/// once, not once per thread, and each thread keeps half of it.
pub(super) fn decide_on<R: Claim + Clone + Send + Sync>(
    obs: &Observations,
    reservations: &[R],
    now: SystemTime,
    policy: &Policy,
    parallel: bool,
) -> Vec<Verdict<R>> {
    if !parallel {
        return judge_all(&Index::new(obs), reservations, None, now, policy);
    }
    let index = Index::build(obs, true);
    // Which thread judges each reservation: its container's.
    let side = foldhash::fast::FixedState::with_seed(0x006e_6574_7265_6170);
    let on_helper: Vec<bool> =
        reservations.iter().map(|r| std::hash::BuildHasher::hash_one(&side, r.container_id()) & 1 == 1).collect();
    let (mine, theirs) = std::thread::scope(|s| {
        let (index, on_helper) = (&index, on_helper.as_slice());
        let helper = std::thread::Builder::new()
            .name("netreap-decide".into())
            .spawn_scoped(s, move || judge_all(index, reservations, Some((on_helper, true)), now, policy));
        let mine = judge_all(index, reservations, Some((on_helper, false)), now, policy);
        // A thread that cannot be started: its share is judged here.
        let theirs = match helper.map(std::thread::ScopedJoinHandle::join) {
            Ok(Ok(theirs)) => theirs,
            _ => judge_all(index, reservations, Some((on_helper, true)), now, policy),
        };
        (mine, theirs)
    });
    // Back in the reservations' order.
    let helpers = on_helper.iter().filter(|&&h| h).count();
    if theirs.len() != helpers || mine.len() != reservations.len() - helpers {
        return judge_all(&index, reservations, None, now, policy);
    }
    let (mut mine, mut theirs) = (mine.into_iter(), theirs.into_iter());
    on_helper.iter().filter_map(|&h| if h { theirs.next() } else { mine.next() }).collect()
}

/// Verdicts for `reservations` (only those `share` gives this thread:
/// where the flag equals the side), in order, on this thread. What
/// depends on a reservation's container alone is looked up once per
/// container: a pod attached to 10 networks has 10 reservations, and each
/// lookup hashes and compares a 64-byte container ID.
fn judge_all<R: Claim + Clone>(
    index: &Index<'_>,
    reservations: &[R],
    share: Option<(&[bool], bool)>,
    now: SystemTime,
    policy: &Policy,
) -> Vec<Verdict<R>> {
    let mut containers: HashMap<&str, Container<'_>, foldhash::fast::RandomState> = HashMap::default();
    reservations
        .iter()
        .enumerate()
        .filter(|(i, _)| share.is_none_or(|(flags, side)| flags.get(*i) == Some(&side)))
        .map(|(_, r)| {
            let c = containers.entry(r.container_id()).or_insert_with(|| Container::of(index, r.container_id()));
            let (status, facts) = judge(index, c, r, now, policy);
            Verdict::with_evidence(r, status, c.evidence(facts))
        })
        .collect()
}

/// Where a container's netns stands, from one piece of evidence.
enum Link<'a> {
    Live(&'a LiveNetns, BoundBy),
    Dead(&'a DeadNetns, BoundBy),
    /// Bound to something neither known live nor seen to die (rare: boxed,
    /// so the common links stay small).
    Unresolved(Box<(Fact, SystemTime)>),
}

/// What judging needs of a container alone (never of a reservation's IP,
/// time or network), found once per container a decision meets. Each
/// field is exactly what the per-reservation lookup it replaces gave.
struct Container<'a> {
    /// Its bindings' netns, then the live netns the model binds it to.
    links: Box<[Link<'a>]>,
    /// Positions of the dead netns bound to it, ascending.
    dead: Box<[usize]>,
    /// Its CNI runs in flight (any that may concern it).
    in_flight: Box<[Fact]>,
    /// The earliest start of a run of exactly this container that the
    /// probes watched: some such run started by `t` iff this is <= `t`.
    first_watched_run: Option<SystemTime>,
    /// The runtime's reasons to keep.
    runtime_keep: Box<[Fact]>,
    /// Pending pods a CNI run of it named.
    pending_pods: Box<[Fact]>,
    /// The last evidence list one of its reservations got: equal facts
    /// share it (they name the netns, not the IP, so mostly they are equal).
    last_evidence: Option<Arc<[Evidence]>>,
}

impl<'a> Container<'a> {
    fn of(ix: &Index<'a>, cid: &str) -> Self {
        let obs = ix.obs;
        // One allocation of the final size (both iterators know theirs).
        let links = ix
            .bindings_of_shared(cid)
            .map(|(b, name, link)| match link {
                BindingLink::Live(live) => Link::Live(live, BoundBy::Binding { source: b.source, netns: name }),
                BindingLink::Dead(dead) => Link::Dead(dead, BoundBy::Binding { source: b.source, netns: name }),
                BindingLink::Unresolved => {
                    let fact = Fact::UnresolvedBinding { netns: name, source: b.source, seen_at: b.seen_at };
                    Link::Unresolved(Box::new((fact, b.seen_at)))
                }
            })
            .chain(ix.live_of_container(cid).map(|live| Link::Live(live, BoundBy::Model)))
            .collect();
        let in_flight = ix
            .ops_concerning(cid)
            .into_iter()
            .filter(|op| op.in_flight())
            .map(|op| Fact::CniOpInFlight {
                container_id: op.container_id.as_deref().map(Box::from),
                command: op.command.as_str().into(),
                plugin: op.plugin.as_str().into(),
                started_at: op.started_at,
            })
            .collect();
        let watched = |t: SystemTime| {
            obs.watching_since.is_some_and(|since| t >= since)
                || obs.watched_before.iter().any(|(since, until)| t >= *since && t <= *until)
        };
        let pending_pods = obs
            .api_pods
            .iter()
            .flatten()
            .filter(|p| p.pending && p.cni_containers.iter().any(|c| c == cid))
            .map(|pod| Fact::ApiPendingPodNamedByCniRun { namespace: pod.namespace.clone(), name: pod.name.clone() })
            .collect();
        Self {
            links,
            dead: ix.dead_positions_of_container(cid).collect(),
            in_flight,
            first_watched_run: ix.ops_of_exactly(cid).map(|op| op.started_at).filter(|&t| watched(t)).min(),
            runtime_keep: super::runtime::keep_facts(ix, cid).into_boxed_slice(),
            pending_pods,
            last_evidence: None,
        }
    }

    /// The evidence list for `facts`: the last one given when equal.
    fn evidence(&mut self, facts: Vec<Fact>) -> Arc<[Evidence]> {
        if let Some(last) = &self.last_evidence
            && last.iter().map(|e| &e.fact).eq(facts.iter())
        {
            return Arc::clone(last);
        }
        let evidence: Arc<[Evidence]> = facts.into_iter().map(Evidence::from).collect();
        self.last_evidence = Some(Arc::clone(&evidence));
        evidence
    }
}

/// Decides one reservation (builds the lookup tables: for a few; `decide`
/// shares them across many).
#[must_use]
pub fn decide_one<R: Claim + Clone>(obs: &Observations, r: &R, now: SystemTime, policy: &Policy) -> Verdict<R> {
    let ix = Index::new(obs);
    let (status, facts) = judge(&ix, &Container::of(&ix, r.container_id()), r, now, policy);
    Verdict::new(r, status, facts)
}

/// The status of one reservation and the facts that decided it.
fn judge<'a>(
    ix: &Index<'a>,
    c: &Container<'a>,
    r: &impl Claim,
    now: SystemTime,
    policy: &Policy,
) -> (Status, Vec<Fact>) {
    let obs = ix.obs;
    // A file stamped in the future (clock step) counts as brand new.
    let age = now.duration_since(r.reserved_at()).unwrap_or(Duration::ZERO);
    let cid = r.container_id();
    let reserved_at = r.reserved_at();

    // Reasons that show the owner alive: any one keeps the reservation.
    let mut in_use = Vec::new();
    let mut pending = Vec::new();
    // The IP is live somewhere not known to be the owner's.
    let mut ip_elsewhere = Vec::new();
    let mut ip_with_another_container = false;

    for n in ix.live_holding_shared(r.ip()) {
        if n.containers.iter().any(|c| c == cid) {
            in_use.push(Fact::IpInOwnLiveNetns { netns: n.netns.id, paths: n.paths });
        } else {
            ip_with_another_container |= !n.containers.is_empty();
            ip_elsewhere.push(Fact::IpInOtherLiveNetns { netns: n.netns.id, containers: n.containers, paths: n.paths });
        }
    }

    let mut dead = Vec::new();
    let mut unresolved = Vec::new();
    let file_death = |d: &DeadNetns, via: BoundBy, dead: &mut Vec<Fact>, unresolved: &mut Vec<(Fact, SystemTime)>| {
        // A netns that died before this reservation was made cannot be
        // where its IP went: the container has a later netns, unknown.
        if d.died_at + CLOCK_SLACK < reserved_at {
            let fact = Fact::BoundNetnsDiedBeforeReservation { netns: d.id, died_at: d.died_at, via };
            unresolved.push((fact, reserved_at));
        } else {
            dead.push(Fact::BoundNetnsDied { netns: d.id, died_at: d.died_at, via });
        }
    };
    // The container's links, then the dead netns of it or that held this
    // IP (in observation order): one list once, taken in its order.
    for link in &c.links {
        match link {
            Link::Live(n, via) => in_use.push(Fact::BoundToLiveNetns { netns: n.id, via: via.clone() }),
            Link::Dead(d, via) => file_death(d, via.clone(), &mut dead, &mut unresolved),
            Link::Unresolved(unresolved_link) => unresolved.push((**unresolved_link).clone()),
        }
    }
    for (d, own) in ix.dead_at_or_holding(&c.dead, r.ip()) {
        if own {
            file_death(d, BoundBy::Model, &mut dead, &mut unresolved);
        } else if d.died_at >= reserved_at {
            // Held this reservation's IP after it was made and belonged to
            // no other known container: the reservation's netns.
            file_death(d, BoundBy::Address, &mut dead, &mut unresolved);
        }
    }

    pending.extend(c.in_flight.iter().cloned());
    in_use.extend(c.runtime_keep.iter().cloned());
    for pod in ix.pods_with(r.ip()) {
        in_use.push(Fact::ApiPodHasIp { namespace: pod.namespace.clone(), name: pod.name.clone() });
    }
    in_use.extend(c.pending_pods.iter().cloned());
    // The youth grace stands in for CNI runs the agent may have missed. It
    // is not needed when the probes, watching without a gap (in this run
    // or an earlier one), saw the run that made the file: a CNI run of this
    // very container that started after watching began and before the
    // file was written (its exec record precedes the IPAM write). Then
    // whether that ADD is in flight is known, not guessed.
    let runs_watched = c.first_watched_run.is_some_and(|t| t <= reserved_at + WATCH_SLACK);
    if age < policy.in_flight_grace && !runs_watched {
        pending.push(Fact::Young { age, grace: policy.in_flight_grace });
    }

    if !in_use.is_empty() {
        in_use.extend(pending);
        in_use.extend(ip_elsewhere);
        return (Status::InUse, in_use);
    }

    // Is the owner dead? Seen to die beats age: every netns it was tied to
    // died and none is unaccounted for.
    let died = !dead.is_empty() && unresolved.is_empty();
    let past_grace = age >= policy.orphan_grace
        && unresolved
            .iter()
            .all(|(_, seen_at)| now.duration_since(*seen_at).unwrap_or(Duration::ZERO) >= policy.orphan_grace);
    // The runtime's word on a sandbox it is done with, with the kernel's
    // (nothing above kept it), stands in for the orphan grace.
    let runtime_gone = if died || past_grace { None } else { super::runtime::says_gone(ix, r) };
    let owner_dead = pending.is_empty() && (died || past_grace || runtime_gone.is_some());

    if !ip_elsewhere.is_empty() {
        // The address lives in a netns not known to be the owner's. With the
        // owner dead (its own netns seen to die, or it never had one and
        // another container's netns holds the IP), that is a duplicate IP.
        let conflict = owner_dead && (died || ip_with_another_container);
        let mut facts = ip_elsewhere;
        if conflict {
            facts.extend(runtime_gone.unwrap_or_default());
            facts.extend(death_facts(died, dead, unresolved, age, policy));
            return (Status::Conflict, facts);
        }
        facts.extend(pending);
        facts.extend(dead);
        facts.extend(unresolved.into_iter().map(|(f, _)| f));
        return (Status::InUse, facts);
    }

    if !pending.is_empty() {
        pending.extend(dead);
        return (Status::Pending, pending);
    }

    if !owner_dead {
        let mut facts: Vec<Fact> = unresolved.into_iter().map(|(f, _)| f).collect();
        facts.push(Fact::AwaitingOrphanGrace { age, grace: policy.orphan_grace });
        facts.extend(dead);
        return (Status::Pending, facts);
    }

    let mut facts = match runtime_gone {
        Some(gone) => gone.into_iter().chain(unresolved.into_iter().map(|(f, _)| f)).chain(dead).collect(),
        None => death_facts(died, dead, unresolved, age, policy),
    };
    facts.push(Fact::IpInNoLiveNetns);
    facts.push(Fact::NoCniOpInFlight);
    facts.extend(super::runtime::release_facts(ix, r));
    if obs.api_pods.is_none() {
        facts.push(Fact::SourceUnavailable { source: "Kubernetes API pod list".into() });
    }
    (Status::Orphaned, facts)
}

/// Why the owner counts as dead: the deaths seen, or the grace that passed.
pub(super) fn death_facts(
    died: bool,
    dead: Vec<Fact>,
    unresolved: Vec<(Fact, SystemTime)>,
    age: Duration,
    policy: &Policy,
) -> Vec<Fact> {
    if died {
        return dead;
    }
    if dead.is_empty() && unresolved.is_empty() {
        return vec![Fact::NeverSeenBound { age, grace: policy.orphan_grace }];
    }
    let mut facts = vec![Fact::NoLiveBindingPastGrace { age, grace: policy.orphan_grace }];
    facts.extend(unresolved.into_iter().map(|(f, _)| f));
    facts.extend(dead);
    facts
}
