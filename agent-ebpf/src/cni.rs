//! CNI plugin runs: exec of an image whose environment carries
//! CNI_COMMAND, and the exit of that process. Processes that are not CNI
//! plugin runs produce no event (filtered here, in the kernel).

use core::{ffi::c_void, mem::size_of};

use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid,
        generated::{bpf_loop, bpf_probe_read_kernel_str, bpf_probe_read_user_str},
    },
    macros::{map, tracepoint},
    maps::{HashMap, PerCpuArray},
    programs::TracePointContext,
};
use netreap_common::{
CniExecData, CniExitData, Event, MAX_ENV_STRINGS, cni_flag, kind,
};

use crate::{
    emit::{header, output},
    kernel::{SKIP, current_task, offsets, read},
};

/// One env string is read this many bytes at a time; a longer string takes
/// several reads (the scan continues past it, never matches inside it).
const ENV_CHUNK: usize = 256;
/// sched_process_exec layout (stable ABI): `__data_loc char[] filename` at 8.
const EXEC_FILENAME_LOC: usize = 8;

/// Processes (tgid) that are CNI plugin runs, so their exit is reported.
#[map]
static CNI_TASKS: HashMap<u32, u32> = HashMap::with_max_entries(16384, 0);

/// The exec record is too big for the 512-byte BPF stack: build it here.
#[map]
static EXEC_SCRATCH: PerCpuArray<Event<CniExecData>> = PerCpuArray::with_max_entries(1, 0);

#[map]
static ENV_SCRATCH: PerCpuArray<[u8; ENV_CHUNK]> = PerCpuArray::with_max_entries(1, 0);

/// Reads a user string into `dst`; returns its length with the NUL, or an
/// error. A return of `dst.len()` means it may have been cut.
#[inline(always)]
fn read_user_str(dst: &mut [u8], src: u64) -> Result<usize, i64> {
    // SAFETY: the helper bounds the write by dst.len() and checks src.
    let n = unsafe {
        bpf_probe_read_user_str(dst.as_mut_ptr().cast::<c_void>(), dst.len() as u32, src as *const c_void)
    };
    if n < 0 { Err(n) } else { Ok(n as usize) }
}

/// Copies the value of `KEY=value` (at `src + key_len`) into `dst`,
/// returning `truncated_flag` when the value may be cut.
#[inline(always)]
fn copy_value(dst: &mut [u8], src: u64, truncated_flag: u32) -> u32 {
    match read_user_str(dst, src) {
        Ok(n) if n >= dst.len() => truncated_flag,
        _ => 0,
    }
}

