//! nsfs mounts of network namespaces through `listmount(2)` and
//! `statmount(2)` (Linux 6.8+), kept by mount id: after a change of the
//! mount table only the mounts not seen before are asked about, so a read
//! costs what changed instead of the whole table (every line of mountinfo
//! formatted by the kernel and parsed here).
//!
//! Used only for the mount namespace (and root) of the calling thread: the
//! paths statmount gives are relative to the caller's root, as mountinfo's
//! are to the root of the process whose table it is. Anything unexpected
//! is an error, and the caller reads the text instead.
//!
//! Layouts and constants: include/uapi/linux/mount.h (statmount and
//! listmount since 6.8; `struct statmount` is 512 bytes before its strings,
//! whatever fields later kernels add in its spare space).

use std::{
    ffi::CStr,
    io,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
};

use super::mountinfo::{NetnsMount, parse_ns_link};

/// `__NR_statmount`, `__NR_listmount`: one number on every architecture
/// that uses the generic table (x86_64 and arm64 here).
#[cfg(all(any(target_arch = "x86_64", target_arch = "aarch64"), target_pointer_width = "64"))]
const SYS_STATMOUNT: Option<libc::c_long> = Some(457);
#[cfg(all(any(target_arch = "x86_64", target_arch = "aarch64"), target_pointer_width = "64"))]
const SYS_LISTMOUNT: Option<libc::c_long> = Some(458);
#[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), target_pointer_width = "64")))]
const SYS_STATMOUNT: Option<libc::c_long> = None;
#[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), target_pointer_width = "64")))]
const SYS_LISTMOUNT: Option<libc::c_long> = None;

/// `struct mnt_id_req`, first version (`MNT_ID_REQ_SIZE_VER0`): the
/// caller's own mount namespace (`mnt_ns_id` came with 6.11).
#[repr(C)]
struct MntIdReq {
    size: u32,
    spare: u32,
    mnt_id: u64,
    /// statmount: the mask asked for; listmount: the last id listed.
    param: u64,
}

const MNT_ID_REQ_SIZE_VER0: u32 = 24;
const _: () = assert!(size_of::<MntIdReq>() == MNT_ID_REQ_SIZE_VER0 as usize);

/// `LSMT_ROOT`: list from the caller's root.
const LSMT_ROOT: u64 = u64::MAX;

const STATMOUNT_MNT_ROOT: u64 = 0x08;
const STATMOUNT_MNT_POINT: u64 = 0x10;
const STATMOUNT_FS_TYPE: u64 = 0x20;
const ASKED: u64 = STATMOUNT_MNT_ROOT | STATMOUNT_MNT_POINT | STATMOUNT_FS_TYPE;

/// The fixed part of `struct statmount`, as far as read here; `str[]`
/// follows at [`STATMOUNT_FIXED`].
#[repr(C)]
struct StatmountHead {
    size: u32,
    /// `__spare1` in 6.8, `mnt_opts` since 6.11.
    spare1: u32,
    mask: u64,
    sb_dev_major: u32,
    sb_dev_minor: u32,
    sb_magic: u64,
    sb_flags: u32,
    /// Offsets into `str[]`.
    fs_type: u32,
    mnt_id: u64,
    mnt_parent_id: u64,
    mnt_id_old: u32,
    mnt_parent_id_old: u32,
    mnt_attr: u64,
    mnt_propagation: u64,
    mnt_peer_group: u64,
    mnt_master: u64,
    propagate_from: u64,
    mnt_root: u32,
    mnt_point: u32,
}

const _: () = assert!(std::mem::offset_of!(StatmountHead, fs_type) == 36);
const _: () = assert!(std::mem::offset_of!(StatmountHead, mnt_root) == 104);
const _: () = assert!(std::mem::offset_of!(StatmountHead, mnt_point) == 108);

/// `sizeof(struct statmount)`: where `str[]` begins.
const STATMOUNT_FIXED: usize = 512;

