//! The Kubernetes source for one-shot commands (`scan`, `release
//! --from-report`): one list of this node's pods and one of the IPPools,
//! each bounded in time. No ledger runs in a one-shot command, so an
//! allocation is this node's when its container has a CNI cache entry here
//! (an ADD that succeeded on this node).

use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client, api::ListParams};
use tracing::{info, warn};

use super::{
    KubeSource,
    agent::{add_pods, made_here},
    pods::{as_evidence, node_selector},
    timed,
    whereabouts::{self, PoolScan},
};
use crate::{
    engine::Observations,
    ipam::{ReservationStore, StoreRef, StoreScan, cnicache::CachedAttachment},
    ledger::Ledger,
};

/// What the API gave a one-shot command.
pub struct OneShot {
    pub client: Client,
    pub pools: PoolScan,
}

/// Lists pods and pools when the API is configured, adds the pods to `obs`
/// and returns this node's whereabouts allocations. None when the source is
/// off (said in the log); an unreachable API or a missing CRD leaves the
/// matching part out, never fails the command.
pub async fn observe(
    kubeconfig: Option<&Path>,
    node: Option<&str>,
    obs: &mut Observations,
    cache: &[std::sync::Arc<CachedAttachment>],
) -> Result<Option<OneShot>, super::KubeError> {
    let client = match super::connect(kubeconfig).await? {
        KubeSource::Off { reason } => {
            info!("Kubernetes source off: {reason}");
            return Ok(None);
        }
        KubeSource::On { client, .. } => client,
    };
    let pools = match whereabouts::list_pools(&client).await {
        Ok(pools) => {
            let seen = made_here(&Ledger::new(), cache);
            whereabouts::scan_pools(&pools, |cid| seen.get(cid).copied())
        }
        Err(e) => {
            warn!("whereabouts IPPools not read: {e}");
            PoolScan::default()
        }
    };
    let pods = match node {
        Some(node) => {
            let api: Api<Pod> = Api::all(client.clone());
            match timed(api.list(&ListParams::default().fields(&node_selector(node)))).await {
                Ok(list) => Some(list.items.iter().filter_map(as_evidence).collect()),
                Err(e) => {
                    warn!("pods of node {node} not read: {e}");
                    None
                }
            }
        }
        None => None,
    };
    add_pods(obs, pods, &pools.pods);
    Ok(Some(OneShot { client, pools }))
}

/// A pool scan as a store, for `scan_report`.
pub struct ListedPools(pub StoreScan);

impl ReservationStore for ListedPools {
    fn store_ref(&self) -> StoreRef {
        StoreRef::Whereabouts { namespace: String::new(), pool: String::new() }
    }

    fn scan(&self) -> StoreScan {
        self.0.clone()
    }
}

/// Releases exactly the orphaned whereabouts entries of a reviewed report,
/// like `release::release_reviewed` does for host-local: each must still be
/// one of this node's allocations in the fresh pool scan, is re-verified by
/// `reverify` (the engine on fresh observations) and then released with a
/// tested patch (re-read and decided again on 409/422). Journaled in
/// `journal`.
pub async fn release_reviewed(
    shot: &OneShot,
    journal: &mut crate::release::Journal,
    reviewed: &[crate::engine::Verdict],
    dry_run: bool,
    reverify: impl Fn(&crate::ipam::Reservation) -> crate::engine::Verdict,
    look: &mut dyn crate::release::lastlook::LastLook,
) -> Result<Vec<crate::release::ReleaseRecord>, crate::release::JournalError> {
    use crate::{
        engine::Status,
        release::{Outcome, ReleaseRecord},
    };
    let mut records = Vec::new();
    for v in
        reviewed.iter().filter(|v| v.status == Status::Orphaned && super::agent::is_whereabouts(&v.reservation.store))
    {
        let record =
            |outcome, reverified| ReleaseRecord { intent_id: None, dry_run, verdict: v.clone(), outcome, reverified };
        if !shot.pools.scan.reservations.contains(&v.reservation) {
            let reason = "not one of this node's whereabouts allocations as the pools read now".to_owned();
            records.push(record(Outcome::Refused { reason }, None));
            continue;
        }
        let fresh = reverify(&v.reservation);
        if fresh.status != Status::Orphaned {
            records.push(record(Outcome::Kept { status: fresh.status, reason: fresh.summary() }, Some(fresh)));
            continue;
        }
        let intent = journal.record_intent(&fresh, dry_run)?;
        let outcome = whereabouts::release(&shot.client, &v.reservation, dry_run, &reverify, look).await;
        journal.record_outcome(&intent.id, &outcome, Some(&fresh))?;
        records.push(ReleaseRecord {
            intent_id: Some(intent.id),
            dry_run,
            verdict: v.clone(),
            outcome,
            reverified: Some(fresh),
        });
    }
    Ok(records)
}
