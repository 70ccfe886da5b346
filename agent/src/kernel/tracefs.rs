//! Tracepoints attach through tracefs; a host or container may not have it
//! mounted. Mount it where the kernel expects it, once, before attaching.

use std::{ffi::CString, io, path::Path};

const TRACEFS_DIRS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

fn populated(dir: &Path) -> bool {
    dir.read_dir().is_ok_and(|mut entries| entries.next().is_some())
}

/// What [`ensure_mounted`] found or did.
#[derive(Debug, PartialEq, Eq)]
pub enum Tracefs {
    AlreadyMounted(&'static str),
    MountedBy(&'static str),
}

/// Makes tracefs available at /sys/kernel/tracing, mounting it if needed.
pub fn ensure_mounted() -> io::Result<Tracefs> {
    if let Err(e) = Path::new(TRACEFS_DIRS[0]).read_dir()
        && e.kind() == io::ErrorKind::PermissionDenied
    {
        return Err(io::Error::new(
            e.kind(),
            format!(
                "cannot read {}: {e}; netreap needs root (CAP_SYS_ADMIN, CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN)",
                TRACEFS_DIRS[0]
            ),
        ));
    }
    if let Some(dir) = TRACEFS_DIRS.into_iter().find(|d| populated(Path::new(d))) {
        return Ok(Tracefs::AlreadyMounted(dir));
    }
    let target = TRACEFS_DIRS[0];
    if !Path::new(target).is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{target} does not exist: is sysfs mounted and the kernel built with CONFIG_TRACING?"),
        ));
    }
    let (source, dir, fstype) = (CString::new("tracefs")?, CString::new(target)?, CString::new("tracefs")?);
    // SAFETY: valid NUL-terminated strings; no data argument.
    let rc = unsafe { libc::mount(source.as_ptr(), dir.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("cannot mount tracefs on {target}: {e}")));
    }
    Ok(Tracefs::MountedBy(target))
}
