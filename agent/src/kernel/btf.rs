//! A minimal reader of kernel BTF, enough to resolve struct member offsets
//! (Rust eBPF has no CO-RE) and find a kernel function's BTF id.
//! Anonymous struct/union members are searched through, as `mm_struct`
//! keeps its fields inside one.
//!
//! The kernel's BTF is ~5 MB (126k types); parsed whole into owned types it
//! made ~14 MB of heap for a moment at start-up, a large part of the agent's
//! peak memory (VmHWM, issue 13). It is streamed instead: one pass over the
//! string section keeps the offsets of the few names asked for, one pass
//! over the type section keeps 16 bytes per type and only the struct
//! members that are asked for or anonymous.

use std::{
    collections::HashMap,
    fs::File,
    io::{self, BufRead, BufReader, Read, Seek, SeekFrom},
    path::{Path, PathBuf},
};

use netreap_common::KernelOffsets;

/// Where the running kernel exposes its BTF.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const BTF_MAGIC: u16 = 0xeb9f;
const HEADER_MIN: usize = 24;

const KIND_INT: u32 = 1;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC: u32 = 12;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;
const KIND_MAX: u32 = 19;

#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error(
        "kernel BTF not found at {path}: netreap needs a kernel built with CONFIG_DEBUG_INFO_BTF=y \
         to find struct offsets ({source})"
    )]
    Missing { path: PathBuf, source: std::io::Error },
    #[error("malformed BTF: {0}")]
    Malformed(String),
    #[error("kernel BTF has no struct {0}")]
    NoStruct(String),
    #[error("kernel BTF: struct {strukt} has no member {member}")]
    NoMember { strukt: String, member: String },
    #[error("kernel BTF: {path} is a bitfield or not byte aligned")]
    NotByteAligned { path: String },
    #[error("kernel BTF: {path} lies at offset {offset}, beyond what a probe reads")]
    TooFar { path: String, offset: u64 },
}

/// Bytes read from the kernel's BTF at a time.
const READ_CHUNK: usize = 64 * 1024;
/// A name the caller did not ask for (or none).
const UNNAMED: u16 = 0;

/// A struct/union member that matters: asked for by name, or anonymous
/// (searched through).
#[derive(Debug, Clone, Copy)]
struct Member {
    /// 1 + index into `Btf::names`; [`UNNAMED`] for an anonymous member.
    name: u16,
    type_id: u32,
    bit_offset: u32,
    bitfield_size: u32,
}

/// One type, compactly: 16 bytes for each of the kernel's ~126k types.
#[derive(Debug, Clone, Copy)]
struct Type {
    /// Target type of modifiers and typedefs.
    refers_to: u32,
    /// Its kept members: `members[first_member..first_member + member_count]`.
    first_member: u32,
    member_count: u16,
    /// 1 + index into `Btf::names`, or [`UNNAMED`].
    name: u16,
    kind: u8,
    /// A struct/union with members (not an empty forward declaration).
    has_members: bool,
}

/// The parts of one BTF blob that matter for the names asked for.
#[derive(Debug)]
pub struct Btf {
    /// Index = type id; id 0 is void.
    types: Vec<Type>,
    members: Vec<Member>,
    /// The names asked for, in the order given.
    names: Vec<String>,
}

fn malformed_io(e: &io::Error, what: &str) -> BtfError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        BtfError::Malformed(format!("{what} truncated"))
    } else {
        BtfError::Malformed(format!("reading {what}: {e}"))
    }
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut word = [0u8; 4];
    r.read_exact(&mut word)?;
    Ok(u32::from_le_bytes(word))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).and_then(|s| <[u8; 4]>::try_from(s).ok()).map_or(0, u32::from_le_bytes)
}

impl Btf {
    /// Parses the BTF in `path`, keeping the names the agent needs
    /// ([`NEEDED_NAMES`]).
    pub fn from_file(path: &Path) -> Result<Self, BtfError> {
        let file = File::open(path).map_err(|source| BtfError::Missing { path: path.to_path_buf(), source })?;
        Self::read(file, NEEDED_NAMES)
    }

    /// The running kernel's BTF.
    pub fn from_sys_fs() -> Result<Self, BtfError> {
        Self::from_file(Path::new(VMLINUX_BTF))
    }

