//! The probe table and its loader: one table decides what loads; optional
//! probes that the kernel refuses are logged fallbacks, never errors.

use std::{fmt, io};

use aya::{
    Btf as AyaBtf, Ebpf, EbpfLoader,
    maps::{MapData, PerCpuArray, ProgramArray, RingBuf},
    programs::{FEntry, FExit, ProgramError, RawTracePoint, TracePoint},
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
    RawTracepoint { name: &'static str },
    FEntry { function: &'static str },
    FExit { function: &'static str },
}

impl fmt::Display for Attach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tracepoint { category, name } => write!(f, "tracepoint {category}/{name}"),
            Self::RawTracepoint { name } => write!(f, "raw_tracepoint {name}"),
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
    /// A second implementation for kernels that refuse `program`, tried
    /// when loading it fails.
    pub variant: Option<Variant>,
    /// Which probe set it belongs to (see [`ProbeOptions`]).
    pub set: ProbeSet,
}

/// The syscall tracepoints name the task that made or entered a netns
/// (attribution: pid, comm, cgroup), but enabling any syscall tracepoint
/// puts every task of the node on the kernel's syscall-tracing slow path.
/// With `probes.attribution = false` (the default) they are not loaded and
/// creation is seen by `task_newtask` and netlink instead; death (RTM_DELNSID,
/// __put_net) and the CNI ledger (sched tracepoints) need neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeSet {
    /// Loaded in both settings.
    Always,
    /// Only with `probes.attribution = true`.
    Attribution,
    /// Only with `probes.attribution = false` (what covers for the others).
    WithoutAttribution,
}

/// What to load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProbeOptions {
    /// Load the syscall tracepoints (`probes.attribution`).
    pub attribution: bool,
}

/// An older-kernel implementation of a probe: `entry` is attached in place
/// of the probe's program, `tail` goes into slot 0 of the program array
/// `tail_map` (a chain of tail calls).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Variant {
    pub name: &'static str,
    pub entry: &'static str,
    pub tail: &'static str,
    pub tail_map: &'static str,
    /// Name of the probe's own implementation, for reports.
    pub primary_name: &'static str,
    /// What the variant gives up against the primary one.
    pub limits: &'static str,
    /// What is lost when neither loads.
    pub lost: &'static str,
}

const fn tp(program: &'static str, category: &'static str, name: &'static str, observes: &'static str) -> ProbeSpec {
    ProbeSpec {
        program,
        attach: Attach::Tracepoint { category, name },
        required: true,
        observes,
        fallback: "",
        variant: None,
        set: ProbeSet::Always,
    }
}

/// A syscall tracepoint: only with `probes.attribution = true`.
const fn syscall_tp(program: &'static str, name: &'static str, observes: &'static str) -> ProbeSpec {
    ProbeSpec { set: ProbeSet::Attribution, ..tp(program, "syscalls", name, observes) }
}

/// The CNI environment scan for kernels without bpf_loop (before 5.17).
pub const ENV_SCAN_TAIL_CALLS: Variant = Variant {
    name: "tail_calls",
    entry: "netreap_cni_exec_chained",
    tail: "netreap_cni_exec_next",
    tail_map: "ENV_TAIL",
    primary_name: "bpf_loop",
    limits: "reads the first 4,352 environment strings (128 per program run, 34 runs: measured on 5.10 and 6.18); a longer \
             environment is reported as scan-limited and its run is kept as unknown",
    lost: "the CNI ledger: no container-to-netns binding from plugin runs (a failed ADD binds nothing), \
           no in-flight detection; bindings come only from the CNI cache and the runtime",
};

