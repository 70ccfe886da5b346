//! The runtime rules, one unit test each, and their safety invariants as
//! property tests.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, SystemTime},
};

use proptest::prelude::*;

use super::*;
use crate::{
    engine::{
        Binding, BindingSource, CniOp, LiveNetns, Policy, Status, Verdict, decide_one,
        fixtures::{Alphabet, NOW_SECS, ip, now, res, t},
        observations::NetnsName,
    },
    ipam::Reservation,
};

fn pod(name: &str) -> PodRef {
    PodRef { namespace: "default".into(), name: name.into(), uid: format!("uid-{name}") }
}

fn sandbox(id: &str, state: SandboxState, netns: Option<&str>, closed: Option<bool>) -> RuntimeSandbox {
    RuntimeSandbox {
        id: id.into(),
        state,
        pod: Some(pod(&format!("pod-{id}"))),
        netns: netns.map(PathBuf::from),
        netns_closed: closed,
    }
}

fn view(sandboxes: Vec<RuntimeSandbox>, listed_at: SystemTime) -> RuntimeView {
    RuntimeView {
        runtime: "containerd test".into(),
        listed_at,
        sandboxes: sandboxes.into_iter().map(|s| (s.id.clone(), s)).collect(),
        networks: None,
        departed: BTreeMap::new(),
    }
}

fn with_runtime(mut obs: Observations, v: Option<RuntimeView>) -> Observations {
    obs.set_runtime(v);
    obs
}

fn one(obs: &Observations, r: &Reservation) -> Verdict {
    decide_one(obs, r, now(), &Policy::default())
}

fn has(v: &Verdict, pred: impl Fn(&Fact) -> bool) -> bool {
    v.evidence.iter().any(|e| pred(&e.fact))
}

fn live_at(inode: u64, path: &str, addrs: &[&str]) -> LiveNetns {
    LiveNetns {
        id: NetnsId::new(Some(inode), Some(1), None),
        container_ids: Vec::new(),
        addresses: addrs.iter().map(|a| ip(a)).collect(),
        paths: vec![PathBuf::from(path)],
    }
}

#[test]
fn a_ready_sandbox_keeps_its_reservations_and_names_its_pod() {
    let r = res("c1", "10.0.0.2", t(0));
    let obs =
        with_runtime(Observations::default(), Some(view(vec![sandbox("c1", SandboxState::Ready, None, None)], now())));
    let v = one(&obs, &r);
    assert_eq!(v.status, Status::InUse, "{}", v.summary());
    assert!(v.summary().contains("pod default/pod-c1"), "{}", v.summary());
}

#[test]
fn a_notready_sandbox_with_its_netns_alive_is_kept_and_stuck() {
    let r = res("c1", "10.0.0.2", t(0));
    // By the runtime's word (not closed) ...
    let said = sandbox("c1", SandboxState::NotReady, Some("/var/run/netns/cni-1"), Some(false));
    let obs = with_runtime(Observations::default(), Some(view(vec![said], now())));
    let v = one(&obs, &r);
    assert_eq!(v.status, Status::InUse, "{}", v.summary());
    assert!(has(&v, |f| matches!(f.runtime(), Some(RuntimeFact::SandboxStuck { .. }))));
    assert_eq!(stuck_sandboxes(&obs).len(), 1);
    // ... or by the kernel's (a live netns at its path), whatever it says.
    let closed = sandbox("c1", SandboxState::NotReady, Some("/var/run/netns/cni-1"), Some(true));
    let kernel = Observations { live: vec![live_at(5, "/run/netns/cni-1", &[])], ..Default::default() };
    let obs = with_runtime(kernel, Some(view(vec![closed], now())));
    let v = one(&obs, &r);
    assert_eq!(v.status, Status::InUse, "{}", v.summary());
    let stuck = stuck_sandboxes(&obs);
    assert_eq!(stuck[0].live, Some(NetnsId::new(Some(5), Some(1), None)));
    assert!(stuck[0].to_string().contains("stuck"), "{}", stuck[0]);
}

