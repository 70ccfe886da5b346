//! Unit tests of the model state machine, with fabricated kernel messages.

use std::{
    net::IpAddr,
    time::{Duration, SystemTime},
};

use super::*;
use crate::{
    kernel::events::Task,
    model::snapshot::NetnsView,
    netlink::wire::{self, Address, Link, Route, consts::*, fake},
};

const HOST: NetnsInode = 1;
const T0: SystemTime = SystemTime::UNIX_EPOCH;

fn model() -> Model {
    Model::new(ModelConfig::default(), HOST, T0)
}

/// The requests among `actions`: (type, seq, the bytes).
fn requests(actions: &[Action]) -> Vec<(u16, u32, Vec<u8>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { request, .. } => {
                let (h, _) = wire::messages(request).next()?.ok()?;
                Some((h.kind, h.seq, request.clone()))
            }
            _ => None,
        })
        .collect()
}

pub(in crate::model) fn deaths(actions: &[Action]) -> Vec<NetnsDeath> {
    actions.iter().filter_map(|a| if let Action::Death(d) = a { Some(d.clone()) } else { None }).collect()
}

fn link(ifindex: u32, name: &str, peer: Option<(u32, Option<i32>)>) -> Link {
    Link {
        ifindex,
        name: Some(name.into()),
        kind: Some("veth".into()),
        flags: IFF_UP,
        mac: None,
        link: peer.map(|p| p.0),
        link_netnsid: peer.and_then(|p| p.1),
        master: None,
        target_nsid: None,
    }
}

fn addr(ifindex: u32, ip: &str, prefix_len: u8) -> Address {
    Address { ifindex, prefix_len, scope: 0, ip: ip.parse().unwrap(), peer: None, label: None, target_nsid: None }
}

/// Answers every dump the model asks for with `parts`, until it asks for
/// no more; other actions are returned.
fn answer_dumps(m: &mut Model, parts: impl FnMut(u16, Option<i32>, u32) -> Vec<Vec<u8>>) -> Vec<Action> {
    answer_dumps_without(m, &[], parts)
}

/// Like `answer_dumps`, with the kernel refusing (EINVAL) every dump aimed
/// at an nsid in `gone`, as it does for an nsid it no longer has.
fn answer_dumps_without(
    m: &mut Model,
    gone: &[i32],
    mut parts: impl FnMut(u16, Option<i32>, u32) -> Vec<Vec<u8>>,
) -> Vec<Action> {
    let mut kept = Vec::new();
    loop {
        let actions = m.take_actions();
        if actions.is_empty() {
            return kept;
        }
        for action in actions {
            let Action::Send { request, dump_seq: Some(seq) } = &action else {
                kept.push(action);
                continue;
            };
            let (h, payload) = wire::messages(request).next().unwrap().unwrap();
            // The target nsid, when the dump names one.
            let target = match h.kind {
                RTM_GETLINK if payload.len() > 16 => Some(i32::from_ne_bytes(payload[20..24].try_into().unwrap())),
                RTM_GETADDR if payload.len() > 8 => Some(i32::from_ne_bytes(payload[12..16].try_into().unwrap())),
                _ => None,
            };
            if target.is_some_and(|t| gone.contains(&t)) {
                m.datagram(None, &fake::done_refused(*seq, libc::EINVAL), T0);
                continue;
            }
            for part in parts(h.kind, target, *seq) {
                m.datagram(None, &part, T0);
            }
            m.datagram(None, &fake::done(*seq), T0);
        }
    }
}

/// Opens `inode` and lets the kernel answer that its nsid is `nsid`.
fn open(m: &mut Model, inode: NetnsInode, nsid: i32) {
    m.netns_opened(inode, 99, T0);
    let actions = m.take_actions();
    let get = requests(&actions).into_iter().find(|r| r.0 == RTM_GETNSID).expect("a GETNSID");
    for (kind, seq, _) in requests(&actions) {
        if kind == RTM_NEWNSID {
            m.datagram(None, &fake::error(seq, libc::EEXIST), T0);
        }
    }
    m.datagram(None, &fake::nsid(RTM_NEWNSID, get.1, nsid), T0);
}

/// A model through its first sync with netns `inode` = nsid `nsid`.
fn synced(inode: NetnsInode, nsid: i32) -> Model {
    synced_with(&[(inode, nsid)])
}

/// A model through its first sync with each netns (inode, nsid) open.
pub(in crate::model) fn synced_with(netns: &[(NetnsInode, i32)]) -> Model {
    let mut m = model();
    m.start_resync(false);
    let Some(Action::Job(Job::Scan { generation, .. })) = m.take_actions().pop() else { panic!("no scan") };
    for &(inode, nsid) in netns {
        open(&mut m, inode, nsid);
        // Its dumps, before the next open takes the actions.
        answer_dumps(&mut m, |_, _, _| vec![]);
    }
    m.scan_done(generation, Scope::Full, BTreeMap::new());
    answer_dumps(&mut m, |kind, _, seq| {
        if kind == RTM_GETNSID {
            netns.iter().map(|&(_, nsid)| fake::nsid(RTM_NEWNSID, seq, nsid)).collect()
        } else {
            vec![]
        }
    });
    assert!(m.is_ready());
    m
}

fn live(m: &mut Model, inode: NetnsInode) -> NetnsView {
    m.snapshot(T0).live_by_inode(inode).cloned().unwrap_or_else(|| panic!("netns {inode} not alive"))
}

#[test]
fn an_nsid_reply_binds_the_inode_and_dumps_its_netns() {
    let mut m = model();
    m.netns_opened(100, 5, T0);
    let sent = requests(&m.take_actions());
    assert_eq!(sent.iter().map(|r| r.0).collect::<Vec<_>>(), vec![RTM_NEWNSID, RTM_GETNSID]);
    m.datagram(None, &fake::nsid(RTM_NEWNSID, sent[1].1, 7), T0);
    let v = live(&mut m, 100);
    assert_eq!(v.nsid, Some(7));
    let dumps = requests(&m.take_actions());
    assert_eq!(dumps.len(), 1, "one dump at a time");
    assert_eq!(dumps[0].0, RTM_GETLINK);
}

