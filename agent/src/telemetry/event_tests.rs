//! docs/events.md and [`Event`] say the same: every variant documented,
//! every documented event a variant, the same field names.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, SystemTime},
};

use serde_json::Value;

use super::*;
use crate::{
    engine::{Fact, PodRef, Status, Verdict},
    ipam::{Anomaly, AnomalyKind, Reservation, StoreRef},
    kernel::events::{CniValue, EnvScanVariant},
    model::snapshot::AddressView,
};

const DOC: &str = include_str!("../../../docs/events.md");

fn task() -> Task {
    Task { ktime_ns: 1, pid: 2, tgid: 2, comm: "host-local".into(), cgroup_id: 3 }
}

fn value(s: &str) -> CniValue {
    CniValue { value: s.into(), truncated: false }
}

fn exec() -> CniExec {
    CniExec {
        binary: value("/opt/cni/bin/host-local"),
        command: value("ADD"),
        container_id: Some(value("c1")),
        netns: Some(value("/run/netns/cni-1")),
        ifname: Some(value("eth0")),
        cni_args: None,
        env_scan_limited: false,
        env_scanned: 30,
        uid: 0,
        scan_variant: EnvScanVariant::BpfLoop,
        nested_in: None,
    }
}

fn reservation() -> Reservation {
    crate::ipam::ReservationData {
        store: StoreRef::HostLocal { data_dir: "/var/lib/cni/networks".into() }.into(),
        network: "podnet".into(),
        ip: "10.1.0.2".parse().expect("an IP"),
        container_id: "c1".into(),
        ifname: Some("eth0".into()),
        created_at: SystemTime::UNIX_EPOCH,
        path: "/var/lib/cni/networks/podnet/10.1.0.2".into(),
        inode: 7,
    }
    .into()
}

fn conflict_verdict() -> Verdict {
    let holder = Fact::IpInOtherLiveNetns {
        netns: crate::identity::NetnsId::new(Some(9), Some(1), None),
        containers: vec!["c2".to_owned()].into(),
        paths: Vec::new().into(),
    };
    Verdict::new(&reservation(), Status::Conflict, vec![holder])
}

fn pod() -> PodRef {
    PodRef { namespace: "ns".into(), name: "web".into(), uid: "u1".into() }
}

fn death() -> NetnsDeath {
    NetnsDeath {
        inode: Some(4_026_532_901),
        nsid: Some(3),
        at: SystemTime::UNIX_EPOCH,
        source: DeathSource::RtmDelnsid,
        addresses: vec![AddressView {
            ip: "10.1.0.2".parse().expect("an IP"),
            prefix_len: 24,
            ifindex: 2,
            ifname: Some("eth0".into()),
            scope: crate::model::snapshot::AddrScope::Global,
        }],
        bind_mounts: vec!["/run/netns/cni-1".into()],
        first_seen: SystemTime::UNIX_EPOCH,
        creator: Some(Creator {
            pid: 1,
            tid: 1,
            comm: "runc".into(),
            cgroup_id: 3,
            via: NetnsVia::Unshare,
            at: SystemTime::UNIX_EPOCH,
        }),
    }
}

/// The index of each variant: adding a variant fails to compile here until
/// it gets an index, and the test fails until it gets a sample.
const VARIANTS: usize = 16;
fn variant_index(e: &Event<'_>) -> usize {
    match e {
        Event::NetnsEntered { .. } => 0,
        Event::NetnsCreated { .. } => 1,
        Event::NetnsFreed { .. } => 2,
        Event::CniExec { .. } => 3,
        Event::CniExecAnomaly { .. } => 4,
        Event::CniExit { .. } => 5,
        Event::MalformedRecord { .. } => 6,
        Event::RecordsDropped { .. } => 7,
        Event::NetnsDied(_) => 8,
        Event::VerdictChanged(_) => 9,
        Event::Release(_) => 10,
        Event::Conflict(_) => 11,
        Event::Anomaly(_) => 12,
        Event::SourceChanged { .. } => 13,
        Event::SandboxStuck(_) => 14,
        Event::SandboxUnstuck(_) => 15,
    }
}

