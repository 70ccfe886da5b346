//! The probe table and its loader: one table decides what loads; optional
//! probes that the kernel refuses are logged fallbacks, never errors.

use std::{fmt, io};

use aya::{
    Btf as AyaBtf, Ebpf, EbpfLoader,
    maps::{MapData, PerCpuArray, RingBuf},
    programs::{FEntry, FExit, ProgramError, TracePoint},
};
use netreap_common::KernelOffsets;
use serde::Serialize;

use super::btf::{self, BtfError};

/// The eBPF object, built by build.rs (see xtask::ebpf).
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/netreap-ebpf.o"));

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum Attach {
    Tracepoint { category: &'static str, name: &'static str },
    FEntry { function: &'static str },
    FExit { function: &'static str },
}

impl fmt::Display for Attach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tracepoint { category, name } => write!(f, "tracepoint {category}/{name}"),
            Self::FEntry { function } => write!(f, "fentry {function}"),
            Self::FExit { function } => write!(f, "fexit {function}"),
        }
    }
}

/// One program of the object and what it is for.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ProbeSpec {
    /// Program (function) name in the eBPF object.
    pub program: &'static str,
    pub attach: Attach,
    /// Required probes make the tracepoint path complete; optional ones
    /// sharpen it where the kernel allows.
    pub required: bool,
    pub observes: &'static str,
    /// What covers for it when an optional probe is refused.
    pub fallback: &'static str,
}

const fn tp(program: &'static str, category: &'static str, name: &'static str, observes: &'static str) -> ProbeSpec {
    ProbeSpec { program, attach: Attach::Tracepoint { category, name }, required: true, observes, fallback: "" }
}