    /// Parses a little-endian BTF blob (x86_64 and aarch64 kernels), keeping
    /// `names`: only they can be looked up.
    pub fn parse(b: &[u8], names: &[&str]) -> Result<Self, BtfError> {
        Self::read(io::Cursor::new(b), names)
    }

    /// Streams a BTF blob: the header, then the string section (for the
    /// offsets of `names`), then the type section.
    fn read<R: Read + Seek>(mut blob: R, names: &[&str]) -> Result<Self, BtfError> {
        let len = blob.seek(SeekFrom::End(0)).map_err(|e| malformed_io(&e, "header"))?;
        blob.seek(SeekFrom::Start(0)).map_err(|e| malformed_io(&e, "header"))?;
        if len < HEADER_MIN as u64 {
            return Err(BtfError::Malformed(format!("{len} bytes is shorter than a header")));
        }
        let mut header = [0u8; HEADER_MIN];
        blob.read_exact(&mut header).map_err(|e| malformed_io(&e, "header"))?;
        let magic = u16::from_le_bytes([header[0], header[1]]);
        if magic != BTF_MAGIC {
            return Err(BtfError::Malformed(format!("bad magic {magic:#x}")));
        }
        let hdr_len = u64::from(u32_at(&header, 4));
        let (type_off, type_len) = (u64::from(u32_at(&header, 8)), u64::from(u32_at(&header, 12)));
        let (str_off, str_len) = (u64::from(u32_at(&header, 16)), u64::from(u32_at(&header, 20)));
        let section = |off: u64, size: u64, what: &str| {
            let start = hdr_len + off;
            if start + size <= len {
                Ok(start)
            } else {
                Err(BtfError::Malformed(format!("{what} section out of bounds")))
            }
        };
        let type_start = section(type_off, type_len, "type")?;
        let str_start = section(str_off, str_len, "string")?;

        let wanted = Self::name_offsets(&mut blob, str_start, str_len, names)?;
        blob.seek(SeekFrom::Start(type_start)).map_err(|e| malformed_io(&e, "type section"))?;
        let mut types_in = BufReader::with_capacity(READ_CHUNK, (&mut blob).take(type_len));
        let mut btf = Self {
            types: vec![Type {
                refers_to: 0,
                first_member: 0,
                member_count: 0,
                name: UNNAMED,
                kind: 0,
                has_members: false,
            }],
            members: Vec::new(),
            names: names.iter().map(|&n| n.to_owned()).collect(),
        };
        let name_of = |off: u32| wanted.get(&off).copied().unwrap_or(UNNAMED);
        let mut at = 0u64;
        while at < type_len {
            let mut word = || read_u32(&mut types_in).map_err(|e| malformed_io(&e, "type section"));
            let name_off = word()?;
            let info = word()?;
            let size_or_type = word()?;
            at += 12;
            let vlen = info & 0xffff;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            if kind == 0 || kind > KIND_MAX {
                return Err(BtfError::Malformed(format!("unknown kind {kind} at type {}", btf.types.len())));
            }
            let first_member =
                u32::try_from(btf.members.len()).map_err(|_| BtfError::Malformed("too many struct members".into()))?;
            let extra_words = match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 1,
                KIND_ARRAY => 3,
                KIND_STRUCT | KIND_UNION => {
                    for _ in 0..vlen {
                        let member_name = word()?;
                        let type_id = word()?;
                        let raw = word()?;
                        let name = name_of(member_name);
                        // Only members asked for, or anonymous ones (searched through).
                        if member_name == 0 || name != UNNAMED {
                            let (bit_offset, bitfield_size) =
                                if kind_flag { (raw & 0x00ff_ffff, raw >> 24) } else { (raw, 0) };
                            btf.members.push(Member { name, type_id, bit_offset, bitfield_size });
                        }
                    }
                    at += u64::from(vlen) * 12;
                    0
                }
                KIND_ENUM | KIND_FUNC_PROTO => vlen * 2,
                KIND_DATASEC | KIND_ENUM64 => vlen * 3,
                _ => 0,
            };
            for _ in 0..extra_words {
                word()?;
            }
            at += u64::from(extra_words) * 4;
            let member_count = u16::try_from(btf.members.len() - first_member as usize)
                .map_err(|_| BtfError::Malformed("struct with too many members".into()))?;
            btf.types.push(Type {
                refers_to: size_or_type,
                first_member,
                member_count,
                name: name_of(name_off),
                kind: kind as u8,
                has_members: matches!(kind, KIND_STRUCT | KIND_UNION) && vlen > 0,
            });
        }
        if at != type_len {
            return Err(BtfError::Malformed("type section ends inside a type".into()));
        }
        btf.types.shrink_to_fit();
        btf.members.shrink_to_fit();
        Ok(btf)
    }

    /// Offsets in the string section of each name in `names`, as
    /// 1 + the name's index.
    fn name_offsets<R: Read + Seek>(
        blob: &mut R,
        start: u64,
        len: u64,
        names: &[&str],
    ) -> Result<HashMap<u32, u16>, BtfError> {
        if names.len() >= usize::from(u16::MAX) {
            return Err(BtfError::Malformed("too many names asked for".into()));
        }
        blob.seek(SeekFrom::Start(start)).map_err(|e| malformed_io(&e, "string section"))?;
        let mut strings = BufReader::with_capacity(READ_CHUNK, blob.take(len));
        let mut found = HashMap::new();
        let mut at = 0u64;
        let mut string = Vec::new();
        loop {
            string.clear();
            let read = strings.read_until(0, &mut string).map_err(|e| malformed_io(&e, "string section"))?;
            if read == 0 {
                break;
            }
            let text = string.strip_suffix(&[0]).unwrap_or(&string);
            if let Some(index) = names.iter().position(|n| n.as_bytes() == text)
                && let Ok(offset) = u32::try_from(at)
            {
                #[expect(clippy::cast_possible_truncation, reason = "checked above: fewer than u16::MAX names")]
                found.insert(offset, index as u16 + 1);
            }
            at += read as u64;
        }
        Ok(found)
    }

    /// 1 + the index of `name` among the names asked for, or [`UNNAMED`].
    fn name_index(&self, name: &str) -> u16 {
        self.names.iter().position(|n| n == name).and_then(|i| u16::try_from(i + 1).ok()).unwrap_or(UNNAMED)
    }

    fn type_name(&self, id: u32) -> String {
        match self.types.get(id as usize) {
            Some(t) if t.name != UNNAMED => self.names.get(usize::from(t.name - 1)).cloned().unwrap_or_default(),
            _ => format!("(type {id})"),
        }
    }

    fn members_of(&self, t: &Type) -> &[Member] {
        let start = t.first_member as usize;
        self.members.get(start..start + usize::from(t.member_count)).unwrap_or_default()
    }

    /// Follows typedefs and qualifiers to the underlying type id.
    fn strip(&self, mut id: u32) -> u32 {
        for _ in 0..32 {
            match self.types.get(id as usize) {
                Some(t)
                    if matches!(
                        u32::from(t.kind),
                        KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG
                    ) =>
                {
                    id = t.refers_to;
                }
                _ => break,
            }
        }
        id
    }

    fn named_type(&self, kind: u32, name: &str) -> Option<u32> {
        let name = self.name_index(name);
        if name == UNNAMED {
            return None;
        }
        self.types
            .iter()
            .position(|t| u32::from(t.kind) == kind && t.name == name && (kind != KIND_STRUCT || t.has_members))
            .and_then(|id| u32::try_from(id).ok())
    }

    fn struct_id(&self, name: &str) -> Result<u32, BtfError> {
        // A struct may appear as a forward declaration too; take the one with members.
        self.named_type(KIND_STRUCT, name).ok_or_else(|| BtfError::NoStruct(name.to_owned()))
    }

    /// The BTF id of kernel function `name` (what an fentry/fexit program
    /// attaches to), when it was asked for and the kernel has it.
    #[must_use]
    pub fn func_id(&self, name: &str) -> Option<u32> {
        self.named_type(KIND_FUNC, name)
    }

    /// Bit offset and type of `member` in struct/union `id`, looking inside
    /// anonymous members.
    fn find_member(&self, id: u32, member: u16, depth: u32) -> Option<(u64, u32, u32)> {
        let t = self.types.get(id as usize)?;
        if depth > 8 || !matches!(u32::from(t.kind), KIND_STRUCT | KIND_UNION) {
            return None;
        }
        let members = self.members_of(t);
        for m in members {
            if m.name != UNNAMED && m.name == member {
                return Some((u64::from(m.bit_offset), m.type_id, m.bitfield_size));
            }
        }
        for m in members.iter().filter(|m| m.name == UNNAMED) {
            if let Some((off, ty, bits)) = self.find_member(self.strip(m.type_id), member, depth + 1) {
                return Some((u64::from(m.bit_offset) + off, ty, bits));
            }
        }
        None
    }

    /// Byte offset of a dotted member path, e.g. `("net", "ns.inum")`.
    pub fn offset_of(&self, strukt: &str, path: &str) -> Result<u32, BtfError> {
        let full = format!("{strukt}.{path}");
        let mut id = self.struct_id(strukt)?;
        let mut owner = strukt.to_owned();
        let mut bits = 0u64;
        for member in path.split('.') {
            let no_member = || BtfError::NoMember { strukt: owner.clone(), member: member.to_owned() };
            let wanted = self.name_index(member);
            if wanted == UNNAMED {
                return Err(no_member());
            }
            let (off, ty, bitfield) = self.find_member(id, wanted, 0).ok_or_else(no_member)?;
            if bitfield != 0 {
                return Err(BtfError::NotByteAligned { path: full });
            }
            bits += off;
            id = self.strip(ty);
            owner = self.type_name(id);
        }
        if !bits.is_multiple_of(8) {
            return Err(BtfError::NotByteAligned { path: full });
        }
        let bytes = bits / 8;
        u32::try_from(bytes).ok().filter(|b| *b < 1 << 16).ok_or(BtfError::TooFar { path: full, offset: bytes })
    }
}

