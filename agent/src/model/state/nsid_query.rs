//! The nsid request protocol: `RTM_NEWNSID` (assign one) and
//! `RTM_GETNSID` (which one) sent with an fd of a netns, and their answers
//! matched by sequence number. An answer says which nsid a netns has; what
//! that means for the registry is the router's to apply.

use std::{collections::HashMap, os::fd::RawFd, time::SystemTime};

use tracing::warn;

use super::{super::snapshot::NetnsInode, STUCK, age};
use crate::netlink::wire::{self, Message};

/// The netns a request was sent for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QueryTarget {
    /// The agent's own.
    Host,
    Inode(NetnsInode),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QueryKind {
    Assign,
    Get,
}

#[derive(Debug, Clone, Copy)]
struct Query {
    target: QueryTarget,
    kind: QueryKind,
    sent: SystemTime,
    /// Sent during a counting resync's scan: a netns found this way is a
    /// correction.
    counting: bool,
}

/// What a message answering one of our requests means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Answer {
    /// The kernel says `target` has `nsid`.
    Bound { target: QueryTarget, nsid: i32, counting: bool },
    /// The request is answered and there is nothing to apply.
    Settled,
}

/// Requests sent and not answered yet, by sequence number.
#[derive(Debug, Default)]
pub(super) struct NsidQueries {
    pending: HashMap<u32, Query>,
}

impl NsidQueries {
    /// The request asking the kernel to give `target` (opened as `fd`) an
    /// nsid, sent with `seq`.
    pub(super) fn assign(
        &mut self,
        target: QueryTarget,
        seq: u32,
        fd: RawFd,
        now: SystemTime,
        counting: bool,
    ) -> Vec<u8> {
        self.pending.insert(seq, Query { target, kind: QueryKind::Assign, sent: now, counting });
        wire::assign_nsid(seq, fd)
    }

    /// The request asking the kernel which nsid `target` (opened as `fd`)
    /// has, sent with `seq`.
    pub(super) fn get(&mut self, target: QueryTarget, seq: u32, fd: RawFd, now: SystemTime, counting: bool) -> Vec<u8> {
        self.pending.insert(seq, Query { target, kind: QueryKind::Get, sent: now, counting });
        wire::get_nsid(seq, fd)
    }

    /// `message`, from the agent's own netns with sequence number `seq`:
    /// `None` when it answers none of our requests.
    pub(super) fn answer(&mut self, seq: u32, message: &Message) -> Option<Answer> {
        let query = self.pending.get(&seq).copied()?;
        match *message {
            Message::NewNsid { nsid } => {
                self.pending.remove(&seq);
                if let Some(nsid) = nsid {
                    return Some(Answer::Bound { target: query.target, nsid, counting: query.counting });
                }
                warn!(target = ?query.target, "netns still has no nsid after assignment");
                Some(Answer::Settled)
            }
            Message::Error { errno, .. } => {
                self.pending.remove(&seq);
                if !(errno == libc::EEXIST && query.kind == QueryKind::Assign) && errno != 0 {
                    warn!(target = ?query.target, errno, "nsid request failed");
                }
                Some(Answer::Settled)
            }
            _ => None,
        }
    }

    /// Forgets requests unanswered too long (their answers were lost).
    pub(super) fn prune(&mut self, now: SystemTime) {
        self.pending.retain(|_, q| age(now, q.sent) <= STUCK);
    }

    /// No request is waiting for its answer.
    pub(super) fn is_idle(&self) -> bool {
        self.pending.is_empty()
    }
}