/// Every probe netreap knows, in load order.
pub const PROBES: &[ProbeSpec] = &[
    syscall_tp("netreap_enter_unshare", "sys_enter_unshare", "unshare(CLONE_NEWNET): remembers the caller's netns"),
    syscall_tp("netreap_exit_unshare", "sys_exit_unshare", "unshare(CLONE_NEWNET): the new netns"),
    syscall_tp("netreap_exit_clone", "sys_exit_clone", "clone(CLONE_NEWNET): the child's new netns"),
    syscall_tp("netreap_exit_clone3", "sys_exit_clone3", "clone3(CLONE_NEWNET): the child's new netns"),
    syscall_tp("netreap_enter_setns", "sys_enter_setns", "setns: remembers the caller's netns"),
    syscall_tp("netreap_exit_setns", "sys_exit_setns", "setns: the netns entered, when it changed"),
    ProbeSpec {
        program: "netreap_task_newtask",
        attach: Attach::RawTracepoint { name: "task_newtask" },
        required: true,
        observes: "clone/clone3(CLONE_NEWNET): the new task's netns, without a syscall tracepoint",
        fallback: "",
        variant: None,
        set: ProbeSet::WithoutAttribution,
    },
    ProbeSpec {
        variant: Some(ENV_SCAN_TAIL_CALLS),
        ..tp("netreap_cni_exec", "sched", "sched_process_exec", "CNI plugin runs: CNI_COMMAND/CONTAINERID/NETNS/IFNAME")
    },
    tp("netreap_cni_exit", "sched", "sched_process_exit", "CNI plugin exit codes"),
    ProbeSpec {
        program: "netreap_copy_net_ns",
        attach: Attach::FExit { function: "copy_net_ns" },
        required: false,
        observes: "every netns creation, whatever the syscall",
        fallback: "syscall tracepoints (unshare, clone, clone3, setns) or task_newtask and netlink report creation",
        variant: None,
        set: ProbeSet::Always,
    },
    ProbeSpec {
        program: "netreap_put_net",
        attach: Attach::FEntry { function: "__put_net" },
        required: false,
        observes: "the exact moment a netns's last reference drops",
        fallback: "rtnetlink RTM_DELNSID reports netns death",
        variant: None,
        set: ProbeSet::Always,
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
    /// For a probe with a [`Variant`]: which implementation runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub implementation: Option<Implementation>,
}

/// Which implementation of a probe with a variant is active, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Implementation {
    /// `bpf_loop` or `tail_calls`; None when neither loaded.
    pub active: Option<&'static str>,
    /// Why the primary implementation was refused (None when it runs).
    pub primary_refused: Option<String>,
    /// Why the variant was refused too (None unless both failed).
    pub variant_refused: Option<String>,
    /// What the active implementation gives up, or what is lost.
    pub note: Option<&'static str>,
}

/// The verifier's log can be megabytes; its last lines say why.
fn short(e: &ProgramError) -> String {
    match e {
        ProgramError::LoadError { io_error, verifier_log } => {
            let log = verifier_log.to_string();
            // The verifier ends with statistics lines; the reason is above them.
            let is_stats = |l: &str| {
                let l = l.trim();
                l.is_empty()
                    || l.starts_with("verification time")
                    || l.starts_with("stack depth")
                    || l.starts_with("processed ")
            };
            let tail: Vec<&str> = log.lines().rev().filter(|l| !is_stats(l)).take(3).collect();
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

/// `bpf(BPF_PROG_LOAD)`'s attributes up to `attach_btf_id` (the kernel
/// takes a shorter `bpf_attr` and reads the rest as zero).
#[repr(C)]
#[derive(Default)]
struct TracingProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    prog_btf_fd: u32,
    func_info_rec_size: u32,
    func_info: u64,
    func_info_cnt: u32,
    line_info_rec_size: u32,
    line_info: u64,
    line_info_cnt: u32,
    attach_btf_id: u32,
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_TRACING: u32 = 26;
const BPF_TRACE_FENTRY: u32 = 24;

/// Does this kernel refuse BPF trampolines outright? A two-instruction
/// fentry program (`return 0`) on the first trampoline function the kernel
/// has: `Some(EPERM)` when the kernel refuses it so (lockdown, no
/// trampoline support), `None` otherwise (loaded, or refused for another
/// reason, which the real load then reports). Costs a syscall, where aya's
/// own check needs its parse of the kernel's BTF (~19 MB of heap).
fn trampolines_refused(kernel_btf: &btf::Btf) -> Option<i32> {
    let attach_btf_id = btf::TRAMPOLINE_FUNCTIONS.iter().find_map(|f| kernel_btf.func_id(f))?;
    // mov r0, 0; exit
    let insns: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    let attr = TracingProgLoad {
        prog_type: BPF_PROG_TYPE_TRACING,
        insn_cnt: 2,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        expected_attach_type: BPF_TRACE_FENTRY,
        attach_btf_id,
        ..TracingProgLoad::default()
    };
    // SAFETY: `attr` and the buffers it points to outlive the call; the
    // kernel reads `size_of::<TracingProgLoad>()` bytes of it.
    let fd =
        unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, &raw const attr, std::mem::size_of::<TracingProgLoad>()) };
    if fd >= 0 {
        // SAFETY: a program fd the kernel just gave us, closed once.
        drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) });
        return None;
    }
    let errno = io::Error::last_os_error().raw_os_error();
    errno.filter(|e| *e == libc::EPERM)
}

