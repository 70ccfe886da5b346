//! Unit tests for each verdict and property tests for the safety invariants.

use std::{
    net::IpAddr,
    path::PathBuf,
    time::{Duration, SystemTime},
};

use proptest::prelude::*;

use super::{
    fixtures::{Alphabet, NOW_SECS, ip, now, res, t},
    *,
};
use crate::ipam::{Reservation, StoreScan};

fn id(inode: u64, nsid: i32) -> NetnsId {
    NetnsId::new(Some(inode), Some(nsid), None)
}

fn live(ns: NetnsId, cids: &[&str], addrs: &[&str], paths: &[&str]) -> LiveNetns {
    LiveNetns {
        id: ns,
        container_ids: cids.iter().map(|s| (*s).to_owned()).collect(),
        addresses: addrs.iter().map(|a| ip(a)).collect(),
        paths: paths.iter().map(PathBuf::from).collect(),
    }
}

fn dead(ns: NetnsId, died: SystemTime, cids: &[&str], addrs: &[&str]) -> DeadNetns {
    DeadNetns {
        id: ns,
        died_at: died,
        container_ids: cids.iter().map(|s| (*s).to_owned()).collect(),
        addresses: addrs.iter().map(|a| ip(a)).collect(),
        paths: Vec::new(),
    }
}

fn bind(cid: &str, netns: NetnsName, seen: SystemTime) -> Binding {
    Binding { container_id: cid.into(), netns, source: BindingSource::CniExec, seen_at: seen }
}

fn op(cid: Option<&str>, command: &str, started: SystemTime, finished: Option<SystemTime>) -> CniOp {
    CniOp {
        container_id: cid.map(crate::ipam::SharedStr::from),
        container_id_truncated: false,
        command: command.into(),
        plugin: "/usr/lib/cni/bridge".into(),
        started_at: started,
        finished_at: finished,
        exit_code: finished.map(|_| 1),
    }
}

fn one(obs: &Observations, r: &Reservation) -> Verdict {
    decide_one(obs, r, now(), &Policy::default())
}

fn has(v: &Verdict, pred: impl Fn(&Fact) -> bool) -> bool {
    v.evidence.iter().any(|e| pred(&e.fact))
}

// ---- one test per verdict and per reason ----

#[test]
fn ip_configured_in_own_live_netns_is_in_use() {
    let r = res("c1", "10.0.0.2", t(0));
    let obs = Observations { live: vec![live(id(5, 1), &["c1"], &["10.0.0.2"], &[])], ..Default::default() };
    let v = one(&obs, &r);
    assert_eq!(v.status, Status::InUse);
    assert!(has(&v, |f| matches!(f, Fact::IpInOwnLiveNetns { .. })));
}

#[test]
fn container_bound_to_live_netns_is_in_use_by_id_and_by_path() {
    let r = res("c1", "10.0.0.2", t(0));
    let by_id = Observations {
        live: vec![live(id(5, 1), &[], &[], &[])],
        bindings: vec![bind("c1", NetnsName::Id(id(5, 1)), t(1))],
        ..Default::default()
    };
    assert_eq!(one(&by_id, &r).status, Status::InUse);
    // Runtimes say /var/run/netns, mountinfo says /run/netns.
    let by_path = Observations {
        live: vec![live(id(5, 1), &[], &[], &["/run/netns/cni-1"])],
        bindings: vec![bind("c1", NetnsName::Path("/var/run/netns/cni-1".into()), t(1))],
        ..Default::default()
    };
    let v = one(&by_path, &r);
    assert_eq!(v.status, Status::InUse);
    assert!(has(&v, |f| matches!(f, Fact::BoundToLiveNetns { .. })));
}

#[test]
fn cni_op_in_flight_is_pending_even_when_the_netns_died() {
    let r = res("c1", "10.0.0.2", t(0));
    let obs = Observations {
        dead: vec![dead(id(5, 1), t(100), &["c1"], &[])],
        cni_ops: vec![op(Some("c1"), "ADD", t(50), None)],
        ..Default::default()
    };
    let v = one(&obs, &r);
    assert_eq!(v.status, Status::Pending);
    assert!(has(&v, |f| matches!(f, Fact::CniOpInFlight { .. })));
    // A finished run is no reason to wait.
    let done = Observations { cni_ops: vec![op(Some("c1"), "ADD", t(50), Some(t(51)))], ..obs };
    assert_eq!(one(&done, &r).status, Status::Orphaned);
}

