//! The decision rule as it was before `decide` looked up what depends on a
//! reservation's container once per container: judging each reservation
//! with every lookup its own. Kept (tests only) as the oracle the
//! per-container path must equal, verdict for verdict, fact for fact.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use super::{
    claim::Claim,
    decide::{CLOCK_SLACK, WATCH_SLACK, death_facts},
    index::{BindingLink, Index},
    observations::{DeadNetns, LiveNetns, Observations},
    policy::Policy,
    verdict::{BoundBy, Fact, Status, Verdict},
};

/// [`super::decide_one`] as it was.
pub fn decide_one<R: Claim + Clone>(obs: &Observations, r: &R, now: SystemTime, policy: &Policy) -> Verdict<R> {
    let (status, facts) = judge(&Index::new(obs), r, now, policy);
    Verdict::new(r, status, facts)
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
