//! Network namespace creation and entry, from syscall tracepoints (the
//! complete path) and, where the kernel allows, fexit copy_net_ns and
//! fentry __put_net.

use core::mem::size_of;

use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{fentry, fexit, map, raw_tracepoint, tracepoint},
    maps::HashMap,
    programs::{FEntryContext, FExitContext, RawTracePointContext, TracePointContext},
};
use netreap_common::{Event, NetnsData, kind, via};

use crate::{
    emit::{Wake, header, output},
    kernel::{SKIP, current_task, net_inum, offsets, read, task_netns_inum},
};

const CLONE_NEWNET: u64 = 0x4000_0000;
/// Syscall tracepoint layout (stable ABI): 8 bytes of common fields, the
/// syscall number, then 8-byte args from offset 16; `long ret` at 16 on exit.
const SYSCALL_ARG0: usize = 16;
const SYSCALL_ARG1: usize = 24;
const SYSCALL_RET: usize = 16;

/// A task's netns before an unshare/setns, until its syscall returns.
#[repr(C)]
#[derive(Clone, Copy)]
struct Pending {
    prev_inum: u32,
    via: u32,
}

/// Keyed by thread id; entries live only for the duration of one syscall.
#[map]
static PENDING_NS: HashMap<u32, Pending> = HashMap::with_max_entries(16384, 0);

fn emit_netns(kind: u32, netns_inum: u32, prev_inum: u32, via: u32) {
    let event = Event {
        header: header(kind, size_of::<Event<NetnsData>>()),
        data: NetnsData { netns_inum, prev_inum, via, _pad: 0 },
    };
    output(&event, Wake::Default);
}

fn remember_current(via: u32) -> Result<u32, i64> {
    let off = offsets();
    if off.valid == 0 {
        return Err(SKIP);
    }
    let prev_inum = task_netns_inum(current_task(), &off)?;
    let tid = bpf_get_current_pid_tgid() as u32;
    PENDING_NS.insert(tid, Pending { prev_inum, via }, 0).map_err(i64::from)?;
    Ok(0)
}

/// Emits when the syscall succeeded and the caller's netns really changed.
fn report_if_changed(ctx: &TracePointContext) -> Result<u32, i64> {
    let tid = bpf_get_current_pid_tgid() as u32;
    // SAFETY: the value is copied out before the entry is removed.
    let Some(pending) = (unsafe { PENDING_NS.get(tid) }).copied() else {
        return Ok(0);
    };
    let _ = PENDING_NS.remove(tid);
    // SAFETY: offset inside the tracepoint record.
    let ret: i64 = unsafe { ctx.read_at(SYSCALL_RET) }.map_err(i64::from)?;
    if ret != 0 {
        return Ok(0);
    }
    let off = offsets();
    let now = task_netns_inum(current_task(), &off)?;
    if now != pending.prev_inum {
        emit_netns(kind::NETNS_ENTERED, now, pending.prev_inum, pending.via);
    }
    Ok(0)
}

/// tracepoint: syscalls/sys_enter_unshare (unsigned long unshare_flags)
#[tracepoint(category = "syscalls", name = "sys_enter_unshare")]
pub fn netreap_enter_unshare(ctx: TracePointContext) -> u32 {
    // SAFETY: offset inside the tracepoint record.
    match unsafe { ctx.read_at::<u64>(SYSCALL_ARG0) } {
        Ok(flags) if flags & CLONE_NEWNET != 0 => remember_current(via::UNSHARE).unwrap_or(0),
        _ => 0,
    }
}

/// tracepoint: syscalls/sys_exit_unshare (long ret)
#[tracepoint(category = "syscalls", name = "sys_exit_unshare")]
pub fn netreap_exit_unshare(ctx: TracePointContext) -> u32 {
    report_if_changed(&ctx).unwrap_or(0)
}

/// tracepoint: syscalls/sys_enter_setns (int fd, int flags)
#[tracepoint(category = "syscalls", name = "sys_enter_setns")]
pub fn netreap_enter_setns(ctx: TracePointContext) -> u32 {
    // nstype 0 means "any type": the fd may be a netns, so compare after.
    // SAFETY: offset inside the tracepoint record.
    match unsafe { ctx.read_at::<u64>(SYSCALL_ARG1) } {
        Ok(nstype) if nstype == 0 || nstype & CLONE_NEWNET != 0 => remember_current(via::SETNS).unwrap_or(0),
        _ => 0,
    }
}

/// tracepoint: syscalls/sys_exit_setns (long ret)
#[tracepoint(category = "syscalls", name = "sys_exit_setns")]
pub fn netreap_exit_setns(ctx: TracePointContext) -> u32 {
    report_if_changed(&ctx).unwrap_or(0)
}