#[test]
fn our_own_assignment_notice_binds_before_the_reply() {
    let mut m = model();
    m.netns_opened(100, 5, T0);
    let sent = requests(&m.take_actions());
    // The kernel multicasts the assignment with our request's sequence.
    m.datagram(None, &fake::nsid(RTM_NEWNSID, sent[0].1, 4), T0);
    assert_eq!(live(&mut m, 100).nsid, Some(4));
    m.datagram(None, &fake::nsid(RTM_NEWNSID, sent[1].1, 4), T0);
    assert_eq!(m.snapshot(T0).alive().filter(|n| !n.host).count(), 1);
}

#[test]
fn delnsid_reports_the_death_with_its_addresses_and_a_reused_inode_is_a_new_netns() {
    let mut m = synced(100, 7);
    m.datagram(Some(7), &fake::link(RTM_NEWLINK, 0, &link(2, "eth0", None)), T0);
    m.datagram(Some(7), &fake::address(RTM_NEWADDR, 0, &addr(2, "10.1.0.5", 24)), T0);
    m.datagram(Some(7), &fake::address(RTM_NEWADDR, 0, &Address { scope: 253, ..addr(2, "fe80::1", 64) }), T0);
    m.take_actions();

    let later = T0 + Duration::from_secs(3);
    m.datagram(None, &fake::nsid(RTM_DELNSID, 0, 7), later);
    let d = deaths(&m.take_actions());
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].inode, d[0].nsid, d[0].source, d[0].at), (Some(100), Some(7), DeathSource::RtmDelnsid, later));
    assert_eq!(d[0].addresses.iter().map(|a| a.ip.to_string()).collect::<Vec<_>>(), vec!["10.1.0.5"]);

    // The kernel reuses both the inode and the nsid for a new netns.
    open(&mut m, 100, 7);
    let s = m.snapshot(later);
    let new = s.live_by_inode(100).expect("new netns alive");
    assert!(new.addresses.is_empty(), "the dead one's addresses leaked into the new one");
    let dead: Vec<_> = s.netns.iter().filter(|n| !n.alive).collect();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].addresses.len(), 2);
}

#[test]
fn nsid_messages_from_other_namespaces_are_their_business() {
    let mut m = synced(100, 7);
    // Netns 7 numbering its own peers: not a death in our frame.
    m.datagram(Some(7), &fake::nsid(RTM_DELNSID, 0, 7), T0);
    m.datagram(Some(7), &fake::nsid(RTM_NEWNSID, 0, 3), T0);
    assert!(deaths(&m.take_actions()).is_empty());
    assert_eq!(m.snapshot(T0).alive().count(), 2);
}

#[test]
fn messages_carrying_the_hosts_own_nsid_are_the_hosts() {
    let mut m = model();
    m.query_host_nsid(3, T0);
    let sent = requests(&m.take_actions());
    m.datagram(None, &fake::nsid(RTM_NEWNSID, sent[1].1, 9), T0);
    m.datagram(Some(9), &fake::address(RTM_NEWADDR, 0, &addr(4, "192.0.2.1", 24)), T0);
    let s = m.snapshot(T0);
    assert_eq!(s.netns.len(), 1, "no netns invented for the host's own nsid");
    assert_eq!(s.netns[0].nsid, Some(9));
    assert_eq!(s.netns[0].addresses.len(), 1);
}

#[test]
fn a_resync_finds_lost_deaths_and_missed_changes_and_counts_them() {
    let mut m = synced(100, 7);
    m.datagram(Some(7), &fake::address(RTM_NEWADDR, 0, &addr(2, "10.1.0.5", 24)), T0);
    m.datagram(Some(7), &fake::address(RTM_NEWADDR, 0, &addr(2, "10.1.0.6", 24)), T0);
    m.take_actions();
    // Netns 101 appeared and 100 lost an address with no event (overrun).
    m.overrun();
    let Some(Action::Job(Job::Scan { generation, .. })) = m.take_actions().pop() else { panic!("no scan") };
    open(&mut m, 100, 7);
    open(&mut m, 101, 8);
    m.scan_done(generation, Scope::Full, BTreeMap::new());
    answer_dumps(&mut m, |kind, target, seq| match (kind, target) {
        (RTM_GETNSID, _) => vec![fake::nsid(RTM_NEWNSID, seq, 7), fake::nsid(RTM_NEWNSID, seq, 8)],
        (RTM_GETADDR, Some(7)) => vec![fake::address(RTM_NEWADDR, seq, &addr(2, "10.1.0.5", 24))],
        _ => vec![],
    });
    let v = live(&mut m, 100);
    assert_eq!(v.addresses.len(), 1);
    let stats = m.stats().clone();
    assert_eq!(stats.overruns, 1);
    assert_eq!(stats.corrections.netns_found, 1);
    assert_eq!(stats.corrections.addresses, 1);

    // Then 101 dies and its RTM_DELNSID is lost.
    m.start_resync(true);
    let Some(Action::Job(Job::Scan { generation, .. })) = m.take_actions().pop() else { panic!("no scan") };
    m.scan_done(generation, Scope::Full, BTreeMap::new());
    let rest = answer_dumps_without(&mut m, &[8], |kind, _, seq| {
        if kind == RTM_GETNSID { vec![fake::nsid(RTM_NEWNSID, seq, 7)] } else { vec![] }
    });
    let d = deaths(&rest);
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].inode, d[0].source), (Some(101), DeathSource::NsidGone));
    assert_eq!(m.stats().corrections.netns_lost, 1);
    assert_eq!(m.stats().resyncs, 3);
}

