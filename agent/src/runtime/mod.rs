//! The container runtime as a source of evidence: a CRI client (runtime.v1
//! over the runtime's unix socket) that turns the runtime's sandbox list into
//! the engine's [`crate::engine::RuntimeView`].
//!
//! Optional by design: without a socket, or with a runtime that stops
//! answering, netreap decides on kernel evidence alone and says so.
//!
//! - `socket`: which socket (flag/config, else the known defaults);
//! - `info`: parsing the verbose answers (pure, unit-tested on recorded
//!   responses of the real containerd);
//! - `client`: the gRPC calls;
//! - `witness`: one view per reconcile, with a cache of what does not change.

pub mod client;
pub mod info;
pub mod socket;
pub mod witness;

use std::{path::PathBuf, time::Duration};

pub use client::CriClient;
/// The CRI protos (runtime.v1), for callers that drive the runtime.
pub use k8s_cri::v1 as api;
pub use socket::{DEFAULT_SOCKETS, SocketChoice};
pub use witness::RuntimeWitness;

/// How long one CRI call may take before the runtime counts as unreachable
/// for this reconcile. containerd answers in milliseconds; a runtime that
/// takes seconds is wedged, and the kernel's evidence must not wait for it.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{0}")]
    NoSocket(String),
    #[error("CRI socket {}: cannot connect: {source}", .socket.display())]
    Connect { socket: PathBuf, source: tonic::transport::Error },
    #[error("CRI {call} on {}: {status}", .socket.display())]
    Call { socket: PathBuf, call: &'static str, status: Box<tonic::Status> },
    #[error("CRI {call} on {}: no answer within {}", .socket.display(), humantime::format_duration(*.after))]
    Timeout { socket: PathBuf, call: &'static str, after: Duration },
}

impl RuntimeError {
    /// The runtime does not implement the call (e.g. GetContainerEvents
    /// before containerd 1.7).
    #[must_use]
    pub fn is_unimplemented(&self) -> bool {
        matches!(self, Self::Call { status, .. } if status.code() == tonic::Code::Unimplemented)
    }
}
