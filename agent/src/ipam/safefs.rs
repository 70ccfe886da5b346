//! File access that never follows a symlink, never blocks on a FIFO and never
//! reads more than it was told to. Store directories are writable by other
//! software (and an attacker who can write there should not be able to make
//! netreap read /etc/shadow or unlink something outside the store), so every
//! open is relative to a directory descriptor and refuses symlinks.

use rustix::fs::{Mode, OFlags};
use std::{
    ffi::{CStr, CString},
    fs::File,
    io,
    mem::ManuallyDrop,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd},
        unix::{ffi::OsStrExt, fs::MetadataExt},
    },
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant, SystemTime},
};

/// A directory opened without following a symlink in its last component.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    /// Whether reads still ask for `O_NOATIME`: cleared the first time the
    /// kernel refuses it (EPERM: not the file's owner and no CAP_FOWNER),
    /// so a scan of files we may not stamp pays the refusal once.
    noatime: AtomicBool,
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
}

/// A single path component: no separator, not `.` or `..`, not empty.
#[must_use]
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

fn is_plain_name_bytes(name: &[u8]) -> bool {
    !name.is_empty() && name != b"." && name != b".." && !name.contains(&b'/') && !name.contains(&0)
}

fn check_name(name: &str) -> io::Result<CString> {
    if !is_plain_name(name) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a plain file name")));
    }
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name holds a NUL byte"))
}

