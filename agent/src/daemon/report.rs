//! The agent's event payloads and metric labels for verdicts and releases
//! (schema in docs/events.md).

use std::{
    collections::BTreeMap,
    time::{Duration, SystemTime},
};

use serde_json::{Value, json};

use crate::{
    engine::{Fact, PodRef, Status, Verdict, runtime::RuntimeFact},
    release::{ReleaseRecord, outcome::Outcome},
};

pub fn status_label(s: Status) -> &'static str {
    match s {
        Status::InUse => "in_use",
        Status::Pending => "pending",
        Status::Orphaned => "orphaned",
        Status::Conflict => "conflict",
    }
}

pub fn outcome_label(o: &Outcome) -> &'static str {
    match o {
        Outcome::Released { .. } => "released",
        Outcome::WouldRelease { .. } => "dry_run",
        Outcome::AlreadyGone => "already_gone",
        Outcome::OwnerChanged { .. } => "owner_changed",
        Outcome::Kept { .. } => "kept",
        Outcome::LastLookKept { .. } => "kept_by_last_look",
        Outcome::Refused { .. } => "refused",
        Outcome::Anomalous { .. } => "anomalous",
        Outcome::Failed { .. } => "error",
        Outcome::LockBusy { .. } => "lock_busy",
        Outcome::DryRunClosed => "dry_run_closed",
    }
}

/// When the netns whose death decided this verdict died.
pub fn death_time(v: &Verdict) -> Option<SystemTime> {
    v.evidence.iter().find_map(|e| match &e.fact {
        Fact::BoundNetnsDied { died_at, .. } => Some(*died_at),
        _ => None,
    })
}

pub fn release_reason(v: &Verdict) -> &'static str {
    let runtime_gone = || v.evidence.iter().any(|e| matches!(e.fact.runtime(), Some(RuntimeFact::GoneWithItsNetns)));
    if death_time(v).is_some() {
        "netns_died"
    } else if runtime_gone() {
        "runtime_gone"
    } else {
        "orphan_grace"
    }
}

/// Names the pod (namespace/name) in an event payload, when the runtime
/// knows it.
pub fn with_pod(mut payload: Value, pod: Option<&PodRef>) -> Value {
    if let (Some(pod), Value::Object(m)) = (pod, &mut payload) {
        m.insert("pod".into(), json!(pod.to_string()));
        if !pod.uid.is_empty() {
            m.insert("pod_uid".into(), json!(pod.uid));
        }
    }
    payload
}

fn evidence_text(v: &Verdict) -> Vec<String> {
    v.evidence_text()
}

fn reservation_fields(v: &Verdict) -> serde_json::Map<String, Value> {
    let r = &v.reservation;
    let mut m = serde_json::Map::new();
    m.insert("store".into(), json!(r.store));
    m.insert("network".into(), json!(r.network));
    m.insert("ip".into(), json!(r.ip.to_string()));
    m.insert("container_id".into(), json!(r.container_id));
    m.insert("ifname".into(), json!(r.ifname));
    m
}

pub fn verdict_changed(v: &Verdict, before: Option<Status>) -> Value {
    let mut m = reservation_fields(v);
    m.insert("from".into(), json!(before.map(status_label)));
    m.insert("to".into(), json!(status_label(v.status)));
    m.insert("summary".into(), json!(v.summary()));
    m.insert("evidence".into(), json!(evidence_text(v)));
    Value::Object(m)
}

pub fn conflict(v: &Verdict) -> Value {
    let holders: Vec<Value> = v
        .evidence
        .iter()
        .filter_map(|e| match &e.fact {
            Fact::IpInOtherLiveNetns { netns, containers, .. } => {
                Some(json!({ "netns_inode": netns.inode, "live_container_ids": containers }))
            }
            _ => None,
        })
        .collect();
    json!({
        "network": v.reservation.network,
        "ip": v.reservation.ip.to_string(),
        "reserved_by": v.reservation.container_id,
        "holders": holders,
        "evidence": evidence_text(v),
    })
}

pub fn release(record: &ReleaseRecord, reason: &str, latency: Option<Duration>) -> Value {
    let mut m = reservation_fields(&record.verdict);
    m.insert("reason".into(), json!(reason));
    m.insert("outcome".into(), json!(outcome_label(&record.outcome)));
    m.insert("detail".into(), json!(record.outcome.to_string()));
    if let Outcome::Failed { error } = &record.outcome {
        m.insert("error".into(), json!(error));
    }
    if let Outcome::LockBusy { .. } = &record.outcome {
        m.insert("error".into(), json!(record.outcome.to_string()));
    }
    m.insert("dry_run".into(), json!(record.dry_run));
    m.insert("intent_id".into(), json!(record.intent_id));
    m.insert("evidence".into(), json!(evidence_text(&record.verdict)));
    if let Some(l) = latency {
        m.insert("death_to_release_seconds".into(), json!(l.as_secs_f64()));
    }
    Value::Object(m)
}

/// Reservations per (network, verdict).
pub fn counts(verdicts: &[Verdict]) -> BTreeMap<(String, &'static str), u64> {
    let mut out = BTreeMap::new();
    for v in verdicts {
        *out.entry((v.reservation.network.to_string(), status_label(v.status))).or_insert(0) += 1;
    }
    out
}