/// Hides the kernel's BTF from this thread: a mount namespace of its own,
/// private (nothing propagates back to the host's), with /dev/null bound
/// over /sys/kernel/btf/vmlinux.
fn hide_kernel_btf() -> io::Result<()> {
    let check = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) };
    // SAFETY: plain syscalls on this thread's own mount namespace; the
    // strings are NUL-terminated literals.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        check(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ))?;
        check(libc::mount(
            c"/dev/null".as_ptr(),
            c"/sys/kernel/btf/vmlinux".as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ))
    }
}

/// An `EbpfLoader` that has not parsed the kernel's BTF. aya 0.14's
/// `EbpfLoader::new()` always parses it (5 MB of vmlinux BTF into ~19 MB of
/// heap, dropped again by `.btf(None)`): that moment was the agent's peak
/// memory (VmHWM, issue 13). So the loader is made on a short-lived thread
/// that first hides the file from itself (its own mount namespace, gone
/// with the thread); aya then finds nothing to parse. Where that cannot be
/// done (no CAP_SYS_ADMIN), the loader is made as usual: the same programs
/// load, at the higher peak.
fn loader_without_kernel_btf() -> EbpfLoader<'static> {
    let made = std::thread::Builder::new().name("netreap-loader".into()).spawn(|| {
        if let Err(e) = hide_kernel_btf() {
            tracing::debug!("cannot hide the kernel BTF from aya's loader ({e}): it parses it once");
        }
        EbpfLoader::new()
    });
    made.ok().and_then(|thread| thread.join().ok()).unwrap_or_else(EbpfLoader::new)
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

fn load_tracepoint(prog: &mut aya::programs::Program, category: &str, name: &str) -> Result<(), ProgramError> {
    <&mut TracePoint>::try_from(prog).and_then(|p| {
        p.load()?;
        p.attach(category, name).map(drop)
    })
}

/// Loads the probe's own program; when the kernel refuses it, the variant
/// (its tail program into the program array, then its entry, attached).
fn load_with_variant(
    ebpf: &mut Ebpf,
    spec: &ProbeSpec,
    variant: Variant,
    (category, name): (&'static str, &'static str),
    force_variant: bool,
) -> Result<(ProbeState, Implementation), ProbeError> {
    let prog = ebpf.program_mut(spec.program).ok_or(ProbeError::MissingProgram(spec.program))?;
    let primary = if force_variant {
        Err("not tried (the variant was asked for)".to_owned())
    } else {
        load_tracepoint(prog, category, name).map_err(|e| explain(&e, spec.attach))
    };
    let primary_refused = match primary {
        Ok(()) => {
            let implementation = Implementation {
                active: Some(variant.primary_name),
                primary_refused: None,
                variant_refused: None,
                note: None,
            };
            return Ok((ProbeState::Active, implementation));
        }
        Err(reason) => reason,
    };
    // Unload what may have half-loaded so the kernel keeps no second copy.
    if let Some(p) = ebpf.program_mut(spec.program).and_then(|p| <&mut TracePoint>::try_from(p).ok()) {
        let _ = p.unload();
    }
    let result = load_variant(ebpf, variant, category, name);
    Ok(match result {
        Ok(()) => (
            ProbeState::Active,
            Implementation {
                active: Some(variant.name),
                primary_refused: Some(primary_refused),
                variant_refused: None,
                note: Some(variant.limits),
            },
        ),
        Err(VariantError::Missing(what)) => return Err(what),
        Err(VariantError::Refused(reason)) => (
            ProbeState::Unavailable(format!(
                "{} refused ({primary_refused}); {} refused ({reason})",
                variant.primary_name, variant.name
            )),
            Implementation {
                active: None,
                primary_refused: Some(primary_refused),
                variant_refused: Some(reason),
                note: Some(variant.lost),
            },
        ),
    })
}

