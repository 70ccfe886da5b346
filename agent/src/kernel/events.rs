//! Typed decoding of ring-buffer records. Every record is checked for
//! length and kind; anything else is a [`DecodeError`], never a panic.

use std::mem::size_of;

use netreap_common::{CniExecData, CniExitData, Event, EventHeader, NetnsData, cni_flag, kind, scan_variant, via};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("record of {len} bytes is shorter than the {need}-byte header")]
    TooShort { len: usize, need: usize },
    #[error("record kind {0} is unknown")]
    UnknownKind(u32),
    #[error("record kind {kind}: {len} bytes, expected {expected}")]
    BadLength { kind: u32, len: usize, expected: usize },
    #[error("record header says {header_len} bytes but {len} arrived")]
    HeaderLength { header_len: u32, len: usize },
    #[error("netns record names unknown origin {0}")]
    UnknownVia(u32),
    #[error("CNI exec record names unknown scan variant {0}")]
    UnknownScanVariant(u32),
}

/// Who did it: the task that ran when the kernel emitted the record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Task {
    /// CLOCK_MONOTONIC nanoseconds.
    pub ktime_ns: u64,
    /// Thread id.
    pub pid: u32,
    /// Process id.
    pub tgid: u32,
    pub comm: String,
    pub cgroup_id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NetnsVia {
    Unshare,
    Clone,
    Clone3,
    Setns,
    CopyNetNs,
    PutNet,
    TaskNewtask,
}

impl NetnsVia {
    fn from_raw(raw: u32) -> Result<Self, DecodeError> {
        Ok(match raw {
            via::UNSHARE => Self::Unshare,
            via::CLONE => Self::Clone,
            via::CLONE3 => Self::Clone3,
            via::SETNS => Self::Setns,
            via::COPY_NET_NS => Self::CopyNetNs,
            via::PUT_NET => Self::PutNet,
            via::TASK_NEWTASK => Self::TaskNewtask,
            other => return Err(DecodeError::UnknownVia(other)),
        })
    }
}

/// Which kernel program read a CNI run's environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvScanVariant {
    /// One bpf_loop (Linux 5.17+).
    BpfLoop,
    /// Bounded loops chained by tail calls (Linux 5.10).
    TailCalls,
}

impl EnvScanVariant {
    fn from_raw(raw: u32) -> Result<Self, DecodeError> {
        match raw {
            scan_variant::BPF_LOOP => Ok(Self::BpfLoop),
            scan_variant::TAIL_CALLS => Ok(Self::TailCalls),
            other => Err(DecodeError::UnknownScanVariant(other)),
        }
    }
}

/// A CNI value read from the plugin's environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CniValue {
    pub value: String,
    /// The kernel's buffer was full: the value may be cut.
    pub truncated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CniExec {
    /// Path the plugin was exec'd by.
    pub binary: CniValue,
    pub command: CniValue,
    pub container_id: Option<CniValue>,
    pub netns: Option<CniValue>,
    pub ifname: Option<CniValue>,
    /// CNI_ARGS (names the pod); `truncated` when it filled the kernel's
    /// buffer, so only its complete `key=value;` pairs are trusted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cni_args: Option<CniValue>,
    /// The kernel's scan stopped before the end of the environment: a CNI_
    /// value (even CNI_COMMAND) may be missing. Such a run is unknown, never
    /// absent.
    pub env_scan_limited: bool,
    /// Environment strings the kernel read.
    pub env_scanned: u32,
    /// Real uid of the process after exec.
    pub uid: u32,
    pub scan_variant: EnvScanVariant,
    /// The kernel saw this run nested: its parent, this process, is a CNI
    /// run with the same CNI_COMMAND, CNI_CONTAINERID and CNI_NETNS (none of
    /// them cut) that had not exited when this one started.
    #[serde(skip)]
    pub nested_in: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct CniExit {
    /// Exit code, when the process exited normally.
    pub exit_code: Option<i32>,
    /// Signal number, when a signal killed it.
    pub signal: Option<i32>,
}

impl CniExit {
    #[must_use]
    pub fn from_wait_status(status: u32) -> Self {
        let signal = (status & 0x7f) as i32;
        if signal == 0 {
            Self { exit_code: Some(((status >> 8) & 0xff) as i32), signal: None }
        } else {
            Self { exit_code: None, signal: Some(signal) }
        }
    }

    #[must_use]
    pub fn succeeded(&self) -> bool {
        self.exit_code == Some(0)
    }
}

/// One decoded kernel record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum KernelEvent {
    /// A task moved into a netns it was not in: a new one (unshare, clone)
    /// or an existing one (setns).
    NetnsEntered {
        task: Task,
        netns_inode: u32,
        previous_netns_inode: u32,
        via: NetnsVia,
    },
    /// copy_net_ns created a netns (fexit; only where the kernel allows).
    NetnsCreated {
        task: Task,
        netns_inode: u32,
        via: NetnsVia,
    },
    /// The last reference of a netns dropped (fentry __put_net).
    NetnsFreed {
        task: Task,
        netns_inode: u32,
    },
    CniExec {
        task: Task,
        exec: CniExec,
    },
    CniExit {
        task: Task,
        exit: CniExit,
    },
}