#[test]
fn an_in_flight_run_of_unknown_container_holds_everything() {
    let r = res("c1", "10.0.0.2", t(0));
    let obs = Observations {
        dead: vec![dead(id(5, 1), t(100), &["c1"], &[])],
        cni_ops: vec![op(None, "ADD", t(9_999), None)],
        ..Default::default()
    };
    assert_eq!(one(&obs, &r).status, Status::Pending);
}

#[test]
fn young_reservation_is_pending() {
    let r = res("c1", "10.0.0.2", now() - Duration::from_secs(5));
    let obs = Observations { dead: vec![dead(id(5, 1), now(), &["c1"], &[])], ..Default::default() };
    let v = one(&obs, &r);
    assert_eq!(v.status, Status::Pending);
    assert!(has(&v, |f| matches!(f, Fact::Young { .. })));
    // A clock step that puts the file in the future counts as brand new.
    assert_eq!(one(&obs, &res("c1", "10.0.0.2", now() + Duration::from_hours(1))).status, Status::Pending);
}

#[test]
fn young_reservation_whose_cni_runs_were_watched_needs_no_grace() {
    let r = res("c1", "10.0.0.2", now() - Duration::from_secs(5));
    let dead_ns = dead(id(5, 1), now(), &["c1"], &[]);
    let finished_add = op(Some("c1"), "ADD", now() - Duration::from_secs(6), Some(now() - Duration::from_secs(4)));
    let watched = Observations {
        dead: vec![dead_ns.clone()],
        cni_ops: vec![finished_add.clone()],
        watching_since: Some(now() - Duration::from_mins(1)),
        ..Default::default()
    };
    assert_eq!(one(&watched, &r).status, Status::Orphaned, "ADD seen and finished, netns dead");
    // Watching began after the run started: the run may have been missed.
    let late = Observations { watching_since: Some(now() - Duration::from_secs(1)), ..watched.clone() };
    assert_eq!(one(&late, &r).status, Status::Pending);
    // No run of this container was seen: the grace still applies.
    let other = Observations {
        cni_ops: vec![op(Some("c2"), "ADD", now() - Duration::from_secs(6), Some(now()))],
        ..watched.clone()
    };
    assert_eq!(one(&other, &r).status, Status::Pending);
    // An ADD still in flight keeps it whatever the watch says.
    let in_flight =
        Observations { cni_ops: vec![op(Some("c1"), "ADD", now() - Duration::from_secs(6), None)], ..watched };
    assert_eq!(one(&in_flight, &r).status, Status::Pending);
}

#[test]
fn runtime_and_api_only_add_reasons_to_keep() {
    let r = res("c1", "10.0.0.2", t(0));
    let base = Observations { dead: vec![dead(id(5, 1), t(100), &["c1"], &[])], ..Default::default() };
    assert_eq!(one(&base, &r).status, Status::Orphaned);
    let runtime = Observations { runtime_sandboxes: Some(vec!["c1".into()]), ..base.clone() };
    assert_eq!(one(&runtime, &r).status, Status::InUse);
    let api = Observations {
        api_pods: Some(vec![ApiPod {
            namespace: "ns".into(),
            name: "p".into(),
            ips: vec![ip("10.0.0.2")],
            pending: false,
            cni_containers: Vec::new(),
        }]),
        ..base.clone()
    };
    let v = one(&api, &r);
    assert_eq!(v.status, Status::InUse);
    assert!(v.summary().contains("pod ns/p"));
    let unrelated = Observations { runtime_sandboxes: Some(vec!["c9".into()]), api_pods: Some(vec![]), ..base };
    let v = one(&unrelated, &r);
    assert_eq!(v.status, Status::Orphaned);
    assert!(has(&v, |f| matches!(f, Fact::RuntimeDoesNotListSandbox)));
}

/// whereabouts #162: a Pending pod whose IP is not reported yet keeps every
/// reservation of a container whose CNI run named it, even one whose netns
/// was seen to die; a pod that is not Pending, or another container's, does not.
#[test]
fn a_pending_pod_named_by_a_cni_run_keeps_its_containers_reservations() {
    let r = res("c1", "10.0.0.2", t(0));
    let base = Observations { dead: vec![dead(id(5, 1), t(100), &["c1"], &[])], ..Default::default() };
    let pod = |pending: bool, containers: &[&str]| ApiPod {
        namespace: "ns".into(),
        name: "p".into(),
        ips: Vec::new(),
        pending,
        cni_containers: containers.iter().map(|c| (*c).to_owned()).collect(),
    };
    let with = |p: ApiPod| Observations { api_pods: Some(vec![p]), ..base.clone() };
    let v = one(&with(pod(true, &["c1"])), &r);
    assert_eq!(v.status, Status::InUse, "{}", v.summary());
    assert!(has(&v, |f| matches!(f, Fact::ApiPendingPodNamedByCniRun { name, .. } if name == "p")));
    assert_eq!(one(&with(pod(false, &["c1"])), &r).status, Status::Orphaned);
    assert_eq!(one(&with(pod(true, &["c2"])), &r).status, Status::Orphaned);
}

