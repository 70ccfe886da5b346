//! What this run carries over from earlier ones (bindings and windows of
//! complete watching, see `restore`), and saves for later ones.

use std::time::{Duration, Instant, SystemTime};

use tracing::warn;

use super::{Agent, restore};
use crate::{
    engine::observations::DeadNetns,
    ledger::persist::{self, Window},
};

/// A netns of its own, alive while the returned fd is open: made on a
/// short-lived thread, so the agent's threads stay where they are. None
/// without the right to (no `CAP_SYS_ADMIN`).
fn scratch_netns() -> Option<std::os::fd::OwnedFd> {
    std::thread::spawn(|| {
        // SAFETY: unshare(2) moves only the calling thread, which ends here.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return None;
        }
        std::fs::File::open("/proc/thread-self/ns/net").ok().map(std::os::fd::OwnedFd::from)
    })
    .join()
    .ok()
    .flatten()
}

#[derive(Default)]
pub(super) struct Memory {
    pub boot_id: String,
    /// Closed windows of complete watching (earlier runs, and this run's
    /// before a ring-buffer loss).
    pub windows: Vec<Window>,
    /// Netns of saved bindings that the kernel says died while netreap was
    /// down.
    pub dead_while_down: Vec<DeadNetns>,
    /// The ledger changed since the last save.
    pub dirty: bool,
    /// A save writing on the blocking pool (one at a time: they share the
    /// temporary file).
    saving: Option<tokio::task::JoinHandle<()>>,
    /// When the last save was started.
    saved_at: Option<Instant>,
}

/// Saves while running are at most this often. What a crash loses is only
/// what was learned since the last save, and that only delays: a binding
/// not saved makes its reservation wait for the orphan grace after a
/// restart instead of being released on the kernel's word, and a watching
/// window ends earlier (youth grace again). Nothing saved can make a live
/// reservation look dead: every saved fact is re-checked with the kernel at
/// start (`restore::fate`), and the engine still finds the IP in a live
/// netns. SIGTERM saves the whole state.
pub(super) const SAVE_INTERVAL: Duration = Duration::from_secs(5);

impl Memory {
    /// Whether a save should start now: something changed, the last one is
    /// done and at least [`SAVE_INTERVAL`] old.
    pub fn save_due(&self, now: Instant) -> bool {
        self.dirty
            && self.saving.as_ref().is_none_or(tokio::task::JoinHandle::is_finished)
            && self.saved_at.is_none_or(|at| now.duration_since(at) >= SAVE_INTERVAL)
    }
}

/// How the saved bindings fared, for the log.
#[derive(Debug, Default)]
pub(super) struct Restored {
    pub alive: usize,
    pub dead: usize,
    pub unknown: usize,
    pub same_boot: bool,
}

