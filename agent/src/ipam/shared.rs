//! Compact forms for what 100k reservations repeat: a container ID appears
//! once per network a pod is attached to, a network name and a store once
//! per reservation. [`SharedStr`] holds one allocation per distinct value,
//! and an [`Interner`] hands out that one during a scan.

use std::{borrow::Borrow, collections::HashSet, ffi::OsStr, fmt, ops::Deref, path::Path, sync::Arc};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An immutable string whose clones share one allocation. Reads as `&str`
/// (deref), compares with `str` and `String`, serializes as a plain string.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SharedStr(Arc<str>);

impl SharedStr {
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether both are the same allocation (not only equal text).
    #[must_use]
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl Deref for SharedStr {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for SharedStr {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl AsRef<Path> for SharedStr {
    fn as_ref(&self) -> &Path {
        Path::new(&*self.0)
    }
}

impl AsRef<OsStr> for SharedStr {
    fn as_ref(&self) -> &OsStr {
        OsStr::new(&*self.0)
    }
}

impl Borrow<str> for SharedStr {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for SharedStr {
    fn from(s: &str) -> Self {
        Self(Arc::from(s))
    }
}

impl From<String> for SharedStr {
    fn from(s: String) -> Self {
        Self(Arc::from(s))
    }
}

impl From<&String> for SharedStr {
    fn from(s: &String) -> Self {
        Self(Arc::from(s.as_str()))
    }
}

impl From<SharedStr> for String {
    fn from(s: SharedStr) -> Self {
        s.0.as_ref().to_owned()
    }
}

impl PartialEq<str> for SharedStr {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for SharedStr {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl PartialEq<String> for SharedStr {
    fn eq(&self, other: &String) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<SharedStr> for String {
    fn eq(&self, other: &SharedStr) -> bool {
        **self == *other.0
    }
}

impl PartialEq<SharedStr> for str {
    fn eq(&self, other: &SharedStr) -> bool {
        *self == *other.0
    }
}

impl PartialEq<SharedStr> for &str {
    fn eq(&self, other: &SharedStr) -> bool {
        **self == *other.0
    }
}

impl Serialize for SharedStr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for SharedStr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Self::from)
    }
}

/// Hands out one [`SharedStr`] per distinct value seen. Lives for one scan:
/// what it holds is what the scan's reservations hold anyway.
#[derive(Debug, Default)]
pub struct Interner {
    /// foldhash, not SipHash: a scan interns every file's container ID.
    seen: HashSet<SharedStr, foldhash::fast::RandomState>,
}

impl Interner {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The shared value equal to `s`, when one was handed out.
    #[must_use]
    pub fn get(&self, s: &str) -> Option<SharedStr> {
        self.seen.get(s).cloned()
    }

    pub fn intern(&mut self, s: &str) -> SharedStr {
        if let Some(found) = self.seen.get(s) {
            return found.clone();
        }
        let shared = SharedStr::from(s);
        self.seen.insert(shared.clone());
        shared
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interned_values_share_one_allocation_and_read_as_text() {
        let mut i = Interner::new();
        let a = i.intern("c1");
        let b = i.intern("c1");
        assert!(std::ptr::eq(a.as_str(), b.as_str()));
        assert_eq!(a, "c1");
        assert_eq!("c1".to_owned(), a);
        assert_eq!(serde_json::to_string(&a).unwrap(), "\"c1\"");
        assert_eq!(serde_json::from_str::<SharedStr>("\"c1\"").unwrap(), b);
        assert_eq!(format!("{a} {a:?}"), "c1 \"c1\"");
    }
}