/// Sentences are rendered when read, not stored: the JSON still carries
/// each fact's `text` and the verdict's `summary`, exactly as the sentences
/// read, and reads back to the same verdict.
#[test]
fn one_pods_reservations_share_one_evidence_list() {
    // A pod on three networks: three reservations decided by the same facts
    // (they name the netns, not the IP) hold one list; a fourth with another
    // fact (its IP is in no netns) gets its own.
    let obs = Observations {
        live: vec![live(id(1, 1), &["c1"], &["10.0.0.2", "10.1.0.2", "10.2.0.2"], &["/run/netns/p1"])],
        ..Observations::default()
    };
    let rs: Vec<_> = ["10.0.0.2", "10.1.0.2", "10.2.0.2", "10.3.0.2"].iter().map(|a| res("c1", a, t(0))).collect();
    let v = decide(&obs, &rs, now(), &Policy::default());
    assert!(v.iter().all(|v| v.status == Status::InUse));
    assert!(std::sync::Arc::ptr_eq(&v[0].evidence, &v[1].evidence));
    assert!(std::sync::Arc::ptr_eq(&v[0].evidence, &v[2].evidence));
    assert!(!std::sync::Arc::ptr_eq(&v[0].evidence, &v[3].evidence));
    assert_ne!(v[0].evidence, v[3].evidence);
    let each: Vec<_> = rs.iter().map(|r| one(&obs, r)).collect();
    assert_eq!(v, each);
}

#[test]
fn verdict_json_carries_rendered_sentences_and_reads_back() {
    let r = res("c1", "10.0.0.2", now() - Duration::from_secs(40));
    let obs = Observations {
        live: vec![live(id(6, 2), &["c2"], &["10.0.0.3"], &["/run/netns/cni-2"])],
        dead: vec![dead(id(5, 1), now() - Duration::from_secs(1), &[], &[])],
        bindings: vec![bind("c1", NetnsName::Id(id(5, 1)), now() - Duration::from_secs(40))],
        ..Default::default()
    };
    let v = one(&obs, &r);
    let json = serde_json::to_value(&v).unwrap();
    assert_eq!(json["summary"], v.summary());
    assert!(v.summary().starts_with("net1 10.0.0.2 (c1 of host-local /var/lib/cni/networks): orphaned: its netns"));
    let texts: Vec<&str> = json["evidence"].as_array().unwrap().iter().map(|e| e["text"].as_str().unwrap()).collect();
    assert_eq!(texts, v.evidence_text());
    assert_eq!(json["evidence"][0]["fact"], "bound_netns_died");
    assert_eq!(json["evidence"][0]["via"]["binding"]["source"], "cni_exec");
    assert_eq!(json["reservation"]["container_id"], "c1");
    let back: Verdict = serde_json::from_value(json).unwrap();
    assert_eq!(back, v);
}

#[test]
fn bound_netns_seen_to_die_is_orphaned_without_waiting_for_the_orphan_grace() {
    let r = res("c1", "10.0.0.2", now() - Duration::from_secs(40));
    let obs = Observations {
        dead: vec![dead(id(5, 1), now() - Duration::from_secs(1), &[], &[])],
        bindings: vec![bind("c1", NetnsName::Id(id(5, 1)), now() - Duration::from_secs(40))],
        ..Default::default()
    };
    let v = one(&obs, &r);
    assert_eq!(v.status, Status::Orphaned, "{}", v.summary());
    assert!(has(&v, |f| matches!(f, Fact::BoundNetnsDied { .. })));
    assert!(has(&v, |f| matches!(f, Fact::IpInNoLiveNetns)));
}

