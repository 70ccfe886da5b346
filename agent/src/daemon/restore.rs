//! Across a restart: what to save of the ledger (each binding with the
//! netns incarnation it named), and at start, what became of each saved
//! incarnation while netreap was down, on the kernel's word only.

use std::time::{Duration, SystemTime};

use super::evidence::{Incarnations, dead_incarnation};
use crate::{
    engine::observations::DeadNetns,
    identity::NetnsId,
    ledger::{
        Attachment, Ledger,
        persist::{Knowledge, SavedBinding, Window},
    },
    model::snapshot::{ModelSnapshot, NetnsView},
};

/// Bindings whose netns is dead or unknown are saved for this long after
/// their last CNI run; bindings of live netns always are.
const KEEP_DEAD_FOR: Duration = Duration::from_hours(24);

/// The incarnation a binding names, as the model sees it now.
fn incarnation(
    incarnations: &Incarnations<'_>,
    known_dead: &[DeadNetns],
    a: &Attachment,
) -> Option<(NetnsId, Option<SystemTime>)> {
    let views: Vec<&NetnsView> = match (a.pinned, a.netns_inode) {
        (Some(id), _) => incarnations.may_be(id).collect(),
        (None, Some(_)) => incarnations.exactly(&incarnations.of_binding(a)),
        (None, None) => return None,
    };
    if let Some(live) = views.iter().find(|v| v.alive) {
        return Some((live.id(), None));
    }
    if let Some(dead) = views.iter().find(|v| v.died_at.is_some()) {
        return Some((dead.id(), dead.died_at));
    }
    if let Some(d) = a.pinned.and_then(|id| known_dead.iter().find(|d| d.id == id)) {
        return Some((d.id, Some(d.died_at)));
    }
    // Seen to die, since forgotten by the model: the ledger kept which.
    if let Some((id, died_at)) = dead_incarnation(a) {
        return Some((id, Some(died_at)));
    }
    // Not in the model now: what was known before (pinned), or the inode.
    a.pinned.or(a.netns_inode.map(NetnsId::inode)).map(|id| (id, None))
}

/// What to save now. `watched`: every window of complete watching so far,
/// this run's last (until now).
#[must_use]
pub fn knowledge_of(
    ledger: &Ledger,
    snapshot: &ModelSnapshot,
    known_dead: &[DeadNetns],
    boot_id: String,
    watched: Vec<Window>,
    now: SystemTime,
) -> Knowledge {
    let mut bindings = Vec::new();
    let incarnations = Incarnations::new(snapshot);
    for a in ledger.shared_attachments() {
        let netns = incarnation(&incarnations, known_dead, a);
        let alive =
            netns.is_some_and(|(id, died)| died.is_none() && incarnations.exactly(&[id]).iter().any(|v| v.alive));
        let stale = now.duration_since(a.last_seen).unwrap_or_default() > KEEP_DEAD_FOR;
        if stale && !alive {
            continue;
        }
        bindings.push(SavedBinding {
            attachment: std::sync::Arc::clone(a),
            netns: netns.map(|n| n.0),
            died_at: netns.and_then(|n| n.1),
        });
    }
    Knowledge::new(boot_id, now, watched, bindings)
}

/// What became of a saved incarnation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// The same netns lives: this is its identity in this run.
    Alive(NetnsId),
    /// The kernel says it is gone: died at or after `died_at`.
    Dead { id: NetnsId, died_at: SystemTime },
    /// Cannot be told (not openable, or the kernel cannot be asked): kept.
    Unknown(NetnsId),
}

/// Decides the fate of one saved binding's netns, after the model's first
/// full sync. `same_boot`: the file is of this boot. `nsid_exists`: the
/// kernel's answer for an nsid (None: cannot tell).
pub fn fate(
    saved: &SavedBinding,
    saved_at: SystemTime,
    same_boot: bool,
    snapshot: &ModelSnapshot,
    nsid_exists: &mut dyn FnMut(i32) -> Option<bool>,
) -> Option<Fate> {
    let id = saved.netns?;
    if let Some(died_at) = saved.died_at {
        return Some(Fate::Dead { id, died_at });
    }
    if !same_boot {
        // Every netns of an earlier boot is gone; it was alive when saved.
        return Some(Fate::Dead { id, died_at: saved_at });
    }
    let live = |pred: &dyn Fn(&NetnsView) -> bool| snapshot.alive().find(|v| !v.host && pred(v)).map(NetnsView::id);
    Some(match (id.nsid, id.inode) {
        (Some(nsid), inode) => match live(&|v| v.nsid == Some(nsid)) {
            // The nsid now names a netns with another inode: the kernel
            // gave the nsid away, which it does only after a death.
            Some(now) if inode.is_some() && now.inode.is_some() && now.inode != inode => {
                Fate::Dead { id, died_at: saved_at }
            }
            Some(now) => Fate::Alive(now),
            None => match nsid_exists(nsid) {
                Some(false) => Fate::Dead { id, died_at: saved_at },
                _ => Fate::Unknown(id),
            },
        },
        (None, Some(inode)) => live(&|v| v.inode.map(u64::from) == Some(inode)).map_or(Fate::Unknown(id), Fate::Alive),
        (None, None) => Fate::Unknown(id),
    })
}