#[test]
fn gone_from_the_runtime_and_bound_nowhere_needs_no_orphan_grace() {
    // 100 s old: past the in-flight grace (30 s), far from the orphan grace (10 min).
    let r = res("c1", "10.0.0.2", t(NOW_SECS - 100));
    let kernel_only = one(&Observations::default(), &r);
    assert_eq!(kernel_only.status, Status::Pending, "{}", kernel_only.summary());

    let mut v = view(vec![], now());
    v.departed.insert("c1".into(), pod("web"));
    let obs = with_runtime(Observations::default(), Some(v));
    let verdict = one(&obs, &r);
    assert_eq!(verdict.status, Status::Orphaned, "{}", verdict.summary());
    assert!(has(&verdict, |f| matches!(f.runtime(), Some(RuntimeFact::GoneWithItsNetns))));
    assert!(verdict.summary().contains("does not list its sandbox (pod default/web)"), "{}", verdict.summary());

    // NOTREADY with its netns closed: the same.
    let closed = sandbox("c1", SandboxState::NotReady, Some("/var/run/netns/cni-1"), Some(true));
    let obs = with_runtime(Observations::default(), Some(view(vec![closed], now())));
    assert_eq!(one(&obs, &r).status, Status::Orphaned);
}

#[test]
fn the_runtime_cannot_judge_a_reservation_newer_than_its_list_nor_another_network() {
    let r = res("c1", "10.0.0.2", t(NOW_SECS - 100));
    let stale = with_runtime(Observations::default(), Some(view(vec![], t(NOW_SECS - 200))));
    assert_eq!(one(&stale, &r).status, Status::Pending);
    let mut other = view(vec![], now());
    other.networks = Some(vec!["k8s-pod-network".into()]);
    let other = with_runtime(Observations::default(), Some(other));
    assert_eq!(one(&other, &r).status, Status::Pending);
}

#[test]
fn gone_never_overrides_a_live_netns_an_in_flight_run_or_youth() {
    let gone = || Some(view(vec![], now()));
    let r = res("c1", "10.0.0.2", t(NOW_SECS - 100));
    let ip_live = with_runtime(
        Observations { live: vec![live_at(5, "/run/netns/x", &["10.0.0.2"])], ..Default::default() },
        gone(),
    );
    assert_ne!(one(&ip_live, &r).status, Status::Orphaned);
    let bound_live = with_runtime(
        Observations {
            live: vec![live_at(5, "/run/netns/x", &[])],
            bindings: vec![Binding {
                container_id: "c1".into(),
                netns: NetnsName::Path("/run/netns/x".into()),
                source: BindingSource::CniExec,
                seen_at: t(1),
            }],
            ..Default::default()
        },
        gone(),
    );
    assert_eq!(one(&bound_live, &r).status, Status::InUse);
    let in_flight = with_runtime(
        Observations {
            cni_ops: vec![CniOp {
                container_id: Some("c1".into()),
                container_id_truncated: false,
                command: "DEL".into(),
                plugin: "bridge".into(),
                started_at: t(NOW_SECS - 1),
                finished_at: None,
                exit_code: None,
            }],
            ..Default::default()
        },
        gone(),
    );
    assert_eq!(one(&in_flight, &r).status, Status::Pending);
    let young = res("c1", "10.0.0.2", t(NOW_SECS - 5));
    assert_eq!(one(&with_runtime(Observations::default(), gone()), &young).status, Status::Pending);
}

#[test]
fn an_unreachable_runtime_adds_and_removes_nothing() {
    let r = res("c1", "10.0.0.2", t(NOW_SECS - 100));
    let obs = with_runtime(Observations::default(), None);
    let v = one(&obs, &r);
    assert_eq!(v, one(&Observations::default(), &r));
    assert!(stuck_sandboxes(&obs).is_empty());
}

#[test]
fn runtime_facts_round_trip_through_json() {
    let fact = Fact::from(RuntimeFact::SandboxStuck {
        pod: Some(pod("web")),
        netns: Some("/var/run/netns/cni-1".into()),
        live: Some(NetnsId::new(Some(9), Some(3), None)),
    });
    let json = serde_json::to_value(&fact).unwrap();
    assert_eq!(json["fact"], "runtime");
    assert_eq!(json["runtime"], "sandbox_stuck");
    assert_eq!(serde_json::from_value::<Fact>(json).unwrap(), fact);
    let gone = Fact::from(RuntimeFact::GoneWithItsNetns);
    assert_eq!(serde_json::from_value::<Fact>(serde_json::to_value(&gone).unwrap()).unwrap(), gone);
}

// ---- properties ----