#[test]
fn never_bound_waits_for_the_orphan_grace() {
    let young = res("c1", "10.0.0.2", now() - Duration::from_mins(1));
    let v = one(&Observations::default(), &young);
    assert_eq!(v.status, Status::Pending);
    assert!(has(&v, |f| matches!(f, Fact::AwaitingOrphanGrace { .. })));
    let old = res("c1", "10.0.0.2", now() - Duration::from_secs(601));
    let v = one(&Observations::default(), &old);
    assert_eq!(v.status, Status::Orphaned);
    assert!(has(&v, |f| matches!(f, Fact::NeverSeenBound { .. })));
}

#[test]
fn ip_in_another_containers_live_netns_while_owner_dead_is_a_conflict() {
    let r = res("c1", "10.0.0.2", t(0));
    let obs = Observations {
        live: vec![live(id(6, 2), &["c2"], &["10.0.0.2"], &[])],
        dead: vec![dead(id(5, 1), t(100), &["c1"], &[])],
        ..Default::default()
    };
    let v = one(&obs, &r);
    assert_eq!(v.status, Status::Conflict);
    assert!(has(&v, |f| matches!(f, Fact::IpInOtherLiveNetns { .. })));
    assert!(has(&v, |f| matches!(f, Fact::BoundNetnsDied { .. })));
    // Never bound and old, but the IP is in another container's netns: still a conflict.
    let never = Observations { dead: vec![], ..obs.clone() };
    assert_eq!(one(&never, &r).status, Status::Conflict);
    // Owner alive too: both are kept.
    let alive = Observations { runtime_sandboxes: Some(vec!["c1".into()]), ..obs };
    assert_eq!(one(&alive, &r).status, Status::InUse);
}

#[test]
fn ip_in_a_live_netns_of_unknown_containers() {
    let r = res("c1", "10.0.0.2", t(0));
    // Owner never seen bound: that netns may well be its own.
    let unknown = Observations { live: vec![live(id(6, 2), &[], &["10.0.0.2"], &[])], ..Default::default() };
    assert_eq!(one(&unknown, &r).status, Status::InUse);
    // Owner's own netns was seen to die: the IP now lives elsewhere.
    let died = Observations { dead: vec![dead(id(5, 1), t(100), &["c1"], &[])], ..unknown };
    assert_eq!(one(&died, &r).status, Status::Conflict);
}

#[test]
fn a_reused_inode_is_told_apart_by_nsid_and_time() {
    let r = res("c1", "10.0.0.2", t(0));
    // Bound to inode 5 / nsid 1, which died; inode 5 now belongs to nsid 2.
    let reused = Observations {
        live: vec![live(id(5, 2), &[], &[], &[])],
        dead: vec![dead(id(5, 1), t(100), &[], &[])],
        bindings: vec![bind("c1", NetnsName::Id(id(5, 1)), t(10))],
        ..Default::default()
    };
    assert_eq!(one(&reused, &r).status, Status::Orphaned);
    // Without an nsid the binding may be the live one: keep.
    let ambiguous = Observations {
        bindings: vec![bind("c1", NetnsName::Id(NetnsId::new(Some(5), None, None)), t(10))],
        ..reused.clone()
    };
    assert_eq!(one(&ambiguous, &r).status, Status::InUse);
    // A binding seen after that death cannot be about the dead netns.
    let later = Observations {
        live: vec![],
        bindings: vec![bind("c1", NetnsName::Id(id(5, 1)), now() - Duration::from_mins(1))],
        ..reused
    };
    let v = one(&later, &r);
    assert_eq!(v.status, Status::Pending, "{}", v.summary());
    assert!(has(&v, |f| matches!(f, Fact::UnresolvedBinding { .. })));
}

#[test]
fn a_netns_that_died_before_the_reservation_is_not_its_death() {
    let r = res("c1", "10.0.0.2", now() - Duration::from_mins(2));
    let obs =
        Observations { dead: vec![dead(id(5, 1), now() - Duration::from_mins(5), &["c1"], &[])], ..Default::default() };
    let v = one(&obs, &r);
    assert_eq!(v.status, Status::Pending, "{}", v.summary());
    assert!(has(&v, |f| matches!(f, Fact::BoundNetnsDiedBeforeReservation { .. })));
    // Within the clock slack the order of the two clocks is not trusted.
    let close =
        Observations { dead: vec![dead(id(5, 1), r.created_at - Duration::from_millis(500), &["c1"], &[])], ..obs };
    assert_eq!(one(&close, &r).status, Status::Orphaned);
    // Past the orphan grace it is a leak all the same.
    let old = res("c1", "10.0.0.2", now() - Duration::from_mins(11));
    let older = Observations {
        dead: vec![dead(id(5, 1), now() - Duration::from_mins(12), &["c1"], &[])],
        ..Default::default()
    };
    assert_eq!(one(&older, &old).status, Status::Orphaned);
}

