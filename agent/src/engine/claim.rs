//! What the engine reads of a reservation: its IP, the container that holds
//! it, the network it belongs to and when it was made. Any store's
//! reservation can be judged by implementing this; the engine never sees
//! where or how a store keeps it.

use std::{net::IpAddr, time::SystemTime};

/// One IP held by one container, as the engine judges it.
pub trait Claim {
    fn ip(&self) -> IpAddr;
    /// The container ID the store recorded as the holder.
    fn container_id(&self) -> &str;
    /// The CNI network (host-local directory, whereabouts pool) it is in.
    fn network(&self) -> &str;
    /// When the store made it (host-local: the file's mtime).
    fn reserved_at(&self) -> SystemTime;
}
