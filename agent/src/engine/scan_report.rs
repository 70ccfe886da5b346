//! A scan report: every reservation with its verdict and evidence, the
//! anomalies, and totals per network. Serializable both ways, so a person
//! can review it and `release --from-report` can act on exactly that.

use std::{collections::BTreeMap, fmt, time::SystemTime};

use serde::{Deserialize, Serialize};

use super::{
    decide::decide,
    observations::Observations,
    policy::Policy,
    verdict::{Status, Verdict},
};
use crate::{
    ipam::{Anomaly, StoreRef, StoreScan},
    timefmt,
};

/// Counts for one network of one store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkTotals {
    pub store: StoreRef,
    pub network: String,
    pub reservations: usize,
    pub in_use: usize,
    pub pending: usize,
    pub orphaned: usize,
    pub conflict: usize,
    pub anomalies: usize,
}

/// Which evidence the report was built from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sources {
    pub live_netns: usize,
    pub dead_netns: usize,
    pub bindings: usize,
    pub cni_ops: usize,
    pub cni_ops_in_flight: usize,
    /// Whether the runtime's sandbox list was available.
    pub runtime: bool,
    /// Whether the Kubernetes API's pod list was available.
    pub api: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScanReport {
    #[serde(with = "timefmt::rfc3339")]
    pub generated_at: SystemTime,
    pub policy: Policy,
    pub sources: Sources,
    pub totals: Vec<NetworkTotals>,
    pub verdicts: Vec<Verdict>,
    pub anomalies: Vec<Anomaly>,
    /// NOTREADY sandboxes whose netns is alive (engine/runtime.rs).
    #[serde(default)]
    pub stuck_sandboxes: Vec<super::runtime::StuckSandbox>,
}

/// The totals of one (store, network), created on first use.
fn entry<'a>(
    totals: &'a mut BTreeMap<(StoreRef, String), NetworkTotals>,
    store: &StoreRef,
    network: &str,
) -> &'a mut NetworkTotals {
    totals.entry((store.clone(), network.to_owned())).or_insert_with(|| NetworkTotals {
        store: store.clone(),
        network: network.to_owned(),
        reservations: 0,
        in_use: 0,
        pending: 0,
        orphaned: 0,
        conflict: 0,
        anomalies: 0,
    })
}

impl ScanReport {
    /// Decides every scanned reservation; pure.
    #[must_use]
    pub fn build(scan: &StoreScan, obs: &Observations, now: SystemTime, policy: &Policy) -> Self {
        let verdicts = decide(obs, &scan.reservations, now, policy);
        let mut totals: BTreeMap<(StoreRef, String), NetworkTotals> = BTreeMap::new();
        for v in &verdicts {
            let t = entry(&mut totals, &v.reservation.store, &v.reservation.network);
            t.reservations += 1;
            match v.status {
                Status::InUse => t.in_use += 1,
                Status::Pending => t.pending += 1,
                Status::Orphaned => t.orphaned += 1,
                Status::Conflict => t.conflict += 1,
            }
        }
        for a in &scan.anomalies {
            // Anomalies outside any network directory are counted under "".
            entry(&mut totals, &a.store, a.network.as_deref().unwrap_or("")).anomalies += 1;
        }
        let sources = Sources {
            live_netns: obs.live.len(),
            dead_netns: obs.dead.len(),
            bindings: obs.bindings.len(),
            cni_ops: obs.cni_ops.len(),
            cni_ops_in_flight: obs.cni_ops.iter().filter(|op| op.in_flight()).count(),
            runtime: obs.runtime_sandboxes.is_some(),
            api: obs.api_pods.is_some(),
        };
        Self {
            generated_at: now,
            policy: *policy,
            sources,
            totals: totals.into_values().collect(),
            verdicts,
            anomalies: scan.anomalies.clone(),
            stuck_sandboxes: super::runtime::stuck_sandboxes(obs),
        }
    }

    /// The entries a release would act on.
    pub fn orphaned(&self) -> impl Iterator<Item = &Verdict> {
        self.verdicts.iter().filter(|v| v.is_orphaned())
    }
}

/// The human-readable report: totals, then one line per reservation and
/// anomaly.
impl fmt::Display for ScanReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "scan at {}", humantime::format_rfc3339_seconds(self.generated_at))?;
        let s = &self.sources;
        writeln!(
            f,
            "evidence: {} live netns, {} dead netns, {} bindings, {} CNI runs ({} in flight), runtime {}, API {}",
            s.live_netns,
            s.dead_netns,
            s.bindings,
            s.cni_ops,
            s.cni_ops_in_flight,
            if s.runtime { "yes" } else { "unavailable" },
            if s.api { "yes" } else { "unavailable" },
        )?;
        for t in &self.totals {
            let store = &t.store;
            let network = if t.network.is_empty() { "(outside networks)" } else { &t.network };
            writeln!(
                f,
                "{store} {network}: {} reservations: {} in use, {} pending, {} orphaned, {} conflict; {} anomalies",
                t.reservations, t.in_use, t.pending, t.orphaned, t.conflict, t.anomalies
            )?;
        }
        for v in &self.verdicts {
            writeln!(f, "  {v}")?;
        }
        for a in &self.anomalies {
            writeln!(f, "  anomaly {:?} at {}: {} (left untouched)", a.kind, a.path, a.detail)?;
        }
        for s in &self.stuck_sandboxes {
            writeln!(f, "  stuck {s}")?;
        }
        Ok(())
    }
}
