//! How many CPUs the agent may use, found once: std reads the cgroup's CPU
//! quota files each time it is asked (half a dozen reads of /proc and /sys),
//! and every scan and every decide asks, on each pod's death.

use std::{num::NonZero, sync::OnceLock};

/// `available_parallelism`, asked once per process (1 when it cannot tell).
#[must_use]
pub fn available() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, NonZero::get))
}
