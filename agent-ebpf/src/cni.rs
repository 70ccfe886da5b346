//! CNI plugin runs: exec of an image whose environment carries
//! CNI_COMMAND, and the exit of that process. Processes that are not CNI
//! plugin runs produce no event (filtered here, in the kernel), except that
//! an environment the scan could not read to its end is always reported:
//! a CNI_COMMAND past the limit must not make a plugin run vanish.
//!
//! Two variants read the environment; the agent loads the first the kernel
//! accepts and attaches it to sched_process_exec:
//! - `netreap_cni_exec`: one `bpf_loop` (Linux 5.17+) over every string;
//! - `netreap_cni_exec_chained` + `netreap_cni_exec_next`: a bounded loop
//!   per program run, continued by tail calls (Linux 5.10).
//!
//! Both share [`step`], so they report the same events.

use core::{ffi::c_void, mem::size_of};

use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_uid_gid,
        generated::{bpf_loop, bpf_probe_read_kernel_str, bpf_probe_read_user_str},
    },
    macros::{map, tracepoint},
    maps::{HashMap, PerCpuArray, ProgramArray},
    programs::TracePointContext,
};
use netreap_common::{
    CniExecData, CniExitData, ENV_CHUNK, ENV_LOOP_STEPS, ENV_TAIL_STEPS, Event, cni_flag, kind, scan_variant,
};

use crate::{
    emit::{Wake, header, output},
    kernel::{SKIP, current_task, offsets, read},
};

/// sched_process_exec layout (stable ABI): `__data_loc char[] filename` at 8.
const EXEC_FILENAME_LOC: usize = 8;
/// The chunk buffer as 8-byte words, so a key prefix is two aligned loads.
const CHUNK_WORDS: usize = ENV_CHUNK / 8;
/// Index of `netreap_cni_exec_next` in ENV_TAIL.
const TAIL_NEXT: u32 = 0;

/// Processes (tgid) that are CNI plugin runs, so their exit is reported,
/// each with its run's [`fingerprint`] (0: none, never nested).
#[map]
static CNI_TASKS: HashMap<u32, u64> = HashMap::with_max_entries(16384, 0);

/// The exec record is too big for the 512-byte BPF stack: build it here.
#[map]
static EXEC_SCRATCH: PerCpuArray<Event<CniExecData>> = PerCpuArray::with_max_entries(1, 0);

#[map]
static ENV_SCRATCH: PerCpuArray<[u64; CHUNK_WORDS]> = PerCpuArray::with_max_entries(1, 0);

/// The tail-call variant's scan state between its program runs (tracepoint
/// programs run with preemption off, so the per-CPU slot is this exec's).
#[map]
static SCAN_STATE: PerCpuArray<EnvScan> = PerCpuArray::with_max_entries(1, 0);

/// Slot TAIL_NEXT holds `netreap_cni_exec_next`, set by the agent when it
/// loads the tail-call variant.
#[map]
static ENV_TAIL: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// State of one environment scan.
#[repr(C)]
#[derive(Clone, Copy)]
struct EnvScan {
    /// Next byte of the environment block to read.
    p: u64,
    end: u64,
    /// The previous read was cut: `p` is inside the same string.
    continuing: u64,
    scanned: u64,
    /// Slot of ENV_TAIL to call next (always TAIL_NEXT). Read from this map
    /// value, the verifier cannot know it: the tail call stays an indirect
    /// one, never a JIT-patched direct jump (poke), which hung 5.10.
    tail_slot: u64,
}

/// A `KEY=` prefix as two little-endian words, the second masked to the
/// key's length (9 to 16 bytes).
struct Key {
    w0: u64,
    w1: u64,
    mask1: u64,
}

const fn key(k: &[u8]) -> Key {
    let mut w0 = 0u64;
    let mut w1 = 0u64;
    let mut i = 0;
    while i < k.len() {
        if i < 8 {
            w0 |= (k[i] as u64) << (8 * i);
        } else {
            w1 |= (k[i] as u64) << (8 * (i - 8));
        }
        i += 1;
    }
    let rest = k.len() - 8;
    let mask1 = if rest >= 8 { u64::MAX } else { (1u64 << (8 * rest)) - 1 };
    Key { w0, w1, mask1 }
}

