//! The pure decision engine: (observations, reservations, now, policy) ->
//! one verdict per reservation, each with the evidence that decided it. No
//! I/O and no clock here, so every rule can be tested exhaustively.

pub mod claim;
pub mod decide;
pub mod index;
pub mod observations;
pub mod policy;
pub mod runtime;
pub mod scan_report;
pub mod verdict;

#[cfg(test)]
pub(crate) mod fixtures;
#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

pub use claim::Claim;
pub use decide::{decide, decide_one};
pub use observations::{ApiPod, Binding, BindingSource, CniOp, DeadNetns, LiveNetns, NetnsId, NetnsName, Observations};
pub use policy::{DEFAULT_IN_FLIGHT_GRACE, DEFAULT_ORPHAN_GRACE, Policy};
pub use runtime::{PodRef, RuntimeSandbox, RuntimeView, SandboxState, StuckSandbox};
pub use scan_report::{NetworkTotals, ScanReport, Sources};
pub use verdict::{BoundBy, Evidence, Fact, Status, Verdict};
