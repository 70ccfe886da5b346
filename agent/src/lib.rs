//! netreap: releases pod IP reservations whose network namespace is gone,
//! on kernel evidence.
//!
//! Data flow, one folder each: `kernel` (eBPF probes) -> `telemetry`
//! (event stream, logs).

pub mod cnirt;
pub mod config;
pub mod kernel;
pub mod ledger;
pub mod telemetry;