const COMMAND: Key = key(b"CNI_COMMAND=");
const CONTAINER_ID: Key = key(b"CNI_CONTAINERID=");
const NETNS: Key = key(b"CNI_NETNS=");
const IFNAME: Key = key(b"CNI_IFNAME=");
const ARGS: Key = key(b"CNI_ARGS=");
/// "CNI_" in the low half of the first word.
const CNI_PREFIX: u64 = COMMAND.w0 & 0xffff_ffff;

/// True when the string read into `(w0, w1)` starts with `k`. A string
/// shorter than the key has its NUL where the key has a letter, so bytes
/// left over from an earlier read never complete a match.
#[inline(always)]
fn is(w0: u64, w1: u64, k: &Key) -> bool {
    w0 == k.w0 && (w1 & k.mask1) == k.w1
}

/// Reads a user string into `dst`; returns its length with the NUL, or an
/// error. A return of `dst.len()` means it may have been cut.
#[inline(always)]
fn read_user_str(dst: *mut u8, len: usize, src: u64) -> Result<usize, i64> {
    // SAFETY: the helper bounds the write by len and checks src.
    let n = unsafe { bpf_probe_read_user_str(dst.cast::<c_void>(), len as u32, src as *const c_void) };
    if n < 0 { Err(n) } else { Ok(n as usize) }
}

/// Copies the value of `KEY=value` (at `src + key_len`) into `dst`,
/// returning `truncated_flag` when the value may be cut.
#[inline(always)]
fn copy_value(dst: &mut [u8], src: u64, truncated_flag: u32) -> u32 {
    match read_user_str(dst.as_mut_ptr(), dst.len(), src) {
        Ok(n) if n >= dst.len() => truncated_flag,
        _ => 0,
    }
}

/// One step of the scan: reads the string at `scan.p` (or the next chunk
/// of a long one) and copies it when it is a CNI_ variable. False when the
/// scan is over: the end was reached, or a read failed (then `p < end`
/// says the scan was cut short).
#[inline(always)]
fn step(scan: &mut EnvScan, data: &mut CniExecData, chunk: &mut [u64; CHUNK_WORDS]) -> bool {
    if scan.p >= scan.end {
        return false;
    }
    let p = scan.p;
    let n = match read_user_str(chunk.as_mut_ptr().cast::<u8>(), ENV_CHUNK, p) {
        Ok(n) if n > 0 => n,
        _ => return false,
    };
    if scan.continuing == 0 {
        scan.scanned += 1;
        let (w0, w1) = (chunk[0], chunk[1]);
        if w0 & 0xffff_ffff == CNI_PREFIX {
            if is(w0, w1, &COMMAND) {
                data.flags |=
                    cni_flag::HAS_COMMAND | copy_value(&mut data.command, p + 12, cni_flag::COMMAND_TRUNCATED);
            } else if is(w0, w1, &CONTAINER_ID) {
                data.flags |= cni_flag::HAS_CONTAINER_ID
                    | copy_value(&mut data.container_id, p + 16, cni_flag::CONTAINER_ID_TRUNCATED);
            } else if is(w0, w1, &NETNS) {
                data.flags |= cni_flag::HAS_NETNS | copy_value(&mut data.netns, p + 10, cni_flag::NETNS_TRUNCATED);
            } else if is(w0, w1, &IFNAME) {
                data.flags |= cni_flag::HAS_IFNAME | copy_value(&mut data.ifname, p + 11, cni_flag::IFNAME_TRUNCATED);
            } else if is(w0, w1, &ARGS) {
                data.flags |=
                    cni_flag::HAS_CNI_ARGS | copy_value(&mut data.cni_args, p + 9, cni_flag::CNI_ARGS_TRUNCATED);
            }
        }
    }
    if n >= ENV_CHUNK {
        // Cut: the rest of this string follows (the NUL sits at ENV_CHUNK-1).
        scan.p = p + (ENV_CHUNK - 1) as u64;
        scan.continuing = 1;
    } else {
        scan.p = p + n as u64;
        scan.continuing = 0;
    }
    true
}