#[test]
fn a_dead_netns_that_held_the_ip_counts_only_when_it_can_be_the_owners() {
    let r = res("c1", "10.0.0.2", t(100));
    let held = Observations { dead: vec![dead(id(5, 1), t(200), &[], &["10.0.0.2"])], ..Default::default() };
    let v = one(&held, &r);
    assert_eq!(v.status, Status::Orphaned);
    assert!(has(&v, |f| matches!(f, Fact::BoundNetnsDied { via: BoundBy::Address, .. })));
    // Died before the reservation was made: a previous holder of the IP.
    let before = Observations { dead: vec![dead(id(5, 1), t(50), &[], &["10.0.0.2"])], ..Default::default() };
    let r_recent = res("c1", "10.0.0.2", now() - Duration::from_mins(1));
    let before_recent =
        Observations { dead: vec![dead(id(5, 1), now() - Duration::from_secs(90), &[], &["10.0.0.2"])], ..before };
    assert_eq!(one(&before_recent, &r_recent).status, Status::Pending);
    // Another container's netns.
    let others = Observations { dead: vec![dead(id(5, 1), now(), &["c2"], &["10.0.0.2"])], ..Default::default() };
    assert_eq!(one(&others, &r_recent).status, Status::Pending);
}

#[test]
fn verdicts_serialize_with_readable_reasons_and_round_trip() {
    let r = res("c1", "10.0.0.2", t(0));
    let obs = Observations { dead: vec![dead(id(5, 1), t(100), &["c1"], &[])], ..Default::default() };
    let v = one(&obs, &r);
    let json = serde_json::to_value(&v).unwrap();
    assert_eq!(json["status"], "orphaned");
    assert_eq!(json["evidence"][0]["fact"], "bound_netns_died");
    assert!(json["evidence"][0]["text"].as_str().unwrap().contains("died at"));
    let back: Verdict = serde_json::from_value(json).unwrap();
    assert_eq!(back, v);
}

#[test]
fn report_totals_per_network() {
    let mut r2 = res("c2", "10.0.0.3", t(0));
    r2.network = "net2".into();
    let scan = StoreScan {
        reservations: vec![res("c1", "10.0.0.2", t(0)), r2, res("c3", "10.0.0.4", t(0))],
        anomalies: vec![],
    };
    let obs = Observations {
        dead: vec![dead(id(5, 1), t(100), &["c1", "c2"], &[])],
        live: vec![live(id(6, 1), &["c3"], &[], &[])],
        ..Default::default()
    };
    let report = ScanReport::build(&scan, &obs, now(), &Policy::default());
    let net1 = report.totals.iter().find(|t| t.network == "net1").unwrap();
    assert_eq!((net1.reservations, net1.orphaned, net1.in_use), (2, 1, 1));
    let net2 = report.totals.iter().find(|t| t.network == "net2").unwrap();
    assert_eq!((net2.reservations, net2.orphaned), (1, 1));
    assert_eq!(report.orphaned().count(), 2);
    let back: ScanReport = serde_json::from_str(&serde_json::to_string(&report).unwrap()).unwrap();
    assert_eq!(back, report);
    assert!(report.to_string().contains("net1: 2 reservations: 1 in use, 0 pending, 1 orphaned"));
}

// ---- properties ----