#[inline(always)]
fn starts_with(buf: &[u8; ENV_CHUNK], key: &[u8]) -> bool {
    let mut i = 0;
    while i < key.len() {
        if buf[i] != key[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// State of the environment scan, shared with the bpf_loop callback.
#[repr(C)]
struct EnvScan {
    /// Next byte of the environment block to read.
    p: u64,
    end: u64,
    /// The previous read was cut: `p` is inside the same string.
    continuing: u64,
    scanned: u64,
    found_command: u64,
}

/// bpf_loop callback: reads one environment string (or the next chunk of a
/// long one) and copies it when it is a CNI_ variable. Returns 1 to stop.
extern "C" fn scan_env_string(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: ctx is the EnvScan on try_cni_exec's stack.
    let scan = unsafe { &mut *ctx.cast::<EnvScan>() };
    if scan.p >= scan.end || (scan.scanned >= u64::from(MAX_ENV_STRINGS) && scan.continuing == 0) {
        return 1;
    }
    let (Some(event), Some(chunk)) = (EXEC_SCRATCH.get_ptr_mut(0), ENV_SCRATCH.get_ptr_mut(0)) else {
        return 1;
    };
    // SAFETY: per-CPU map slots, exclusive to this program run on this CPU.
    let (data, chunk) = unsafe { (&mut (*event).data, &mut *chunk) };
    let p = scan.p;
    let n = match read_user_str(chunk, p) {
        Ok(n) if n > 0 => n,
        _ => return 1,
    };
    if scan.continuing == 0 {
        scan.scanned += 1;
        if chunk[0] == b'C' && chunk[1] == b'N' && chunk[2] == b'I' && chunk[3] == b'_' {
            if starts_with(chunk, b"CNI_COMMAND=") {
                data.flags |= copy_value(&mut data.command, p + 12, cni_flag::COMMAND_TRUNCATED);
                scan.found_command = 1;
            } else if starts_with(chunk, b"CNI_CONTAINERID=") {
                data.flags |= cni_flag::HAS_CONTAINER_ID
                    | copy_value(&mut data.container_id, p + 16, cni_flag::CONTAINER_ID_TRUNCATED);
            } else if starts_with(chunk, b"CNI_NETNS=") {
                data.flags |= cni_flag::HAS_NETNS | copy_value(&mut data.netns, p + 10, cni_flag::NETNS_TRUNCATED);
            } else if starts_with(chunk, b"CNI_IFNAME=") {
                data.flags |=
                    cni_flag::HAS_IFNAME | copy_value(&mut data.ifname, p + 11, cni_flag::IFNAME_TRUNCATED);
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
    0
}

/// tracepoint: sched/sched_process_exec (filename, pid, old_pid)
#[tracepoint(category = "sched", name = "sched_process_exec")]
pub fn netreap_cni_exec(ctx: TracePointContext) -> u32 {
    try_cni_exec(&ctx).unwrap_or(0)
}

fn try_cni_exec(ctx: &TracePointContext) -> Result<u32, i64> {
    let off = offsets();
    if off.valid == 0 {
        return Err(SKIP);
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let mm: *const u8 = read(current_task(), off.task_mm)?;
    if mm.is_null() {
        return Err(SKIP);
    }
    let env_start: u64 = read(mm, off.mm_env_start)?;
    let env_end: u64 = read(mm, off.mm_env_end)?;

    let event = EXEC_SCRATCH.get_ptr_mut(0).ok_or(SKIP)?;
    // SAFETY: per-CPU map slot, exclusive to this program run on this CPU.
    let event = unsafe { &mut *event };
    let data = &mut event.data;
    data.flags = 0;
    data.command[0] = 0;
    data.container_id[0] = 0;
    data.netns[0] = 0;
    data.ifname[0] = 0;
    data.filename[0] = 0;

    // bpf_loop (5.17+) keeps the verifier's work to one pass over the body,
    // where an open-coded loop of this size exceeds its budget.
    let mut scan = EnvScan { p: env_start, end: env_end, continuing: 0, scanned: 0, found_command: 0 };
    // SAFETY: the callback is a static function; the context lives on this stack.
    unsafe {
        bpf_loop(
            MAX_ENV_STRINGS * 2,
            scan_env_string as *mut c_void,
            (&raw mut scan).cast::<c_void>(),
            0,
        );
    }
    let data = &mut event.data;
    if scan.p < scan.end {
        data.flags |= cni_flag::ENV_SCAN_LIMIT;
    }
    data.env_scanned = scan.scanned as u32;
    let found_command = scan.found_command != 0;

    if !found_command || data.command[0] == 0 {
        // Not a CNI plugin run (any more, if this process exec'd again).
        let _ = CNI_TASKS.remove(&tgid);
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

    event.header = header(kind::CNI_EXEC, size_of::<Event<CniExecData>>());
    let _ = CNI_TASKS.insert(&tgid, &1, 0);
    output(event);
    Ok(0)
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
    let (tid, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    // The leader's exit_code is the group's exit status, whichever thread
    // called exit_group.
    if tid != tgid {
        return Ok(0);
    }
    // SAFETY: the value is not used, only its presence.
    if unsafe { CNI_TASKS.get(&tgid) }.is_none() {
        return Ok(0);
    }
    let _ = CNI_TASKS.remove(&tgid);
    let off = offsets();
    let exit_status: u32 = read(current_task(), off.task_exit_code)?;
    let event = Event {
        header: header(kind::CNI_EXIT, size_of::<Event<CniExitData>>()),
        data: CniExitData { exit_status, _pad: 0 },
    };
    output(&event);
    Ok(0)
}