/// Kernel functions the fentry/fexit programs attach to.
pub const TRAMPOLINE_FUNCTIONS: [&str; 2] = ["copy_net_ns", "__put_net"];

/// Every name the agent looks up in the kernel's BTF: the structs and
/// members of [`REQUIRED_MEMBERS`] (and the path parts between them), and
/// [`TRAMPOLINE_FUNCTIONS`].
pub const NEEDED_NAMES: &[&str] = &[
    "task_struct",
    "nsproxy",
    "real_parent",
    "exit_code",
    "mm",
    "pid",
    "tgid",
    "net_ns",
    "net",
    "ns",
    "inum",
    "mm_struct",
    "env_start",
    "env_end",
    "copy_net_ns",
    "__put_net",
];

/// Every member the programs read, as (struct, member path).
pub const REQUIRED_MEMBERS: [(&str, &str); 8] = [
    ("task_struct", "nsproxy"),
    ("task_struct", "real_parent"),
    ("task_struct", "exit_code"),
    ("task_struct", "mm"),
    ("nsproxy", "net_ns"),
    ("net", "ns.inum"),
    ("mm_struct", "env_start"),
    ("mm_struct", "env_end"),
];

/// Resolves every offset the eBPF programs need.
pub fn resolve_offsets(btf: &Btf) -> Result<KernelOffsets, BtfError> {
    Ok(KernelOffsets {
        task_nsproxy: btf.offset_of("task_struct", "nsproxy")?,
        task_real_parent: btf.offset_of("task_struct", "real_parent")?,
        task_exit_code: btf.offset_of("task_struct", "exit_code")?,
        task_mm: btf.offset_of("task_struct", "mm")?,
        nsproxy_net_ns: btf.offset_of("nsproxy", "net_ns")?,
        net_ns_inum: btf.offset_of("net", "ns.inum")?,
        task_pid: btf.offset_of("task_struct", "pid")?,
        task_tgid: btf.offset_of("task_struct", "tgid")?,
        mm_env_start: btf.offset_of("mm_struct", "env_start")?,
        mm_env_end: btf.offset_of("mm_struct", "env_end")?,
        valid: 1,
        _pad: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a BTF blob: `struct inner { int a; int b; }` and
    /// `struct outer { int x; struct { int pad; struct inner in; }; }`.
    fn sample() -> Vec<u8> {
        let strings = b"\0int\0inner\0a\0b\0outer\0x\0pad\0in\0".to_vec();
        let s = |name: &str| -> u32 {
            let needle = format!("\0{name}\0");
            strings.windows(needle.len()).position(|w| w == needle.as_bytes()).map(|p| p as u32 + 1).unwrap()
        };
        let mut t = Vec::new();
        let mut push = |words: &[u32]| words.iter().for_each(|w| t.extend_from_slice(&w.to_le_bytes()));
        // 1: int (4 bytes)
        push(&[s("int"), KIND_INT << 24, 4, 32]);
        // 2: struct inner { a @0, b @32 }
        push(&[s("inner"), KIND_STRUCT << 24 | 2, 8, s("a"), 1, 0, s("b"), 1, 32]);
        // 3: anonymous struct { pad @0, in @64 }
        push(&[0, KIND_STRUCT << 24 | 2, 16, s("pad"), 1, 0, s("in"), 2, 64]);
        // 4: struct outer { x @0, <anon> @64 }
        push(&[s("outer"), KIND_STRUCT << 24 | 2, 24, s("x"), 1, 0, 0, 3, 64]);
        let mut b = Vec::new();
        b.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        b.extend_from_slice(&[1, 0]);
        for w in [24u32, 0, t.len() as u32, t.len() as u32, strings.len() as u32] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b.extend_from_slice(&t);
        b.extend_from_slice(&strings);
        b
    }

    const SAMPLE_NAMES: &[&str] = &["outer", "x", "pad", "in", "b", "inner", "nope"];

    #[test]
    fn resolves_nested_and_anonymous_members() {
        let btf = Btf::parse(&sample(), SAMPLE_NAMES).expect("sample parses");
        assert_eq!(btf.offset_of("outer", "x").unwrap(), 0);
        assert_eq!(btf.offset_of("outer", "pad").unwrap(), 8);
        assert_eq!(btf.offset_of("outer", "in.b").unwrap(), 8 + 8 + 4);
        assert!(matches!(btf.offset_of("outer", "nope"), Err(BtfError::NoMember { .. })));
        assert!(matches!(btf.offset_of("absent", "x"), Err(BtfError::NoStruct(_))));
        // A name not asked for at parse time cannot be found.
        assert!(matches!(btf.offset_of("outer", "a"), Err(BtfError::NoMember { .. })));
        assert_eq!(btf.func_id("outer"), None, "a struct is no function");
    }

    #[test]
    fn every_name_the_agent_looks_up_is_kept() {
        for (strukt, path) in REQUIRED_MEMBERS.iter().chain(&[("task_struct", "pid"), ("task_struct", "tgid")]) {
            assert!(NEEDED_NAMES.contains(strukt), "{strukt}");
            for part in path.split('.') {
                assert!(NEEDED_NAMES.contains(&part), "{strukt}.{path}: {part}");
            }
        }
        for function in TRAMPOLINE_FUNCTIONS {
            assert!(NEEDED_NAMES.contains(&function), "{function}");
        }
    }

    #[test]
    fn malformed_blobs_are_typed_errors() {
        assert!(matches!(Btf::parse(&[], SAMPLE_NAMES), Err(BtfError::Malformed(_))));
        let mut bad = sample();
        bad[0] = 0;
        assert!(matches!(Btf::parse(&bad, SAMPLE_NAMES), Err(BtfError::Malformed(_))));
        let good = sample();
        for cut in [25, 40, good.len() - 3] {
            assert!(Btf::parse(&good[..cut], SAMPLE_NAMES).is_err(), "cut at {cut} must fail");
        }
    }

    #[test]
    fn missing_file_names_the_path_and_the_config() {
        let err = Btf::from_file(Path::new("/nonexistent/btf")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/btf") && msg.contains("CONFIG_DEBUG_INFO_BTF"), "{msg}");
    }

    #[test]
    fn this_kernels_offsets_resolve() {
        if !Path::new(VMLINUX_BTF).exists() {
            eprintln!("skip: {VMLINUX_BTF} absent (kernel without BTF)");
            return;
        }
        let btf = Btf::from_sys_fs().expect("kernel BTF parses");
        let off = resolve_offsets(&btf).expect("all offsets resolve");
        assert_eq!(off.valid, 1);
        // Sanity bounds: fields lie inside their structs and are aligned.
        assert!(off.task_nsproxy > 0 && off.task_nsproxy.is_multiple_of(8));
        assert!(off.task_real_parent > 0 && off.task_real_parent.is_multiple_of(8));
        assert!(off.task_mm > 0 && off.task_mm.is_multiple_of(8));
        assert_eq!(off.mm_env_end, off.mm_env_start + 8, "env_end follows env_start");
        assert!(off.net_ns_inum.is_multiple_of(4));
        for function in TRAMPOLINE_FUNCTIONS {
            assert!(btf.func_id(function).is_some_and(|id| id > 0), "{function} has a BTF id");
        }
    }
}
