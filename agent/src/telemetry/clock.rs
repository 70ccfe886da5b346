//! Kernel records carry CLOCK_MONOTONIC; the stream shows wall time too.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Converts CLOCK_MONOTONIC nanoseconds to wall-clock time.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// realtime - monotonic, in nanoseconds, measured once at start.
    offset_ns: i128,
}

/// CLOCK_MONOTONIC now, in nanoseconds (bpf_ktime_get_ns's clock).
#[must_use]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Clock {
    #[must_use]
    pub fn new() -> Self {
        let mono = monotonic_ns();
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
        Self { offset_ns: wall as i128 - i128::from(mono) }
    }

    #[must_use]
    pub fn wall(&self, ktime_ns: u64) -> SystemTime {
        let ns = (i128::from(ktime_ns) + self.offset_ns).max(0);
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// RFC 3339 with milliseconds, UTC.
#[must_use]
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}