#[test]
fn a_netns_born_during_the_nsid_dump_is_not_swept() {
    let mut m = synced(100, 7);
    m.start_resync(true);
    let Some(Action::Job(Job::Scan { generation, .. })) = m.take_actions().pop() else { panic!("no scan") };
    m.scan_done(generation, Scope::Full, BTreeMap::new());
    let (_, seq, _) = requests(&m.take_actions()).pop().expect("nsid dump");
    m.datagram(None, &fake::nsid(RTM_NEWNSID, seq, 7), T0);
    // Assigned after the dump passed its slot.
    m.datagram(None, &fake::nsid(RTM_NEWNSID, 0, 2), T0);
    m.datagram(None, &fake::done(seq), T0);
    assert!(deaths(&m.take_actions()).is_empty());
    assert_eq!(m.snapshot(T0).alive().count(), 3);
}

#[test]
fn veth_peers_and_host_routes_resolve_across_namespaces() {
    let mut m = synced(100, 7);
    // Host side, in the host's frame: peer ifindex 2 in nsid 7.
    m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(10, "veth-host", Some((2, Some(7))))), T0);
    // Pod side, from inside the pod: its link-netnsid is in its own frame.
    m.datagram(Some(7), &fake::link(RTM_NEWLINK, 0, &link(2, "eth0", Some((10, Some(0))))), T0);
    let route = Route {
        family: AF_INET,
        dst_len: 32,
        table: RT_TABLE_MAIN,
        protocol: 3,
        scope: 253,
        route_type: RTN_UNICAST,
        dst: Some("10.1.0.5".parse().unwrap()),
        oif: Some(10),
        priority: None,
    };
    m.datagram(None, &fake::route(RTM_NEWROUTE, 0, &route), T0);
    let s = m.snapshot(T0);
    let pod = s.live_by_inode(100).unwrap();
    let eth0 = &pod.interfaces[0];
    let peer = eth0.link.as_ref().unwrap();
    assert_eq!(peer.ifname.as_deref(), Some("veth-host"));
    assert!(peer.netns.unwrap().host);
    let host_veth = s.netns[0].interfaces.iter().find(|i| i.ifindex == 10).unwrap();
    assert_eq!(host_veth.link.as_ref().unwrap().netns.unwrap().inode, Some(100));
    assert_eq!(pod.host_routes, vec!["10.1.0.5".parse::<IpAddr>().unwrap()]);
    assert_eq!(s.host_routes[0].netns.unwrap().inode, Some(100));
    // The host side placed the pod side's peer: no dump for it.
    let dumps = requests(&m.take_actions());
    assert!(!dumps.iter().any(|d| d.0 == RTM_GETLINK), "{dumps:?}");
    // A peer no host link names back (here, in another pod) takes a dump of
    // the pod's links to be placed in our frame, once per read.
    m.datagram(Some(7), &fake::link(RTM_NEWLINK, 0, &link(3, "eth1", Some((4, Some(1))))), T0);
    m.datagram(Some(7), &fake::link(RTM_NEWLINK, 0, &link(3, "eth1", Some((4, Some(1))))), T0);
    let dumps = requests(&m.take_actions());
    assert_eq!(dumps.iter().filter(|d| d.0 == RTM_GETLINK).count(), 1, "{dumps:?}");

    view::assert_resolver_matches_filed_maps(&m.registry);

    m.datagram(None, &fake::link(RTM_DELLINK, 0, &link(10, "veth-host", None)), T0);
    assert!(m.snapshot(T0).host_routes.is_empty(), "routes through a deleted link go with it");
    view::assert_resolver_matches_filed_maps(&m.registry);
}

/// Many pods whose own side of the veth is placed from the host's side
/// (each host veth names an ifindex 2 in its pod: the registry files them
/// by the netns they name), with two links that name the same end (the
/// last one read wins, as when every link was filed up front), and routes
/// into each pod: every
/// link is placed as the filed maps placed it, and a dying pod's view
/// names its host veth.
#[test]
fn links_placed_from_the_other_end_resolve_as_the_filed_maps_did() {
    let mut m = synced(100, 7);
    let pods: Vec<(NetnsInode, i32)> = (0..12).map(|i| (200 + i, 20 + i as i32)).collect();
    for &(inode, nsid) in &pods {
        open(&mut m, inode, nsid);
    }
    answer_dumps(&mut m, |_, _, _| Vec::new());
    for (i, &(_, nsid)) in pods.iter().enumerate() {
        let host_ifindex = 10 + i as u32;
        m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(host_ifindex, "veth", Some((2, Some(nsid))))), T0);
        // From inside the pod, in its own numbering: placed from the host's side.
        m.datagram(Some(nsid), &fake::link(RTM_NEWLINK, 0, &link(2, "eth0", Some((host_ifindex, Some(0))))), T0);
        let mut route = host_route(&format!("10.1.0.{}", i + 1), host_ifindex);
        route.protocol = 3;
        m.datagram(None, &fake::route(RTM_NEWROUTE, 0, &route), T0);
    }
    // A second link naming pod 0's eth0 (a link of pod 1, placed in our
    // frame): two candidates for one end.
    m.datagram(
        None,
        &fake::link(RTM_NEWLINK, 0, &{
            let mut l = link(5, "odd", Some((2, Some(pods[0].1))));
            l.target_nsid = Some(pods[1].1);
            l
        }),
        T0,
    );
    view::assert_resolver_matches_filed_maps(&m.registry);
    let s = same_as_fresh(&mut m, T0);
    for (i, &(inode, _)) in pods.iter().enumerate().skip(1) {
        let eth0 = view_of(&s, inode).interfaces.iter().find(|l| l.ifindex == 2).cloned().unwrap();
        assert_eq!(eth0.link.as_ref().and_then(|l| l.ifname.as_deref()), Some("veth"), "pod {i}");
    }
    // A pod dies: its view (taken as it dies) is the last snapshot's.
    let before = view_of(&s, pods[3].0);
    m.datagram(None, &fake::nsid(RTM_DELNSID, 0, pods[3].1), T0);
    let died = deaths(&m.take_actions());
    let [death] = died.as_slice() else { panic!("one death: {died:?}") };
    assert_eq!(death.inode, Some(pods[3].0));
    let after = m.snapshot(T0);
    let dead = after.netns.iter().find(|v| !v.alive && v.inode == Some(pods[3].0)).unwrap();
    assert_eq!(dead.interfaces, before.interfaces);
    assert_eq!(dead.host_routes, before.host_routes);
    view::assert_resolver_matches_filed_maps(&m.registry);
}