fn alphabet() -> Alphabet {
    Alphabet {
        cids: &["c0", "c1", "c2"],
        ips: &["10.0.0.1", "10.0.0.2", "fd00::1"],
        paths: &["/run/netns/a", "/var/run/netns/a", "/run/netns/b", "/proc/9/ns/net"],
        // Times around "now", some in the future.
        times: (0..NOW_SECS + 100).prop_map(t).boxed(),
        netns_ids: (1u64..4, prop::option::of(0i32..2))
            .prop_map(|(inode, nsid)| NetnsId::new(Some(inode), nsid, None))
            .boxed(),
        sources: &[BindingSource::CniExec, BindingSource::CniCache, BindingSource::Runtime],
        most: 3,
    }
}
fn a_cid() -> impl Strategy<Value = String> {
    alphabet().cid()
}
fn an_ip() -> impl Strategy<Value = IpAddr> {
    alphabet().ip()
}
fn a_path() -> impl Strategy<Value = PathBuf> {
    alphabet().path()
}
fn a_time() -> impl Strategy<Value = SystemTime> {
    alphabet().time()
}
fn a_netns_ref() -> impl Strategy<Value = NetnsName> {
    alphabet().netns_name()
}
fn a_live() -> impl Strategy<Value = LiveNetns> {
    alphabet().live()
}
fn an_op() -> impl Strategy<Value = CniOp> {
    (prop::option::of(a_cid()), any::<bool>(), a_time(), prop::option::of(a_time()), prop::option::of(-1i32..3))
        .prop_map(|(container_id, container_id_truncated, started_at, finished_at, exit_code)| CniOp {
            container_id: container_id.map(crate::ipam::SharedStr::from),
            container_id_truncated,
            command: "ADD".into(),
            plugin: "bridge".into(),
            started_at,
            finished_at,
            exit_code,
        })
}
fn a_pod() -> impl Strategy<Value = ApiPod> {
    prop::collection::vec(an_ip(), 0..2).prop_map(|ips| ApiPod {
        namespace: "ns".into(),
        name: "p".into(),
        ips,
        pending: false,
        cni_containers: Vec::new(),
    })
}
fn observations() -> impl Strategy<Value = Observations> {
    (
        prop::collection::vec(a_live(), 0..3),
        prop::collection::vec(alphabet().dead(), 0..4),
        prop::collection::vec(alphabet().binding(), 0..4),
        prop::collection::vec(an_op(), 0..3),
        prop::option::of(prop::collection::vec(a_cid(), 0..2)),
        prop::option::of(prop::collection::vec(a_pod(), 0..2)),
        prop::option::of(a_time()),
        prop::collection::vec((a_time(), a_time()), 0..2),
    )
        .prop_map(
            |(live, dead, bindings, cni_ops, runtime_sandboxes, api_pods, watching_since, watched_before)| {
                Observations {
                    live,
                    dead,
                    bindings,
                    cni_ops,
                    runtime_sandboxes,
                    runtime: None,
                    api_pods,
                    watching_since,
                    watched_before,
                }
            },
        )
}
fn a_reservation() -> impl Strategy<Value = Reservation> {
    (a_cid(), an_ip(), a_time()).prop_map(|(cid, ip, created)| {
        let mut r = res(&cid, "10.0.0.1", created);
        r.ip = ip;
        r
    })
}
fn a_policy() -> impl Strategy<Value = Policy> {
    (0u64..120, 0u64..12_000)
        .prop_map(|(f, o)| Policy { in_flight_grace: Duration::from_secs(f), orphan_grace: Duration::from_secs(o) })
}

