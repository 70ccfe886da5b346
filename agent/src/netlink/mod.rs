//! rtnetlink, the first channel of evidence: one socket in the agent's
//! netns that hears links, addresses, routes and nsids of every netns that
//! has an nsid here (`socket`, netlink-sys read with recvmsg), the messages
//! it carries (`wire`, parsed and built with netlink-packet-route), the
//! kernel-side filter that keeps the model's noise out (`filter`), and
//! direct questions to the kernel (`query`).

pub mod filter;
pub mod query;
pub mod socket;
pub mod wire;

pub use socket::{Datagram, RtnlSocket, SocketError, SocketOptions};
pub use wire::{Address, Header, Link, Message, Route, WireError};

/// Large enough for any rtnetlink datagram: the kernel caps dump skbs at
/// 32 KiB whatever the reader offers.
pub const RECV_BUFFER: usize = 64 * 1024;
