//! The decoders against messages built by the crate's emitters, against
//! malformed and truncated input, and against arbitrary bytes.

use super::{consts::*, *};

fn one(bytes: &[u8]) -> (Header, Message) {
    let mut it = messages(bytes);
    let (h, p) = it.next().expect("one message").expect("frames");
    assert!(it.next().is_none());
    (h, decode(&h, p).expect("decodes"))
}

fn decode_one(bytes: &[u8]) -> Result<Message, WireError> {
    let (h, p) = messages(bytes).next().expect("one message").expect("frames");
    decode(&h, p)
}

fn veth() -> Link {
    Link {
        ifindex: 7,
        name: Some("veth1".into()),
        kind: Some("veth".into()),
        flags: IFF_UP,
        mac: None,
        link: Some(2),
        link_netnsid: Some(3),
        master: None,
        target_nsid: Some(5),
    }
}

#[test]
fn link_round_trips_through_the_fake_encoder() {
    let l = veth();
    let (h, m) = one(&fake::link(RTM_NEWLINK, 9, &l));
    assert_eq!(h.seq, 9);
    assert_eq!(h.kind, RTM_NEWLINK);
    assert_eq!(m, Message::NewLink(l.clone()));
    assert_eq!(one(&fake::link(RTM_DELLINK, 0, &l)).1, Message::DelLink(l));
}

#[test]
fn addresses_prefer_ifa_local_and_decode_both_families() {
    let a = Address {
        ifindex: 2,
        prefix_len: 64,
        scope: 0,
        ip: "fd00::5".parse().unwrap(),
        peer: None,
        label: None,
        target_nsid: None,
    };
    assert_eq!(one(&fake::address(RTM_DELADDR, 0, &a)).1, Message::DelAddress(a));
    // IPv4 with IFA_LOCAL differing from IFA_ADDRESS (point-to-point).
    let mut m = AddressMessage::default();
    m.header.family = AddressFamily::Inet;
    m.header.prefix_len = 32;
    m.header.index = 3;
    m.attributes = vec![
        AddressAttribute::Address("10.0.0.1".parse().unwrap()),
        AddressAttribute::Local("10.0.0.2".parse().unwrap()),
        AddressAttribute::Label("eth0".into()),
        AddressAttribute::TargetNetNsId(4),
    ];
    let bytes = serialize(0, 0, NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewAddress(m)));
    let Message::NewAddress(got) = one(&bytes).1 else { panic!("not an address") };
    assert_eq!(got.ip, "10.0.0.2".parse::<IpAddr>().unwrap());
    assert_eq!(got.peer, Some("10.0.0.1".parse::<IpAddr>().unwrap()));
    // The fake encoder writes both ends back (and no label).
    let without_label = Address { label: None, ..got.clone() };
    assert_eq!(one(&fake::address(RTM_NEWADDR, 0, &got)).1, Message::NewAddress(without_label));
    assert_eq!((got.ifindex, got.prefix_len, got.label.as_deref(), got.target_nsid), (3, 32, Some("eth0"), Some(4)));
}

#[test]
fn routes_decode_the_fields_the_model_reads() {
    let r = Route {
        family: AF_INET,
        dst_len: 32,
        table: RT_TABLE_MAIN,
        protocol: 4,
        scope: 253,
        route_type: RTN_UNICAST,
        dst: Some("10.1.2.3".parse().unwrap()),
        oif: Some(9),
        priority: Some(100),
    };
    assert_eq!(one(&fake::route(RTM_NEWROUTE, 3, &r)).1, Message::NewRoute(r.clone()));
    // A table past 255 is only in RTA_TABLE.
    let high = Route { table: 1000, family: AF_INET6, dst: Some("fd00::1".parse().unwrap()), dst_len: 128, ..r };
    assert_eq!(one(&fake::route(RTM_DELROUTE, 0, &high)).1, Message::DelRoute(high));
    // An IPv4 route whose RTA_DST is not 4 bytes.
    let mut payload = vec![AF_INET, 32, 0, 0, 254, 4, 0, RTN_UNICAST, 0, 0, 0, 0];
    payload.extend([7, 0, 1, 0, 10, 0, 0, 0]);
    assert!(matches!(decode_one(&fake::raw(RTM_NEWROUTE, 0, 0, &payload)), Err(WireError::Malformed { .. })));
    // An MPLS route (AF_MPLS, from an AF_UNSPEC dump) is no IP route.
    let mut payload = vec![28, 20, 0, 0, 254, 4, 0, RTN_UNICAST, 0, 0, 0, 0];
    payload.extend([8, 0, 1, 0, 0, 1, 0x41, 0]);
    let Ok(Message::NewRoute(mpls)) = decode_one(&fake::raw(RTM_NEWROUTE, 0, 0, &payload)) else { panic!("no route") };
    assert_eq!((mpls.family, mpls.dst), (28, None));
}

