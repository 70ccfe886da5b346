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
/// judged on up to [`DECIDE_THREADS`] threads, each on its own half, against
/// one shared index: judging is a pure function of the index and the
/// reservation, so the verdicts are those of one thread.
#[must_use]
pub fn decide<R: Claim + Clone + Send + Sync>(
    obs: &Observations,
    reservations: &[R],
    now: SystemTime,
    policy: &Policy,
) -> Vec<Verdict<R>> {
    let index = Index::new(obs);
    let threads = crate::cpus::available().min(DECIDE_THREADS);
    if threads < 2 || reservations.len() < PARALLEL_DECIDE_MIN {
        return judge_all(&index, reservations, now, policy);
    }
    let (first, rest) = reservations.split_at(reservations.len() / 2);
    std::thread::scope(|s| {
        let index = &index;
        let helper = std::thread::Builder::new()
            .name("netreap-decide".into())
            .spawn_scoped(s, move || judge_all(index, rest, now, policy));
        let mut out = judge_all(index, first, now, policy);
        // A thread that cannot be started: its half is judged here.
        match helper.map(std::thread::ScopedJoinHandle::join) {
            Ok(Ok(other)) => out.extend(other),
            _ => out.extend(judge_all(index, rest, now, policy)),
        }
        out
    })
}

/// Verdicts for `reservations`, in order, on this thread.
fn judge_all<R: Claim + Clone>(
    index: &Index<'_>,
    reservations: &[R],
    now: SystemTime,
    policy: &Policy,
) -> Vec<Verdict<R>> {
    let mut shared = SharedEvidence::default();
    reservations
        .iter()
        .map(|r| {
            let (status, facts) = judge(index, r, now, policy);
            Verdict::with_evidence(r, status, shared.evidence(r.container_id(), facts))
        })
        .collect()
}

/// One evidence list per distinct list of facts a container's reservations
/// got: a pod attached to 10 networks has 10 reservations, almost always
/// decided by the same facts (which name the netns, not the IP). Keeps the
/// last list per container; equal facts share it.
#[derive(Default)]
struct SharedEvidence<'r> {
    last: HashMap<&'r str, Arc<[Evidence]>, foldhash::fast::RandomState>,
}

impl<'r> SharedEvidence<'r> {
    fn evidence(&mut self, container_id: &'r str, facts: Vec<Fact>) -> Arc<[Evidence]> {
        if let Some(last) = self.last.get(container_id)
            && last.iter().map(|e| &e.fact).eq(facts.iter())
        {
            return Arc::clone(last);
        }
        let evidence: Arc<[Evidence]> = facts.into_iter().map(Evidence::from).collect();
        self.last.insert(container_id, Arc::clone(&evidence));
        evidence
    }
}

/// Where a container's netns stands, from one piece of evidence.
enum Link<'a> {
    Live(&'a LiveNetns, BoundBy),
    Dead(&'a DeadNetns, BoundBy),
    /// Bound to something neither known live nor seen to die.
    Unresolved(Fact, SystemTime),
}

/// Every netns the reservation's container is known to be tied to.
fn links<'a>(ix: &Index<'a>, r: &impl Claim) -> Vec<Link<'a>> {
    let cid = r.container_id();
    let mut out = Vec::new();
    for (b, name, link) in ix.bindings_of_shared(cid) {
        let via = || BoundBy::Binding { source: b.source, netns: Arc::clone(&name) };
        match link {
            BindingLink::Live(live) => out.push(Link::Live(live, via())),
            BindingLink::Dead(dead) => out.push(Link::Dead(dead, via())),
            BindingLink::Unresolved => {
                let fact = Fact::UnresolvedBinding { netns: Arc::clone(&name), source: b.source, seen_at: b.seen_at };
                out.push(Link::Unresolved(fact, b.seen_at));
            }
        }
    }
    for live in ix.live_of_container(cid) {
        out.push(Link::Live(live, BoundBy::Model));
    }
    for (dead, own) in ix.dead_of_container_or_ip(cid, r.ip()) {
        if own {
            out.push(Link::Dead(dead, BoundBy::Model));
        } else if dead.died_at >= r.reserved_at() {
            // Held this reservation's IP after it was made and belonged to
            // no other known container: the reservation's netns.
            out.push(Link::Dead(dead, BoundBy::Address));
        }
    }
    out
}

