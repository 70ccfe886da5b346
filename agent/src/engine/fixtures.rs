//! Test fixtures shared by the engine's and the death path's tests: one
//! clock, one host-local reservation, and proptest generators of
//! observations over an alphabet each test module picks (small, so that
//! containers, IPs, netns and paths meet often).

use std::{
    net::IpAddr,
    path::PathBuf,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use proptest::prelude::*;

use super::{Binding, BindingSource, DeadNetns, LiveNetns, NetnsId, NetnsName};
use crate::ipam::{Reservation, ReservationData, StoreRef};

/// A wall-clock time `secs` after the tests' epoch.
pub(crate) fn t(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

/// "Now" in every test; reservations made at t(0) are 10 000 s old.
pub(crate) const NOW_SECS: u64 = 10_000;

pub(crate) fn now() -> SystemTime {
    t(NOW_SECS)
}

pub(crate) fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A host-local reservation of `addr` in network `net1`.
pub(crate) fn res(cid: &str, addr: &str, created: SystemTime) -> Reservation {
    Reservation::from(ReservationData {
        store: StoreRef::HostLocal { data_dir: "/var/lib/cni/networks".into() }.into(),
        network: "net1".into(),
        ip: ip(addr),
        container_id: cid.into(),
        ifname: Some("eth0".into()),
        created_at: created,
        path: format!("/var/lib/cni/networks/net1/{addr}").into(),
        inode: 1,
    })
}

/// What a module's generated observations are made of.
pub(crate) struct Alphabet {
    pub cids: &'static [&'static str],
    pub ips: &'static [&'static str],
    pub paths: &'static [&'static str],
    pub times: BoxedStrategy<SystemTime>,
    pub netns_ids: BoxedStrategy<NetnsId>,
    pub sources: &'static [BindingSource],
    /// A netns view names fewer than this many containers and addresses.
    pub most: usize,
}

impl Alphabet {
    pub(crate) fn cid(&self) -> impl Strategy<Value = String> + use<> {
        prop::sample::select(self.cids).prop_map(str::to_owned)
    }

    pub(crate) fn ip(&self) -> impl Strategy<Value = IpAddr> + use<> {
        prop::sample::select(self.ips).prop_map(ip)
    }

    pub(crate) fn path(&self) -> impl Strategy<Value = PathBuf> + use<> {
        prop::sample::select(self.paths).prop_map(PathBuf::from)
    }

    pub(crate) fn time(&self) -> BoxedStrategy<SystemTime> {
        self.times.clone()
    }

    pub(crate) fn netns_id(&self) -> BoxedStrategy<NetnsId> {
        self.netns_ids.clone()
    }

    pub(crate) fn netns_name(&self) -> impl Strategy<Value = NetnsName> + use<> {
        prop_oneof![self.netns_id().prop_map(NetnsName::Id), self.path().prop_map(NetnsName::Path)]
    }

    pub(crate) fn live(&self) -> impl Strategy<Value = LiveNetns> + use<> {
        (
            self.netns_id(),
            prop::collection::vec(self.cid(), 0..self.most),
            prop::collection::vec(self.ip(), 0..self.most),
            prop::collection::vec(self.path(), 0..2),
        )
            .prop_map(|(id, container_ids, addresses, paths)| LiveNetns {
                id,
                container_ids,
                addresses,
                paths,
            })
    }

    pub(crate) fn dead(&self) -> impl Strategy<Value = DeadNetns> + use<> {
        (
            self.netns_id(),
            self.time(),
            prop::collection::vec(self.cid(), 0..self.most),
            prop::collection::vec(self.ip(), 0..self.most),
            prop::collection::vec(self.path(), 0..2),
        )
            .prop_map(|(id, died_at, container_ids, addresses, paths)| DeadNetns {
                id,
                died_at,
                container_ids,
                addresses,
                paths,
            })
    }

    pub(crate) fn binding(&self) -> impl Strategy<Value = Binding> + use<> {
        let source = prop::sample::select(self.sources);
        (self.cid(), self.netns_name(), source, self.time())
            .prop_map(|(container_id, netns, source, seen_at)| Binding { container_id, netns, source, seen_at })
    }
}