#[test]
fn nsid_not_assigned_is_none() {
    assert_eq!(one(&fake::nsid(RTM_NEWNSID, 0, -1)).1, Message::NewNsid { nsid: None });
    assert_eq!(one(&fake::nsid(RTM_DELNSID, 0, 4)).1, Message::DelNsid { nsid: Some(4) });
}

#[test]
fn errors_carry_the_request_sequence() {
    assert_eq!(one(&fake::error(12, libc::EEXIST)).1, Message::Error { errno: libc::EEXIST, request_seq: Some(12) });
    assert_eq!(one(&fake::error(13, 0)).1, Message::Error { errno: 0, request_seq: Some(13) });
    // An error whose copy of the request is cut short has no sequence.
    let cut = fake::raw(NLMSG_ERROR, 0, 5, &(-libc::EINVAL).to_ne_bytes());
    assert_eq!(one(&cut).1, Message::Error { errno: libc::EINVAL, request_seq: None });
}

#[test]
fn done_carries_the_dump_error() {
    assert_eq!(one(&fake::done(4)).1, Message::Done { error: 0 });
    assert_eq!(one(&fake::done_refused(4, libc::EINVAL)).1, Message::Done { error: -libc::EINVAL });
    // Old kernels send DONE without the error word.
    assert_eq!(one(&fake::raw(NLMSG_DONE, 0, 4, &[])).1, Message::Done { error: 0 });
}

