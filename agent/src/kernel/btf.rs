//! A minimal reader of kernel BTF, enough to resolve struct member offsets
//! (Rust eBPF has no CO-RE). Anonymous struct/union members are searched
//! through, as `mm_struct` keeps its fields inside one.

use std::path::{Path, PathBuf};

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

#[derive(Debug, Clone)]
struct Member {
    name_off: u32,
    type_id: u32,
    bit_offset: u32,
    bitfield_size: u32,
}

#[derive(Debug, Clone)]
struct Type {
    name_off: u32,
    kind: u32,
    /// Target type of modifiers and typedefs.
    refers_to: u32,
    members: Vec<Member>,
}

/// Parsed type table of one BTF blob.
#[derive(Debug)]
pub struct Btf {
    /// Index = type id; id 0 is void.
    types: Vec<Type>,
    strings: Vec<u8>,
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, BtfError> {
    b.get(at..at + 4)
        .and_then(|s| <[u8; 4]>::try_from(s).ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| BtfError::Malformed(format!("truncated at byte {at}")))
}

impl Btf {
    pub fn from_file(path: &Path) -> Result<Self, BtfError> {
        let bytes = std::fs::read(path).map_err(|source| BtfError::Missing { path: path.to_path_buf(), source })?;
        Self::parse(&bytes)
    }

    /// The running kernel's BTF.
    pub fn from_sys_fs() -> Result<Self, BtfError> {
        Self::from_file(Path::new(VMLINUX_BTF))
    }

    /// Parses a little-endian BTF blob (x86_64 and aarch64 kernels).
    pub fn parse(b: &[u8]) -> Result<Self, BtfError> {
        if b.len() < HEADER_MIN {
            return Err(BtfError::Malformed(format!("{} bytes is shorter than a header", b.len())));
        }
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != BTF_MAGIC {
            return Err(BtfError::Malformed(format!("bad magic {magic:#x}")));
        }
        let hdr_len = u32_at(b, 4)? as usize;
        let (type_off, type_len) = (u32_at(b, 8)? as usize, u32_at(b, 12)? as usize);
        let (str_off, str_len) = (u32_at(b, 16)? as usize, u32_at(b, 20)? as usize);
        let section = |off: usize, len: usize, what: &str| {
            let start = hdr_len.checked_add(off);
            let end = start.and_then(|s| s.checked_add(len));
            match (start, end) {
                (Some(s), Some(e)) if e <= b.len() => Ok(&b[s..e]),
                _ => Err(BtfError::Malformed(format!("{what} section out of bounds"))),
            }
        };
        let type_sec = section(type_off, type_len, "type")?;
        let strings = section(str_off, str_len, "string")?.to_vec();

        let mut types = vec![Type { name_off: 0, kind: 0, refers_to: 0, members: Vec::new() }];
        let mut at = 0usize;
        while at < type_sec.len() {
            let name_off = u32_at(type_sec, at)?;
            let info = u32_at(type_sec, at + 4)?;
            let size_or_type = u32_at(type_sec, at + 8)?;
            at += 12;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            if kind == 0 || kind > KIND_MAX {
                return Err(BtfError::Malformed(format!("unknown kind {kind} at type {}", types.len())));
            }
            let mut members = Vec::new();
            let extra = match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                KIND_STRUCT | KIND_UNION => {
                    for m in 0..vlen {
                        let base = at + m * 12;
                        let raw = u32_at(type_sec, base + 8)?;
                        let (bit_offset, bitfield_size) =
                            if kind_flag { (raw & 0x00ff_ffff, raw >> 24) } else { (raw, 0) };
                        members.push(Member {
                            name_off: u32_at(type_sec, base)?,
                            type_id: u32_at(type_sec, base + 4)?,
                            bit_offset,
                            bitfield_size,
                        });
                    }
                    vlen * 12
                }
                KIND_ENUM | KIND_FUNC_PROTO => vlen * 8,
                KIND_DATASEC | KIND_ENUM64 => vlen * 12,
                _ => 0,
            };
            at += extra;
            types.push(Type { name_off, kind, refers_to: size_or_type, members });
        }
        if at != type_sec.len() {
            return Err(BtfError::Malformed("type section ends inside a type".into()));
        }
        Ok(Self { types, strings })
    }

