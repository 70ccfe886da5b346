use std::{collections::HashMap, time::Duration};

use proptest::prelude::*;

use super::*;
use crate::engine::{
    Binding, BindingSource, CniOp, Fact, Observations, Policy, Status, decide,
    fixtures::{Alphabet, now, res, t},
};

// Small alphabets, so containers, IPs, netns and paths meet often.
fn alphabet() -> Alphabet {
    Alphabet {
        cids: &["c1", "c2", "c3", "c4"],
        ips: &["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"],
        paths: &["/run/netns/a", "/var/run/netns/a", "/run/netns/b", "/run/netns/c"],
        times: a_time().boxed(),
        netns_ids: (prop::option::of(1u64..4), prop::option::of(1i32..3), prop::option::of(a_time()))
            .prop_map(|(inode, nsid, seen)| NetnsId::new(inode, nsid, seen))
            .boxed(),
        sources: &[BindingSource::CniExec, BindingSource::CniCache],
        most: 2,
    }
}
fn a_cid() -> impl Strategy<Value = String> {
    alphabet().cid()
}
fn a_time() -> impl Strategy<Value = SystemTime> {
    prop::sample::select(vec![0u64, 100, 5_000, 9_000, 9_990, 10_000]).prop_map(t)
}
fn an_op() -> impl Strategy<Value = CniOp> {
    (prop::option::of(a_cid()), a_time(), prop::option::of(a_time())).prop_map(
        |(container_id, started_at, finished_at)| CniOp {
            container_id: container_id.map(SharedStr::from),
            container_id_truncated: false,
            command: "ADD".into(),
            plugin: "bridge".into(),
            started_at,
            finished_at,
            exit_code: finished_at.map(|_| 0),
        },
    )
}
fn observations() -> impl Strategy<Value = Observations> {
    (
        prop::collection::vec(alphabet().live(), 0..3),
        prop::collection::vec(alphabet().dead(), 1..4),
        prop::collection::vec(alphabet().binding(), 0..5),
        prop::collection::vec(an_op(), 0..2),
        prop::option::of(a_time()),
    )
        .prop_map(|(live, mut dead, bindings, cni_ops, watching_since)| {
            // One entry per incarnation (evidence names a dead netns by id).
            let mut seen = Vec::new();
            dead.retain(|d| {
                let new = !seen.contains(&d.id);
                seen.push(d.id);
                new
            });
            Observations { live, dead, bindings, cni_ops, watching_since, ..Observations::default() }
        })
}
/// Reservations with distinct files (one per IP, as host-local has it).
fn reservations() -> impl Strategy<Value = Vec<Reservation>> {
    prop::collection::vec((alphabet().ip(), a_cid(), a_time()), 0..6).prop_map(|rs| {
        let mut by_ip = HashMap::new();
        for (ip, cid, created) in rs {
            by_ip.entry(ip).or_insert_with(|| res(&cid, &ip.to_string(), created));
        }
        by_ip.into_values().collect()
    })
}
fn a_policy() -> impl Strategy<Value = Policy> {
    prop::sample::select(vec![0u64, 30, 600, 20_000])
        .prop_map(|g| Policy { in_flight_grace: Duration::from_secs(g.min(30)), orphan_grace: Duration::from_secs(g) })
}

/// The key the daemon builds from the model's death report, for one of
/// the observations' dead netns.
fn key_of(d: &DeadNetns) -> DeathKey {
    DeathKey { id: d.id, paths: d.paths.clone(), addresses: d.addresses.clone() }
}