/// Room for the three strings asked (paths up to `PATH_MAX`), grown on
/// `EOVERFLOW` up to [`STATMOUNT_MAX`].
const STATMOUNT_START: usize = STATMOUNT_FIXED + 4 * 4096;
const STATMOUNT_MAX: usize = 1 << 20;

/// Mount ids asked per listmount call.
const LIST_CHUNK: usize = 512;

/// Why the kernel's mount list cannot be used (the text is read instead).
#[derive(Debug, thiserror::Error)]
pub enum KernelMountsError {
    #[error("listmount/statmount are not known on this architecture")]
    NoSyscall,
    #[error("listmount: {0}")]
    List(io::Error),
    #[error("statmount of mount {id}: {source}")]
    Stat { id: u64, source: io::Error },
    #[error("statmount of mount {id}: {what}")]
    Answer { id: u64, what: &'static str },
    #[error("{table} is not the table of this thread's mount namespace and root: {why}")]
    OtherTable { table: PathBuf, why: String },
}

impl KernelMountsError {
    /// Errors that say the calls will never work here (the reader stops
    /// trying), as opposed to this table or this moment.
    #[must_use]
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::NoSyscall | Self::Answer { .. } => true,
            Self::List(e) | Self::Stat { source: e, .. } => {
                matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM | libc::EINVAL | libc::EOPNOTSUPP))
            }
            Self::OtherTable { .. } => false,
        }
    }
}

/// What one mount id is, as far as netns discovery cares: a network
/// namespace's nsfs mount or something else. A mount id is never reused
/// and a mount's root never changes, so this is asked once per mount; its
/// mount point changes only when it (or a mount above it) is moved, which
/// is why a change that neither adds nor removes a mount asks them all
/// again.
#[derive(Debug)]
struct Known {
    id: u64,
    netns: Option<NetnsMount>,
}

/// What statmount said of one mount id.
enum Mount {
    /// Unmounted between the list and the question.
    Gone,
    /// Not a network namespace's nsfs mount.
    Other,
    Netns(NetnsMount),
}

/// The mounts of the caller's mount namespace, by id (ascending, as
/// listmount gives them and mountinfo lists them since 6.8).
#[derive(Debug, Default)]
pub struct KernelMounts {
    known: Vec<Known>,
    ids: Vec<u64>,
    /// statmount's buffer, as u64 for the struct's alignment.
    buf: Vec<u64>,
    statmounts: u64,
    /// Tests: listmount fails with this errno, as on a kernel without it.
    #[cfg(test)]
    pub(super) fail_with: Option<i32>,
}

impl KernelMounts {
    /// statmount calls made so far (tests: a change costs what it added).
    #[must_use]
    pub fn statmounts(&self) -> u64 {
        self.statmounts
    }

    /// Forgets every mount: the next read asks each one.
    pub fn forget(&mut self) {
        self.known.clear();
    }

    /// The nsfs mounts of network namespaces now, in mount-id order,
    /// asking statmount only about mounts not seen by the previous read;
    /// `changed`: the table was reported changed since that read, so a
    /// list without a new or a gone mount means a move (all asked again).
    /// On error nothing is kept.
    pub fn read(&mut self, changed: bool, out: &mut Vec<NetnsMount>) -> Result<(), KernelMountsError> {
        let result = self.read_inner(changed, out);
        if result.is_err() {
            self.known.clear();
            out.clear();
        }
        result
    }