#[test]
fn a_dying_netns_is_described_as_the_last_snapshot_showed_it() {
    let mut m = synced(100, 7);
    m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(10, "veth-host", Some((2, Some(7))))), T0);
    m.datagram(Some(7), &fake::link(RTM_NEWLINK, 0, &link(2, "eth0", Some((10, Some(0))))), T0);
    m.datagram(Some(7), &fake::address(RTM_NEWADDR, 0, &addr(2, "10.1.0.5", 24)), T0);
    let route = Route {
        family: AF_INET,
        dst_len: 32,
        table: RT_TABLE_MAIN,
        protocol: 3,
        scope: 253,
        route_type: RTN_UNICAST,
        dst: Some("10.1.0.5".parse().unwrap()),
        oif: Some(10),
        priority: None,
    };
    m.datagram(None, &fake::route(RTM_NEWROUTE, 0, &route), T0);
    let alive = live(&mut m, 100);
    assert_eq!(alive.interfaces[0].link.as_ref().and_then(|l| l.ifname.as_deref()), Some("veth-host"));
    m.take_actions();
    // The dying view resolves only this netns's references: the same ones.
    m.datagram(None, &fake::nsid(RTM_DELNSID, 0, 7), T0);
    assert_eq!(deaths(&m.take_actions()).len(), 1);
    let dead = m.snapshot(T0).netns.into_iter().find(|n| !n.alive && n.inode == Some(100)).expect("dead view");
    assert_eq!(dead.died_at, Some(T0));
    assert_eq!(NetnsView { alive: true, died_at: None, death_source: None, ..(*dead).clone() }, alive);
}

fn task(comm: &str) -> Task {
    Task { ktime_ns: 1, pid: 42, tgid: 41, comm: comm.into(), cgroup_id: 5 }
}

#[test]
fn probes_name_the_creator_ask_for_discovery_and_report_put_net() {
    let mut m = synced(100, 7);
    let entered = KernelEvent::NetnsEntered {
        task: task("runc"),
        netns_inode: 200,
        previous_netns_inode: HOST,
        via: NetnsVia::Unshare,
    };
    m.kernel_event(&entered, T0);
    m.kernel_event(&entered, T0);
    let jobs: Vec<_> = m.take_actions().into_iter().filter(|a| matches!(a, Action::Job(_))).collect();
    assert!(matches!(jobs.as_slice(), [Action::Job(Job::Resolve { inode: 200, tgid: 41, tid: 42 })]), "{jobs:?}");
    open(&mut m, 200, 8);
    let creator = live(&mut m, 200).creator.expect("creator");
    assert_eq!((creator.comm.as_str(), creator.pid, creator.via), ("runc", 41, NetnsVia::Unshare));

    m.kernel_event(&KernelEvent::NetnsFreed { task: task("kworker"), netns_inode: 200 }, T0);
    let d = deaths(&m.take_actions());
    assert_eq!((d[0].inode, d[0].source), (Some(200), DeathSource::PutNet));
    // The RTM_DELNSID that follows changes nothing.
    m.datagram(None, &fake::nsid(RTM_DELNSID, 0, 8), T0);
    assert!(deaths(&m.take_actions()).is_empty());
}

#[test]
fn dump_parts_for_a_netns_that_died_mid_dump_are_dropped() {
    let mut m = model();
    m.netns_opened(100, 5, T0);
    let sent = requests(&m.take_actions());
    m.datagram(None, &fake::nsid(RTM_NEWNSID, sent[1].1, 7), T0);
    let (_, seq, _) = requests(&m.take_actions()).pop().expect("link dump");
    m.datagram(None, &fake::nsid(RTM_DELNSID, 0, 7), T0);
    m.datagram(None, &fake::link(RTM_NEWLINK, seq, &Link { target_nsid: Some(7), ..link(3, "other", None) }), T0);
    m.datagram(None, &fake::done(seq), T0);
    let s = m.snapshot(T0);
    let dead = s.netns.iter().find(|n| !n.alive).unwrap();
    assert!(dead.interfaces.is_empty());
    // The queue moved on to the next dump.
    assert!(requests(&m.take_actions()).is_empty(), "no dump for a dead netns");
}

#[test]
fn dead_netns_are_forgotten_after_the_retention() {
    let mut m = synced(100, 7);
    m.datagram(None, &fake::nsid(RTM_DELNSID, 0, 7), T0);
    m.tick(T0 + Duration::from_mins(1));
    assert_eq!(m.snapshot(T0).netns.len(), 2);
    m.tick(T0 + Duration::from_mins(10) + Duration::from_secs(1));
    assert_eq!(m.snapshot(T0).netns.len(), 1);
}

#[test]
fn garbage_datagrams_are_counted_not_fatal() {
    let mut m = synced(100, 7);
    m.datagram(Some(7), &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], T0);
    let mut bad = fake::address(RTM_NEWADDR, 0, &addr(2, "10.1.0.5", 24));
    bad[0..4].copy_from_slice(&20u32.to_ne_bytes());
    m.datagram(Some(7), &bad, T0);
    assert_eq!(m.stats().malformed_messages, 2);
}

proptest::proptest! {
    #[test]
    fn arbitrary_datagrams_never_panic_the_model(
        origin in proptest::option::of(-1i32..10),
        bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..400),
    ) {
        let mut m = synced(100, 7);
        m.datagram(origin, &bytes, T0);
        let _ = m.snapshot(T0);
    }
}

