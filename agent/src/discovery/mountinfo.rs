//! nsfs bind mounts in a mountinfo file (`ip netns add`, CNI runtimes'
//! /var/run/netns/cni-*): mount point and inode, from the text alone.

use std::path::PathBuf;

/// One network-namespace mount: `net:[inode]` mounted at `path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetnsMount {
    pub inode: u32,
    pub path: PathBuf,
}

/// Decodes the octal escapes mountinfo uses for space, tab, newline and
/// backslash in paths (`\040` ...). Three octal digits above `\377` name
/// no byte (the kernel never writes them): kept as text.
fn unescape(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if let Some(byte) = octal_escape(&bytes[i..]) {
            out.push(byte);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// The byte of a `\ooo` escape at the start of `bytes`, if it is one.
fn octal_escape(bytes: &[u8]) -> Option<u8> {
    let [b'\\', digits @ ..] = bytes.get(..4)? else { return None };
    let value = digits.iter().try_fold(0_u32, |v, d| (b'0'..=b'7').contains(d).then(|| v * 8 + u32::from(d - b'0')))?;
    u8::try_from(value).ok()
}

/// `net:[4026532000]` -> 4026532000.
#[must_use]
pub fn parse_ns_link(text: &str) -> Option<u32> {
    text.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
}

/// Every nsfs mount of a network namespace in `text`. Malformed lines are
/// skipped: the kernel writes this file, a line we cannot read is not ours.
#[must_use]
pub fn parse(text: &str) -> Vec<NetnsMount> {
    let mut out = Vec::new();
    for line in text.lines() {
        // Most lines are not nsfs: skip them before splitting. Spaces in
        // paths are escaped (`\040`), so this only matches the separator.
        if !line.contains(" - nsfs ") {
            continue;
        }
        let mut fields = line.split(' ');
        // id, parent, major:minor, root, mount point
        let (Some(_), Some(_), Some(_), Some(root), Some(mount_point)) =
            (fields.next(), fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        // Optional fields end at "-"; the filesystem type follows.
        let mut rest = fields.skip_while(|f| *f != "-");
        if rest.next() != Some("-") || rest.next() != Some("nsfs") {
            continue;
        }
        if let Some(inode) = parse_ns_link(root) {
            out.push(NetnsMount { inode, path: unescape(mount_point) });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 0:21 / /proc rw,nosuid shared:5 - proc proc rw
612 25 0:4 net:[4026532512] /run/netns/cni-1234 rw shared:310 - nsfs nsfs rw
613 25 0:4 net:[4026532513] /run/netns/with\\040space rw - nsfs nsfs rw
614 25 0:4 mnt:[4026532600] /run/mntns/x rw - nsfs nsfs rw
615 25 0:4 net:[4026532512] /var/lib/kubelet/netns-alias rw master:7 shared:9 - nsfs nsfs rw
garbage line
616 25 0:4 net:[notanumber] /x rw - nsfs nsfs rw
";

    #[test]
    fn finds_network_namespace_mounts_only() {
        let mounts = parse(SAMPLE);
        assert_eq!(
            mounts,
            vec![
                NetnsMount { inode: 4_026_532_512, path: "/run/netns/cni-1234".into() },
                NetnsMount { inode: 4_026_532_513, path: "/run/netns/with space".into() },
                NetnsMount { inode: 4_026_532_512, path: "/var/lib/kubelet/netns-alias".into() },
            ]
        );
    }

    /// Escapes of a byte decode; three octal digits above `\377` (no byte:
    /// the kernel never writes them) stay text, and so does a short one.
    #[test]
    fn octal_escapes_decode_only_to_bytes() {
        use std::os::unix::ffi::OsStrExt as _;
        let decoded = |s: &str| unescape(s).as_os_str().as_bytes().to_vec();
        assert_eq!(decoded("/a\\040b\\011c\\134"), b"/a b\tc\\".to_vec());
        assert_eq!(decoded("\\377"), vec![0xff]);
        assert_eq!(decoded("\\400/\\777"), b"\\400/\\777".to_vec());
        assert_eq!(decoded("\\08\\12"), b"\\08\\12".to_vec());
    }

    #[test]
    fn ns_links_parse() {
        assert_eq!(parse_ns_link("net:[4026531840]"), Some(4_026_531_840));
        assert_eq!(parse_ns_link("mnt:[4026531840]"), None);
        assert_eq!(parse_ns_link("net:[]"), None);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_text_never_panics(s in ".{0,300}|([\\\\0-9a]{0,3}){0,20}") {
            let _ = parse(&s);
            let _ = unescape(&s);
        }
    }
}