    fn read_inner(&mut self, changed: bool, out: &mut Vec<NetnsMount>) -> Result<(), KernelMountsError> {
        #[cfg(test)]
        if let Some(errno) = self.fail_with {
            return Err(KernelMountsError::List(io::Error::from_raw_os_error(errno)));
        }
        list_mounts(&mut self.ids)?;
        if !self.ids.is_sorted() {
            self.ids.sort_unstable();
        }
        self.ids.dedup();
        let same_set = self.ids.len() == self.known.len() && self.ids.iter().zip(&self.known).all(|(a, k)| *a == k.id);
        if changed && same_set {
            self.known.clear();
        }
        // Merge the sorted id list with the sorted known mounts: kept ones
        // move over, new ones are asked, gone ones are dropped.
        let old = std::mem::take(&mut self.known);
        let mut old = old.into_iter().peekable();
        let ids = std::mem::take(&mut self.ids);
        let mut known = Vec::with_capacity(ids.len());
        for &id in &ids {
            while old.next_if(|k| k.id < id).is_some() {}
            if let Some(k) = old.next_if(|k| k.id == id) {
                known.push(k);
                continue;
            }
            self.statmounts += 1;
            match self.stat(id) {
                Ok(Mount::Gone) => {}
                Ok(Mount::Other) => known.push(Known { id, netns: None }),
                Ok(Mount::Netns(m)) => known.push(Known { id, netns: Some(m) }),
                Err(e) => {
                    self.ids = ids;
                    return Err(e);
                }
            }
        }
        self.ids = ids;
        self.known = known;
        out.clear();
        out.extend(self.known.iter().filter_map(|k| k.netns.clone()));
        Ok(())
    }

    /// statmount of one mount.
    fn stat(&mut self, id: u64) -> Result<Mount, KernelMountsError> {
        let Some(nr) = SYS_STATMOUNT else { return Err(KernelMountsError::NoSyscall) };
        if self.buf.len() * 8 < STATMOUNT_START {
            self.buf.resize(STATMOUNT_START / 8, 0);
        }
        let req = MntIdReq { size: MNT_ID_REQ_SIZE_VER0, spare: 0, mnt_id: id, param: ASKED };
        loop {
            let len = self.buf.len() * 8;
            // SAFETY: a valid request and a writable buffer of `len` bytes.
            let rc = unsafe { libc::syscall(nr, &raw const req, self.buf.as_mut_ptr(), len, 0) };
            if rc == 0 {
                break;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENOENT) => return Ok(Mount::Gone),
                Some(libc::EINTR | libc::EAGAIN) => {}
                Some(libc::EOVERFLOW) if len < STATMOUNT_MAX => self.buf.resize(len * 2 / 8, 0),
                _ => return Err(KernelMountsError::Stat { id, source: e }),
            }
        }
        let bytes = as_bytes(&self.buf);
        let answer = |what| KernelMountsError::Answer { id, what };
        // SAFETY: the buffer is u64-aligned and longer than the head, which
        // is plain integers; the kernel wrote it (and zeroes what it does
        // not know).
        let head = unsafe { &*self.buf.as_ptr().cast::<StatmountHead>() };
        if head.mask & ASKED != ASKED {
            return Err(answer("not every field asked was given"));
        }
        let size = usize::try_from(head.size).map_err(|_| answer("size"))?.min(bytes.len());
        let strings = bytes.get(STATMOUNT_FIXED..size).ok_or_else(|| answer("size"))?;
        let string = |off: u32| -> Result<&[u8], KernelMountsError> {
            let at = strings.get(off as usize..).ok_or_else(|| answer("string offset"))?;
            CStr::from_bytes_until_nul(at).map(CStr::to_bytes).map_err(|_| answer("unterminated string"))
        };
        if string(head.fs_type)? != b"nsfs" {
            return Ok(Mount::Other);
        }
        let Some(inode) = std::str::from_utf8(string(head.mnt_root)?).ok().and_then(parse_ns_link) else {
            return Ok(Mount::Other);
        };
        let point = string(head.mnt_point)?;
        // Empty when the mount cannot be reached from our root (mountinfo
        // leaves such a mount out): the list should not have given it.
        if point.first() != Some(&b'/') {
            return Err(answer("a mount point that is not an absolute path"));
        }
        let path = PathBuf::from(std::ffi::OsStr::from_bytes(point));
        Ok(Mount::Netns(NetnsMount { inode, path }))
    }
}

fn as_bytes(buf: &[u64]) -> &[u8] {
    // SAFETY: any u64 slice is a valid byte slice of 8 times its length.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), size_of_val(buf)) }
}