/// Whether a verdict's evidence ties it to this dead netns.
fn names_death(v: &crate::engine::Verdict, d: &DeadNetns) -> bool {
    v.evidence.iter().any(|e| match &e.fact {
        Fact::BoundNetnsDied { netns, .. } | Fact::BoundNetnsDiedBeforeReservation { netns, .. } => *netns == d.id,
        _ => false,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Safety: for every reservation the death path judges, its verdict is
    /// the one the full reconcile reaches on the same observations.
    /// Completeness (not safety: a miss waits for the full pass): every
    /// reservation the full verdict ties to the dead netns is judged.
    #[test]
    fn a_targeted_verdict_is_the_full_verdict(
        obs in observations(),
        all in reservations(),
        which in 0usize..4,
        policy in a_policy(),
    ) {
        let now = now();
        let dead = &obs.dead[which % obs.dead.len()];
        let known = Known::new(&all, t(0));
        let (containers, ips) = concerned_keys(&obs, &[key_of(dead)]);
        let judged = candidates(&known, &containers, &ips);
        let full: HashMap<PathBuf, crate::engine::Verdict> =
            decide(&obs, &all, now, &policy).into_iter().map(|v| (v.reservation.path.clone(), v)).collect();
        let targeted = decide(&obs, &judged, now, &policy);
        for v in &targeted {
            prop_assert_eq!(Some(v), full.get(&v.reservation.path), "{}", v.summary());
        }
        let judged_paths: HashSet<&PathBuf> = judged.iter().map(|r| &r.path).collect();
        for (path, v) in &full {
            let tied = names_death(v, dead);
            prop_assert!(!tied || judged_paths.contains(path), "missed {}", v.summary());
            if v.status == Status::Orphaned && v.evidence.iter().any(|e| matches!(e.fact, Fact::BoundNetnsDied { .. })) {
                // Orphaned by some death: if it is this one, it was judged.
                prop_assert!(!tied || judged_paths.contains(path));
            }
        }
        // Every other reservation of a judged container is judged too (a
        // release batch reads what an attachment still holds from them).
        for r in &all {
            if judged.iter().any(|j| j.container_id == r.container_id) {
                prop_assert!(judged_paths.contains(&r.path));
            }
        }
    }
}

/// The death path's case: a container bound (by the ledger) to the netns
/// that died, with another container's reservation beside it.
#[test]
fn a_death_concerns_its_containers_and_addresses_only() {
    let died = NetnsId::new(Some(7), Some(1), Some(t(1)));
    let obs = Observations {
        dead: vec![DeadNetns {
            id: died,
            died_at: t(9_000),
            container_ids: Vec::new(),
            addresses: vec![IpAddr::from([10, 0, 0, 9])],
            paths: Vec::new(),
        }],
        bindings: vec![Binding {
            container_id: "c1".into(),
            netns: NetnsName::Id(died),
            source: BindingSource::CniExec,
            seen_at: t(10),
        }],
        ..Observations::default()
    };
    let c1 = res("c1", "10.0.0.2", t(10));
    let c2 = res("c2", "10.0.0.3", t(10));
    let by_ip = res("c3", "10.0.0.9", t(10));
    let known = Known::new(&[c1.clone(), c2, by_ip.clone()], t(20));
    let key = DeathKey { id: died, paths: Vec::new(), addresses: Vec::new() };
    let (containers, ips) = concerned_keys(&obs, &[key]);
    let judged = candidates(&known, &containers, &ips);
    assert_eq!(judged, vec![c1, by_ip]);
    let v = decide(&obs, &judged, now(), &Policy::default());
    assert_eq!(v[0].status, Status::Orphaned, "{}", v[0].summary());
}

/// A CNI run of a concerned container since the last full pass: its newest
/// reservation may be missing from what that pass found.
#[test]
fn a_run_since_the_last_full_pass_asks_for_the_whole_store() {
    let op = |started: u64, finished: Option<u64>, cid: Option<&str>| CniOp {
        container_id: cid.map(SharedStr::from),
        container_id_truncated: false,
        command: "ADD".into(),
        plugin: "bridge".into(),
        started_at: t(started),
        finished_at: finished.map(t),
        exit_code: finished.map(|_| 0),
    };
    let known = Known::new(&[], t(100));
    assert!(!may_have_missed(&[op(10, Some(20), Some("c1"))], &known, &["c1"]));
    assert!(may_have_missed(&[op(10, Some(150), Some("c1"))], &known, &["c1"]));
    assert!(may_have_missed(&[op(10, None, Some("c1"))], &known, &["c1"]));
    assert!(!may_have_missed(&[op(150, None, Some("c2"))], &known, &["c1"]));
    assert!(may_have_missed(&[op(150, None, None)], &known, &["c1"]), "an unnamed run may be c1's");
    assert!(may_have_missed(&[], &Known::default(), &["c1"]), "no full pass yet");
    // The pod's DEL just before its netns went writes no reservation; a
    // command it cannot be sure of may.
    let with_command = |command: &str| {
        let mut run = op(150, Some(160), Some("c1"));
        run.command = command.into();
        vec![run]
    };
    for command in ["DEL", "CHECK", "GC", "VERSION", "STATUS"] {
        assert!(!may_have_missed(&with_command(command), &known, &["c1"]), "{command}");
    }
    for command in ["ADD", "", "del", "ADDX"] {
        assert!(may_have_missed(&with_command(command), &known, &["c1"]), "{command:?}");
    }
}

/// Re-reading takes each file as it is now: gone files drop out, a new
/// owner or a new inode shows.
#[test]
fn reread_takes_the_files_as_they_are_now() {
    let tmp = tempfile::tempdir().unwrap();
    let net = tmp.path().join("net1");
    std::fs::create_dir(&net).unwrap();
    let file = |ip: &str, cid: &str| {
        let mut r = res(cid, ip, t(0));
        r.path = net.join(ip);
        r
    };
    std::fs::write(net.join("10.0.0.2"), "c1\r\neth0").unwrap();
    std::fs::write(net.join("10.0.0.3"), "c9\r\neth1").unwrap();
    let read = reread(&[file("10.0.0.2", "c1"), file("10.0.0.3", "c2"), file("10.0.0.4", "c3")]);
    assert_eq!(read.len(), 2, "10.0.0.4 is gone");
    assert_eq!(read[0].container_id.as_str(), "c1");
    assert_ne!(read[0].created_at, t(0));
    assert_eq!((read[1].container_id.as_str(), read[1].ifname.as_deref()), ("c9", Some("eth1")));
}
