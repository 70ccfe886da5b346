//! The router's netlink side: each datagram decoded, and each message
//! routed, in arrival order, to the dump under way, the nsid request it
//! answers, or the registry as a notification. `RTM_DELNSID` in the
//! agent's own frame and a refused dump aimed at a record's nsid (once
//! such dumps are known to work) are deaths; nothing else here is.

use std::time::SystemTime;

use tracing::{debug, warn};

use super::{
    Model,
    dumps::{Dump, DumpEnd, Outcome},
    nsid_query::Answer,
    records::{Entry, NetnsKey, Table},
    registry::Origin,
};
use crate::{
    model::snapshot::DeathSource,
    netlink::wire::{self, Header, Message},
};

impl Model {
    /// One datagram from the socket. `origin_nsid` is its
    /// `NETLINK_LISTEN_ALL_NSID` control message.
    pub fn datagram(&mut self, origin_nsid: Option<i32>, bytes: &[u8], now: SystemTime) {
        self.last_now = now;
        for item in wire::messages(bytes) {
            match item {
                Err(e) => {
                    self.counts.malformed_messages += 1;
                    warn!("malformed netlink datagram, rest skipped: {e}");
                    break;
                }
                Ok((header, payload)) => match wire::decode(&header, payload) {
                    Ok(message) => self.message(origin_nsid, &header, message, now),
                    Err(e) => {
                        self.counts.malformed_messages += 1;
                        warn!(kind = header.kind, "malformed netlink message skipped: {e}");
                    }
                },
            }
        }
    }

    fn message(&mut self, origin_nsid: Option<i32>, header: &Header, message: Message, now: SystemTime) {
        let origin = self.registry.origin(origin_nsid);
        if origin == Origin::Host && header.seq != 0 {
            if self.dumps.answers(header.seq) {
                self.dump_part(header, message, now);
                return;
            }
            match self.queries.answer(header.seq, &message) {
                Some(Answer::Bound { target, nsid, counting }) => return self.bind(target, nsid, counting, now),
                Some(Answer::Settled) => return,
                None => {}
            }
        }
        match message {
            // Never the host's own nsid: a late reply to a pruned query can
            // carry it.
            Message::NewNsid { nsid: Some(n) } if origin == Origin::Host && Some(n) != self.registry.host_nsid() => {
                self.nsid_appeared(n, now);
            }
            Message::DelNsid { nsid: Some(n) } if origin == Origin::Host => {
                if let Some(id) = self.registry.by_nsid(n) {
                    self.die(id, DeathSource::RtmDelnsid, now);
                } else {
                    debug!(nsid = n, "RTM_DELNSID for an nsid the model never bound");
                }
            }
            Message::NewLink(_)
            | Message::DelLink(_)
            | Message::NewAddress(_)
            | Message::DelAddress(_)
            | Message::NewRoute(_)
            | Message::DelRoute(_) => {
                let key = match origin {
                    Origin::Host => NetnsKey::Host,
                    Origin::Record(id) => NetnsKey::Record(id),
                    // An event can beat the RTM_NEWNSID that announces its
                    // netns; the nsid is valid, so start the record here.
                    Origin::Unknown(n) => NetnsKey::Record(self.nsid_appeared(n, now)),
                };
                self.event(key, message, now);
            }
            Message::Error { errno, request_seq } if errno != 0 => {
                debug!(errno, ?request_seq, "netlink error for a request no longer tracked");
            }
            // Other netns numbering their peers (not our frame of reference),
            // stray acknowledgements, types we did not ask for.
            Message::NewNsid { .. }
            | Message::DelNsid { .. }
            | Message::Done { .. }
            | Message::Error { .. }
            | Message::Other => {}
        }
    }

    /// A notification about `key` (not a dump part).
    fn event(&mut self, key: NetnsKey, message: Message, now: SystemTime) {
        let applied = self.registry.apply_event(key, message, now);
        if let Some(entry) = applied.shown {
            self.dumps.mark(key, entry);
        }
        if applied.needs_link_dump {
            match key {
                NetnsKey::Record(id) => {
                    if !self.peer_checks.contains(&id) {
                        self.peer_checks.push(id);
                    }
                }
                NetnsKey::Host => {
                    self.queue_dump(Dump { target: key, table: Table::Links, counting: false, for_resync: false });
                }
            }
        }
    }

    fn dump_part(&mut self, header: &Header, message: Message, now: SystemTime) {
        let Some((dump, nsid)) = self.dumps.part(header) else {
            return;
        };
        // Parts for a record that died mid-dump describe whoever holds the
        // nsid now: drop them, that netns gets its own dump.
        let target_alive = match dump.target {
            NetnsKey::Host => true,
            NetnsKey::Record(id) => self.registry.holds_nsid(id, nsid),
        };
        if target_alive && !matches!(message, Message::Done { .. } | Message::Error { .. }) {
            self.registry.touch(dump.target, now);
        }
        match message {
            Message::Done { error: 0 } => self.end_dump(DumpEnd::Complete),
            Message::Done { error } => self.end_dump(DumpEnd::Refused(error.saturating_neg())),
            Message::Error { errno, .. } => self.end_dump(DumpEnd::Refused(errno)),
            Message::NewNsid { nsid: Some(n) } if dump.table == Table::Nsids => {
                if Some(n) != self.registry.host_nsid() {
                    let known = self.registry.by_nsid(n).is_some();
                    self.nsid_appeared(n, now);
                    if !known && dump.counting {
                        self.registry.count_found();
                    }
                }
                self.dumps.mark(NetnsKey::Host, Entry::Nsid(n));
            }
            part if target_alive => {
                if let Some(entry) = self.registry.apply_dump_part(dump.target, dump.table, part, dump.counting) {
                    self.dumps.mark(dump.target, entry);
                }
            }
            _ => {}
        }
    }

    pub(super) fn end_dump(&mut self, end: DumpEnd) {
        let Some(ended) = self.dumps.end(end) else {
            return;
        };
        let (dump, nsid) = (ended.dump, ended.nsid);
        match ended.outcome {
            Outcome::Repeat => {}
            Outcome::Complete { seen, started_epoch } => {
                self.registry.sweep(dump.target, nsid, dump.table, &seen, started_epoch, dump.counting);
                self.dump_finished(dump);
            }
            Outcome::NsidGone(id) => {
                // The refusal is about this very record only if it still
                // holds the nsid the dump was aimed at.
                if nsid.is_some()
                    && self.registry.holds_nsid(id, nsid)
                    && let Some(at) = self.registry.last_alive(id)
                {
                    self.die(id, DeathSource::NsidGone, at);
                } else {
                    debug!(errno = libc::EINVAL, table = ?dump.table, ?nsid, "dump refused");
                }
                self.dump_finished(dump);
            }
            Outcome::Nothing => self.dump_finished(dump),
        }
        self.start_next_dump();
    }
}
