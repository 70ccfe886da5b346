//! Kernel/user shared layouts. Every type is `#[repr(C)]` with explicit
//! padding fields, no bool/enum/Option fields, so both sides agree byte for byte.
#![no_std]
#![expect(clippy::pub_underscore_fields, reason = "`_pad` names explicit ABI padding, written as 0 by both sides")]

/// Event kinds on the ring buffer. Ids are stable: never renumber.
pub mod kind {
    /// A task's netns changed to a new one: `unshare(CLONE_NEWNET)`, clone
    /// with `CLONE_NEWNET` (the child's netns) or `setns` into another netns.
    pub const NETNS_ENTERED: u32 = 1;
    /// copy_net_ns returned a new netns (fexit, where the kernel allows it).
    pub const NETNS_CREATED: u32 = 2;
    /// The last reference of a netns dropped (fentry __put_net).
    pub const NETNS_FREED: u32 = 3;
    /// A CNI plugin image was exec'd (its environment carries CNI_COMMAND).
    pub const CNI_EXEC: u32 = 4;
    /// A CNI plugin process exited.
    pub const CNI_EXIT: u32 = 5;
}

/// How a netns event was observed (`NetnsData::via`).
pub mod via {
    pub const UNSHARE: u32 = 1;
    pub const CLONE: u32 = 2;
    pub const CLONE3: u32 = 3;
    pub const SETNS: u32 = 4;
    pub const COPY_NET_NS: u32 = 5;
    pub const PUT_NET: u32 = 6;
    /// raw tracepoint task_newtask: a task created with CLONE_NEWNET (the
    /// creation path when the syscall tracepoints are off).
    pub const TASK_NEWTASK: u32 = 7;
}

/// Bits of `CniExecData::flags`: which values were truncated or missing.
pub mod cni_flag {
    pub const COMMAND_TRUNCATED: u32 = 1 << 0;
    pub const CONTAINER_ID_TRUNCATED: u32 = 1 << 1;
    pub const NETNS_TRUNCATED: u32 = 1 << 2;
    pub const IFNAME_TRUNCATED: u32 = 1 << 3;
    pub const FILENAME_TRUNCATED: u32 = 1 << 4;
    /// The scan stopped before the end of the environment (a loop or
    /// tail-call limit, or an unreadable string): a value after that point
    /// would be missing, so the run is reported even without CNI_COMMAND.
    pub const ENV_SCAN_LIMIT: u32 = 1 << 5;
    pub const CNI_ARGS_TRUNCATED: u32 = 1 << 6;
    /// CNI_COMMAND was found (a record with ENV_SCAN_LIMIT may lack it).
    pub const HAS_COMMAND: u32 = 1 << 11;
    pub const HAS_CONTAINER_ID: u32 = 1 << 8;
    pub const HAS_NETNS: u32 = 1 << 9;
    pub const HAS_IFNAME: u32 = 1 << 10;
    /// CNI_ARGS was found (it names the pod: K8S_POD_NAMESPACE, K8S_POD_NAME).
    pub const HAS_CNI_ARGS: u32 = 1 << 12;
}

pub const COMM_LEN: usize = 16;
pub const CNI_COMMAND_LEN: usize = 16;
pub const CNI_CONTAINER_ID_LEN: usize = 128;
pub const CNI_NETNS_LEN: usize = 256;
pub const CNI_IFNAME_LEN: usize = 32;
pub const FILENAME_LEN: usize = 256;
/// CNI_ARGS as the runtime writes it (`IgnoreUnknown=1;K8S_POD_NAMESPACE=..;
/// K8S_POD_NAME=..;K8S_POD_INFRA_CONTAINER_ID=..;K8S_POD_UID=..`): about 200
/// bytes for the longest names in practice; a longer one is flagged cut and
/// the agent falls back to /proc/<pid>/environ.
pub const CNI_ARGS_LEN: usize = 384;
/// Which environment scan produced a CNI_EXEC record
/// (`CniExecData::scan_variant`). Ids are stable: never renumber.
pub mod scan_variant {
    /// One program, `bpf_loop` (Linux 5.17+): reads the whole environment.
    pub const BPF_LOOP: u32 = 1;
    /// Bounded loops in a chain of tail calls (Linux 5.10): reads up to
    /// `ENV_TAIL_STEPS * 34` strings or chunks.
    pub const TAIL_CALLS: u32 = 2;
}