/// Issue 10: the kernel's nsid dump comes in parts and resumes by position;
/// with many netns, live ones go missing from it. Absence is not death:
/// each is checked with a dump aimed at its own nsid, and only the kernel
/// refusing that nsid (EINVAL) kills it.
#[test]
fn absence_from_an_nsid_dump_is_not_death() {
    let mut m = synced(100, 7);
    open(&mut m, 101, 8);
    answer_dumps(&mut m, |_, _, _| vec![]);
    for _ in 0..3 {
        m.start_resync(true);
        let Some(Action::Job(Job::Scan { generation, .. })) = m.take_actions().pop() else { panic!("no scan") };
        m.scan_done(generation, Scope::Full, BTreeMap::new());
        // The dump lists only nsid 7; 8 still answers its own dumps.
        let rest =
            answer_dumps(
                &mut m,
                |kind, _, seq| {
                    if kind == RTM_GETNSID { vec![fake::nsid(RTM_NEWNSID, seq, 7)] } else { vec![] }
                },
            );
        assert!(deaths(&rest).is_empty(), "{:?}", deaths(&rest));
    }
    assert_eq!(live(&mut m, 101).nsid, Some(8));
    assert_eq!(m.stats().corrections.netns_lost, 0);
}

/// An EINVAL before any dump by target nsid has worked may be an old
/// kernel refusing them all: it kills nothing.
#[test]
fn a_refused_targeted_dump_kills_nothing_until_targeted_dumps_are_known_to_work() {
    let mut m = model();
    m.start_resync(false);
    let Some(Action::Job(Job::Scan { generation, .. })) = m.take_actions().pop() else { panic!("no scan") };
    open(&mut m, 100, 7);
    m.scan_done(generation, Scope::Full, BTreeMap::new());
    let rest = answer_dumps_without(&mut m, &[7], |kind, _, seq| {
        if kind == RTM_GETNSID { vec![fake::nsid(RTM_NEWNSID, seq, 7)] } else { vec![] }
    });
    assert!(deaths(&rest).is_empty());
    assert!(live(&mut m, 100).alive);
}

/// A `__put_net` record about an earlier netns whose inode was reused at
/// once must not kill the netns that holds the inode now.
#[test]
fn a_stale_put_net_record_does_not_kill_the_netns_that_reused_the_inode() {
    let mut m = synced(100, 7);
    // Seen first now: long after the boot-time record below.
    let now = SystemTime::now();
    m.netns_opened(200, 99, now);
    let actions = m.take_actions();
    let get = requests(&actions).into_iter().find(|r| r.0 == RTM_GETNSID).expect("a GETNSID");
    m.datagram(None, &fake::nsid(RTM_NEWNSID, get.1, 8), now);
    answer_dumps(&mut m, |_, _, _| vec![]);
    let stale = KernelEvent::NetnsFreed { task: Task { ktime_ns: 1, ..task("kworker") }, netns_inode: 200 };
    m.kernel_event(&stale, now);
    assert!(deaths(&m.take_actions()).is_empty(), "the stale record killed the newcomer");
    assert!(m.snapshot(now).live_by_inode(200).is_some());
    // Its own record (after its first sight) does.
    let own_ktime = {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: a valid out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64 + 50_000_000
    };
    let fresh = KernelEvent::NetnsFreed { task: Task { ktime_ns: own_ktime, ..task("kworker") }, netns_inode: 200 };
    m.kernel_event(&fresh, now);
    let d = deaths(&m.take_actions());
    assert_eq!((d[0].inode, d[0].source), (Some(200), DeathSource::PutNet));
}

/// The incremental snapshot equals one built from nothing.
fn same_as_fresh(m: &mut Model, now: SystemTime) -> ModelSnapshot {
    let snapshot = m.snapshot(now);
    assert_eq!(snapshot, m.fresh_snapshot(now), "incremental snapshot differs from a fresh one");
    view::assert_resolver_matches_filed_maps(&m.registry);
    snapshot
}

fn view_of(s: &ModelSnapshot, inode: NetnsInode) -> Arc<NetnsView> {
    s.netns.iter().find(|n| n.alive && n.inode == Some(inode)).cloned().unwrap_or_else(|| panic!("{inode} alive"))
}

fn host_route(dst: &str, oif: u32) -> Route {
    Route {
        family: AF_INET,
        dst_len: 32,
        table: RT_TABLE_MAIN,
        protocol: 3,
        scope: 253,
        route_type: RTN_UNICAST,
        dst: Some(dst.parse().unwrap()),
        oif: Some(oif),
        priority: None,
    }
}

fn mounted(inode: NetnsInode, path: &str) -> BTreeMap<NetnsInode, Sighting> {
    BTreeMap::from([(inode, Sighting { bind_mounts: vec![path.into()], ..Sighting::default() })])
}