impl Agent {
    /// Loads what an earlier run saved and asks the kernel what became of
    /// each netns it knew (after the model's first full sync).
    pub(super) async fn remember(&mut self) {
        self.memory.boot_id = persist::boot_id();
        let knowledge = match persist::load(&self.config.state_dir) {
            Ok(Some(k)) => k,
            Ok(None) => return,
            Err(e) => {
                warn!("earlier knowledge not used: {e}");
                return;
            }
        };
        let snapshot = match self.model.snapshot().await {
            Ok(s) => s,
            Err(e) => {
                warn!("earlier knowledge not used: no model snapshot: {e}");
                return;
            }
        };
        let same_boot = !knowledge.boot_id.is_empty() && knowledge.boot_id == self.memory.boot_id;
        let mut querier = crate::netlink::query::Querier::open().ok();
        // "This nsid is gone" is believed only from a kernel that answered a
        // dump aimed at an nsid that exists. That reference must stay alive
        // while the saved nsids are asked: a live netns of the model may be
        // one deleted just before this start, destroyed a moment later (then
        // the check fails and every saved netns that died while netreap was
        // down stays "unknown"). So a netns is made for the check, held, and
        // dropped after it (it shows as a short-lived netns); a model's live
        // netns is the reference only when none can be made.
        let scratch = if same_boot { scratch_netns() } else { None };
        // The scratch took the lowest free nsid, maybe a saved one: it names
        // the scratch now, so the netns that had it is gone (the kernel frees
        // an nsid only when its netns dies).
        let scratch_nsid = querier
            .as_mut()
            .zip(scratch.as_ref())
            .and_then(|(q, fd)| q.nsid_of(std::os::fd::AsRawFd::as_raw_fd(fd), true).ok().flatten());
        let known_good = scratch_nsid.or_else(|| snapshot.alive().find(|v| !v.host).and_then(|v| v.nsid));
        let mut nsid_exists = |nsid: i32| {
            if Some(nsid) == scratch_nsid {
                return Some(false);
            }
            querier.as_mut().and_then(|q| q.nsid_exists(nsid, known_good).ok().flatten())
        };
        let mut counts = Restored { same_boot, ..Restored::default() };
        let mut restored_attachments = Vec::with_capacity(knowledge.bindings.len());
        let mut dead_now: Vec<DeadNetns> = Vec::new();
        for saved in knowledge.bindings {
            let fate = restore::fate(&saved, knowledge.saved_at, same_boot, &snapshot, &mut nsid_exists);
            match &fate {
                Some(restore::Fate::Alive(_)) => counts.alive += 1,
                Some(restore::Fate::Dead { .. }) => counts.dead += 1,
                Some(restore::Fate::Unknown(_)) | None => counts.unknown += 1,
            }
            let (attachment, died) = restore::restored(saved, fate.as_ref());
            if let Some(d) = died {
                match dead_now.iter_mut().find(|x| x.id == d.id) {
                    Some(x) => x.container_ids.extend(d.container_ids),
                    None => dead_now.push(d),
                }
            }
            restored_attachments.push(attachment);
        }
        drop(scratch);
        self.ledger.restore(restored_attachments);
        self.memory.windows = knowledge.watched;
        self.publish_restored(&counts, &dead_now);
        self.memory.dead_while_down = dead_now;
        self.attachments_dirty = true;
        self.memory.dirty = true;
    }

    /// Saves the ledger with each binding's netns incarnation, after a save
    /// still writing (at shutdown).
    pub(super) async fn save_knowledge(&mut self) {
        if let Some(saving) = self.memory.saving.take() {
            let _ = saving.await;
        }
        let Some(knowledge) = self.knowledge().await else { return };
        if let Err(e) = persist::save(&self.config.state_dir, &knowledge) {
            warn!("knowledge not saved: {e}");
        }
    }

    /// Starts a save when one is due ([`Memory::save_due`]): the document
    /// is made here, written and fsync'd on the blocking pool, so the event
    /// loop (a death's release) never waits for the disk.
    pub(super) async fn save_knowledge_when_due(&mut self) {
        let now = Instant::now();
        if !self.memory.save_due(now) {
            return;
        }
        self.memory.saved_at = Some(now);
        let Some(knowledge) = self.knowledge().await else { return };
        self.memory.dirty = false;
        let dir = self.config.state_dir.clone();
        self.memory.saving = Some(tokio::task::spawn_blocking(move || {
            if let Err(e) = persist::save(&dir, &knowledge) {
                warn!("knowledge not saved: {e}");
            }
        }));
    }

    /// What to save now.
    async fn knowledge(&mut self) -> Option<persist::Knowledge> {
        let snapshot = match self.model.snapshot().await {
            Ok(s) => s,
            Err(e) => {
                warn!("knowledge not saved: no model snapshot: {e}");
                return None;
            }
        };
        let now = SystemTime::now();
        let mut windows = self.memory.windows.clone();
        windows.push(Window { since: self.watching_since, until: now });
        Some(restore::knowledge_of(
            &self.ledger,
            &snapshot,
            &self.memory.dead_while_down,
            self.memory.boot_id.clone(),
            windows,
            now,
        ))
    }
}