fn alphabet() -> Alphabet {
    Alphabet {
        cids: &["c1", "c2", "c3"],
        ips: &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        paths: &["/run/netns/a", "/var/run/netns/a", "/run/netns/b"],
        times: a_time().boxed(),
        netns_ids: (1u64..4, prop::option::of(0i32..3))
            .prop_map(|(inode, nsid)| NetnsId::new(Some(inode), nsid, None))
            .boxed(),
        sources: &[BindingSource::CniExec],
        most: 2,
    }
}
fn a_cid() -> impl Strategy<Value = String> {
    alphabet().cid()
}
fn a_time() -> impl Strategy<Value = SystemTime> {
    (0u64..=NOW_SECS + 5).prop_map(t)
}
fn an_op() -> impl Strategy<Value = CniOp> {
    (prop::option::of(a_cid()), a_time(), prop::option::of(a_time())).prop_map(
        |(container_id, started_at, finished_at)| CniOp {
            container_id: container_id.map(crate::ipam::SharedStr::from),
            container_id_truncated: false,
            command: "ADD".into(),
            plugin: "bridge".into(),
            started_at,
            finished_at,
            exit_code: None,
        },
    )
}
fn kernel_observations() -> impl Strategy<Value = Observations> {
    (
        prop::collection::vec(alphabet().live(), 0..3),
        prop::collection::vec(alphabet().dead(), 0..3),
        prop::collection::vec(alphabet().binding(), 0..3),
        prop::collection::vec(an_op(), 0..2),
        prop::option::of(a_time()),
    )
        .prop_map(|(live, dead, bindings, cni_ops, watching_since)| Observations {
            live,
            dead,
            bindings,
            cni_ops,
            watching_since,
            ..Observations::default()
        })
}
fn a_state() -> impl Strategy<Value = SandboxState> {
    prop_oneof![Just(SandboxState::Ready), Just(SandboxState::NotReady)]
}
fn a_sandbox() -> impl Strategy<Value = RuntimeSandbox> {
    (a_cid(), a_state(), prop::option::of(alphabet().path()), prop::option::of(any::<bool>())).prop_map(
        |(id, state, netns, netns_closed)| RuntimeSandbox {
            pod: Some(PodRef { namespace: "ns".into(), name: format!("p-{id}"), uid: String::new() }),
            id,
            state,
            netns,
            netns_closed,
        },
    )
}
fn a_view() -> impl Strategy<Value = RuntimeView> {
    (
        prop::collection::vec(a_sandbox(), 0..3),
        a_time(),
        prop::option::of(prop::sample::subsequence(vec!["net1".to_owned(), "other".to_owned()], 0..=2)),
    )
        .prop_map(|(sandboxes, listed_at, networks)| RuntimeView { networks, ..view(sandboxes, listed_at) })
}
fn a_reservation() -> impl Strategy<Value = Reservation> {
    (a_cid(), alphabet().ip(), a_time()).prop_map(|(cid, ip, created)| {
        let mut r = res(&cid, "10.0.0.1", created);
        r.ip = ip;
        r
    })
}
fn a_policy() -> impl Strategy<Value = Policy> {
    (0u64..120, 120u64..12_000)
        .prop_map(|(f, o)| Policy { in_flight_grace: Duration::from_secs(f), orphan_grace: Duration::from_secs(o) })
}

