//! The dump queue: one netlink dump at a time, each marking the entries it
//! (or a notification meanwhile) shows, so that at its end what was not
//! seen can be swept. It reports how each dump ended; it never removes
//! anything itself, and it reports a refused dump aimed at an nsid as the
//! kernel's word that the nsid is gone only once a dump by target nsid has
//! worked on this kernel.

use std::{
    collections::{HashSet, VecDeque},
    time::SystemTime,
};

use tracing::debug;

use super::{
    STUCK, age,
    records::{Entry, NetnsKey, RecordId, Table},
};
use crate::netlink::wire::{self, Header};

/// A dump to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Dump {
    pub(super) target: NetnsKey,
    pub(super) table: Table,
    /// Differences found count as corrections (periodic resync only).
    pub(super) counting: bool,
    pub(super) for_resync: bool,
}

#[derive(Debug)]
struct ActiveDump {
    seq: u32,
    dump: Dump,
    /// The nsid the request targeted (records only).
    nsid: Option<i32>,
    seen: HashSet<Entry>,
    interrupted: bool,
    started_epoch: u64,
    started_at: SystemTime,
}

/// How a dump ended, as the socket showed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DumpEnd {
    Complete,
    /// Refused with this errno (positive).
    Refused(i32),
    /// Never finished.
    Lost,
}

/// What an ended dump means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Complete and consistent: what existed before `started_epoch` and is
    /// not in `seen` can be swept.
    Complete { seen: HashSet<Entry>, started_epoch: u64 },
    /// Complete, but the kernel said it may be inconsistent: queued again
    /// at the front, not finished.
    Repeat,
    /// Refused with EINVAL while aimed at record `0`'s nsid, once dumps by
    /// target nsid are known to work: the kernel no longer has that nsid,
    /// which it removes only when the netns is destroyed.
    NsidGone(RecordId),
    /// Refused for another reason, or lost: nothing learned.
    Nothing,
}

/// A dump that ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Ended {
    pub(super) dump: Dump,
    /// The nsid it targeted.
    pub(super) nsid: Option<i32>,
    pub(super) outcome: Outcome,
}

/// Dumps waiting, and the one the socket is answering.
#[derive(Debug, Default)]
pub(super) struct DumpQueue {
    queued: VecDeque<Dump>,
    active: Option<ActiveDump>,
    /// A dump aimed at an nsid has succeeded: the kernel supports target
    /// nsids, so an EINVAL for one means the nsid is gone.
    targeted_dumps_work: bool,
}

impl DumpQueue {
    /// Queues `dump` unless the same one is queued already.
    pub(super) fn queue(&mut self, dump: Dump) {
        let duplicate = self.queued.iter_mut().find(|d| d.target == dump.target && d.table == dump.table);
        match duplicate {
            Some(d) if !dump.for_resync || d.for_resync => d.counting |= dump.counting,
            _ => self.queued.push_back(dump),
        }
    }

    /// Queues a resync's dumps, each replacing a plain queued duplicate.
    pub(super) fn queue_for_resync(&mut self, dumps: Vec<Dump>) {
        for d in dumps {
            self.queued.retain(|q| !(q.target == d.target && q.table == d.table && !q.for_resync));
            self.queued.push_back(d);
        }
    }

    /// A dump is under way.
    pub(super) fn busy(&self) -> bool {
        self.active.is_some()
    }

    /// The next dump to start, taken off the queue.
    pub(super) fn next_queued(&mut self) -> Option<Dump> {
        self.queued.pop_front()
    }

    /// Starts `dump` aimed at `nsid` (records) with `seq`; returns the
    /// request to send. `epoch`: the registry's, at the start.
    pub(super) fn start(&mut self, dump: Dump, nsid: Option<i32>, seq: u32, epoch: u64, now: SystemTime) -> Vec<u8> {
        let request = match dump.table {
            Table::Links => wire::dump_links(seq, nsid),
            Table::Addresses => wire::dump_addresses(seq, nsid, wire::Family::Both),
            Table::Routes => wire::dump_routes(seq),
            Table::Nsids => wire::dump_nsids(seq),
        };
        self.active = Some(ActiveDump {
            seq,
            dump,
            nsid,
            seen: HashSet::new(),
            interrupted: false,
            started_epoch: epoch,
            started_at: now,
        });
        request
    }

    /// Sequence number `seq` is the dump under way's.
    pub(super) fn answers(&self, seq: u32) -> bool {
        self.active.as_ref().is_some_and(|a| a.seq == seq)
    }

    /// The request of dump `seq` could not be sent: it goes back to the
    /// queue, so that it does not block the ones behind it.
    pub(super) fn unsent(&mut self, seq: u32) {
        if self.answers(seq)
            && let Some(active) = self.active.take()
        {
            self.queued.push_back(active.dump);
        }
    }

    /// A part of the dump under way arrived: notes whether the kernel
    /// flagged it inconsistent, and says which dump (and nsid) it is.
    pub(super) fn part(&mut self, header: &Header) -> Option<(Dump, Option<i32>)> {
        let active = self.active.as_mut()?;
        if header.dump_interrupted() {
            active.interrupted = true;
        }
        Some((active.dump, active.nsid))
    }

    /// `entry` of `key` is present now (shown by the dump or by a
    /// notification since it started).
    pub(super) fn mark(&mut self, key: NetnsKey, entry: Entry) {
        if let Some(a) = &mut self.active
            && a.dump.target == key
            && a.dump.table == entry.table()
        {
            a.seen.insert(entry);
        }
    }

