//! The decision engine's knobs and their safe defaults, in one place.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::timefmt;

/// Default [`Policy::in_flight_grace`]: 30 s.
///
/// host-local writes the reservation file in the middle of an ADD, before
/// the address is configured and (for a chain) long before libcni writes its
/// cache. A reservation this young is kept whatever else is known, which
/// covers an agent that started mid-ADD, a lost exec record and a netns not
/// yet discovered. Plugins usually finish an ADD in well under a second; a
/// slow IPAM or a loaded node takes seconds, not tens of seconds.
pub const DEFAULT_IN_FLIGHT_GRACE: Duration = Duration::from_secs(30);

/// Default [`Policy::orphan_grace`]: 10 min.
///
/// Used only for reservations never seen bound to any netns (no CNI run,
/// no cache entry, no address seen): without a death to point at, only age
/// and the absence of the IP from every live netns speak for a leak. Cilium
/// expires such IPs after 10 min and Calico after 15; netreap usually has a
/// death event and does not wait at all.
pub const DEFAULT_ORPHAN_GRACE: Duration = Duration::from_mins(10);

/// Graces of the decision rule. Deserializes from e.g.
/// `{"in_flight_grace": "30s", "orphan_grace": "10m"}`; a missing field takes
/// its default, an unknown one is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// A reservation younger than this is pending, whatever else is known.
    #[serde(with = "timefmt::duration")]
    pub in_flight_grace: Duration,
    /// A reservation never seen bound must be older than this to be orphaned.
    #[serde(with = "timefmt::duration")]
    pub orphan_grace: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self { in_flight_grace: DEFAULT_IN_FLIGHT_GRACE, orphan_grace: DEFAULT_ORPHAN_GRACE }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deserializes_with_defaults_and_rejects_unknown_fields() {
        let p: Policy = serde_json::from_str(r#"{"orphan_grace": "2m"}"#).unwrap();
        assert_eq!(p, Policy { in_flight_grace: DEFAULT_IN_FLIGHT_GRACE, orphan_grace: Duration::from_mins(2) });
        assert!(serde_json::from_str::<Policy>(r#"{"orphan_gr": "2m"}"#).is_err());
        assert!(serde_json::from_str::<Policy>(r#"{"orphan_grace": "soon"}"#).is_err());
        let round: Policy = serde_json::from_str(&serde_json::to_string(&Policy::default()).unwrap()).unwrap();
        assert_eq!(round, Policy::default());
    }
}