#[test]
fn an_incremental_snapshot_says_what_a_fresh_one_says_across_births_deaths_mounts_and_addresses() {
    let mut m = synced(100, 7);
    let t = |s: u64| T0 + Duration::from_secs(s);
    same_as_fresh(&mut m, t(0));
    // Pod 100 wired to the host: veth pair, address, host route.
    m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(10, "veth-a", Some((2, Some(7))))), t(1));
    m.datagram(Some(7), &fake::link(RTM_NEWLINK, 0, &link(2, "eth0", Some((10, Some(0))))), t(1));
    m.datagram(Some(7), &fake::address(RTM_NEWADDR, 0, &addr(2, "10.1.0.5", 24)), t(1));
    m.datagram(None, &fake::route(RTM_NEWROUTE, 0, &host_route("10.1.0.5", 10)), t(1));
    let first = same_as_fresh(&mut m, t(1));
    assert_eq!(view_of(&first, 100).host_routes, vec!["10.1.0.5".parse::<IpAddr>().unwrap()]);

    // A birth: netns 200 (nsid 8) and its dumps.
    open(&mut m, 200, 8);
    answer_dumps(&mut m, |_, _, _| vec![]);
    let born = same_as_fresh(&mut m, t(2));
    assert!(Arc::ptr_eq(&view_of(&first, 100), &view_of(&born, 100)), "an unchanged netns's view is shared");
    // Its wiring, in the host's frame for both ends (as a dump gives it).
    m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(11, "veth-b", Some((3, Some(8))))), t(3));
    m.datagram(Some(8), &fake::link(RTM_NEWLINK, 0, &link(3, "eth0", Some((11, Some(0))))), t(3));
    m.datagram(None, &fake::route(RTM_NEWROUTE, 0, &host_route("10.1.0.6", 11)), t(3));
    let wired = same_as_fresh(&mut m, t(3));
    assert!(Arc::ptr_eq(&view_of(&first, 100), &view_of(&wired, 100)), "another pod's wiring leaves it alone");

    // An address change in 200 only.
    m.datagram(Some(8), &fake::address(RTM_NEWADDR, 0, &addr(3, "10.1.0.6", 24)), t(4));
    let addressed = same_as_fresh(&mut m, t(4));
    assert!(Arc::ptr_eq(&view_of(&wired, 100), &view_of(&addressed, 100)));
    assert!(!Arc::ptr_eq(&view_of(&wired, 200), &view_of(&addressed, 200)));
    m.datagram(Some(8), &fake::address(RTM_DELADDR, 0, &addr(3, "10.1.0.6", 24)), t(5));
    same_as_fresh(&mut m, t(5));
    // A host route alone (its link unchanged) changes the pod it leads into.
    m.datagram(None, &fake::route(RTM_NEWROUTE, 0, &host_route("10.1.0.7", 11)), t(5));
    let routed = same_as_fresh(&mut m, t(5));
    assert!(view_of(&routed, 200).host_routes.contains(&"10.1.0.7".parse().unwrap()));
    m.datagram(None, &fake::route(RTM_DELROUTE, 0, &host_route("10.1.0.7", 11)), t(5));
    same_as_fresh(&mut m, t(5));

    // Mounts: 200 bind-mounted, then unmounted; a full scan with processes.
    m.scan_done(0, Scope::Mounts, mounted(200, "/run/netns/nrM-b"));
    let mounted_now = same_as_fresh(&mut m, t(6));
    assert_eq!(view_of(&mounted_now, 200).bind_mounts, vec![std::path::PathBuf::from("/run/netns/nrM-b")]);
    m.scan_done(0, Scope::Mounts, BTreeMap::new());
    same_as_fresh(&mut m, t(7));
    let full = BTreeMap::from([(100, Sighting { process_count: 2, ..Sighting::default() })]);
    m.scan_done(0, Scope::Full, full);
    same_as_fresh(&mut m, t(8));

    // A peer renamed: the pod that shows its name changes with it.
    m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(10, "veth-a2", Some((2, Some(7))))), t(9));
    let renamed = same_as_fresh(&mut m, t(9));
    let eth0 = &view_of(&renamed, 100).interfaces[0];
    assert_eq!(eth0.link.as_ref().and_then(|l| l.ifname.as_deref()), Some("veth-a2"));

    // A route and a link removed on the host.
    m.datagram(None, &fake::route(RTM_DELROUTE, 0, &host_route("10.1.0.6", 11)), t(10));
    same_as_fresh(&mut m, t(10));
    m.datagram(None, &fake::link(RTM_DELLINK, 0, &link(11, "veth-b", None)), t(10));
    same_as_fresh(&mut m, t(10));

    // A death, then the nsid reused by a new netns with the old peer's name.
    m.datagram(None, &fake::nsid(RTM_DELNSID, 0, 7), t(11));
    assert_eq!(deaths(&m.take_actions()).len(), 1);
    let after_death = same_as_fresh(&mut m, t(11));
    assert!(after_death.netns.iter().any(|n| !n.alive && n.inode == Some(100)));
    open(&mut m, 300, 7);
    answer_dumps(&mut m, |_, _, _| vec![]);
    m.datagram(Some(7), &fake::link(RTM_NEWLINK, 0, &link(2, "eth0", Some((10, Some(0))))), t(12));
    same_as_fresh(&mut m, t(12));
    m.datagram(None, &fake::link(RTM_DELLINK, 0, &link(10, "veth-a2", None)), t(13));
    same_as_fresh(&mut m, t(13));
    // Nothing changed: the same views again, only older.
    let again = same_as_fresh(&mut m, t(20));
    let before = same_as_fresh(&mut m, t(30));
    assert!(again.netns.iter().zip(&before.netns).all(|(a, b)| Arc::ptr_eq(a, b)));
    let json = serde_json::to_value(&before).unwrap();
    assert_eq!(json["netns"][0]["age_secs"], 30, "ages are the snapshot's: {json}");
}

/// The host's view, rebuilt with one peer's read gone and another's kept
/// (its reads are diffed, not taken out and put back), still changes with
/// the peer it kept reading.
#[test]
fn a_view_rebuilt_with_fewer_reads_still_hears_of_the_reads_it_kept() {
    let mut m = synced(100, 7);
    let t = |s: u64| T0 + Duration::from_secs(s);
    open(&mut m, 200, 8);
    answer_dumps(&mut m, |_, _, _| vec![]);
    m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(10, "veth-a", Some((2, Some(7))))), t(1));
    m.datagram(Some(7), &fake::link(RTM_NEWLINK, 0, &link(2, "eth0", Some((10, Some(0))))), t(1));
    m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(11, "veth-b", Some((3, Some(8))))), t(1));
    m.datagram(Some(8), &fake::link(RTM_NEWLINK, 0, &link(3, "eth0", Some((11, Some(0))))), t(1));
    same_as_fresh(&mut m, t(1));
    // The host's veth to 100 goes: its view is rebuilt, reading 200 only.
    m.datagram(None, &fake::link(RTM_DELLINK, 0, &link(10, "veth-a", None)), t(2));
    same_as_fresh(&mut m, t(2));
    // 200's end renamed: the host's view names it anew.
    m.datagram(Some(8), &fake::link(RTM_NEWLINK, 0, &link(3, "eth9", Some((11, Some(0))))), t(3));
    let renamed = same_as_fresh(&mut m, t(3));
    let veth_b = renamed.netns[0].interfaces.iter().find(|i| i.ifindex == 11).expect("veth-b on the host");
    assert_eq!(veth_b.link.as_ref().and_then(|l| l.ifname.as_deref()), Some("eth9"));
}

