//! The ring buffer, the drop counter, and the common header.

use aya_ebpf::{
    bindings::{BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{bpf_get_current_cgroup_id, bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::map,
    maps::{PerCpuArray, RingBuf},
};
use netreap_common::{COMM_LEN, Event, EventHeader};

/// 1 MiB: a burst of ~1,400 CNI exec records or ~16,000 netns records.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 20, 0);

/// Records that did not fit in EVENTS, per CPU. The agent reports them and
/// resyncs: a drop means the model may have missed something.
#[map]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
pub fn header(kind: u32, len: usize) -> EventHeader {
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: helpers without preconditions.
    let (ktime_ns, cgroup_id) = unsafe { (bpf_ktime_get_ns(), bpf_get_current_cgroup_id()) };
    EventHeader {
        kind,
        len: len as u32,
        ktime_ns,
        pid: pid_tgid as u32,
        tgid: (pid_tgid >> 32) as u32,
        cgroup_id,
        comm: bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]),
    }
}

/// When the agent is woken for a record.
#[derive(Clone, Copy)]
pub enum Wake {
    /// As the kernel decides: when the agent has read everything before.
    Default,
    /// Not for this record: the next wake-up reads it (a DEL's exec record,
    /// read with its exit; a nested run's records, read with its parent's
    /// exit; the agent also reads the ring before every decision and once a
    /// second).
    Later,
    /// Now, even when earlier records are unread (an outermost CNI run's
    /// exit, which brings the records queued with `Later`).
    Now,
}

/// Copies a record into the ring buffer, counting it when it does not fit.
#[inline(always)]
pub fn output<T>(event: &Event<T>, wake: Wake) {
    let flags = match wake {
        Wake::Default => 0,
        Wake::Later => u64::from(BPF_RB_NO_WAKEUP),
        Wake::Now => u64::from(BPF_RB_FORCE_WAKEUP),
    };
    if EVENTS.output::<Event<T>>(event, flags).is_err() {
        count_drop();
    }
}

#[inline(always)]
fn count_drop() {
    if let Some(slot) = DROPS.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *slot += 1 };
    }
}
