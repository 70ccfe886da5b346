//! Views that no longer change (the recently dead), indexed once, in sealed
//! chunks shared by every snapshot. A death's pass asks the chunks which of
//! them hold an address or were mounted under a name, instead of filing
//! every dead view of the last minutes again (up to 4,096, one view after
//! another, for every death).
//!
//! A chunk answers with offsets into its own run of views; a snapshot's
//! [`SealedViews`] says where that run sits in its `netns`, and which of the
//! chunk's first views are already forgotten (the oldest deaths go first).

use std::{ffi::OsStr, net::IpAddr, ops::Range, sync::Arc};

use super::snapshot::NetnsView;
use crate::identity::last_name;

/// Views per chunk: a pass asks at most `max_dead / CHUNK` chunks.
pub const CHUNK: usize = 64;

/// A run of consecutive views, indexed when it was sealed.
#[derive(Debug, PartialEq, Eq)]
pub struct SealedChunk {
    len: usize,
    /// Each global address with the offset of its view, sorted.
    ips: Vec<(IpAddr, usize)>,
    /// Each bind mount's last component ([`last_name`]) with the offset of
    /// its view, sorted.
    mounts: Vec<(Option<Box<OsStr>>, usize)>,
}

impl SealedChunk {
    #[must_use]
    pub fn new<'v>(views: impl IntoIterator<Item = &'v NetnsView>) -> Self {
        let (mut ips, mut mounts, mut len) = (Vec::new(), Vec::new(), 0);
        for (offset, view) in views.into_iter().enumerate() {
            ips.extend(view.global_addresses().map(|a| (a.ip, offset)));
            mounts.extend(view.bind_mounts.iter().map(|m| (last_name(m).map(Box::from), offset)));
            len = offset + 1;
        }
        ips.sort_unstable();
        mounts.sort_unstable();
        Self { len, ips, mounts }
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offsets of the views holding `ip`.
    fn at_ip(&self, ip: IpAddr) -> impl Iterator<Item = usize> + '_ {
        let from = self.ips.partition_point(|(k, _)| *k < ip);
        self.ips[from..].iter().take_while(move |(k, _)| *k == ip).map(|&(_, offset)| offset)
    }

    /// Offsets of the views mounted at a path whose last component is `name`.
    fn at_mount<'s>(&'s self, name: Option<&'s OsStr>) -> impl Iterator<Item = usize> + 's {
        let from = self.mounts.partition_point(|(k, _)| k.as_deref() < name);
        self.mounts[from..].iter().take_while(move |(k, _)| k.as_deref() == name).map(|&(_, offset)| offset)
    }
}

/// How many views these chunks hold, less the first `skip` (at most the
/// first chunk's length).
pub fn covered_by<'c>(chunks: impl IntoIterator<Item = &'c Arc<SealedChunk>>, skip: usize) -> usize {
    chunks.into_iter().map(|c| c.len()).sum::<usize>().saturating_sub(skip)
}

/// Which views of a snapshot's `netns` sealed chunks index: consecutive
/// positions from `start`, the chunks' views in order after the first
/// `skip` of the first chunk (forgotten since it was sealed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SealedViews {
    chunks: Vec<Arc<SealedChunk>>,
    start: usize,
    skip: usize,
}

impl SealedViews {
    /// None indexed (every view is filed by the pass that reads it).
    pub const NONE: Self = Self { chunks: Vec::new(), start: 0, skip: 0 };

    /// These chunks' views from position `start` on, less the first `skip`.
    /// `None` when `skip` is not inside the first chunk.
    #[must_use]
    pub fn new(chunks: Vec<Arc<SealedChunk>>, start: usize, skip: usize) -> Option<Self> {
        let first = chunks.first().map_or(0, |c| c.len());
        (skip == 0 || skip < first).then_some(Self { chunks, start, skip })
    }

    /// The positions the chunks index.
    #[must_use]
    pub fn covered(&self) -> Range<usize> {
        self.start..self.start + covered_by(&self.chunks, self.skip)
    }

    /// Pushes the positions of the covered views holding `ip`.
    pub fn at_ip(&self, ip: IpAddr, out: &mut Vec<usize>) {
        self.positions(out, |chunk| chunk.at_ip(ip).collect());
    }

    /// Pushes the positions of the covered views mounted at a path whose
    /// last component ([`last_name`]) is `name`.
    pub fn at_mount(&self, name: Option<&OsStr>, out: &mut Vec<usize>) {
        self.positions(out, |chunk| chunk.at_mount(name).collect());
    }