/// A pod's death rebuilds, of the host's view, only the interface that
/// read the dead pod: the others are shared with the snapshot before (the
/// host's view has one interface per pod; rebuilding them all on every
/// death cost ~0.1 ms at 200 pods).
#[test]
fn a_death_rebuilds_only_the_host_interfaces_it_touches() {
    let mut m = synced(100, 7);
    let t = |s: u64| T0 + Duration::from_secs(s);
    open(&mut m, 200, 8);
    answer_dumps(&mut m, |_, _, _| vec![]);
    m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(1, "br0", None)), t(1));
    for (host_if, nsid) in [(10, 7), (11, 8)] {
        m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(host_if, "veth", Some((2, Some(nsid))))), t(1));
    }
    let before = same_as_fresh(&mut m, t(1));
    m.datagram(None, &fake::nsid(RTM_DELNSID, 0, 8), t(2));
    let after = same_as_fresh(&mut m, t(2));
    let (old, new) = (&before.netns[0].interfaces, &after.netns[0].interfaces);
    assert!(!Arc::ptr_eq(&before.netns[0], &after.netns[0]), "the host's view shows the dead pod's end");
    let shared: Vec<u32> = old.iter().zip(new).filter(|(a, b)| Arc::ptr_eq(a, b)).map(|(a, _)| a.ifindex).collect();
    assert_eq!(shared, vec![1, 10], "the bridge and the live pod's veth are shared");
    assert_eq!(new[2].link.as_ref().and_then(|l| l.netns), None, "the dead pod's end is no longer placed");
}

/// Links added, renamed, re-pointed and removed in every netns's frame,
/// peers placed by nsid or from the other end, deaths and nsids given
/// again, snapshots taken between any of them: every incremental snapshot
/// equals one built from nothing (`same_as_fresh`; the model's own debug
/// assertion checks every snapshot too), so a view that keeps interfaces
/// keeps only those that would be built the same.
#[test]
fn views_kept_in_part_equal_fresh_ones_whatever_changes() {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// A host link (event, the host's frame): ifindex, name, peer
        /// (ifindex, nsid; None: same netns).
        Host(u32, u8, Option<(u32, Option<i32>)>),
        /// A pod's link: nsid, ifindex, name, peer. Announced by an event
        /// from the pod (unverified), then the pod's dump says it in the
        /// host's frame.
        Pod(i32, u32, u8, Option<(u32, Option<i32>)>),
        /// A link removed: the pod's nsid (None: the host's), ifindex.
        Del(Option<i32>, u32),
        /// A link removed whose notification was lost: the next dump of
        /// its netns sweeps it.
        Lost(Option<i32>, u32),
        Death(i32),
        Birth(i32),
        /// The host learns its own nsid (0): links naming 0 name it.
        HostNsid,
        /// An address added (or removed, when it was there) on a link of
        /// the host (None) or a pod: the view changes, not its interfaces.
        Addr(Option<i32>, u32),
        Snapshot,
    }
    // Few ifindexes and nsids, so that links name each other, two links
    // name one end, and nsids name no netns, then one.
    let peer = |lo: u32, hi: u32| proptest::option::of((lo..hi, proptest::option::of(0_i32..5)));
    let op = prop_oneof![
        3 => (2_u32..5, 0_u8..2, peer(2, 5)).prop_map(|(i, n, p)| Op::Host(i, n, p)),
        3 => (1_i32..4, 2_u32..5, 0_u8..2, peer(2, 5)).prop_map(|(ns, i, n, p)| Op::Pod(ns, i, n, p)),
        1 => (proptest::option::of(1_i32..4), 2_u32..5).prop_map(|(ns, i)| Op::Del(ns, i)),
        1 => (proptest::option::of(1_i32..4), 2_u32..5).prop_map(|(ns, i)| Op::Lost(ns, i)),
        1 => (1_i32..5).prop_map(Op::Death),
        // nsid 0 too: a netns the model tracks until the host learns that
        // nsid is its own.
        1 => (0_i32..5).prop_map(Op::Birth),
        1 => Just(Op::HostNsid),
        1 => (proptest::option::of(1_i32..4), 2_u32..5).prop_map(|(ns, i)| Op::Addr(ns, i)),
        2 => Just(Op::Snapshot),
    ];
    proptest!(ProptestConfig::with_cases(400), |(ops in proptest::collection::vec(op, 1..40))| {
        let mut m = synced(100, 1);
        // What the kernel holds: links by netns (None: the host), in the
        // host's frame; the live pods' nsids and inodes.
        let mut links: BTreeMap<Option<i32>, BTreeMap<u32, Link>> = BTreeMap::new();
        let mut alive: BTreeMap<i32, NetnsInode> = BTreeMap::from([(1, 100)]);
        let mut next_inode = 101;
        let mut addresses: BTreeSet<(Option<i32>, u32)> = BTreeSet::new();
        let mut host_bound = false;
        let name = |n: u8| if n == 0 { "eth0" } else { "veth" };
        for (step, op) in ops.into_iter().enumerate() {
            let now = T0 + Duration::from_secs(step as u64);
            match op {
                Op::Host(ifindex, named, peer) => {
                    let l = link(ifindex, name(named), peer);
                    m.datagram(None, &fake::link(RTM_NEWLINK, 0, &l), now);
                    links.entry(None).or_default().insert(ifindex, l);
                }
                Op::Pod(ns, ifindex, named, peer) if alive.contains_key(&ns) => {
                    let l = link(ifindex, name(named), peer);
                    m.datagram(Some(ns), &fake::link(RTM_NEWLINK, 0, &l), now);
                    links.entry(Some(ns)).or_default().insert(ifindex, l);
                }
                Op::Del(ns, i) if ns.is_none_or(|n| alive.contains_key(&n)) => {
                    if let Some(l) = links.entry(ns).or_default().remove(&i) {
                        m.datagram(ns, &fake::link(RTM_DELLINK, 0, &l), now);
                    }
                }
                Op::Death(ns) if alive.remove(&ns).is_some() => {
                    links.remove(&Some(ns));
                    m.datagram(None, &fake::nsid(RTM_DELNSID, 0, ns), now);
                }
                Op::Lost(ns, ifindex) => {
                    links.entry(ns).or_default().remove(&ifindex);
                }
                Op::Birth(ns) if !alive.contains_key(&ns) && (ns != 0 || !host_bound) => {
                    open(&mut m, next_inode, ns);
                    alive.insert(ns, next_inode);
                    next_inode += 1;
                }
                Op::HostNsid => {
                    host_bound = true;
                    if alive.remove(&0).is_some() {
                        links.remove(&Some(0));
                    }
                    m.query_host_nsid(3, now);
                    if let Some(&(_, seq, _)) = requests(&m.take_actions()).get(1) {
                        m.datagram(None, &fake::nsid(RTM_NEWNSID, seq, 0), now);
                    }
                }
                Op::Addr(ns, ifindex) if ns.is_none_or(|n| alive.contains_key(&n)) => {
                    let kind = if addresses.insert((ns, ifindex)) { RTM_NEWADDR } else { RTM_DELADDR };
                    if kind == RTM_DELADDR {
                        addresses.remove(&(ns, ifindex));
                    }
                    m.datagram(ns, &fake::address(kind, 0, &addr(ifindex, "10.9.0.1", 24)), now);
                }
                Op::Snapshot => {
                    same_as_fresh(&mut m, now);
                }
                _ => {}
            }
            // The dumps the model asks for, answered from what the kernel holds.
            answer_dumps(&mut m, |kind, target, seq| match kind {
                RTM_GETLINK => links
                    .get(&target.filter(|t| alive.contains_key(t)))
                    .into_iter()
                    .flat_map(BTreeMap::values)
                    .map(|l| fake::link(RTM_NEWLINK, seq, l))
                    .collect(),
                RTM_GETNSID => alive.keys().map(|&n| fake::nsid(RTM_NEWNSID, seq, n)).collect(),
                _ => vec![],
            });
        }
        same_as_fresh(&mut m, T0 + Duration::from_secs(100));
    });
}