/// The facts the invariants speak of, computed independently of the engine
/// (exact matches only: the engine may match more, never less).
fn ip_in_live_netns(obs: &Observations, r: &Reservation) -> bool {
    obs.live.iter().any(|n| n.addresses.contains(&r.ip))
}
fn op_in_flight(obs: &Observations, r: &Reservation) -> bool {
    obs.cni_ops.iter().any(|op| op.finished_at.is_none() && op.container_id.as_deref() == Some(r.container_id.as_str()))
}
fn bound_netns_alive(obs: &Observations, r: &Reservation) -> bool {
    let by_model = obs.live.iter().any(|n| n.container_ids.iter().any(|c| *c == r.container_id));
    let by_binding = obs.bindings.iter().filter(|b| b.container_id == r.container_id).any(|b| {
        obs.live.iter().any(|n| match &b.netns {
            NetnsName::Id(id) => n.id == *id,
            NetnsName::Path(p) => n.paths.contains(p),
        })
    });
    by_model || by_binding
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn live_evidence_is_never_orphaned(obs in observations(), r in a_reservation(), policy in a_policy()) {
        let v = decide_one(&obs, &r, now(), &policy);
        if ip_in_live_netns(&obs, &r) {
            prop_assert_ne!(v.status, Status::Orphaned, "IP configured in a live netns: {}", v.summary());
        }
        if op_in_flight(&obs, &r) {
            prop_assert_ne!(v.status, Status::Orphaned, "CNI op in flight: {}", v.summary());
        }
        if bound_netns_alive(&obs, &r) {
            prop_assert_ne!(v.status, Status::Orphaned, "bound netns alive: {}", v.summary());
            prop_assert_eq!(v.status, Status::InUse, "bound netns alive: {}", v.summary());
        }
        if obs.runtime_sandboxes.as_ref().is_some_and(|s| s.iter().any(|c| *c == r.container_id)) {
            prop_assert_eq!(v.status, Status::InUse);
        }
        let watched = obs.watching_since.is_some_and(|since| {
            obs.cni_ops.iter().any(|op| {
                op.container_id.as_deref() == Some(r.container_id.as_str())
                    && op.started_at >= since
                    && op.started_at <= r.created_at + super::decide::WATCH_SLACK
            })
        });
        if !watched && now().duration_since(r.created_at).map_or(true, |age| age < policy.in_flight_grace) {
            prop_assert_ne!(v.status, Status::Orphaned, "young and not watched: {}", v.summary());
        }
    }

    #[test]
    fn orphaned_always_names_a_death_or_an_expired_grace(obs in observations(), r in a_reservation(), policy in a_policy()) {
        let v = decide_one(&obs, &r, now(), &policy);
        if v.status == Status::Orphaned {
            let death = has(&v, |f| matches!(
                f,
                Fact::BoundNetnsDied { .. } | Fact::NeverSeenBound { .. } | Fact::NoLiveBindingPastGrace { .. }
            ));
            prop_assert!(death, "orphaned without a death or grace: {}", v.summary());
            let no_ip = has(&v, |f| matches!(f, Fact::IpInNoLiveNetns));
            prop_assert!(no_ip, "orphaned without IpInNoLiveNetns: {}", v.summary());
        }
        prop_assert!(!v.evidence.is_empty());
    }

    #[test]
    fn optional_sources_only_add_reasons_to_keep(obs in observations(), r in a_reservation(), policy in a_policy()) {
        let with = decide_one(&obs, &r, now(), &policy);
        let without = Observations { runtime_sandboxes: None, api_pods: None, ..obs.clone() };
        let without = decide_one(&without, &r, now(), &policy);
        if with.status == Status::Orphaned {
            prop_assert_eq!(without.status, Status::Orphaned);
        }
    }

    #[test]
    fn adding_a_live_netns_never_creates_an_orphan(
        obs in observations(), r in a_reservation(), policy in a_policy(), extra in a_live()
    ) {
        let before = decide_one(&obs, &r, now(), &policy);
        let mut more = obs.clone();
        more.live.push(extra);
        let after = decide_one(&more, &r, now(), &policy);
        if after.status == Status::Orphaned {
            prop_assert_eq!(before.status, Status::Orphaned);
        }
    }

    #[test]
    fn decide_is_a_pure_map(obs in observations(), rs in prop::collection::vec(a_reservation(), 0..4), policy in a_policy()) {
        let all = decide(&obs, &rs, now(), &policy);
        let each: Vec<_> = rs.iter().map(|r| decide_one(&obs, r, now(), &policy)).collect();
        prop_assert_eq!(&all, &each);
        prop_assert_eq!(all, decide(&obs, &rs, now(), &policy));
    }
}

// The index must find exactly what a linear search over the observations
// finds, first match and order included.
proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn index_lookups_equal_linear_search(
        obs in observations(),
        netns in a_netns_ref(),
        seen_at in a_time(),
        cid in a_cid(),
        addr in an_ip(),
    ) {
        use super::{index::Index, observations::same_netns_path};
        // Built on one thread or on two (the addresses' table on a helper).
        for ix in [Index::new(&obs), Index::build(&obs, true)] {
            let live_linear = obs.live.iter().find(|n| match &netns {
                NetnsName::Id(id) => n.id.may_be(id),
                NetnsName::Path(p) => n.paths.iter().any(|q| same_netns_path(p, q)),
            });
            prop_assert_eq!(ix.live_matching(&netns), live_linear);
            let dead_linear = obs.dead.iter().find(|d| {
                seen_at <= d.died_at
                    && match &netns {
                        NetnsName::Id(id) => d.id.may_be(id),
                        NetnsName::Path(p) => d.paths.iter().any(|q| same_netns_path(p, q)),
                    }
            });
            prop_assert_eq!(ix.dead_matching(&netns, seen_at), dead_linear);
            let ops_linear: Vec<_> = obs.cni_ops.iter().filter(|op| op.may_concern(&cid)).collect();
            prop_assert_eq!(ix.ops_concerning(&cid), ops_linear);
            let holding: Vec<_> = obs.live.iter().filter(|n| n.addresses.contains(&addr)).collect();
            prop_assert_eq!(ix.live_holding(addr).collect::<Vec<_>>(), holding);
            let dead_linear: Vec<_> = obs
                .dead
                .iter()
                .filter(|d| d.container_ids.contains(&cid) || (d.container_ids.is_empty() && d.addresses.contains(&addr)))
                .collect();
            let dead_indexed: Vec<_> = ix.dead_of_container_or_ip(&cid, addr).into_iter().map(|(d, _)| d).collect();
            prop_assert_eq!(dead_indexed, dead_linear);
            // Where each binding's netns stands is found once, at build time:
            // exactly what matching it then would find.
            for c in obs.bindings.iter().map(|b| &b.container_id) {
                for (b, name, link) in ix.bindings_of_shared(c) {
                    prop_assert_eq!(&*name, &b.netns);
                    let (live, dead) = (ix.live_matching(&b.netns), ix.dead_matching(&b.netns, b.seen_at));
                    match link {
                        super::index::BindingLink::Live(n) => prop_assert!(live.is_some_and(|l| std::ptr::eq(l, n))),
                        super::index::BindingLink::Dead(d) => {
                            prop_assert!(live.is_none() && dead.is_some_and(|x| std::ptr::eq(x, d)));
                        }
                        super::index::BindingLink::Unresolved => prop_assert!(live.is_none() && dead.is_none()),
                    }
                }
            }
        }
    }

    #[test]
    fn path_keys_agree_with_same_netns_path(a in a_path(), b in a_path()) {
        use super::{index::path_key, observations::same_netns_path};
        prop_assert_eq!(path_key(&a) == path_key(&b), same_netns_path(&a, &b));
    }
}