/// Bytes of an environment string read at once; a longer string takes
/// several reads ("steps"). Above one page of most strings in practice.
pub const ENV_CHUNK: usize = 4096;
/// bpf_loop iterations (one string, or one chunk of a long one, each). The
/// kernel caps argv+envp at 6 MiB (fs/exec.c, `_STK_LIM / 4 * 3`), and each
/// string costs at least 9 bytes (a NUL and its pointer), so no environment
/// needs more than 6 MiB / 9 + 6 MiB / (ENV_CHUNK - 1) < 2^20 steps: this
/// variant reads any environment an exec can carry to its end.
pub const ENV_LOOP_STEPS: u32 = 1 << 20;
/// Steps per program run of the tail-call variant (a bounded loop the 5.10
/// verifier walks). The kernel allows 33 tail calls after the first run
/// (measured on 5.10 and 6.18: 34 runs, 4,352 strings).
pub const ENV_TAIL_STEPS: u32 = 128;

/// Common header of every ring-buffer record.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventHeader {
    pub kind: u32,
    /// Size of the whole record, header included.
    pub len: u32,
    /// bpf_ktime_get_ns: CLOCK_MONOTONIC nanoseconds.
    pub ktime_ns: u64,
    /// Thread id (the kernel's pid).
    pub pid: u32,
    /// Process id (the kernel's tgid).
    pub tgid: u32,
    pub cgroup_id: u64,
    pub comm: [u8; COMM_LEN],
}

/// NETNS_ENTERED, NETNS_CREATED, NETNS_FREED.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetnsData {
    /// ns.inum of the netns (the inode of /proc/PID/ns/net).
    pub netns_inum: u32,
    /// The task's netns before the change (0 when not known).
    pub prev_inum: u32,
    pub via: u32,
    pub _pad: u32,
}

/// CNI_EXEC: NUL-terminated strings read from the new image's environment.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CniExecData {
    pub flags: u32,
    /// Environment strings scanned.
    pub env_scanned: u32,
    /// Real uid of the task after exec (`bpf_get_current_uid_gid`).
    pub uid: u32,
    /// [`scan_variant`] that read the environment.
    pub scan_variant: u32,
    /// When the run is nested (its parent is a CNI run with the same
    /// CNI_COMMAND, CNI_CONTAINERID and CNI_NETNS, none of them cut: bridge
    /// running host-local), the parent's process id; else 0.
    pub nested_in: u32,
    pub _pad: u32,
    pub command: [u8; CNI_COMMAND_LEN],
    pub container_id: [u8; CNI_CONTAINER_ID_LEN],
    pub netns: [u8; CNI_NETNS_LEN],
    pub ifname: [u8; CNI_IFNAME_LEN],
    pub filename: [u8; FILENAME_LEN],
    /// CNI_ARGS, so the pod's name survives a plugin that exits before the
    /// agent could read its environment.
    pub cni_args: [u8; CNI_ARGS_LEN],
}

// Layout guards: the kernel and the agent agree on these sizes, and no
// field leaves padding behind it.
const _: () = assert!(core::mem::size_of::<EventHeader>() == 48);
const _: () = assert!(
    core::mem::size_of::<CniExecData>()
        == 6 * 4
            + CNI_COMMAND_LEN
            + CNI_CONTAINER_ID_LEN
            + CNI_NETNS_LEN
            + CNI_IFNAME_LEN
            + FILENAME_LEN
            + CNI_ARGS_LEN
);
const _: () = assert!(core::mem::size_of::<Event<CniExecData>>() == 48 + 712 + CNI_ARGS_LEN);

/// CNI_EXIT.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CniExitData {
    /// task->exit_code: wait status (exit code << 8 | signal).
    pub exit_status: u32,
    pub _pad: u32,
}

/// A whole record: header plus kind-specific data.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event<T> {
    pub header: EventHeader,
    pub data: T,
}

/// Kernel struct member offsets, resolved from BTF by the agent at start
/// and written into the programs as a global before load (no CO-RE in Rust).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    pub task_nsproxy: u32,
    pub task_real_parent: u32,
    pub task_exit_code: u32,
    pub task_mm: u32,
    pub nsproxy_net_ns: u32,
    /// Offset of ns.inum inside struct net (net.ns + ns_common.inum).
    pub net_ns_inum: u32,
    pub mm_env_start: u32,
    pub mm_env_end: u32,
    /// task_struct.pid and .tgid: the new task's ids in task_newtask.
    pub task_pid: u32,
    pub task_tgid: u32,
    /// Non-zero once the agent filled the struct; programs do nothing before.
    pub valid: u32,
    pub _pad: u32,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all are repr(C), made of integers and byte arrays, no padding.
    unsafe impl aya::Pod for super::KernelOffsets {}
}
