//! The ring buffer as an async stream of decoded records.

use aya::maps::{MapData, RingBuf};
use tokio::io::{Interest, unix::AsyncFd};

use super::{
    events::{DecodeError, KernelEvent, decode},
    probes::{DropCounter, ProbeError, Probes},
};

/// Reads records as the kernel writes them; see [`KernelStream::next_batch`]
/// and [`KernelStream::pending`].
pub struct KernelStream {
    ring: AsyncFd<RingBuf<MapData>>,
    drops: DropCounter,
    drops_seen: u64,
}

impl KernelStream {
    /// Takes the ring buffer of loaded probes. Needs a tokio reactor.
    pub fn new(probes: &mut Probes) -> Result<Self, ProbeError> {
        let (ring, drops) = probes.take_channels()?;
        // SAFETY: RingBuf owns its map fd for its whole life and always
        // returns that same fd; the AsyncFd owns the RingBuf.
        let ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(|e| ProbeError::Poll(e.into()))?;
        Ok(Self { ring, drops, drops_seen: 0 })
    }

    /// Waits until records are ready, then drains every one available.
    pub async fn next_batch(&mut self) -> Result<Vec<Result<KernelEvent, DecodeError>>, ProbeError> {
        loop {
            let mut guard = self.ring.readable_mut().await.map_err(ProbeError::Poll)?;
            let ring = guard.get_inner_mut();
            let mut batch = Vec::new();
            while let Some(item) = ring.next() {
                batch.push(decode(&item));
            }
            guard.clear_ready();
            if !batch.is_empty() {
                return Ok(batch);
            }
        }
    }

    /// Every record written so far, without waiting. The probes let a DEL's
    /// exec record wait for its exit, and a nested CNI run's records for
    /// its parent's exit, before waking the agent, so whatever decides
    /// reads the ring first (see `Agent::catch_up`).
    pub fn pending(&mut self) -> Vec<Result<KernelEvent, DecodeError>> {
        let ring = self.ring.get_mut();
        let mut batch = Vec::new();
        while let Some(item) = ring.next() {
            batch.push(decode(&item));
        }
        batch
    }

    /// Records the kernel dropped since the last call (ring buffer full).
    pub fn new_drops(&mut self) -> Result<u64, ProbeError> {
        let total = self.drops.total()?;
        let new = total.saturating_sub(self.drops_seen);
        self.drops_seen = total;
        Ok(new)
    }
}