/// Two pods' links name one host link whose own nsid names no netns: the
/// host's link is placed from the other end, by the last of them. A second
/// one added may be that last one: the host's kept interface is checked
/// again (whichever pod comes last, both orders are tried).
#[test]
fn a_link_that_comes_to_name_a_kept_interface_places_it_anew() {
    for first in [7, 8] {
        let mut m = synced(100, 7);
        let t = |s: u64| T0 + Duration::from_secs(s);
        m.query_host_nsid(3, T0);
        let seq = requests(&m.take_actions())[1].1;
        m.datagram(None, &fake::nsid(RTM_NEWNSID, seq, 0), T0);
        open(&mut m, 200, 8);
        answer_dumps(&mut m, |_, _, _| vec![]);
        // The host's link names nsid 5: no netns has it.
        m.datagram(None, &fake::link(RTM_NEWLINK, 0, &link(3, "veth", Some((4, Some(5))))), t(1));
        let pod_link = link(4, "eth0", Some((3, Some(0))));
        // The pod's link announced from inside it, then its dump (the
        // host's frame) names the host's link.
        let answer = |m: &mut Model, nsid: i32| {
            m.datagram(Some(nsid), &fake::link(RTM_NEWLINK, 0, &pod_link), t(2));
            answer_dumps(m, |kind, target, seq| {
                if kind == RTM_GETLINK && target == Some(nsid) {
                    vec![fake::link(RTM_NEWLINK, seq, &pod_link)]
                } else {
                    vec![]
                }
            });
        };
        answer(&mut m, first);
        let placed = |s: &ModelSnapshot| s.netns[0].interfaces[0].link.as_ref().and_then(|l| l.netns?.nsid);
        assert_eq!(placed(&same_as_fresh(&mut m, t(2))), Some(first));
        answer(&mut m, 15 - first);
        same_as_fresh(&mut m, t(3));
    }
}

/// A netns tracked by an nsid that turns out to be the host's own: its
/// record goes, and with it what its links named (the count of links
/// naming each ifindex, which spares searches for the other end of a
/// link no link names, is taken again from every link and compared).
#[test]
fn a_record_that_was_the_host_takes_its_links_with_it() {
    let mut m = synced(100, 7);
    open(&mut m, 200, 0);
    let eth0 = link(2, "eth0", Some((9, None)));
    m.datagram(Some(0), &fake::link(RTM_NEWLINK, 0, &eth0), T0);
    answer_dumps(&mut m, |kind, target, seq| {
        if kind == RTM_GETLINK && target == Some(0) { vec![fake::link(RTM_NEWLINK, seq, &eth0)] } else { vec![] }
    });
    same_as_fresh(&mut m, T0);
    m.query_host_nsid(3, T0);
    let seq = requests(&m.take_actions())[1].1;
    m.datagram(None, &fake::nsid(RTM_NEWNSID, seq, 0), T0);
    assert!(m.snapshot(T0).netns.iter().all(|n| n.inode != Some(200) || !n.alive), "the record is gone");
    same_as_fresh(&mut m, T0);
}