    /// The dump under way has been unanswered too long. The kernel always
    /// finishes a dump we read; one that does not is a lost request.
    pub(super) fn stuck(&self, now: SystemTime) -> bool {
        self.active.as_ref().is_some_and(|a| age(now, a.started_at) > STUCK)
    }

    /// Ends the dump under way.
    pub(super) fn end(&mut self, end: DumpEnd) -> Option<Ended> {
        let active = self.active.take()?;
        let (dump, nsid) = (active.dump, active.nsid);
        let outcome = match end {
            DumpEnd::Complete => {
                if nsid.is_some() {
                    self.targeted_dumps_work = true;
                }
                if active.interrupted {
                    // The kernel says the dump may be inconsistent: do it
                    // again rather than sweep on it.
                    self.queued.push_front(dump);
                    Outcome::Repeat
                } else {
                    Outcome::Complete { seen: active.seen, started_epoch: active.started_epoch }
                }
            }
            // Only trusted once a dump by target nsid has worked here
            // (older kernels refuse them all).
            DumpEnd::Refused(errno) => match dump.target {
                NetnsKey::Record(id) if errno == libc::EINVAL && nsid.is_some() && self.targeted_dumps_work => {
                    Outcome::NsidGone(id)
                }
                _ => {
                    debug!(errno, table = ?dump.table, ?nsid, "dump refused");
                    Outcome::Nothing
                }
            },
            DumpEnd::Lost => Outcome::Nothing,
        };
        Some(Ended { dump, nsid, outcome })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const T0: SystemTime = SystemTime::UNIX_EPOCH;

    fn links_of(id: RecordId) -> Dump {
        Dump { target: NetnsKey::Record(id), table: Table::Links, counting: false, for_resync: false }
    }

    /// Starts the next queued dump aimed at `nsid` and ends it with `end`.
    fn run(q: &mut DumpQueue, nsid: Option<i32>, seq: u32, end: DumpEnd) -> Ended {
        let dump = q.next_queued().expect("a queued dump");
        q.start(dump, nsid, seq, 1, T0);
        assert!(q.answers(seq));
        q.end(end).expect("a dump under way")
    }

    /// Older kernels refuse every dump by target nsid: an EINVAL is the
    /// kernel's word that the nsid is gone only once one has worked.
    #[test]
    fn a_refused_targeted_dump_means_nsid_gone_only_once_targeted_dumps_worked() {
        let mut q = DumpQueue::default();
        q.queue(links_of(1));
        assert_eq!(run(&mut q, Some(7), 1, DumpEnd::Refused(libc::EINVAL)).outcome, Outcome::Nothing);
        q.queue(links_of(2));
        assert!(matches!(run(&mut q, Some(8), 2, DumpEnd::Complete).outcome, Outcome::Complete { .. }));
        q.queue(links_of(1));
        assert_eq!(run(&mut q, Some(7), 3, DumpEnd::Refused(libc::EINVAL)).outcome, Outcome::NsidGone(1));
        // Another errno, or a dump of the agent's own netns, says nothing.
        q.queue(links_of(1));
        assert_eq!(run(&mut q, Some(7), 4, DumpEnd::Refused(libc::EPERM)).outcome, Outcome::Nothing);
        q.queue(Dump { target: NetnsKey::Host, table: Table::Links, counting: false, for_resync: false });
        assert_eq!(run(&mut q, None, 5, DumpEnd::Refused(libc::EINVAL)).outcome, Outcome::Nothing);
    }

    #[test]
    fn a_lost_dump_teaches_nothing_and_frees_the_queue() {
        let mut q = DumpQueue::default();
        q.queue(links_of(1));
        q.queue(links_of(2));
        let dump = q.next_queued().expect("queued");
        q.start(dump, Some(7), 1, 1, T0);
        assert!(!q.stuck(T0 + STUCK) && q.stuck(T0 + STUCK + Duration::from_secs(1)));
        assert_eq!(q.end(DumpEnd::Lost).map(|e| e.outcome), Some(Outcome::Nothing));
        assert!(!q.busy());
        assert_eq!(q.next_queued(), Some(links_of(2)));
    }

    #[test]
    fn marks_count_only_for_the_dump_under_way() {
        let mut q = DumpQueue::default();
        q.queue(links_of(1));
        let dump = q.next_queued().expect("queued");
        q.start(dump, Some(7), 1, 1, T0);
        q.mark(NetnsKey::Record(1), Entry::Link(3));
        q.mark(NetnsKey::Record(2), Entry::Link(4));
        q.mark(NetnsKey::Record(1), Entry::Nsid(7));
        let Some(Ended { outcome: Outcome::Complete { seen, .. }, .. }) = q.end(DumpEnd::Complete) else {
            panic!("not complete");
        };
        assert_eq!(seen, HashSet::from([Entry::Link(3)]));
    }

    #[test]
    fn a_duplicate_merges_and_a_resync_dump_replaces_a_plain_one() {
        let mut q = DumpQueue::default();
        q.queue(links_of(1));
        q.queue(Dump { counting: true, ..links_of(1) });
        assert_eq!(q.next_queued(), Some(Dump { counting: true, ..links_of(1) }));
        assert_eq!(q.next_queued(), None);
        q.queue(links_of(1));
        q.queue_for_resync(vec![Dump { for_resync: true, ..links_of(1) }]);
        assert_eq!(q.next_queued(), Some(Dump { for_resync: true, ..links_of(1) }));
        assert_eq!(q.next_queued(), None);
    }
}
