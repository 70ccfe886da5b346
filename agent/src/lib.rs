//! netreap: releases pod IP reservations whose network namespace is gone,
//! on kernel evidence.
//!
//! Data flow, one folder each: `kernel` (eBPF probes) -> `telemetry`
//! (event stream, logs).
//!
//! Namespaces: `discovery` (nsfs mounts, /proc/*/ns/net), `netlink` (one
//! rtnetlink socket hearing every netns by nsid) and `kernel` -> `model`
//! (every netns with its links, addresses, host routes and death).
//!
//! Reservations: `ipam` (host-local data dirs, libcni cache; anomalies are
//! reported, never touched) -> `engine` (pure decision: in use, pending,
//! orphaned, conflict, with evidence) -> `release` (journaled, under the
//! plugin's lock; re-verified after a crash).
//!
//! Kubernetes (optional): `kube` (the node's pods as evidence, whereabouts
//! IPPools as a store, Events).

pub mod cnirt;
pub mod config;
pub mod cpus;
pub mod daemon;
pub mod discovery;
pub mod engine;
pub mod fast;
pub mod identity;
pub mod ipam;
pub mod kernel;
pub mod kube;
pub mod ledger;
pub mod model;
pub mod netlink;
pub mod release;
pub mod runtime;
pub mod sources;
pub mod telemetry;
#[cfg(test)]
mod test_netns;
pub mod timefmt;
