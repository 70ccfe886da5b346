//! A writer for the `newc` cpio format that the kernel unpacks as an
//! initramfs. Written here rather than shelling out to `cpio -o` so the
//! archive can hold device nodes (`/dev/console` must exist before devtmpfs
//! is mounted, or init runs with no stdio) without `mknod` on the host, and
//! so no extra package is needed.

use std::{
    fmt::Write as _,
    io::{self, Write},
};

/// File type bits of `st_mode`.
const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFCHR: u32 = 0o020_000;

/// Streams entries into a `newc` archive; [`Writer::finish`] adds the trailer.
pub struct Writer<W: Write> {
    out: W,
    next_ino: u32,
    written: u64,
}

impl<W: Write> Writer<W> {
    pub fn new(out: W) -> Self {
        Self { out, next_ino: 1, written: 0 }
    }

    pub fn dir(&mut self, path: &str, perm: u32) -> io::Result<()> {
        self.entry(path, S_IFDIR | perm, (0, 0), &[])
    }

    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.entry(path, S_IFREG | perm, (0, 0), data)
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        self.entry(path, S_IFLNK | 0o777, (0, 0), target.as_bytes())
    }

    pub fn char_dev(&mut self, path: &str, perm: u32, major: u32, minor: u32) -> io::Result<()> {
        self.entry(path, S_IFCHR | perm, (major, minor), &[])
    }

    /// Writes the trailer entry and returns the sink.
    pub fn finish(mut self) -> io::Result<W> {
        self.next_ino = 0;
        self.entry("TRAILER!!!", 0, (0, 0), &[])?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn entry(&mut self, path: &str, mode: u32, rdev: (u32, u32), data: &[u8]) -> io::Result<()> {
        // Archive names are relative to the root the kernel unpacks into.
        let name = path.trim_start_matches('/');
        let size = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{path}: over 4 GiB")))?;
        let name_size =
            u32::try_from(name.len() + 1).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name too long"))?;
        let ino = self.next_ino;
        self.next_ino += 1;
        let nlink = if mode & S_IFDIR == S_IFDIR { 2 } else { 1 };
        // magic, ino, mode, uid, gid, nlink, mtime, filesize, dev major/minor,
        // rdev major/minor, namesize, check: all 8-digit hex.
        let fields = [ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev.0, rdev.1, name_size, 0];
        let mut header = String::with_capacity(110);
        header.push_str("070701");
        for f in fields {
            let _ = write!(header, "{f:08X}");
        }
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Header+name and data are each padded to a multiple of 4 bytes.
    fn pad(&mut self) -> io::Result<()> {
        let rem = (4 - self.written % 4) % 4;
        self.put(&[0; 3][..rem as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_end_with_a_trailer() {
        let mut w = Writer::new(Vec::new());
        w.dir("/bin", 0o755).expect("test data");
        w.file("/bin/x", 0o755, b"hello").expect("test data");
        w.symlink("/bin/sh", "busybox").expect("test data");
        w.char_dev("/dev/console", 0o600, 5, 1).expect("test data");
        let out = w.finish().expect("test data");
        assert_eq!(out.len() % 4, 0);
        assert!(out.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&out);
        // name "bin/x" (6 with NUL) after a 110-byte header: data starts aligned.
        let at = text.find("bin/x\0").expect("test data");
        let data = (at + 6).div_ceil(4) * 4;
        assert_eq!(&out[data..data + 5], b"hello");
        assert!(text.contains("TRAILER!!!\0"));
        // The console node: mode 020600, rdev 5:1.
        let console = text.find("dev/console").expect("test data") - 110;
        assert_eq!(&text[console + 14..console + 22], "00002180");
        assert_eq!(&text[console + 78..console + 94], "0000000500000001");
    }
}