/// Applies a fate to the saved attachment: the attachment to restore (its
/// binding pinned to the incarnation), and the dead netns to show the engine.
#[must_use]
pub fn restored(saved: SavedBinding, fate: Option<&Fate>) -> (Attachment, Option<DeadNetns>) {
    let mut a = std::sync::Arc::unwrap_or_clone(saved.attachment);
    let dead = match fate {
        Some(Fate::Alive(id) | Fate::Unknown(id)) => {
            a.pinned = Some(*id);
            None
        }
        Some(Fate::Dead { id, died_at }) => {
            a.pinned = Some(*id);
            Some(DeadNetns {
                id: *id,
                died_at: *died_at,
                container_ids: vec![a.container_id.clone()],
                addresses: Vec::new(),
                paths: a.netns_path.iter().map(std::path::PathBuf::from).collect(),
            })
        }
        None => None,
    };
    (a, dead)
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;
    use crate::model::{sealed::SealedViews, snapshot::ModelStats};

    fn t(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
    }

    fn view(inode: u32, nsid: i32, first_seen: u64) -> NetnsView {
        NetnsView {
            inode: Some(inode),
            nsid: Some(nsid),
            host: false,
            alive: true,
            first_seen: t(first_seen),
            died_at: None,
            death_source: None,
            creator: None,
            bind_mounts: Vec::new(),
            process_count: 0,
            processes: Vec::new(),
            interfaces: Vec::new(),
            addresses: Vec::new(),
            host_routes: Vec::new(),
        }
    }

    fn snapshot(views: Vec<NetnsView>) -> ModelSnapshot {
        ModelSnapshot {
            sealed: SealedViews::NONE,
            taken_at: t(100),
            netns: views.into_iter().map(std::sync::Arc::new).collect(),
            host_routes: std::sync::Arc::default(),
            stats: ModelStats::default(),
        }
    }

    fn saved(inode: u64, nsid: i32) -> SavedBinding {
        SavedBinding {
            attachment: std::sync::Arc::new(Attachment {
                container_id: "c1".into(),
                netns_path: Some("/run/netns/a".into()),
                netns_inode: Some(inode),
                netns_nsid: None,
                netns_bound_at: Some(t(1)),
                pinned: None,
                died: None,
                ifnames: Vec::new(),
                operations: Vec::new(),
                first_seen: t(1),
                last_seen: t(1),
            }),
            netns: Some(NetnsId::new(Some(inode), Some(nsid), Some(t(0)))),
            died_at: None,
        }
    }

    #[test]
    fn the_kernel_decides_each_fate_and_silence_is_never_death() {
        let now = snapshot(vec![view(77, 3, 90), view(88, 4, 90)]);
        let mut never: Box<dyn FnMut(i32) -> Option<bool>> = Box::new(|_| panic!("no need to ask"));
        // Same nsid, same inode: the same netns, under this run's identity.
        assert_eq!(fate(&saved(77, 3), t(50), true, &now, &mut *never), Some(Fate::Alive(view(77, 3, 90).id())));
        // Its nsid names another inode now: gone.
        assert!(
            matches!(fate(&saved(99, 4), t(50), true, &now, &mut *never), Some(Fate::Dead { died_at, .. }) if died_at == t(50))
        );
        // Not in the model: the kernel says the nsid is gone, or cannot say.
        assert!(matches!(fate(&saved(55, 9), t(50), true, &now, &mut |_| Some(false)), Some(Fate::Dead { .. })));
        assert!(matches!(fate(&saved(55, 9), t(50), true, &now, &mut |_| None), Some(Fate::Unknown(_))));
        assert!(matches!(fate(&saved(55, 9), t(50), true, &now, &mut |_| Some(true)), Some(Fate::Unknown(_))));
        // An earlier boot: every netns of it is gone.
        assert!(matches!(fate(&saved(77, 3), t(50), false, &now, &mut *never), Some(Fate::Dead { .. })));
    }

    /// A binding whose netns the kernel said died, since forgotten by the
    /// model, is saved with that death (so the next run shows the engine
    /// the death), not as the bare inode its live newcomer would match.
    #[test]
    fn a_binding_seen_to_die_is_saved_dead_after_the_model_forgot_its_netns() {
        let mut a = (*saved(77, 3).attachment).clone();
        let died = NetnsId::new(Some(77), Some(3), Some(t(0)));
        a.died = Some(crate::ledger::BindingDeath { incarnation: Some((died, t(20))) });
        let mut ledger = Ledger::new();
        ledger.restore(vec![a.clone()]);
        let now = snapshot(vec![view(77, 3, 90)]);
        let knowledge = knowledge_of(&ledger, &now, &[], "boot".into(), Vec::new(), t(100));
        assert_eq!((knowledge.bindings[0].netns, knowledge.bindings[0].died_at), (Some(died), Some(t(20))));
        // Without the mark: the inode alone, fate unknown until asked.
        a.died = None;
        let mut ledger = Ledger::new();
        ledger.restore(vec![a]);
        let knowledge = knowledge_of(&ledger, &now, &[], "boot".into(), Vec::new(), t(100));
        assert_eq!(knowledge.bindings[0].died_at, None);
    }

    #[test]
    fn a_dead_fate_pins_the_binding_and_shows_the_engine_the_death() {
        let s = saved(55, 9);
        let id = s.netns.unwrap();
        let (a, dead) = restored(s, Some(&Fate::Dead { id, died_at: t(50) }));
        assert_eq!(a.pinned, Some(id));
        let dead = dead.expect("a dead netns");
        assert_eq!((dead.id, dead.died_at, dead.container_ids), (id, t(50), vec!["c1".to_owned()]));
    }
}