/// Starts a scan of the current task's new environment: clears the record
/// and returns where the environment lies.
#[inline(always)]
fn begin(variant: u32) -> Result<EnvScan, i64> {
    let off = offsets();
    if off.valid == 0 {
        return Err(SKIP);
    }
    let mm: *const u8 = read(current_task(), off.task_mm)?;
    if mm.is_null() {
        return Err(SKIP);
    }
    let env_start: u64 = read(mm, off.mm_env_start)?;
    let env_end: u64 = read(mm, off.mm_env_end)?;
    let event = EXEC_SCRATCH.get_ptr_mut(0).ok_or(SKIP)?;
    // SAFETY: per-CPU map slot, exclusive to this program run on this CPU.
    let data = unsafe { &mut (*event).data };
    data.flags = 0;
    data.env_scanned = 0;
    data.uid = bpf_get_current_uid_gid() as u32;
    data.scan_variant = variant;
    data.nested_in = 0;
    // Whole, not only the first byte: the fingerprint hashes every byte,
    // and a read stops at its NUL.
    zero(&mut data.command);
    zero(&mut data.container_id);
    zero(&mut data.netns);
    data.ifname[0] = 0;
    data.filename[0] = 0;
    data.cni_args[0] = 0;
    Ok(EnvScan { p: env_start, end: env_end, continuing: 0, scanned: 0, tail_slot: u64::from(TAIL_NEXT) })
}

/// Ends a scan: emits the record when this is a CNI run (or may be one,
/// when the scan was cut short) and remembers the process for its exit.
#[inline(always)]
fn finish(ctx: &TracePointContext, scan: &EnvScan) -> Result<u32, i64> {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let event = EXEC_SCRATCH.get_ptr_mut(0).ok_or(SKIP)?;
    // SAFETY: per-CPU map slot, exclusive to this program run on this CPU.
    let event = unsafe { &mut *event };
    let data = &mut event.data;
    if scan.p < scan.end {
        data.flags |= cni_flag::ENV_SCAN_LIMIT;
    }
    data.env_scanned = scan.scanned as u32;
    let is_cni_run = data.flags & cni_flag::HAS_COMMAND != 0 && data.command[0] != 0;
    if !is_cni_run && data.flags & cni_flag::ENV_SCAN_LIMIT == 0 {
        // Not a CNI plugin run (any more, if this process exec'd again).
        let _ = CNI_TASKS.remove(tgid);
        return Ok(0);
    }

    // SAFETY: offset inside the tracepoint record.
    let loc: u32 = unsafe { ctx.read_at(EXEC_FILENAME_LOC) }.map_err(i64::from)?;
    let src = ctx_base(ctx).wrapping_add((loc & 0xffff) as usize);
    // SAFETY: the helper bounds the write and checks the source.
    let n = unsafe {
        bpf_probe_read_kernel_str(
            data.filename.as_mut_ptr().cast::<c_void>(),
            data.filename.len() as u32,
            src.cast::<c_void>(),
        )
    };
    if n >= data.filename.len() as i64 {
        data.flags |= cni_flag::FILENAME_TRUNCATED;
    }

    // A DEL's exec record is read with the run's exit (or before any
    // decision): one wake-up per DEL instead of two. So is a nested run's
    // (see `nested_in`), read with its parent's exit at the latest. Any other
    // run's is read at once: its CNI_NETNS is resolved to a netns identity
    // when read, and the netns of an ADD that fails may be gone soon after
    // (a DEL that cannot be resolved keeps what its ADD resolved), even
    // while a DEL's record waits unread.
    let is_del = data.command[0] == b'D' && data.command[1] == b'E' && data.command[2] == b'L' && data.command[3] == 0;
    let own = fingerprint(data);
    let parent = nested_in(own);
    event.data.nested_in = parent;
    event.header = header(kind::CNI_EXEC, size_of::<Event<CniExecData>>());
    let _ = CNI_TASKS.insert(tgid, own, 0);
    output(event, if is_del || parent != 0 { Wake::Later } else { Wake::Now });
    Ok(0)
}

/// Flags that make a record's values uncertain: such a run is never taken
/// for a copy of its parent's.
const UNCERTAIN: u32 = cni_flag::COMMAND_TRUNCATED
    | cni_flag::CONTAINER_ID_TRUNCATED
    | cni_flag::NETNS_TRUNCATED
    | cni_flag::ENV_SCAN_LIMIT;

