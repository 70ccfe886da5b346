//! The two library calls behind `netreap scan` and `netreap release
//! --from-report`, so the CLI stays thin.

use std::time::SystemTime;

use super::{ReleaseError, ReleaseRecord, Releaser, outcome::Outcome};
use crate::{
    engine::{Observations, Policy, ScanReport, Status, Verdict},
    ipam::{Reservation, ReservationStore, cnicache::CniCache, scan_all},
};

/// Scans `stores`, adds the CNI cache's bindings (and anomalies) when a
/// cache is given, and decides every reservation.
#[must_use]
pub fn scan_report(
    stores: &[&dyn ReservationStore],
    cache: Option<&CniCache>,
    obs: &Observations,
    now: SystemTime,
    policy: &Policy,
) -> ScanReport {
    let mut scan = scan_all(stores);
    let Some(cache) = cache else {
        return ScanReport::build(&scan, obs, now, policy);
    };
    let cached = cache.scan();
    let mut obs = obs.clone();
    obs.bindings.extend(cached.attachments.iter().filter_map(|a| a.binding()));
    scan.anomalies.extend(cached.anomalies);
    ScanReport::build(&scan, &obs, now, policy)
}

/// Releases exactly the orphaned entries of a reviewed report (delete an
/// entry from the report to spare it). Each is first re-verified by
/// `reverify` (the engine on fresh observations) and released only if it is
/// still orphaned; the releaser then checks the file is still the same one
/// with the same owner. Entries the report does not call orphaned are left
/// alone and not listed.
pub fn release_reviewed(
    report: &ScanReport,
    releaser: &mut Releaser,
    mut reverify: impl FnMut(&Reservation) -> Verdict,
) -> Result<Vec<ReleaseRecord>, ReleaseError> {
    let mut records = Vec::new();
    for reviewed in report.verdicts.iter().filter(|v| v.status == Status::Orphaned) {
        let fresh = reverify(&reviewed.reservation);
        let kept = |outcome: Outcome, fresh: Verdict| ReleaseRecord {
            intent_id: None,
            dry_run: releaser.config().dry_run,
            verdict: reviewed.clone(),
            outcome,
            reverified: Some(fresh),
        };
        if fresh.reservation != reviewed.reservation {
            let reason = "re-verification judged a different reservation".to_owned();
            records.push(kept(Outcome::Refused { reason }, fresh));
            continue;
        }
        if fresh.status != Status::Orphaned {
            let outcome = Outcome::Kept { status: fresh.status, reason: fresh.summary() };
            records.push(kept(outcome, fresh));
            continue;
        }
        let mut record = releaser.release(&fresh)?;
        record.verdict = reviewed.clone();
        record.reverified = Some(fresh);
        records.push(record);
    }
    Ok(records)
}