#[test]
fn requests_have_consistent_lengths_and_the_fields_the_kernel_reads() {
    for req in [
        dump_links(1, Some(2)),
        dump_addresses(1, None, Family::Both),
        dump_routes(3),
        dump_nsids(4),
        assign_nsid(5, 9),
    ] {
        let buffer = NetlinkBuffer::new_checked(&req[..]).expect("frames");
        assert_eq!(buffer.length() as usize, req.len());
        assert_eq!(req.len() % 4, 0);
        assert!(buffer.flags() & NLM_F_REQUEST != 0);
    }
    // The target nsid right after the fixed header, where the model's tests
    // (and the kernel) look for it.
    let links = dump_links(7, Some(42));
    assert_eq!(links[4..6], RTM_GETLINK.to_ne_bytes());
    assert_eq!(links[6..8], (NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    assert_eq!(links[NLMSG_HDRLEN + 16 + 2..NLMSG_HDRLEN + 20], IFLA_TARGET_NETNSID.to_ne_bytes());
    assert_eq!(links[NLMSG_HDRLEN + 20..NLMSG_HDRLEN + 24], 42i32.to_ne_bytes());
    let addresses = dump_addresses(7, Some(42), Family::Both);
    assert_eq!(addresses[NLMSG_HDRLEN + 8 + 2..NLMSG_HDRLEN + 12], IFA_TARGET_NETNSID.to_ne_bytes());
    assert_eq!(addresses[NLMSG_HDRLEN + 12..NLMSG_HDRLEN + 16], 42i32.to_ne_bytes());
    assert_eq!(addresses[NLMSG_HDRLEN], AF_UNSPEC);
    assert_eq!(dump_addresses(7, None, Family::Inet)[NLMSG_HDRLEN], AF_INET);
    assert_eq!(dump_addresses(7, None, Family::Inet6)[NLMSG_HDRLEN], AF_INET6);
    // Assignment: NETNSA_NSID -1 ("pick one") and NETNSA_FD.
    let assign = assign_nsid(5, 9);
    let (h, p) = messages(&assign).next().unwrap().unwrap();
    assert_eq!((h.kind, h.seq, h.flags), (RTM_NEWNSID, 5, NLM_F_REQUEST));
    let m = NsidMessage::parse(p).unwrap();
    assert_eq!(m.attributes, vec![NsidAttribute::Id(-1), NsidAttribute::Fd(9)]);
    let get = get_nsid(6, 9);
    let (h, p) = messages(&get).next().unwrap().unwrap();
    assert_eq!((h.kind, h.seq), (RTM_GETNSID, 6));
    assert_eq!(NsidMessage::parse(p).unwrap().attributes, vec![NsidAttribute::Fd(9)]);
}

#[test]
fn several_messages_in_one_datagram() {
    let mut datagram = fake::nsid(RTM_NEWNSID, 0, 1);
    datagram.extend(fake::link(RTM_NEWLINK, 0, &veth()));
    datagram.extend(fake::nsid(RTM_DELNSID, 0, 1));
    let kinds: Vec<u16> = messages(&datagram).map(|m| m.unwrap().0.kind).collect();
    assert_eq!(kinds, [RTM_NEWNSID, RTM_NEWLINK, RTM_DELNSID]);
    // Trailing bytes shorter than a header are padding, not an error.
    datagram.extend([0u8; 8]);
    assert_eq!(messages(&datagram).count(), 3);
}

#[test]
fn a_lying_length_stops_the_datagram() {
    let mut bytes = fake::done(1);
    bytes[0] = 200;
    assert!(matches!(messages(&bytes).next(), Some(Err(WireError::BadMessageLength { len: 200, .. }))));
    // Shorter than its own header.
    bytes[0] = 8;
    assert!(matches!(messages(&bytes).next(), Some(Err(WireError::BadMessageLength { len: 8, .. }))));
    let mut attr = fake::nsid(RTM_NEWNSID, 0, 1);
    attr[20] = 99; // attribute length past the end
    assert!(matches!(decode_one(&attr), Err(WireError::Malformed { what: "rtgenmsg", .. })));
}

#[test]
fn truncated_messages_are_typed_errors() {
    for (kind, fixed) in [(RTM_NEWLINK, 16), (RTM_DELADDR, 8), (RTM_NEWROUTE, 12), (RTM_DELNSID, 4)] {
        for len in 0..fixed {
            let bytes = fake::raw(kind, 0, 0, &vec![0; len]);
            assert!(matches!(decode_one(&bytes), Err(WireError::Malformed { .. })), "{kind} with {len} bytes");
        }
    }
    assert!(matches!(decode_one(&fake::raw(NLMSG_ERROR, 0, 0, &[0, 0])), Err(WireError::Malformed { .. })));
    // Every cut of a good link message frames or fails, never panics.
    let good = fake::link(RTM_NEWLINK, 1, &veth());
    for cut in 0..good.len() {
        let mut bytes = good[..cut].to_vec();
        if bytes.len() >= 4 {
            bytes[..4].copy_from_slice(&(cut as u32).to_ne_bytes());
        }
        for (h, p) in messages(&bytes).flatten() {
            let _ = decode(&h, p);
        }
    }
}

#[test]
fn wrong_sized_attributes_the_model_reads_are_errors() {
    // An IFA_ADDRESS of 5 bytes.
    let mut payload = vec![AF_INET, 24, 0, 0, 2, 0, 0, 0];
    payload.extend([9, 0, 1, 0, 10, 0, 0, 1, 7, 0, 0, 0]);
    assert!(matches!(decode_one(&fake::raw(RTM_NEWADDR, 0, 0, &payload)), Err(WireError::Malformed { .. })));
    // An address message with no address at all.
    let bare = fake::raw(RTM_NEWADDR, 0, 0, &[AF_INET, 24, 0, 0, 2, 0, 0, 0]);
    assert_eq!(decode_one(&bare), Err(WireError::NoAddress));
    // An IFLA_LINK of 2 bytes.
    let mut payload = vec![0u8; 16];
    payload.extend([6, 0, 5, 0, 1, 0, 0, 0]);
    assert!(matches!(decode_one(&fake::raw(RTM_NEWLINK, 0, 0, &payload)), Err(WireError::Malformed { .. })));
}

#[test]
fn attributes_the_model_does_not_read_are_not_parsed() {
    // IFLA_MTU (4) of 2 bytes would fail the crate's parser: skipped.
    let mut payload = vec![0u8; 16];
    payload[4..8].copy_from_slice(&3u32.to_ne_bytes());
    payload.extend([6, 0, 4, 0, 1, 0, 0, 0]);
    payload.extend([7, 0, 3, 0, b'l', b'o', 0, 0]);
    let Ok(Message::NewLink(l)) = decode_one(&fake::raw(RTM_NEWLINK, 0, 0, &payload)) else { panic!("not a link") };
    assert_eq!((l.ifindex, l.name.as_deref()), (3, Some("lo")));
}

#[test]
fn unknown_link_kinds_keep_their_name() {
    let l = Link { kind: Some("netreap-made-up".into()), ..veth() };
    assert_eq!(one(&fake::link(RTM_NEWLINK, 0, &l)).1, Message::NewLink(l));
}

#[test]
fn other_types_are_not_parsed() {
    assert_eq!(one(&fake::raw(libc::RTM_NEWNEIGH, 0, 0, &[1, 2, 3])).1, Message::Other);
    assert_eq!(one(&fake::raw(1, 0, 0, &[])).1, Message::Other);
}

proptest::proptest! {
    #[test]
    fn arbitrary_datagrams_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
        for (h, p) in messages(&bytes).flatten() {
            let _ = decode(&h, p);
        }
    }

    #[test]
    fn arbitrary_payloads_never_panic(kind in 0u16..100, payload in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
        let h = Header { kind, flags: 0, seq: 0, port: 0 };
        let _ = decode(&h, &payload);
    }

    /// Valid headers with arbitrary attribute runs: the decoders reach the
    /// crate's attribute parsers, not only its header checks.
    #[test]
    fn arbitrary_attributes_never_panic(
        kind in proptest::sample::select(vec![RTM_NEWLINK, RTM_DELADDR, RTM_NEWROUTE, RTM_NEWNSID]),
        family in proptest::sample::select(vec![AF_UNSPEC, AF_INET, AF_INET6, 28]),
        attrs in proptest::collection::vec((0u16..70, proptest::collection::vec(proptest::num::u8::ANY, 0..24)), 0..8),
    ) {
        let fixed = match kind { RTM_NEWLINK => 16, RTM_DELADDR => 8, RTM_NEWROUTE => 12, _ => 4 };
        let mut payload = vec![0u8; fixed];
        payload[0] = family;
        for (t, v) in &attrs {
            payload.extend(((4 + v.len()) as u16).to_ne_bytes());
            payload.extend(t.to_ne_bytes());
            payload.extend(v);
            payload.resize(align4(payload.len()), 0);
        }
        let h = Header { kind, flags: 0, seq: 0, port: 0 };
        let _ = decode(&h, &payload);
    }
}

#[test]
fn a_bridge_port_view_of_a_link_is_not_the_link() {
    // The same veth as the bridge sends it: AF_BRIDGE, no peer attributes.
    let mut bytes = fake::link(RTM_DELLINK, 0, &veth());
    bytes[NLMSG_HDRLEN] = libc::AF_BRIDGE as u8;
    assert_eq!(one(&bytes).1, Message::Other);
    bytes[4..6].copy_from_slice(&RTM_NEWLINK.to_ne_bytes());
    assert_eq!(one(&bytes).1, Message::Other);
    // AF_UNSPEC, the link itself, still decodes.
    bytes[NLMSG_HDRLEN] = libc::AF_UNSPEC as u8;
    assert!(matches!(one(&bytes).1, Message::NewLink(_)));
}