// Many reservations are judged on two threads: the verdicts, their order
// included, must be what judging each alone gives.
proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn a_large_decision_on_two_threads_equals_one_by_one(
        obs in observations(),
        few in prop::collection::vec(a_reservation(), 1..6),
        policy in a_policy(),
    ) {
        let rs: Vec<_> = few.iter().cycle().take(super::decide::PARALLEL_DECIDE_MIN + 7).cloned().collect();
        let all = decide(&obs, &rs, now(), &policy);
        prop_assert_eq!(all.len(), rs.len());
        let each: Vec<_> = few.iter().map(|r| decide_one(&obs, r, now(), &policy)).collect();
        for (i, v) in all.iter().enumerate() {
            prop_assert_eq!(v, &each[i % few.len()]);
        }
    }
}

/// Observations whose API pods may be Pending and named by CNI runs of
/// the generated containers (what a container's pending-pod facts read),
/// with more runs and bindings than `observations` gives: several per container.
fn observations_with_pending_pods() -> impl Strategy<Value = Observations> {
    (
        observations(),
        prop::collection::vec((any::<bool>(), prop::collection::vec(a_cid(), 0..2)), 2),
        prop::collection::vec(an_op(), 0..6),
        prop::collection::vec(alphabet().binding(), 0..4),
    )
        .prop_map(|(mut obs, named, ops, bindings)| {
            for (pod, (pending, cids)) in obs.api_pods.iter_mut().flatten().zip(named) {
                pod.pending = pending;
                pod.cni_containers = cids;
            }
            obs.cni_ops.extend(ops);
            obs.bindings.extend(bindings);
            obs
        })
}

/// A reservation made within the in-flight graces `a_policy` gives (where
/// the watched runs decide).
fn a_young_reservation() -> impl Strategy<Value = Reservation> {
    (a_reservation(), NOW_SECS - 130..NOW_SECS + 5).prop_map(|(mut r, at)| {
        r.created_at = t(at);
        r
    })
}

// What depends on a container alone is looked up once per container:
// every verdict, its evidence in order included, must be what judging
// each reservation with all its own lookups gave (`reference`).
proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn judging_per_container_equals_judging_each_reservation_alone(
        obs in observations_with_pending_pods(),
        rs in prop::collection::vec(prop_oneof![a_reservation(), a_young_reservation()], 1..8),
        policy in a_policy(),
    ) {
        let all = decide(&obs, &rs, now(), &policy);
        // The same reservations on two threads (each container judged on
        // the thread its ID hashes to), whatever their number.
        let on_two = super::decide::decide_on(&obs, &rs, now(), &policy, true);
        prop_assert_eq!(on_two.len(), rs.len());
        for ((r, v), v2) in rs.iter().zip(&all).zip(&on_two) {
            let expected = super::reference::decide_one(&obs, r, now(), &policy);
            prop_assert_eq!(v, &expected);
            prop_assert_eq!(v2, &expected);
            prop_assert_eq!(&decide_one(&obs, r, now(), &policy), &expected);
        }
    }
}