fn fd_or_error(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Dir {
    /// Opens `path` as a directory; a symlink as last component fails (ELOOP).
    pub fn open(path: &Path) -> io::Result<Self> {
        let c = c_path(path)?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: valid NUL-terminated path; the result is checked.
        let fd = fd_or_error(unsafe { libc::open(c.as_ptr(), flags) })?;
        Ok(Self { fd, noatime: AtomicBool::new(true) })
    }

    /// Opens `name` in this directory for reading: no symlink, no blocking
    /// on a FIFO or device. The caller checks the type ([`FileMeta::of`]).
    fn open_read(&self, name: &str) -> io::Result<ReadFd> {
        self.open_read_c(&check_name(name)?)
    }

    /// [`Dir::open_read`] with a name already NUL-terminated (a scan renders
    /// each name into one reused buffer instead of allocating it).
    ///
    /// Opens with `O_NOATIME` where the kernel allows it: looking must not
    /// write. A read under `relatime` stamps the access time of a file not
    /// read since it was written, which dirties the inode and costs a
    /// journal update per file: a third of a first scan's kernel time.
    fn open_read_c(&self, name: &CStr) -> io::Result<ReadFd> {
        if !is_plain_name_bytes(name.to_bytes()) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a plain file name")));
        }
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
        if self.noatime.load(Ordering::Relaxed) {
            match rustix::fs::openat(&self.fd, name, flags | OFlags::NOATIME, Mode::empty()) {
                Err(rustix::io::Errno::PERM) => self.noatime.store(false, Ordering::Relaxed),
                other => return Ok(ReadFd::new(other?)),
            }
        }
        Ok(ReadFd::new(rustix::fs::openat(&self.fd, name, flags, Mode::empty())?))
    }

    /// Lists this directory through its own descriptor (what is listed is
    /// the directory opened without following a symlink, not whatever the
    /// path names by now), calling `each` with every name but `.` and `..`,
    /// NUL-terminated, with no allocation per entry. An error stops the
    /// listing; the names already given stay given.
    pub fn for_each_name(&self, mut each: impl FnMut(&CStr)) -> io::Result<()> {
        // fdopendir takes over the descriptor it is given: a duplicate,
        // which shares the directory offset, so it is rewound first.
        // SAFETY: a valid open descriptor; the result is checked.
        let dup = fd_or_error(unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) })?;
        // SAFETY: a valid directory descriptor; on success the stream owns it.
        let stream = unsafe { libc::fdopendir(dup.as_raw_fd()) };
        if stream.is_null() {
            return Err(io::Error::last_os_error());
        }
        // The stream owns the descriptor now: closedir closes it.
        let _owned_by_stream = dup.into_raw_fd();
        let stream = DirStream(stream);
        // SAFETY: a valid open stream.
        unsafe { libc::rewinddir(stream.0) };
        loop {
            // readdir returns NULL both at the end and on error; only errno
            // tells them apart.
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = 0 };
            // SAFETY: a valid open stream, read by this thread only.
            let entry = unsafe { libc::readdir(stream.0) };
            if entry.is_null() {
                let err = io::Error::last_os_error();
                return if err.raw_os_error() == Some(0) { Ok(()) } else { Err(err) };
            }
            // SAFETY: the entry readdir returned holds a NUL-terminated name
            // and stays valid until the next readdir on this stream.
            let name = unsafe { CStr::from_ptr((*entry).d_name.as_ptr()) };
            if !matches!(name.to_bytes(), b"." | b"..") {
                each(name);
            }
        }
    }

    /// Opens (creating it if needed, as host-local does) the lock file
    /// `name`: `O_CREAT|O_RDONLY`, mode 0750 like go-filemutex, no symlink.
    pub fn open_lock(&self, name: &str) -> io::Result<File> {
        let c = check_name(name)?;
        let flags = libc::O_RDONLY | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
        let mode: libc::c_uint = 0o750;
        // SAFETY: valid dirfd and NUL-terminated name; the result is checked.
        let fd = fd_or_error(unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), flags, mode) })?;
        let file = File::from(fd);
        if !file.metadata()?.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("lock {name:?} is not a regular file")));
        }
        Ok(file)
    }

    /// Makes entry changes (an unlink) durable.
    pub fn sync(&self) -> io::Result<()> {
        // SAFETY: a valid open descriptor.
        if unsafe { libc::fsync(self.fd.as_raw_fd()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Removes the file `name` (never a directory) from this directory.
    pub fn unlink(&self, name: &str) -> io::Result<()> {
        let c = check_name(name)?;
        // SAFETY: valid dirfd and NUL-terminated name.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Gives this thread a descriptor table of its own that holds only `keep`
/// and the standard streams. Every open and close takes its table's lock:
/// two threads opening and closing 100,000 files in one table spent 7 %
/// of the scan's samples spinning on it (1.8 % in tables of their own).
///
/// Only for a thread that opens files under `keep` and closes them itself,
/// hands no descriptor out and ends soon: whatever it opens is in its own
/// table only. The copies it drops here leave every other thread's
/// descriptors (and what they hold open: a netns, a lock) as they were.
/// On an error (before Linux 5.9, or a seccomp filter) the table is still
/// shared and nothing was closed.
pub fn private_descriptor_table(keep: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut keep: Vec<libc::c_uint> =
        keep.iter().filter_map(|fd| libc::c_uint::try_from(fd.as_raw_fd()).ok()).filter(|&fd| fd > 2).collect();
    keep.sort_unstable();
    keep.dedup();
    let close_range = |first: libc::c_uint, last: libc::c_uint, flags: libc::c_uint| {
        // SAFETY: closes descriptors of this thread's own table only (the
        // first call unshares it), none that this thread still uses.
        if unsafe { libc::syscall(libc::SYS_close_range, first, last, flags) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    // Unsharing with a range that runs to the end copies only the
    // descriptors below it.
    let above = keep.last().map_or(3, |&fd| fd + 1);
    close_range(above, libc::c_uint::MAX, libc::CLOSE_RANGE_UNSHARE)?;
    let mut first = 3;
    for &fd in &keep {
        if fd > first {
            close_range(first, fd - 1, 0)?;
        }
        first = fd + 1;
    }
    Ok(())
}

/// A directory stream from fdopendir(3), closed with its descriptor when
/// dropped.
struct DirStream(*mut libc::DIR);

impl Drop for DirStream {
    fn drop(&mut self) {
        // SAFETY: a stream fdopendir returned, closed once (with the
        // descriptor it took over).
        unsafe { libc::closedir(self.0) };
    }
}

/// A descriptor opened for one read, closed with the close system call
/// itself (rustix) rather than glibc's wrapper, which is a cancellation
/// point and brackets each call with pthread's cancel state: its wrappers
/// of the four calls per file held about 10 % of a 100k-file scan's
/// samples.
struct ReadFd(ManuallyDrop<OwnedFd>);

impl ReadFd {
    fn new(fd: OwnedFd) -> Self {
        Self(ManuallyDrop::new(fd))
    }
}

impl AsFd for ReadFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Drop for ReadFd {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and never used again.
        let fd = unsafe { ManuallyDrop::take(&mut self.0) };
        // SAFETY: the descriptor is ours (out of its OwnedFd, so nothing
        // else closes it) and is closed once.
        unsafe { rustix::io::close(fd.into_raw_fd()) };
    }
}

/// What a bounded read found.
#[derive(Debug)]
pub enum Bounded {
    /// The whole content, at most `limit` bytes.
    Content(Vec<u8>, FileMeta),
    /// Not a regular file (FIFO, socket, device, directory).
    NotRegular(FileMeta),
    /// Larger than the limit; nothing was read.
    TooLarge(FileMeta),
}

/// Reads `name` in `dir`, at most `limit` bytes, after checking (on the open
/// descriptor, so nothing can be swapped in between) that it is a regular file.
pub fn read_bounded(dir: &Dir, name: &str, limit: u64) -> io::Result<Bounded> {
    let mut buf = Vec::new();
    Ok(match read_bounded_into(dir, name, limit, &mut buf)? {
        Read::Content(meta) => Bounded::Content(buf, meta),
        Read::NotRegular(meta) => Bounded::NotRegular(meta),
        Read::TooLarge(meta) => Bounded::TooLarge(meta),
    })
}

/// What is kept of a file's status, from one plain fstat(2) on the open
/// descriptor. std's `File::metadata` asks statx(2) for every field and
/// carries them all; a scan of 100k files needs these, and a release
/// compares the same (inode, mtime) it re-reads with what the scan kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMeta {
    mode: u32,
    size: u64,
    ino: u64,
    mtime_sec: i64,
    mtime_nsec: i64,
}

impl FileMeta {
    /// The status of the file `fd` is open on, from the fstat system call
    /// itself: glibc (2.33 on) makes fstat an fstatat(fd, "",
    /// AT_EMPTY_PATH), which the kernel first treats as a path (a tenth of
    /// a 100k scan's fstat time).
    pub fn of(fd: impl AsFd) -> io::Result<Self> {
        let st = rustix::fs::fstat(fd)?;
        Ok(Self {
            mode: st.st_mode,
            size: u64::try_from(st.st_size).unwrap_or(0),
            ino: st.st_ino,
            mtime_sec: st.st_mtime,
            mtime_nsec: i64::try_from(st.st_mtime_nsec).unwrap_or(0),
        })
    }

    #[must_use]
    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// `st_mode`: type and permission bits.
    #[must_use]
    pub fn mode(&self) -> u32 {
        self.mode
    }

    /// `st_size` in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.size
    }

    /// A regular file (`S_IFREG`).
    #[must_use]
    pub fn is_regular(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }

    /// A directory (`S_IFDIR`).
    #[must_use]
    pub fn is_directory(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }

    /// The modification time, equal to what std's `Metadata::modified`
    /// gives for the same file (a release compares the two).
    #[must_use]
    pub fn modified(&self) -> SystemTime {
        let nsec = u32::try_from(self.mtime_nsec).ok().filter(|n| *n < 1_000_000_000).unwrap_or(0);
        let whole = Duration::from_secs(self.mtime_sec.unsigned_abs());
        let at = if self.mtime_sec >= 0 {
            SystemTime::UNIX_EPOCH.checked_add(whole)
        } else {
            SystemTime::UNIX_EPOCH.checked_sub(whole)
        };
        at.and_then(|t| t.checked_add(Duration::from_nanos(u64::from(nsec)))).unwrap_or(SystemTime::UNIX_EPOCH)
    }
}

/// What [`read_bounded_into`] found; the content is in the caller's buffer.
#[derive(Debug)]
pub enum Read {
    Content(FileMeta),
    NotRegular(FileMeta),
    TooLarge(FileMeta),
}

/// [`read_bounded`] into a buffer the caller reuses from file to file (a
/// scan of 100k files allocates nothing per file). `buf` is cleared first.
/// Three syscalls for a small file: open, fstat, one read. A regular file
/// that returns fewer bytes than asked is at its end, so a read that
/// returned exactly the size fstat gave needs no second read to see EOF.
pub fn read_bounded_into(dir: &Dir, name: &str, limit: u64, buf: &mut Vec<u8>) -> io::Result<Read> {
    read_fd_bounded(&dir.open_read(name)?, limit, buf)
}

/// [`read_bounded_into`] with a NUL-terminated name: no allocation at all.
pub fn read_bounded_into_c(dir: &Dir, name: &CStr, limit: u64, buf: &mut Vec<u8>) -> io::Result<Read> {
    read_fd_bounded(&dir.open_read_c(name)?, limit, buf)
}

fn read_fd_bounded(file: &ReadFd, limit: u64, buf: &mut Vec<u8>) -> io::Result<Read> {
    let fd = file.as_fd();
    let meta = FileMeta::of(fd)?;
    if !meta.is_regular() {
        return Ok(Read::NotRegular(meta));
    }
    if meta.len() > limit {
        return Ok(Read::TooLarge(meta));
    }
    buf.clear();
    // One byte more than the limit tells a file that grew after fstat.
    let want = usize::try_from(limit.saturating_add(1)).unwrap_or(usize::MAX);
    let expected = usize::try_from(meta.len()).unwrap_or(usize::MAX);
    buf.reserve(expected.saturating_add(1).min(want));
    loop {
        let len = buf.len();
        if len >= want {
            return Ok(Read::TooLarge(meta));
        }
        if buf.capacity() == len {
            buf.reserve(1);
        }
        let room = (buf.capacity() - len).min(want - len);
        // Into the spare capacity: nothing is zeroed first.
        let spare = buf.spare_capacity_mut().get_mut(..room).unwrap_or_default();
        let n = match rustix::io::read(fd, spare) {
            Ok((read, _)) => read.len(),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        // SAFETY: the kernel initialised the first `n` bytes of the spare
        // capacity, which follow the `len` already initialised.
        unsafe { buf.set_len(len + n) };
        if n == 0 || (n < room && buf.len() == expected) {
            return Ok(Read::Content(meta));
        }
    }
}

/// An exclusive flock(2) held until dropped (closing the descriptor drops it).
#[derive(Debug)]
pub struct FlockGuard {
    file: File,
}

impl FlockGuard {
    /// Blocks until the exclusive lock is ours, like go-filemutex's `Lock()`.
    #[allow(dead_code, reason = "releases wait with a deadline (lock_exclusive_timeout); kept for callers without one")]
    pub fn lock_exclusive(file: File) -> io::Result<Self> {
        loop {
            // SAFETY: a valid open descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Self { file });
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }

    /// Waits at most `timeout` for the exclusive lock. `Ok(Err(file))` when
    /// it is still held at the deadline. flock(2) has no timed wait, so this
    /// polls `LOCK_NB`, backing off from 1 ms to 50 ms: a plugin holds the
    /// lock for milliseconds, and a stuck one must not hold the caller.
    pub fn lock_exclusive_timeout(file: File, timeout: Duration) -> io::Result<Result<Self, File>> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        loop {
            // SAFETY: a valid open descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(Ok(Self { file }));
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => {}
                _ => return Err(err),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Err(file));
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Processes holding a flock on `file` (from /proc/locks, in this pid
    /// namespace), each as "pid (comm)": for a message naming who is stuck.
    #[must_use]
    pub fn holders(file: &File) -> Vec<String> {
        let Ok(meta) = file.metadata() else { return Vec::new() };
        let dev = meta.dev();
        let id = format!("{:02x}:{:02x}:{}", libc::major(dev), libc::minor(dev), meta.ino());
        let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
        locks
            .lines()
            // "1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF"; waiters
            // have "->" after the number and hold nothing.
            .map(str::split_whitespace)
            .filter_map(|mut f| {
                let _n = f.next()?;
                let kind = f.next()?;
                (kind == "FLOCK").then_some(())?;
                let (_mode, _rw, pid, file_id) = (f.next()?, f.next()?, f.next()?, f.next()?);
                (file_id == id).then(|| pid.to_owned())
            })
            .map(|pid| {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                format!("{pid} ({})", comm.trim())
            })
            .collect()
    }

    /// Takes the exclusive lock only if nobody holds it.
    pub fn try_lock_exclusive(file: File) -> io::Result<Option<Self>> {
        // SAFETY: a valid open descriptor.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Some(Self { file }));
        }
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::WouldBlock { Ok(None) } else { Err(err) }
    }
}

impl Drop for FlockGuard {
    fn drop(&mut self) {
        // Closing would release it too; unlocking first makes the intent plain.
        // SAFETY: a valid open descriptor.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::PermissionsExt as _};

    use super::*;

    fn atime_ns(path: &Path) -> i128 {
        let m = fs::symlink_metadata(path).unwrap();
        i128::from(m.atime()) * 1_000_000_000 + i128::from(m.atime_nsec())
    }

    #[test]
    fn reading_leaves_the_access_time_alone() {
        // relatime stamps a file read for the first time since it was
        // written (atime <= mtime): what a scan of fresh files would do.
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("nrS-10.0.0.2");
        fs::write(&file, "c1\r\neth0").unwrap();
        let old = libc::timespec { tv_sec: 1_000_000, tv_nsec: 0 };
        let c = CString::new(file.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid path and two valid timespecs (atime, mtime).
        assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), [old, old].as_ptr(), 0) }, 0);
        let before = atime_ns(&file);
        let dir = Dir::open(tmp.path()).unwrap();
        let mut buf = Vec::new();
        let read = read_bounded_into(&dir, "nrS-10.0.0.2", 1024, &mut buf).unwrap();
        assert!(matches!(read, Read::Content(_)));
        assert_eq!(buf, b"c1\r\neth0");
        assert_eq!(atime_ns(&file), before, "the read stamped the access time");
    }

    #[test]
    fn the_compact_status_agrees_with_std() {
        // A release compares the scan's inode and mtime (FileMeta) with
        // what std reads at release time: they must be equal, before 1970
        // and with nanoseconds too.
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        for (sec, nsec) in [(1_700_000_000, 123_456_789), (0, 0), (-5, 300), (-1_000_000, 999_999_999)] {
            let file = tmp.path().join("nrS-10.0.0.2");
            fs::write(&file, "c1\r\neth0").unwrap();
            let c = CString::new(file.as_os_str().as_bytes()).unwrap();
            let t = libc::timespec { tv_sec: sec, tv_nsec: nsec };
            // SAFETY: a valid path and two valid timespecs (atime, mtime).
            assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), [t, t].as_ptr(), 0) }, 0);
            let mut buf = Vec::new();
            let Read::Content(meta) = read_bounded_into(&dir, "nrS-10.0.0.2", 1024, &mut buf).unwrap() else {
                panic!("a regular file");
            };
            let std_meta = fs::symlink_metadata(&file).unwrap();
            assert_eq!(meta.modified(), std_meta.modified().unwrap(), "mtime {sec}.{nsec}");
            assert_eq!(meta.ino(), std_meta.ino());
            assert_eq!(meta.len(), std_meta.len());
            assert_eq!(meta.mode(), std_meta.mode());
            assert!(meta.is_regular() && !meta.is_directory());
        }
        fs::create_dir(tmp.path().join("nrS-d")).unwrap();
        let mut buf = Vec::new();
        let read = read_bounded_into(&dir, "nrS-d", 1024, &mut buf).unwrap();
        assert!(matches!(read, Read::NotRegular(m) if m.is_directory()));
    }

    /// Whether `fd` is open in the calling thread's descriptor table.
    fn is_open(fd: std::os::fd::RawFd) -> bool {
        // SAFETY: F_GETFD only asks; any number is safe to ask about.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        flags >= 0
    }

    #[test]
    fn a_private_descriptor_table_keeps_only_what_it_was_given() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("nrS-10.0.0.2"), "c1\r\neth0").unwrap();
        let kept = Dir::open(tmp.path()).unwrap();
        let other = File::open(tmp.path().join("nrS-10.0.0.2")).unwrap();
        let (kept_fd, other_fd) = (kept.as_fd().as_raw_fd(), other.as_raw_fd());
        let file = tmp.path().join("nrS-10.0.0.2");
        // This thread's descriptors open on `file`.
        let open_on_file = || {
            fs::read_dir("/proc/thread-self/fd")
                .unwrap()
                .filter(|e| e.as_ref().is_ok_and(|e| fs::read_link(e.path()).is_ok_and(|l| l == file)))
                .count()
        };
        let (read, other_open, stderr_open) = std::thread::scope(|s| {
            s.spawn(|| {
                private_descriptor_table(&[kept.as_fd()]).unwrap();
                let (other_open, stderr_open) = (is_open(other_fd), is_open(2));
                let mut buf = Vec::new();
                let read = read_bounded_into(&kept, "nrS-10.0.0.2", 1024, &mut buf).unwrap();
                // Opened here and never closed: in this thread's table only,
                // which goes with the thread.
                std::mem::forget(kept.open_read("nrS-10.0.0.2").unwrap());
                assert_eq!(open_on_file(), 1, "the one this thread left open");
                (matches!(read, Read::Content(_)).then_some(buf), other_open, stderr_open)
            })
            .join()
            .unwrap()
        });
        assert_eq!(read, Some(b"c1\r\neth0".to_vec()), "a kept directory still reads");
        assert!(!other_open, "a descriptor not kept is closed in the thread's own table");
        assert!(stderr_open, "the standard streams stay");
        assert!(is_open(kept_fd) && is_open(other_fd), "the other threads' descriptors are untouched");
        assert_eq!(open_on_file(), 1, "only `other`: what the thread opened stayed out of this table");
    }

    #[test]
    fn a_reader_that_may_not_skip_the_access_time_still_reads() {
        // O_NOATIME needs the file's owner or CAP_FOWNER: a thread with
        // another filesystem uid (which drops CAP_FOWNER) gets EPERM for it
        // and must fall back to a plain open, for this file and the next.
        let tmp = tempfile::tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        for name in ["nrS-a", "nrS-b"] {
            fs::write(tmp.path().join(name), "c1\r\neth0").unwrap();
            fs::set_permissions(tmp.path().join(name), fs::Permissions::from_mode(0o644)).unwrap();
        }
        let path = tmp.path().to_owned();
        let got = std::thread::spawn(move || {
            // Per thread (the raw syscall): only this thread is nobody.
            // SAFETY: plain syscall; the thread ends right after.
            unsafe { libc::syscall(libc::SYS_setfsuid, 65_534) };
            let dir = Dir::open(&path).unwrap();
            let mut out = Vec::new();
            for name in ["nrS-a", "nrS-b"] {
                let mut buf = Vec::new();
                let read = read_bounded_into(&dir, name, 1024, &mut buf).map(|r| matches!(r, Read::Content(_)));
                out.push((read.map_err(|e| e.to_string()), buf));
            }
            (out, dir.noatime.load(Ordering::Relaxed))
        })
        .join()
        .unwrap();
        let (reads, noatime) = got;
        for (read, buf) in reads {
            assert_eq!(read, Ok(true));
            assert_eq!(buf, b"c1\r\neth0");
        }
        assert!(!noatime, "the refusal is remembered for the directory");
    }
}