    fn positions(&self, out: &mut Vec<usize>, mut offsets: impl FnMut(&SealedChunk) -> Vec<usize>) {
        // `before`: the chunk's first view's place among the chunks' views.
        let mut before = 0;
        for chunk in &self.chunks {
            for offset in offsets(chunk) {
                let at = before + offset;
                if at >= self.skip {
                    out.push(self.start + at - self.skip);
                }
            }
            before += chunk.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        net::Ipv4Addr,
        path::PathBuf,
        time::{Duration, UNIX_EPOCH},
    };

    use super::*;
    use crate::model::snapshot::{AddrScope, AddressView};

    fn view(ip: Option<u8>, link_local: bool, mount: Option<&str>) -> NetnsView {
        let address = |ip: IpAddr, scope| AddressView { ip, prefix_len: 24, ifindex: 2, ifname: None, scope };
        let mut addresses: Vec<AddressView> =
            ip.map(|i| address(IpAddr::V4(Ipv4Addr::new(10, 0, 0, i)), AddrScope::Global)).into_iter().collect();
        if link_local {
            addresses.push(address(IpAddr::V4(Ipv4Addr::new(169, 254, 0, 1)), AddrScope::Link));
        }
        NetnsView {
            inode: Some(1),
            nsid: None,
            host: false,
            alive: false,
            first_seen: UNIX_EPOCH,
            died_at: Some(UNIX_EPOCH + Duration::from_secs(1)),
            death_source: None,
            creator: None,
            bind_mounts: mount.map(PathBuf::from).into_iter().collect(),
            process_count: 0,
            processes: Vec::new(),
            interfaces: Vec::new(),
            addresses,
            host_routes: Vec::new(),
        }
    }

    #[test]
    fn chunks_answer_what_a_walk_of_the_covered_views_finds() {
        use proptest::prelude::*;
        let one = (proptest::option::of(0_u8..4), any::<bool>(), proptest::option::of(0_usize..4));
        let mounts = ["/run/netns/a", "/var/run/netns/a", "/run/netns/b", "/"];
        let case = (proptest::collection::vec(one, 0..40), 1_usize..5, 0_usize..5, 0_usize..4);
        proptest!(ProptestConfig::with_cases(500), |((views, chunk, skip, start) in case)| {
            let views: Vec<Arc<NetnsView>> =
                views.into_iter().map(|(ip, ll, m)| Arc::new(view(ip, ll, m.map(|m| mounts[m])))).collect();
            let chunks: Vec<Arc<SealedChunk>> =
                views.chunks(chunk).map(|c| Arc::new(SealedChunk::new(c.iter().map(Arc::as_ref)))).collect();
            let Some(sealed) = SealedViews::new(chunks, start, skip) else {
                prop_assert!(skip > 0 && skip >= chunk.min(views.len()));
                return Ok(());
            };
            // The snapshot: `start` views of its own, then the chunks' views
            // less the first `skip`.
            let snapshot: Vec<&NetnsView> = std::iter::repeat_n(views.first(), start)
                .flatten()
                .chain(views.iter().skip(skip))
                .map(Arc::as_ref)
                .collect();
            prop_assert_eq!(sealed.covered(), start..snapshot.len().max(start));
            for i in 0..5 {
                let ip = IpAddr::V4(Ipv4Addr::new(10, 0, 0, i));
                let mut found = Vec::new();
                sealed.at_ip(ip, &mut found);
                found.sort_unstable();
                let walked: Vec<usize> = sealed
                    .covered()
                    .filter(|&p| snapshot[p].global_addresses().any(|a| a.ip == ip))
                    .collect();
                prop_assert_eq!(found, walked, "{}", ip);
            }
            let link_local = IpAddr::V4(Ipv4Addr::new(169, 254, 0, 1));
            let mut found = Vec::new();
            sealed.at_ip(link_local, &mut found);
            prop_assert!(found.is_empty(), "a link-local address is not filed");
            for name in ["a", "b", "c"].map(|n| Some(OsStr::new(n))).into_iter().chain([None]) {
                let mut found = Vec::new();
                sealed.at_mount(name, &mut found);
                found.sort_unstable();
                let walked: Vec<usize> = sealed
                    .covered()
                    .filter(|&p| snapshot[p].bind_mounts.iter().any(|m| last_name(m) == name))
                    .collect();
                prop_assert_eq!(found, walked, "{:?}", name);
            }
        });
    }
}