    fn name(&self, off: u32) -> &str {
        let rest = self.strings.get(off as usize..).unwrap_or_default();
        let end = rest.iter().position(|&c| c == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    /// Follows typedefs and qualifiers to the underlying type id.
    fn strip(&self, mut id: u32) -> u32 {
        for _ in 0..32 {
            match self.types.get(id as usize) {
                Some(t)
                    if matches!(t.kind, KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG) =>
                {
                    id = t.refers_to;
                }
                _ => break,
            }
        }
        id
    }

    fn struct_id(&self, name: &str) -> Result<u32, BtfError> {
        // A struct may appear as a forward declaration too; take the one with members.
        self.types
            .iter()
            .enumerate()
            .find(|(_, t)| t.kind == KIND_STRUCT && !t.members.is_empty() && self.name(t.name_off) == name)
            .map(|(id, _)| id as u32)
            .ok_or_else(|| BtfError::NoStruct(name.to_owned()))
    }

    /// Bit offset and type of `member` in struct/union `id`, looking inside
    /// anonymous members.
    fn find_member(&self, id: u32, member: &str, depth: u32) -> Option<(u64, u32, u32)> {
        let t = self.types.get(id as usize)?;
        if depth > 8 || !matches!(t.kind, KIND_STRUCT | KIND_UNION) {
            return None;
        }
        for m in &t.members {
            if m.name_off != 0 && self.name(m.name_off) == member {
                return Some((u64::from(m.bit_offset), m.type_id, m.bitfield_size));
            }
        }
        for m in t.members.iter().filter(|m| m.name_off == 0) {
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
            let (off, ty, bitfield) = self
                .find_member(id, member, 0)
                .ok_or_else(|| BtfError::NoMember { strukt: owner.clone(), member: member.to_owned() })?;
            if bitfield != 0 {
                return Err(BtfError::NotByteAligned { path: full });
            }
            bits += off;
            id = self.strip(ty);
            owner = self.types.get(id as usize).map(|t| self.name(t.name_off).to_owned()).unwrap_or_default();
        }
        if !bits.is_multiple_of(8) {
            return Err(BtfError::NotByteAligned { path: full });
        }
        let bytes = bits / 8;
        u32::try_from(bytes).ok().filter(|b| *b < 1 << 16).ok_or(BtfError::TooFar { path: full, offset: bytes })
    }
}

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

    #[test]
    fn resolves_nested_and_anonymous_members() {
        let btf = Btf::parse(&sample()).expect("sample parses");
        assert_eq!(btf.offset_of("outer", "x").unwrap(), 0);
        assert_eq!(btf.offset_of("outer", "pad").unwrap(), 8);
        assert_eq!(btf.offset_of("outer", "in.b").unwrap(), 8 + 8 + 4);
        assert!(matches!(btf.offset_of("outer", "nope"), Err(BtfError::NoMember { .. })));
        assert!(matches!(btf.offset_of("absent", "x"), Err(BtfError::NoStruct(_))));
    }

    #[test]
    fn malformed_blobs_are_typed_errors() {
        assert!(matches!(Btf::parse(&[]), Err(BtfError::Malformed(_))));
        let mut bad = sample();
        bad[0] = 0;
        assert!(matches!(Btf::parse(&bad), Err(BtfError::Malformed(_))));
        let good = sample();
        for cut in [25, 40, good.len() - 3] {
            assert!(Btf::parse(&good[..cut]).is_err(), "cut at {cut} must fail");
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
    }
}