impl KernelEvent {
    /// The event's name in the stream.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Self::NetnsEntered { .. } => "netns_entered",
            Self::NetnsCreated { .. } => "netns_created",
            Self::NetnsFreed { .. } => "netns_freed",
            Self::CniExec { .. } => "cni_exec",
            Self::CniExit { .. } => "cni_exit",
        }
    }

    #[must_use]
    pub fn task(&self) -> &Task {
        match self {
            Self::NetnsEntered { task, .. }
            | Self::NetnsCreated { task, .. }
            | Self::NetnsFreed { task, .. }
            | Self::CniExec { task, .. }
            | Self::CniExit { task, .. } => task,
        }
    }
}

/// Text up to the first NUL (lossy UTF-8). No NUL at all means the value
/// filled the buffer, so it is flagged as truncated.
fn c_string(bytes: &[u8], flagged: bool) -> CniValue {
    let end = bytes.iter().position(|&b| b == 0);
    let text = &bytes[..end.unwrap_or(bytes.len())];
    CniValue { value: String::from_utf8_lossy(text).into_owned(), truncated: flagged || end.is_none() }
}

fn read<T: Copy>(bytes: &[u8]) -> T {
    debug_assert!(bytes.len() >= size_of::<T>());
    // SAFETY: callers check the length; T is a repr(C) integer/byte-array struct
    // for which every bit pattern is valid; read_unaligned needs no alignment.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
}

fn expect_len(kind: u32, bytes: &[u8], expected: usize) -> Result<(), DecodeError> {
    if bytes.len() == expected { Ok(()) } else { Err(DecodeError::BadLength { kind, len: bytes.len(), expected }) }
}

