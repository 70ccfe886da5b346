//! The node model: every network namespace, its links, addresses, host
//! routes and its death, built from rtnetlink (`netlink`), discovery
//! (`discovery`) and the probes (`kernel`).
//!
//! - [`state`]: the model as a pure state machine (messages in, actions out):
//!   a router over its parts (the netns registry, the nsid requests, the
//!   dump queue, the resync, the view), one file each.
//! - [`watcher`]: runs it on the caller's tokio runtime; [`Watcher`] is the
//!   handle, the death receiver gets a [`NetnsDeath`] per death.
//! - [`snapshot`]: what it shows ([`ModelSnapshot`]), serializable; the
//!   input of the decision engine and of `netreap netns --json`.
//! - [`sealed`]: the dead views, indexed once in chunks every snapshot
//!   shares.
//! - `worker`: the discovery thread (blocking file-system work).

pub mod sealed;
pub mod snapshot;
pub mod state;
pub mod watcher;
mod worker;

pub use snapshot::{
    AddrScope, AddressView, Corrections, Creator, DeathSource, HostRouteView, InterfaceView, LinkRef, ModelSnapshot,
    ModelStats, NetnsDeath, NetnsInode, NetnsView, PeerNetns,
};
pub use state::{Model, ModelConfig};
pub use watcher::{ModelHandle, Watcher, WatcherConfig, WatcherError};