enum VariantError {
    /// The object lacks a program or map: a build error, never a kernel's.
    Missing(ProbeError),
    Refused(String),
}

fn load_variant(ebpf: &mut Ebpf, variant: Variant, category: &str, name: &str) -> Result<(), VariantError> {
    let attach = Attach::Tracepoint { category: "", name: "" };
    let tail = ebpf.program_mut(variant.tail).ok_or(VariantError::Missing(ProbeError::MissingProgram(variant.tail)))?;
    let tail = <&mut TracePoint>::try_from(tail).map_err(|e| VariantError::Refused(e.to_string()))?;
    tail.load().map_err(|e| VariantError::Refused(format!("{}: {}", variant.tail, explain(&e, attach))))?;
    let tail_fd = tail
        .fd()
        .map_err(|e| VariantError::Refused(e.to_string()))?
        .try_clone()
        .map_err(|e| VariantError::Refused(format!("{}: {e}", variant.tail)))?;
    let map = ebpf.map_mut(variant.tail_map).ok_or(VariantError::Missing(ProbeError::MissingMap(variant.tail_map)))?;
    let mut slots: ProgramArray<&mut MapData> = ProgramArray::try_from(map)
        .map_err(|e| VariantError::Missing(ProbeError::Map { name: variant.tail_map, source: Box::new(e) }))?;
    slots.set(0, &tail_fd, 0).map_err(|e| VariantError::Refused(format!("{}: {e}", variant.tail_map)))?;
    let entry =
        ebpf.program_mut(variant.entry).ok_or(VariantError::Missing(ProbeError::MissingProgram(variant.entry)))?;
    load_tracepoint(entry, category, name)
        .map_err(|e| VariantError::Refused(format!("{}: {}", variant.entry, explain(&e, attach))))
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
    /// Every probe of the tracepoint path, the syscall tracepoints included
    /// (`probes.attribution = true`).
    pub fn load() -> Result<Self, ProbeError> {
        Self::load_with(true, false, ProbeOptions { attribution: true })
    }

    /// Like [`Probes::load`], with the probe set `options` names.
    pub fn load_configured(options: ProbeOptions) -> Result<Self, ProbeError> {
        Self::load_with(true, false, options)
    }

    /// Like [`Probes::load`], but a failing required probe is recorded in
    /// `status` instead of failing the load: the `netreap probes` report.
    /// Both probe sets are tried (a survey of the kernel).
    pub fn survey() -> Result<Self, ProbeError> {
        Self::load_with(false, false, ProbeOptions { attribution: true })
    }

    /// Like [`Probes::load`], but every probe with a [`Variant`] runs its
    /// variant even where the kernel accepts its own program: proves the
    /// older kernels' code path on any kernel (tests, `netreap probes
    /// --variants`).
    pub fn load_variants() -> Result<Self, ProbeError> {
        Self::load_with(true, true, ProbeOptions { attribution: true })
    }

    fn load_with(strict: bool, force_variants: bool, options: ProbeOptions) -> Result<Self, ProbeError> {
        match super::tracefs::ensure_mounted().map_err(ProbeError::Tracefs)? {
            super::tracefs::Tracefs::MountedBy(dir) => tracing::info!("mounted tracefs on {dir}"),
            super::tracefs::Tracefs::AlreadyMounted(_) => {}
        }
        // Our parse of the kernel's BTF keeps only what the offsets and the
        // trampoline check need, and is dropped before aya loads anything.
        let (offsets, trampolines_refused) = {
            let kernel_btf = btf::Btf::from_sys_fs()?;
            (btf::resolve_offsets(&kernel_btf)?, trampolines_refused(&kernel_btf))
        };
        // The programs use no CO-RE relocations: the loader needs no kernel
        // BTF. Only fentry/fexit do, parsed after the object is loaded so
        // the two never sit in memory together (the agent's peak RSS).
        let mut ebpf = loader_without_kernel_btf()
            .btf(None)
            .override_global("OFFSETS", &offsets, true)
            .load(EBPF_OBJECT)
            .map_err(|e| ProbeError::Object(Box::new(e)))?;

        // aya's parse of the kernel's BTF (~19 MB of heap for a moment) only
        // when a trampoline could load: where the kernel refuses them
        // outright, every fentry/fexit probe is unavailable for that reason.
        let wants_trampolines = PROBES.iter().any(|p| matches!(p.attach, Attach::FEntry { .. } | Attach::FExit { .. }));
        let aya_btf =
            (wants_trampolines && trampolines_refused.is_none()).then(|| AyaBtf::from_sys_fs().ok()).flatten();
        let mut status = Vec::with_capacity(PROBES.len());
        for spec in PROBES {
            // A survey (not strict) tries both sets.
            let off = match (strict, spec.set, options.attribution) {
                (true, ProbeSet::Attribution, false) => {
                    Some("off: probes.attribution = false (task_newtask and netlink report creation)")
                }
                (true, ProbeSet::WithoutAttribution, true) => {
                    Some("off: probes.attribution = true (the syscall tracepoints report creation)")
                }
                _ => None,
            };
            if let Some(reason) = off {
                // Not loaded by choice: never a failed required probe.
                let spec = ProbeSpec { required: false, ..*spec };
                status.push(ProbeStatus {
                    spec,
                    state: ProbeState::Unavailable(reason.to_owned()),
                    implementation: None,
                });
                continue;
            }
            if let (Some(variant), Attach::Tracepoint { category, name }) = (spec.variant, spec.attach) {
                let (state, implementation) =
                    load_with_variant(&mut ebpf, spec, variant, (category, name), force_variants)?;
                if let (ProbeState::Unavailable(reason), true, true) = (&state, spec.required, strict) {
                    return Err(ProbeError::Required {
                        program: spec.program,
                        attach: spec.attach,
                        reason: reason.clone(),
                    });
                }
                status.push(ProbeStatus { spec: *spec, state, implementation: Some(implementation) });
                continue;
            }
            let prog = ebpf.program_mut(spec.program).ok_or(ProbeError::MissingProgram(spec.program))?;
            let result: Result<(), ProgramError> = match spec.attach {
                Attach::Tracepoint { category, name } => load_tracepoint(prog, category, name),
                Attach::RawTracepoint { name } => <&mut RawTracePoint>::try_from(prog).and_then(|p| {
                    p.load()?;
                    p.attach(name).map(drop)
                }),
                Attach::FEntry { .. } | Attach::FExit { .. } if trampolines_refused.is_some() => {
                    Err(ProgramError::SyscallError(aya::sys::SyscallError {
                        call: "bpf_prog_load",
                        io_error: io::Error::from_raw_os_error(trampolines_refused.unwrap_or(libc::EPERM)),
                    }))
                }
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
            status.push(ProbeStatus { spec: *spec, state, implementation: None });
        }
        Ok(Self { ebpf, offsets, status })
    }

    /// The implementation of `program`'s probe that runs (None: a probe
    /// without variants, or none loaded).
    #[must_use]
    pub fn implementation(&self, program: &str) -> Option<&'static str> {
        self.status.iter().find(|s| s.spec.program == program)?.implementation.as_ref()?.active
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
        let drops = PerCpuArray::try_from(drops).map_err(|e| ProbeError::Map { name: "DROPS", source: Box::new(e) })?;
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