/// Every probe netreap knows, in load order.
pub const PROBES: &[ProbeSpec] = &[
    tp("netreap_enter_unshare", "syscalls", "sys_enter_unshare", "unshare(CLONE_NEWNET): remembers the caller's netns"),
    tp("netreap_exit_unshare", "syscalls", "sys_exit_unshare", "unshare(CLONE_NEWNET): the new netns"),
    tp("netreap_exit_clone", "syscalls", "sys_exit_clone", "clone(CLONE_NEWNET): the child's new netns"),
    tp("netreap_exit_clone3", "syscalls", "sys_exit_clone3", "clone3(CLONE_NEWNET): the child's new netns"),
    tp("netreap_enter_setns", "syscalls", "sys_enter_setns", "setns: remembers the caller's netns"),
    tp("netreap_exit_setns", "syscalls", "sys_exit_setns", "setns: the netns entered, when it changed"),
    tp("netreap_cni_exec", "sched", "sched_process_exec", "CNI plugin runs: CNI_COMMAND/CONTAINERID/NETNS/IFNAME"),
    tp("netreap_cni_exit", "sched", "sched_process_exit", "CNI plugin exit codes"),
    ProbeSpec {
        program: "netreap_copy_net_ns",
        attach: Attach::FExit { function: "copy_net_ns" },
        required: false,
        observes: "every netns creation, whatever the syscall",
        fallback: "syscall tracepoints (unshare, clone, clone3, setns) report creation",
    },
    ProbeSpec {
        program: "netreap_put_net",
        attach: Attach::FEntry { function: "__put_net" },
        required: false,
        observes: "the exact moment a netns's last reference drops",
        fallback: "rtnetlink RTM_DELNSID reports netns death",
    },
];

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Btf(#[from] BtfError),
    #[error("cannot load the eBPF object")]
    Object(#[source] Box<aya::EbpfError>),
    #[error("the eBPF object has no program {0}")]
    MissingProgram(&'static str),
    #[error("the eBPF object has no map {0}")]
    MissingMap(&'static str),
    #[error("map {name}: {source}")]
    Map { name: &'static str, source: Box<aya::maps::MapError> },
    #[error("required probe {program} ({attach}) failed: {reason}")]
    Required { program: &'static str, attach: Attach, reason: String },
    #[error("tracepoints need tracefs")]
    Tracefs(#[source] io::Error),
    #[error("cannot watch the ring buffer")]
    Poll(#[source] io::Error),
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "reason")]
pub enum ProbeState {
    Active,
    /// The kernel refused it; the agent runs on without it.
    Unavailable(String),
}

#[derive(Debug, Clone, Serialize)]
pub struct ProbeStatus {
    #[serde(flatten)]
    pub spec: ProbeSpec,
    #[serde(flatten)]
    pub state: ProbeState,
}

/// The verifier's log can be megabytes; its last lines say why.
fn short(e: &ProgramError) -> String {
    match e {
        ProgramError::LoadError { io_error, verifier_log } => {
            let log = verifier_log.to_string();
            let tail: Vec<&str> = log.lines().rev().filter(|l| !l.trim().is_empty()).take(3).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            if tail.is_empty() {
                format!("BPF_PROG_LOAD: {io_error}")
            } else {
                format!("BPF_PROG_LOAD: {io_error}; verifier: {}", tail.join(" | "))
            }
        }
        other => other.to_string(),
    }
}

/// Turns a load/attach failure into a reason a person can act on.
fn explain(e: &ProgramError, attach: Attach) -> String {
    let errno = match e {
        ProgramError::LoadError { io_error, .. } => io_error.raw_os_error(),
        ProgramError::SyscallError(s) => s.io_error.raw_os_error(),
        _ => None,
    };
    match (errno, attach) {
        (Some(libc::EPERM), Attach::FEntry { .. } | Attach::FExit { .. }) => {
            "the kernel refuses BPF trampolines (EPERM: lockdown, or no \
             CONFIG_DYNAMIC_FTRACE_WITH_DIRECT_CALLS)"
                .to_owned()
        }
        (Some(libc::ENOENT), Attach::Tracepoint { .. }) => format!("tracepoint not in this kernel: {}", short(e)),
        _ => short(e),
    }
}

/// fentry/fexit need the kernel's BTF as aya parsed it.
fn trampoline_btf(btf: Option<&AyaBtf>) -> Result<&AyaBtf, ProgramError> {
    btf.ok_or_else(|| {
        ProgramError::Btf(aya::BtfError::FileError {
            path: btf::VMLINUX_BTF.into(),
            error: io::Error::from(io::ErrorKind::NotFound),
        })
    })
}

/// Loaded programs, with their maps still in the object.
pub struct Probes {
    ebpf: Ebpf,
    pub offsets: KernelOffsets,
    pub status: Vec<ProbeStatus>,
}

impl Probes {
    /// Resolves offsets from BTF, loads the object and attaches every probe
    /// the kernel accepts. Fails only when a required probe fails.
    pub fn load() -> Result<Self, ProbeError> {
        Self::load_with(true)
    }

    /// Like [`Probes::load`], but a failing required probe is recorded in
    /// `status` instead of failing the load: the `netreap probes` report.
    pub fn survey() -> Result<Self, ProbeError> {
        Self::load_with(false)
    }

    fn load_with(strict: bool) -> Result<Self, ProbeError> {
        match super::tracefs::ensure_mounted().map_err(ProbeError::Tracefs)? {
            super::tracefs::Tracefs::MountedBy(dir) => tracing::info!("mounted tracefs on {dir}"),
            super::tracefs::Tracefs::AlreadyMounted(_) => {}
        }
        // Our parse of the kernel's BTF is dropped before aya parses it again:
        // both at once would set the agent's peak memory.
        let offsets = btf::resolve_offsets(&btf::Btf::from_sys_fs()?)?;
        // The programs use no CO-RE relocations: the loader needs no kernel
        // BTF. Only fentry/fexit do, parsed after the object is loaded so
        // the two never sit in memory together (the agent's peak RSS).
        let mut ebpf = EbpfLoader::new()
            .btf(None)
            .override_global("OFFSETS", &offsets, true)
            .load(EBPF_OBJECT)
            .map_err(|e| ProbeError::Object(Box::new(e)))?;

        let aya_btf = PROBES
            .iter()
            .any(|p| matches!(p.attach, Attach::FEntry { .. } | Attach::FExit { .. }))
            .then(|| AyaBtf::from_sys_fs().ok())
            .flatten();
        let mut status = Vec::with_capacity(PROBES.len());
        for spec in PROBES {
            let prog = ebpf.program_mut(spec.program).ok_or(ProbeError::MissingProgram(spec.program))?;
            let result: Result<(), ProgramError> = match spec.attach {
                Attach::Tracepoint { category, name } => <&mut TracePoint>::try_from(prog).and_then(|p| {
                    p.load()?;
                    p.attach(category, name).map(drop)
                }),
                Attach::FEntry { function } => trampoline_btf(aya_btf.as_ref()).and_then(|b| {
                    let p = <&mut FEntry>::try_from(prog)?;
                    p.load(function, b)?;
                    p.attach().map(drop)
                }),
                Attach::FExit { function } => trampoline_btf(aya_btf.as_ref()).and_then(|b| {
                    let p = <&mut FExit>::try_from(prog)?;
                    p.load(function, b)?;
                    p.attach().map(drop)
                }),
            };
            let state = match result {
                Ok(()) => ProbeState::Active,
                Err(e) if spec.required && strict => {
                    return Err(ProbeError::Required {
                        program: spec.program,
                        attach: spec.attach,
                        reason: explain(&e, spec.attach),
                    });
                }
                Err(e) => ProbeState::Unavailable(explain(&e, spec.attach)),
            };
            status.push(ProbeStatus { spec: *spec, state });
        }
        Ok(Self { ebpf, offsets, status })
    }

    /// Is the optional probe for `program` running?
    #[must_use]
    pub fn is_active(&self, program: &str) -> bool {
        self.status.iter().any(|s| s.spec.program == program && matches!(s.state, ProbeState::Active))
    }

    /// Takes the ring buffer and the drop counter out of the object. The
    /// programs stay attached for as long as `Probes` lives.
    pub fn take_channels(&mut self) -> Result<(RingBuf<MapData>, DropCounter), ProbeError> {
        let events = self.ebpf.take_map("EVENTS").ok_or(ProbeError::MissingMap("EVENTS"))?;
        let events = RingBuf::try_from(events).map_err(|e| ProbeError::Map { name: "EVENTS", source: Box::new(e) })?;
        let drops = self.ebpf.take_map("DROPS").ok_or(ProbeError::MissingMap("DROPS"))?;
        let drops =
            PerCpuArray::try_from(drops).map_err(|e| ProbeError::Map { name: "DROPS", source: Box::new(e) })?;
        Ok((events, DropCounter { map: drops }))
    }
}

/// Reads the kernel's count of records the ring buffer had no room for.
pub struct DropCounter {
    map: PerCpuArray<MapData, u64>,
}

impl DropCounter {
    /// Total drops over all CPUs since load.
    pub fn total(&self) -> Result<u64, ProbeError> {
        let values = self.map.get(&0, 0).map_err(|e| ProbeError::Map { name: "DROPS", source: Box::new(e) })?;
        Ok(values.iter().sum())
    }
}