/// Decodes one ring-buffer record.
pub fn decode(bytes: &[u8]) -> Result<KernelEvent, DecodeError> {
    let need = size_of::<EventHeader>();
    if bytes.len() < need {
        return Err(DecodeError::TooShort { len: bytes.len(), need });
    }
    let header: EventHeader = read(bytes);
    let task = Task {
        ktime_ns: header.ktime_ns,
        pid: header.pid,
        tgid: header.tgid,
        comm: c_string(&header.comm, false).value,
        cgroup_id: header.cgroup_id,
    };
    let expected = match header.kind {
        kind::NETNS_ENTERED | kind::NETNS_CREATED | kind::NETNS_FREED => size_of::<Event<NetnsData>>(),
        kind::CNI_EXEC => size_of::<Event<CniExecData>>(),
        kind::CNI_EXIT => size_of::<Event<CniExitData>>(),
        other => return Err(DecodeError::UnknownKind(other)),
    };
    expect_len(header.kind, bytes, expected)?;
    if header.len as usize != bytes.len() {
        return Err(DecodeError::HeaderLength { header_len: header.len, len: bytes.len() });
    }
    Ok(match header.kind {
        kind::CNI_EXEC => {
            let ev: Event<CniExecData> = read(bytes);
            let d = ev.data;
            let has = |flag: u32| d.flags & flag != 0;
            let value = |buf: &[u8], present: u32, cut: u32| has(present).then(|| c_string(buf, has(cut)));
            KernelEvent::CniExec {
                task,
                exec: CniExec {
                    binary: c_string(&d.filename, has(cni_flag::FILENAME_TRUNCATED)),
                    command: c_string(&d.command, has(cni_flag::COMMAND_TRUNCATED)),
                    container_id: value(&d.container_id, cni_flag::HAS_CONTAINER_ID, cni_flag::CONTAINER_ID_TRUNCATED),
                    netns: value(&d.netns, cni_flag::HAS_NETNS, cni_flag::NETNS_TRUNCATED),
                    ifname: value(&d.ifname, cni_flag::HAS_IFNAME, cni_flag::IFNAME_TRUNCATED),
                    cni_args: value(&d.cni_args, cni_flag::HAS_CNI_ARGS, cni_flag::CNI_ARGS_TRUNCATED),
                    env_scan_limited: has(cni_flag::ENV_SCAN_LIMIT),
                    env_scanned: d.env_scanned,
                    uid: d.uid,
                    scan_variant: EnvScanVariant::from_raw(d.scan_variant)?,
                    nested_in: (d.nested_in != 0).then_some(d.nested_in),
                },
            }
        }
        kind::CNI_EXIT => {
            let ev: Event<CniExitData> = read(bytes);
            KernelEvent::CniExit { task, exit: CniExit::from_wait_status(ev.data.exit_status) }
        }
        k => {
            let ev: Event<NetnsData> = read(bytes);
            let d = ev.data;
            let via = NetnsVia::from_raw(d.via)?;
            match k {
                kind::NETNS_ENTERED => KernelEvent::NetnsEntered {
                    task,
                    netns_inode: d.netns_inum,
                    previous_netns_inode: d.prev_inum,
                    via,
                },
                kind::NETNS_CREATED => KernelEvent::NetnsCreated { task, netns_inode: d.netns_inum, via },
                _ => KernelEvent::NetnsFreed { task, netns_inode: d.netns_inum },
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use netreap_common::{COMM_LEN, FILENAME_LEN};

    use super::*;

    fn bytes_of<T>(v: &T) -> Vec<u8> {
        // SAFETY: test-only view of a repr(C) value as bytes.
        unsafe { std::slice::from_raw_parts(std::ptr::from_ref(v).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    fn header(kind: u32, len: usize) -> EventHeader {
        let mut comm = [0u8; COMM_LEN];
        comm[..6].copy_from_slice(b"bridge");
        EventHeader { kind, len: len as u32, ktime_ns: 42, pid: 7, tgid: 7, cgroup_id: 9, comm }
    }

    fn fill(dst: &mut [u8], s: &str) {
        dst[..s.len()].copy_from_slice(s.as_bytes());
    }

    fn exec_record(flags: u32) -> Event<CniExecData> {
        let mut d = CniExecData {
            flags,
            env_scanned: 12,
            uid: 0,
            scan_variant: scan_variant::BPF_LOOP,
            nested_in: 0,
            _pad: 0,
            command: [0; 16],
            container_id: [0; 128],
            netns: [0; 256],
            ifname: [0; 32],
            filename: [0; FILENAME_LEN],
            cni_args: [0; netreap_common::CNI_ARGS_LEN],
        };
        fill(&mut d.command, "ADD");
        fill(&mut d.container_id, "abc123");
        fill(&mut d.netns, "/var/run/netns/cni-1");
        fill(&mut d.ifname, "eth0");
        fill(&mut d.filename, "/usr/lib/cni/bridge");
        Event { header: header(kind::CNI_EXEC, size_of::<Event<CniExecData>>()), data: d }
    }

    #[test]
    fn decodes_a_netns_record() {
        let ev = Event {
            header: header(kind::NETNS_ENTERED, size_of::<Event<NetnsData>>()),
            data: NetnsData { netns_inum: 4_026_532_000, prev_inum: 4_026_531_840, via: via::UNSHARE, _pad: 0 },
        };
        let decoded = decode(&bytes_of(&ev)).expect("valid record");
        assert_eq!(
            decoded,
            KernelEvent::NetnsEntered {
                task: Task { ktime_ns: 42, pid: 7, tgid: 7, comm: "bridge".into(), cgroup_id: 9 },
                netns_inode: 4_026_532_000,
                previous_netns_inode: 4_026_531_840,
                via: NetnsVia::Unshare,
            }
        );
    }

    #[test]
    fn decodes_a_cni_exec_with_flags() {
        let flags = cni_flag::HAS_CONTAINER_ID | cni_flag::HAS_NETNS | cni_flag::NETNS_TRUNCATED;
        let KernelEvent::CniExec { exec, .. } = decode(&bytes_of(&exec_record(flags))).unwrap() else {
            panic!("not an exec")
        };
        assert_eq!(exec.command.value, "ADD");
        assert_eq!(exec.binary.value, "/usr/lib/cni/bridge");
        assert_eq!(exec.container_id.as_ref().map(|v| v.value.as_str()), Some("abc123"));
        assert!(exec.netns.as_ref().is_some_and(|v| v.truncated), "flagged value is truncated");
        assert_eq!(exec.ifname, None, "absent without HAS_IFNAME");
        assert_eq!(exec.nested_in, None, "0: not nested");
        let mut rec = exec_record(flags);
        rec.data.nested_in = 4321;
        let KernelEvent::CniExec { exec, .. } = decode(&bytes_of(&rec)).unwrap() else { panic!("not an exec") };
        assert_eq!(exec.nested_in, Some(4321));
    }

    #[test]
    fn a_value_without_nul_is_truncated() {
        let mut rec = exec_record(cni_flag::HAS_IFNAME);
        rec.data.ifname = [b'x'; 32];
        let KernelEvent::CniExec { exec, .. } = decode(&bytes_of(&rec)).unwrap() else { panic!() };
        let ifname = exec.ifname.expect("present");
        assert!(ifname.truncated);
        assert_eq!(ifname.value.len(), 32);
    }

    #[test]
    fn exit_status_splits_code_and_signal() {
        assert_eq!(CniExit::from_wait_status(3 << 8), CniExit { exit_code: Some(3), signal: None });
        assert_eq!(CniExit::from_wait_status(9), CniExit { exit_code: None, signal: Some(9) });
        assert!(CniExit::from_wait_status(0).succeeded());
    }

    #[test]
    fn truncated_records_are_typed_errors() {
        let full = bytes_of(&exec_record(0));
        for cut in [0, 1, 47] {
            assert!(matches!(decode(&full[..cut]), Err(DecodeError::TooShort { .. })), "cut {cut}");
        }
        for cut in [48, 100, full.len() - 1] {
            assert!(matches!(decode(&full[..cut]), Err(DecodeError::BadLength { .. })), "cut {cut}");
        }
        let mut long = full.clone();
        long.push(0);
        assert!(matches!(decode(&long), Err(DecodeError::BadLength { .. })));
    }

    #[test]
    fn garbage_records_are_typed_errors() {
        let mut h = header(99, 48);
        assert_eq!(decode(&bytes_of(&h)), Err(DecodeError::UnknownKind(99)));
        h.kind = kind::NETNS_FREED;
        let mut ev = Event { header: h, data: NetnsData { netns_inum: 1, prev_inum: 0, via: 77, _pad: 0 } };
        ev.header.len = size_of::<Event<NetnsData>>() as u32;
        assert_eq!(decode(&bytes_of(&ev)), Err(DecodeError::UnknownVia(77)));
        ev.data.via = via::PUT_NET;
        ev.header.len = 3;
        assert!(matches!(decode(&bytes_of(&ev)), Err(DecodeError::HeaderLength { .. })));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..900)) {
            let _ = decode(&bytes);
        }
    }
}