/// Every mount id reachable from the caller's root in its mount namespace.
fn list_mounts(ids: &mut Vec<u64>) -> Result<(), KernelMountsError> {
    let Some(nr) = SYS_LISTMOUNT else { return Err(KernelMountsError::NoSyscall) };
    ids.clear();
    let mut last = 0;
    loop {
        ids.reserve(LIST_CHUNK);
        let spare = ids.spare_capacity_mut();
        let req = MntIdReq { size: MNT_ID_REQ_SIZE_VER0, spare: 0, mnt_id: LSMT_ROOT, param: last };
        // SAFETY: a valid request; the kernel writes at most `spare.len()`
        // ids into the spare capacity.
        let rc = unsafe { libc::syscall(nr, &raw const req, spare.as_mut_ptr(), spare.len(), 0) };
        let Ok(n) = usize::try_from(rc) else {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(KernelMountsError::List(e));
        };
        let asked = spare.len();
        // SAFETY: the kernel initialised the first `n <= asked` spare slots.
        unsafe { ids.set_len(ids.len() + n.min(asked)) };
        if n < asked {
            return Ok(());
        }
        last = ids.last().copied().unwrap_or(0);
    }
}

/// Whether the table at `mountinfo` lists what listmount and statmount
/// give the calling thread: `PROC/{self,thread-self,N}/mountinfo` of a
/// process in this thread's mount namespace, with this thread's root.
pub fn is_own_table(proc_root: &Path, mountinfo: &Path) -> Result<(), KernelMountsError> {
    let other = |why: String| KernelMountsError::OtherTable { table: mountinfo.to_path_buf(), why };
    let pid_dir = mountinfo
        .parent()
        .filter(|_| mountinfo.file_name().is_some_and(|n| n == "mountinfo"))
        .filter(|dir| dir.parent() == Some(proc_root))
        .filter(|dir| {
            dir.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == "self" || n == "thread-self" || n.parse::<u32>().is_ok())
        })
        .ok_or_else(|| other("not a process's mountinfo under the proc root".into()))?;
    let own = proc_root.join("thread-self");
    let ns = |dir: &Path| {
        let path = dir.join("ns/mnt");
        std::fs::metadata(&path)
            .map(|m| {
                use std::os::unix::fs::MetadataExt as _;
                (m.dev(), m.ino())
            })
            .map_err(|e| other(format!("{}: {e}", path.display())))
    };
    if ns(pid_dir)? != ns(&own)? {
        return Err(other("another mount namespace".into()));
    }
    if root_of(&pid_dir.join("root")).map_err(&other)? != root_of(&own.join("root")).map_err(&other)? {
        return Err(other("another root".into()));
    }
    Ok(())
}

/// Whether `mountinfo`, once found to be the calling thread's own table
/// ([`is_own_table`]), stays so: that of `self` or `thread-self` (a pid's
/// can go to another process).
pub fn stays_own(mountinfo: &Path) -> bool {
    mountinfo.file_name().is_some_and(|n| n == "mountinfo")
        && mountinfo.parent().and_then(Path::file_name).is_some_and(|n| n == "self" || n == "thread-self")
}

/// The mount and inode a process's root is.
fn root_of(path: &Path) -> Result<(u64, u32, u32, u64), String> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: zeroed statx is a valid out-buffer.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let mask = libc::STATX_INO | libc::STATX_MNT_ID | libc::STATX_MNT_ID_UNIQUE;
    // SAFETY: a valid C string and out-pointer.
    let rc = unsafe { libc::statx(libc::AT_FDCWD, c_path.as_ptr(), 0, mask, &raw mut stx) };
    if rc != 0 {
        return Err(format!("{}: {}", path.display(), io::Error::last_os_error()));
    }
    if stx.stx_mask & (libc::STATX_MNT_ID | libc::STATX_MNT_ID_UNIQUE) == 0 || stx.stx_mask & libc::STATX_INO == 0 {
        return Err(format!("{}: statx gives no mount id", path.display()));
    }
    Ok((stx.stx_mnt_id, stx.stx_dev_major, stx.stx_dev_minor, stx.stx_ino))
}