/// A hash of the run's CNI_COMMAND, CNI_CONTAINERID and CNI_NETNS, never 0;
/// 0 for a record whose values may be cut or missing.
#[inline(always)]
fn fingerprint(data: &CniExecData) -> u64 {
    if data.flags & UNCERTAIN != 0 {
        return 0;
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    h = mix_words(h, &data.command);
    h = mix_words(h, &data.container_id);
    h = mix_words(h, &data.netns);
    if h == 0 { 1 } else { h }
}

#[inline(always)]
#[expect(clippy::cast_ptr_alignment, reason = "the field is 8-aligned: checked below")]
fn mix_words<const N: usize>(mut h: u64, bytes: &[u8; N]) -> u64 {
    let words = bytes.as_ptr().cast::<u64>();
    let mut i = 0;
    while i < N / 8 {
        // SAFETY: inside the array; these fields lie at multiples of 8 in
        // an 8-aligned map value (checked below).
        let w = unsafe { words.add(i).read() };
        h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
        i += 1;
    }
    h
}

/// Zeroes a field word by word (volatile: no memset call, which BPF lacks).
#[inline(always)]
#[expect(clippy::cast_ptr_alignment, reason = "the field is 8-aligned: checked below")]
fn zero<const N: usize>(bytes: &mut [u8; N]) {
    let words = bytes.as_mut_ptr().cast::<u64>();
    let mut i = 0;
    while i < N / 8 {
        // SAFETY: inside the array, 8-aligned (checked below).
        unsafe { words.add(i).write_volatile(0) };
        i += 1;
    }
}

// The word reads above need these fields 8-aligned inside the record.
const _: () = {
    let base = core::mem::offset_of!(Event<CniExecData>, data);
    assert!((base + core::mem::offset_of!(CniExecData, command)) % 8 == 0);
    assert!((base + core::mem::offset_of!(CniExecData, container_id)) % 8 == 0);
    assert!((base + core::mem::offset_of!(CniExecData, netns)) % 8 == 0);
    assert!(netreap_common::CNI_COMMAND_LEN.is_multiple_of(8));
    assert!(netreap_common::CNI_CONTAINER_ID_LEN.is_multiple_of(8));
    assert!(netreap_common::CNI_NETNS_LEN.is_multiple_of(8));
};

/// The process id of the current task's parent when that is a CNI run
/// with the same fingerprint (0 when not: no CNI run has process id 0),
/// i.e. the run is nested: a plugin running another for the same operation (bridge
/// exec'ing host-local, a meta plugin its delegates) or a plugin's helper
/// (iptables) that inherited its environment. Such a run's records need no
/// wake-up of their own: the parent waits for it, so they are in the ring
/// before the parent's exit record, which wakes the agent; the agent reads
/// the ring before every decision too. Its CNI_NETNS is the parent's, whose
/// exec record (an outer ADD's) was read at once, and a later failure to
/// resolve the same path keeps what was resolved. A run whose parent is
/// gone (killed; it was re-parented) is not nested: its exit wakes. The
/// agent gives a nested run its parent's netns resolution (agent/src/ledger).
#[inline(always)]
fn nested_in(own: u64) -> u32 {
    if own == 0 {
        return 0;
    }
    let off = offsets();
    let Ok(parent) = read::<*const u8>(current_task(), off.task_real_parent) else {
        return 0;
    };
    if parent.is_null() {
        return 0;
    }
    let Ok(parent_tgid) = read::<u32>(parent, off.task_tgid) else {
        return 0;
    };
    // SAFETY: a plain lookup; the value is copied at once.
    if unsafe { CNI_TASKS.get(parent_tgid) }.is_some_and(|&theirs| theirs == own) { parent_tgid } else { 0 }
}

/// bpf_loop callback: one [`step`]. Returns 1 to stop.
extern "C" fn loop_step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: ctx is the EnvScan on try_cni_exec's stack.
    let scan = unsafe { &mut *ctx.cast::<EnvScan>() };
    let (Some(event), Some(chunk)) = (EXEC_SCRATCH.get_ptr_mut(0), ENV_SCRATCH.get_ptr_mut(0)) else {
        return 1;
    };
    // SAFETY: per-CPU map slots, exclusive to this program run on this CPU.
    let (data, chunk) = unsafe { (&mut (*event).data, &mut *chunk) };
    i64::from(!step(scan, data, chunk))
}

/// tracepoint: sched/sched_process_exec (filename, pid, old_pid).
/// The bpf_loop variant (Linux 5.17+).
#[tracepoint(category = "sched", name = "sched_process_exec")]
pub fn netreap_cni_exec(ctx: TracePointContext) -> u32 {
    try_cni_exec(&ctx).unwrap_or(0)
}