/// In the child (ret == 0), a netns other than its parent's is a new one:
/// clone(CLONE_NEWNET) gave the child a netns at birth.
fn report_clone_child(ctx: &TracePointContext, via: u32) -> Result<u32, i64> {
    // SAFETY: offset inside the tracepoint record.
    let ret: i64 = unsafe { ctx.read_at(SYSCALL_RET) }.map_err(i64::from)?;
    if ret != 0 {
        return Ok(0);
    }
    let off = offsets();
    if off.valid == 0 {
        return Ok(0);
    }
    let task = current_task();
    let child = task_netns_inum(task, &off)?;
    let parent: *const u8 = read(task, off.task_real_parent)?;
    let parent = task_netns_inum(parent, &off)?;
    if child != parent {
        emit_netns(kind::NETNS_ENTERED, child, parent, via);
    }
    Ok(0)
}

/// tracepoint: syscalls/sys_exit_clone (long ret); fires in parent and child.
#[tracepoint(category = "syscalls", name = "sys_exit_clone")]
pub fn netreap_exit_clone(ctx: TracePointContext) -> u32 {
    report_clone_child(&ctx, via::CLONE).unwrap_or(0)
}

/// tracepoint: syscalls/sys_exit_clone3 (long ret); fires in parent and child.
#[tracepoint(category = "syscalls", name = "sys_exit_clone3")]
pub fn netreap_exit_clone3(ctx: TracePointContext) -> u32 {
    report_clone_child(&ctx, via::CLONE3).unwrap_or(0)
}

/// raw tracepoint: task_newtask (struct task_struct *task, u64 clone_flags),
/// in the parent, after the new task's namespaces are set: a task created
/// with CLONE_NEWNET is in a new netns. No syscall tracepoint is involved
/// (those put every task on the kernel's syscall-tracing slow path), so
/// this is the creation probe when `probes.attribution` is off. The record
/// names the new task (pid, tgid), so its netns can be opened through it.
#[raw_tracepoint(tracepoint = "task_newtask")]
pub fn netreap_task_newtask(ctx: RawTracePointContext) -> i32 {
    try_task_newtask(&ctx).unwrap_or(0)
}

fn try_task_newtask(ctx: &RawTracePointContext) -> Result<i32, i64> {
    let clone_flags: u64 = ctx.arg(1);
    if clone_flags & CLONE_NEWNET == 0 {
        return Ok(0);
    }
    let off = offsets();
    if off.valid == 0 {
        return Ok(0);
    }
    let task: *const u8 = ctx.arg(0);
    let child = task_netns_inum(task, &off)?;
    let parent = task_netns_inum(current_task(), &off).unwrap_or(0);
    if child == parent {
        return Ok(0);
    }
    let pid: u32 = read(task, off.task_pid)?;
    let tgid: u32 = read(task, off.task_tgid)?;
    let mut h = header(kind::NETNS_CREATED, size_of::<Event<NetnsData>>());
    h.pid = pid;
    h.tgid = tgid;
    let event =
        Event { header: h, data: NetnsData { netns_inum: child, prev_inum: parent, via: via::TASK_NEWTASK, _pad: 0 } };
    output(&event, Wake::Default);
    Ok(0)
}

/// fexit: struct net *copy_net_ns(u64 flags, struct user_namespace *, struct net *old_net)
#[fexit(function = "copy_net_ns")]
pub fn netreap_copy_net_ns(ctx: FExitContext) -> i32 {
    let off = offsets();
    if off.valid == 0 {
        return 0;
    }
    let old: *const u8 = ctx.arg(2);
    let new: *const u8 = ctx.arg(3);
    // Without CLONE_NEWNET the old netns comes back; errors are ERR_PTRs.
    if new == old || (new as i64) < 0 && (new as i64) >= -4095 {
        return 0;
    }
    let prev = net_inum(old, &off).unwrap_or(0);
    if let Ok(inum) = net_inum(new, &off) {
        emit_netns(kind::NETNS_CREATED, inum, prev, via::COPY_NET_NS);
    }
    0
}

/// fentry: void __put_net(struct net *net): the last reference is gone.
#[fentry(function = "__put_net")]
pub fn netreap_put_net(ctx: FEntryContext) -> i32 {
    let off = offsets();
    if off.valid == 0 {
        return 0;
    }
    let net: *const u8 = ctx.arg(0);
    if let Ok(inum) = net_inum(net, &off) {
        emit_netns(kind::NETNS_FREED, inum, 0, via::PUT_NET);
    }
    0
}
