//! Reads of kernel structs through offsets the agent resolved from BTF.

use aya_ebpf::helpers::{bpf_get_current_task, bpf_probe_read_kernel};
use netreap_common::KernelOffsets;

/// Filled by the agent (EbpfLoader::override_global) before load.
#[unsafe(no_mangle)]
static OFFSETS: KernelOffsets = KernelOffsets {
    task_nsproxy: 0,
    task_real_parent: 0,
    task_exit_code: 0,
    task_mm: 0,
    nsproxy_net_ns: 0,
    net_ns_inum: 0,
    mm_env_start: 0,
    mm_env_end: 0,
    task_pid: 0,
    task_tgid: 0,
    valid: 0,
    _pad: 0,
};

/// Error code for "nothing to report" paths (e.g. a task without nsproxy).
pub const SKIP: i64 = 0;

#[inline(always)]
pub fn offsets() -> KernelOffsets {
    // SAFETY: a plain read of a constant global; volatile so the compiler
    // does not fold the placeholder zeros the loader replaces.
    unsafe { core::ptr::read_volatile(&raw const OFFSETS) }
}

#[inline(always)]
pub fn current_task() -> *const u8 {
    // SAFETY: helper with no preconditions.
    unsafe { bpf_get_current_task() as *const u8 }
}

/// Reads a `T` at `base + off` from kernel memory.
#[inline(always)]
pub fn read<T>(base: *const u8, off: u32) -> Result<T, i64> {
    // SAFETY: bpf_probe_read_kernel checks the address; a bad one is an Err.
    unsafe { bpf_probe_read_kernel(base.wrapping_add(off as usize).cast::<T>()).map_err(i64::from) }
}

/// ns.inum of a struct net.
#[inline(always)]
pub fn net_inum(net: *const u8, off: &KernelOffsets) -> Result<u32, i64> {
    if net.is_null() {
        return Err(SKIP);
    }
    read::<u32>(net, off.net_ns_inum)
}

/// ns.inum of a task's network namespace (task->nsproxy->net_ns->ns.inum).
#[inline(always)]
pub fn task_netns_inum(task: *const u8, off: &KernelOffsets) -> Result<u32, i64> {
    if task.is_null() {
        return Err(SKIP);
    }
    let nsproxy: *const u8 = read(task, off.task_nsproxy)?;
    if nsproxy.is_null() {
        // An exiting task has dropped its namespaces.
        return Err(SKIP);
    }
    let net: *const u8 = read(nsproxy, off.nsproxy_net_ns)?;
    net_inum(net, off)
}