/// Decides one reservation (builds the lookup tables: for a few; `decide`
/// shares them across many).
#[must_use]
pub fn decide_one<R: Claim + Clone>(obs: &Observations, r: &R, now: SystemTime, policy: &Policy) -> Verdict<R> {
    let (status, facts) = judge(&Index::new(obs), r, now, policy);
    Verdict::new(r, status, facts)
}

/// The status of one reservation and the facts that decided it.
fn judge(ix: &Index<'_>, r: &impl Claim, now: SystemTime, policy: &Policy) -> (Status, Vec<Fact>) {
    let obs = ix.obs;
    // A file stamped in the future (clock step) counts as brand new.
    let age = now.duration_since(r.reserved_at()).unwrap_or(Duration::ZERO);
    let cid = r.container_id();

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

    let links = links(ix, r);
    let mut dead = Vec::new();
    let mut unresolved = Vec::new();
    for link in links {
        match link {
            Link::Live(n, via) => in_use.push(Fact::BoundToLiveNetns { netns: n.id, via }),
            // A netns that died before this reservation was made cannot be
            // where its IP went: the container has a later netns, unknown.
            Link::Dead(d, via) if d.died_at + CLOCK_SLACK < r.reserved_at() => {
                unresolved.push((
                    Fact::BoundNetnsDiedBeforeReservation { netns: d.id, died_at: d.died_at, via },
                    r.reserved_at(),
                ));
            }
            Link::Dead(d, via) => dead.push(Fact::BoundNetnsDied { netns: d.id, died_at: d.died_at, via }),
            Link::Unresolved(fact, seen_at) => unresolved.push((fact, seen_at)),
        }
    }

    for op in ix.ops_concerning(cid).into_iter().filter(|op| op.in_flight()) {
        pending.push(Fact::CniOpInFlight {
            container_id: op.container_id.as_deref().map(Box::from),
            command: op.command.as_str().into(),
            plugin: op.plugin.as_str().into(),
            started_at: op.started_at,
        });
    }
    in_use.extend(super::runtime::keep_facts(ix, cid));
    for pod in ix.pods_with(r.ip()) {
        in_use.push(Fact::ApiPodHasIp { namespace: pod.namespace.clone(), name: pod.name.clone() });
    }
    let pending_pods = obs.api_pods.iter().flatten().filter(|p| p.pending && p.cni_containers.iter().any(|c| c == cid));
    for pod in pending_pods {
        in_use.push(Fact::ApiPendingPodNamedByCniRun { namespace: pod.namespace.clone(), name: pod.name.clone() });
    }
    if age < policy.in_flight_grace && !cni_runs_watched(ix, r) {
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

/// The youth grace stands in for CNI runs the agent may have missed. It is
/// not needed when the probes, watching without a gap (in this run or an
/// earlier one), saw the run that made the file: a CNI run of this very container that started after watching
/// began and before the file was written (its exec record precedes the IPAM
/// write). Then whether that ADD is in flight is known, not guessed.
fn cni_runs_watched(ix: &Index<'_>, r: &impl Claim) -> bool {
    let watched = |t: SystemTime| {
        ix.obs.watching_since.is_some_and(|since| t >= since)
            || ix.obs.watched_before.iter().any(|(since, until)| t >= *since && t <= *until)
    };
    let reserved_at = r.reserved_at();
    ix.ops_of_exactly(r.container_id()).any(|op| watched(op.started_at) && op.started_at <= reserved_at + WATCH_SLACK)
}

/// Why the owner counts as dead: the deaths seen, or the grace that passed.
fn death_facts(
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