/// Serialized samples of every variant, with every optional field present
/// in at least one of them.
fn samples() -> Vec<Value> {
    let (task, exec, exit) = (task(), exec(), CniExit { exit_code: Some(0), signal: None });
    let not_root = CniRunAnomaly::NotRoot { binary: "/tmp/x".into(), uid: 1000 };
    let (conflict, pod) = (conflict_verdict(), pod());
    let death = death();
    let ids = vec!["c1".to_owned()];
    let dead = crate::engine::observations::DeadNetns { container_ids: ids.clone(), ..Default::default() };
    let failed = ReleaseRecord {
        intent_id: Some("i1".into()),
        dry_run: false,
        verdict: conflict.clone(),
        outcome: Outcome::Failed { error: "boom".into() },
        reverified: None,
    };
    let anomaly = Anomaly {
        store: StoreRef::clone(&reservation().store),
        network: Some("podnet".into()),
        path: "/x".into(),
        kind: AnomalyKind::Symlink,
        detail: "a symlink".into(),
    };
    let stuck = StuckSandbox {
        id: "c1".into(),
        pod: Some(pod.clone()),
        netns: Some("/run/netns/cni-1".into()),
        live: Some(crate::identity::NetnsId::new(Some(9), None, None)),
        netns_closed: Some(false),
    };
    let events = [
        Event::NetnsEntered { task: &task, netns_inode: 1, previous_netns_inode: 2, via: NetnsVia::Unshare },
        Event::NetnsCreated { task: &task, netns_inode: 1, via: NetnsVia::CopyNetNs },
        Event::NetnsFreed { task: &task, netns_inode: 1 },
        Event::CniExec { task: &task, exec: &exec },
        Event::CniExecAnomaly {
            pid: 1,
            comm: "x",
            anomaly: &not_root,
            command: "ADD",
            container_id: Some("c1"),
            uid: 1000,
        },
        Event::CniExit { task: &task, exit: &exit },
        Event::MalformedRecord { error: "short".into() },
        Event::RecordsDropped { dropped: 1 },
        Event::NetnsDied(NetnsDied::seen(&death, &ids)),
        Event::NetnsDied(NetnsDied::while_down(&dead, true)),
        Event::VerdictChanged(VerdictChanged::new(&conflict, Some(Status::Pending), Some(&pod))),
        Event::Release(Release::new(&failed, ReleaseReason::NetnsDied, Some(Duration::from_millis(3)), Some(&pod))),
        Event::Conflict(Conflict::verdict(&conflict, Some(&pod))),
        Event::Conflict(Conflict::last_look(&conflict, "10.1.0.2 in netns 9")),
        Event::Anomaly(&anomaly),
        Event::SourceChanged { source: "cri", active: true, detail: "containerd" },
        Event::SandboxStuck((&stuck).into()),
        Event::SandboxUnstuck((&stuck).into()),
    ];
    let mut hit = [false; VARIANTS];
    for e in &events {
        hit[variant_index(e)] = true;
    }
    assert!(hit.iter().all(|h| *h), "every variant needs a sample: {hit:?}");
    events.iter().map(|e| serde_json::to_value(e).expect("serializes")).collect()
}