/// Exact-match versions of "something live holds it", computed apart from
/// the engine.
fn kernel_holds(obs: &Observations, r: &Reservation, policy: &Policy) -> bool {
    let ip_live = obs.live.iter().any(|n| n.addresses.contains(&r.ip));
    let in_flight = obs
        .cni_ops
        .iter()
        .any(|op| op.finished_at.is_none() && op.container_id.as_ref().is_none_or(|c| *c == r.container_id));
    let bound_live = obs.live.iter().any(|n| n.container_ids.iter().any(|c| *c == r.container_id))
        || obs.bindings.iter().filter(|b| b.container_id == r.container_id).any(|b| {
            obs.live.iter().any(|n| match &b.netns {
                NetnsName::Id(id) => n.id.may_be(id),
                NetnsName::Path(p) => n.paths.iter().any(|q| super::super::observations::same_netns_path(p, q)),
            })
        });
    let watched = obs.watching_since.is_some_and(|since| {
        obs.cni_ops.iter().any(|op| {
            op.container_id.as_deref() == Some(r.container_id.as_str())
                && op.started_at >= since
                && op.started_at <= r.created_at + super::super::decide::WATCH_SLACK
        })
    });
    let young = now().duration_since(r.created_at).map_or(true, |age| age < policy.in_flight_grace);
    ip_live || in_flight || bound_live || (young && !watched)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// READY keeps every reservation of its ID.
    #[test]
    fn ready_keeps(obs in kernel_observations(), v in a_view(), r in a_reservation(), policy in a_policy()) {
        let ready = v.sandboxes.get(r.container_id.as_str()).is_some_and(|s| s.state == SandboxState::Ready);
        let obs = with_runtime(obs, Some(v));
        let verdict = decide_one(&obs, &r, now(), &policy);
        if ready {
            prop_assert_eq!(verdict.status, Status::InUse, "{}", verdict.summary());
        }
    }

    /// NOTREADY with its netns alive (runtime's word or kernel's) keeps, and
    /// is listed stuck.
    #[test]
    fn notready_with_live_netns_keeps_and_is_stuck(
        obs in kernel_observations(), v in a_view(), r in a_reservation(), policy in a_policy()
    ) {
        let obs = with_runtime(obs, Some(v));
        let view = obs.runtime.as_ref().unwrap();
        let netns_alive = |s: &RuntimeSandbox| {
            s.netns_closed == Some(false)
                || s.netns.as_ref().is_some_and(|p| {
                    obs.live.iter().any(|n| n.paths.iter().any(|q| super::super::observations::same_netns_path(p, q)))
                })
        };
        let stuck = stuck_sandboxes(&obs);
        for s in view.sandboxes.values() {
            let expect = s.state == SandboxState::NotReady && netns_alive(s);
            prop_assert_eq!(stuck.iter().any(|x| x.id == s.id), expect, "{:?}", s);
        }
        if view.sandboxes.get(r.container_id.as_str()).is_some_and(|s| s.state == SandboxState::NotReady && netns_alive(s)) {
            let verdict = decide_one(&obs, &r, now(), &policy);
            prop_assert_eq!(verdict.status, Status::InUse, "{}", verdict.summary());
        }
    }

    /// Whatever the runtime says, it never overrides a live netns, an
    /// in-flight CNI run or the youth grace.
    #[test]
    fn runtime_never_overrides_kernel_keeps(
        obs in kernel_observations(), v in a_view(), r in a_reservation(), policy in a_policy()
    ) {
        let holds = kernel_holds(&obs, &r, &policy);
        let obs = with_runtime(obs, Some(v));
        let verdict = decide_one(&obs, &r, now(), &policy);
        if holds {
            prop_assert_ne!(verdict.status, Status::Orphaned, "{}", verdict.summary());
        }
    }

    /// A runtime that cannot be reached adds nothing and removes nothing:
    /// verdicts are the kernel's alone.
    #[test]
    fn unreachable_runtime_changes_nothing(obs in kernel_observations(), r in a_reservation(), policy in a_policy()) {
        let kernel = decide_one(&obs, &r, now(), &policy);
        let obs = with_runtime(obs, None);
        prop_assert_eq!(decide_one(&obs, &r, now(), &policy), kernel);
        prop_assert!(stuck_sandboxes(&obs).is_empty());
    }

    /// The runtime only ever moves a verdict towards release when it is done
    /// with the sandbox (not listed, or netns closed), for a network it
    /// judges, after the reservation was made; and every orphan it makes
    /// says so.
    #[test]
    fn release_evidence_only_from_a_sandbox_the_runtime_is_done_with(
        obs in kernel_observations(), v in a_view(), r in a_reservation(), policy in a_policy()
    ) {
        let kernel = decide_one(&obs, &r, now(), &policy);
        let listed = v.sandboxes.get(r.container_id.as_str()).cloned();
        let judges = v.networks.as_ref().is_none_or(|n| n.iter().any(|x| *x == r.network));
        let after_reservation = r.created_at + CLOCK_SLACK <= v.listed_at;
        let obs = with_runtime(obs, Some(v));
        let verdict = decide_one(&obs, &r, now(), &policy);
        if verdict.status == Status::Orphaned && kernel.status != Status::Orphaned {
            let done = listed.is_none_or(|s| s.state == SandboxState::NotReady && s.netns_closed == Some(true));
            prop_assert!(done && judges && after_reservation, "{}", verdict.summary());
            prop_assert!(has(&verdict, |f| matches!(f.runtime(), Some(RuntimeFact::GoneWithItsNetns))));
            prop_assert!(has(&verdict, |f| matches!(f, Fact::IpInNoLiveNetns)));
        }
        if kernel.status == Status::Orphaned {
            // The kernel's orphans stay orphans unless the runtime keeps them
            // (READY or stuck).
            let keeps = has(&verdict, |f| matches!(
                f.runtime(),
                Some(RuntimeFact::SandboxReady { .. } | RuntimeFact::SandboxStuck { .. })
            ));
            prop_assert!(verdict.status == Status::Orphaned || keeps, "{}", verdict.summary());
        }
    }
}