fn try_cni_exec(ctx: &TracePointContext) -> Result<u32, i64> {
    let mut scan = begin(scan_variant::BPF_LOOP)?;
    // bpf_loop keeps the verifier's work to one pass over the body, where
    // an open-coded loop of this size exceeds its budget.
    // SAFETY: the callback is a static function; the context lives on this stack.
    unsafe {
        bpf_loop(ENV_LOOP_STEPS, loop_step as *mut c_void, (&raw mut scan).cast::<c_void>(), 0);
    }
    finish(ctx, &scan)
}

/// tracepoint: sched/sched_process_exec (filename, pid, old_pid).
/// The tail-call variant (Linux 5.10): starts the scan, then chains.
#[tracepoint(category = "sched", name = "sched_process_exec")]
pub fn netreap_cni_exec_chained(ctx: TracePointContext) -> u32 {
    try_cni_exec_chained(&ctx).unwrap_or(0)
}

fn try_cni_exec_chained(ctx: &TracePointContext) -> Result<u32, i64> {
    let scan = begin(scan_variant::TAIL_CALLS)?;
    let state = SCAN_STATE.get_ptr_mut(0).ok_or(SKIP)?;
    // SAFETY: per-CPU map slot, exclusive to this program run on this CPU.
    unsafe { *state = scan };
    scan_chunk(ctx)
}

/// Tail-call target of the 5.10 variant (never attached): the next
/// ENV_TAIL_STEPS steps of the scan in SCAN_STATE.
#[tracepoint(category = "sched", name = "sched_process_exec")]
pub fn netreap_cni_exec_next(ctx: TracePointContext) -> u32 {
    scan_chunk(&ctx).unwrap_or(0)
}

#[inline(always)]
fn scan_chunk(ctx: &TracePointContext) -> Result<u32, i64> {
    let state = SCAN_STATE.get_ptr_mut(0).ok_or(SKIP)?;
    let event = EXEC_SCRATCH.get_ptr_mut(0).ok_or(SKIP)?;
    let chunk = ENV_SCRATCH.get_ptr_mut(0).ok_or(SKIP)?;
    // SAFETY: per-CPU map slots, exclusive to this program run on this CPU.
    let (scan, data, chunk) = unsafe { (&mut *state, &mut (*event).data, &mut *chunk) };
    let mut more = true;
    let mut i = 0;
    while more && i < ENV_TAIL_STEPS {
        more = step(scan, data, chunk);
        i += 1;
    }
    if more && scan.p < scan.end {
        // SAFETY: a tail call replaces this program run; it returns only
        // when it fails (no more tail calls allowed, or an empty slot).
        unsafe { ENV_TAIL.tail_call(ctx, scan.tail_slot as u32) };
    }
    // Done, or the chain ran out: finish flags a scan that stopped early.
    let scan = *scan;
    finish(ctx, &scan)
}

#[inline(always)]
fn ctx_base(ctx: &TracePointContext) -> *const u8 {
    use aya_ebpf::EbpfContext as _;
    ctx.as_ptr().cast::<u8>().cast_const()
}

/// tracepoint: sched/sched_process_exit (comm, pid, prio, group_dead)
#[tracepoint(category = "sched", name = "sched_process_exit")]
pub fn netreap_cni_exit(_ctx: TracePointContext) -> u32 {
    try_cni_exit().unwrap_or(0)
}

fn try_cni_exit() -> Result<u32, i64> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (thread_id, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    // The leader's exit_code is the group's exit status, whichever thread
    // called exit_group.
    if thread_id != tgid {
        return Ok(0);
    }
    // SAFETY: a plain lookup; the value is copied at once.
    let Some(own) = (unsafe { CNI_TASKS.get(tgid) }).copied() else {
        return Ok(0);
    };
    let _ = CNI_TASKS.remove(tgid);
    let off = offsets();
    let exit_status: u32 = read(current_task(), off.task_exit_code)?;
    let event = Event {
        header: header(kind::CNI_EXIT, size_of::<Event<CniExitData>>()),
        data: CniExitData { exit_status, _pad: 0 },
    };
    // A nested run's exit is read with its parent's (which waits for it);
    // the outermost run's wakes the agent, bringing what waited before it.
    // Asked now, not at exec: a run whose parent died meanwhile has been
    // re-parented, and its exit wakes. An outermost DEL's too: left unread,
    // it would keep every later netns record (written with the default
    // wake-up: `__put_net`, the death of the netns the runtime removes
    // next) from waking the agent until the next forced wake-up or tick.
    output(&event, if nested_in(own) != 0 { Wake::Later } else { Wake::Now });
    Ok(0)
}