/// `### \`name\`` sections of the doc, each with the field paths of its
/// table (`exec.binary` stays dotted).
fn documented() -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in DOC.lines() {
        if let Some(rest) = line.strip_prefix("### ") {
            let name = rest.trim().trim_matches('`').to_owned();
            out.entry(name.clone()).or_default();
            current = Some(name);
        } else if line.starts_with("## ") {
            current = None;
        } else if let Some(name) = &current {
            if let Some((_, same)) = line.split_once("Same fields as `") {
                let other = same.split('`').next().unwrap_or_default();
                let fields = out.get(other).cloned().unwrap_or_default();
                assert!(!fields.is_empty(), "{name}: 'Same fields as' names an undocumented event {other}");
                out.entry(name.clone()).or_default().extend(fields);
            } else if let Some(row) = line.strip_prefix('|') {
                let first = row.split('|').next().unwrap_or_default();
                let names: Vec<&str> = first.split('`').skip(1).step_by(2).collect();
                out.entry(name.clone()).or_default().extend(names.iter().map(|n| (*n).to_owned()));
            }
        }
    }
    out
}

#[test]
fn the_doc_and_the_event_enum_say_the_same() {
    let mut serialized: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for sample in samples() {
        let name = sample["event"].as_str().expect("an event tag").to_owned();
        serialized.entry(name).or_default().push(sample);
    }
    let documented = documented();
    let names = |m: &BTreeMap<String, _>| m.keys().cloned().collect::<BTreeSet<String>>();
    let ours: BTreeSet<String> = serialized.keys().cloned().collect();
    assert_eq!(names(&documented), ours, "events in docs/events.md vs variants of Event");
    for (name, samples) in &serialized {
        let doc = &documented[name];
        let top: BTreeSet<String> =
            samples.iter().flat_map(|s| s.as_object().expect("an object").keys().cloned()).collect();
        let doc_top: BTreeSet<String> =
            doc.iter().map(|f| f.split('.').next().unwrap_or_default().to_owned()).chain(["event".into()]).collect();
        assert_eq!(doc_top, top, "fields of {name}: docs/events.md vs Event");
        for path in doc.iter().filter(|f| f.contains('.')) {
            let found = samples.iter().any(|s| path.split('.').try_fold(s, |v, k| v.get(k)).is_some());
            assert!(found, "{name}: documented field {path} is not in any sample");
        }
    }
}

#[test]
fn kernel_events_keep_their_names_and_fields() {
    let (task, exec) = (task(), exec());
    let kernel = KernelEvent::CniExec { task: task.clone(), exec: exec.clone() };
    let direct = serde_json::to_value(&kernel).expect("serializes");
    let ours = serde_json::to_value(Event::from(&kernel)).expect("serializes");
    assert_eq!(direct, ours);
}

#[test]
fn a_status_and_an_outcome_have_one_spelling() {
    for s in [Status::InUse, Status::Pending, Status::Orphaned, Status::Conflict] {
        assert_eq!(serde_json::to_value(s).expect("serializes"), status_label(s));
    }
    let outcomes = [
        Outcome::Released { cache_entries_removed: Vec::new(), cache_notes: Vec::new() },
        Outcome::WouldRelease { cache_entries: Vec::new(), cache_notes: Vec::new() },
        Outcome::AlreadyGone,
        Outcome::OwnerChanged { found: String::new() },
        Outcome::Kept { status: Status::InUse, reason: String::new() },
        Outcome::LastLookKept { found: String::new(), ip_configured: false },
        Outcome::Refused { reason: String::new() },
        Outcome::Anomalous { kind: AnomalyKind::Symlink, detail: String::new() },
        Outcome::Failed { error: String::new() },
        Outcome::LockBusy { lock: "/l".into(), waited_ms: 1, holders: Vec::new() },
        Outcome::DryRunClosed,
    ];
    for o in &outcomes {
        // The journal's `result` is the label too.
        assert_eq!(serde_json::to_value(o).expect("serializes")["result"], o.label());
    }
    // Journals written before the spellings were unified still read.
    for (old, new) in [("would_release", "dry_run"), ("last_look_kept", "kept_by_last_look"), ("failed", "error")] {
        let line = format!(r#"{{"result":"{old}","cache_entries":[],"found":"x","ip_configured":true,"error":"e"}}"#);
        let o: Outcome = serde_json::from_str(&line).expect("an old journal outcome");
        assert_eq!(o.label(), new);
    }
}
