//! Hash maps for the hot paths: foldhash, seeded per process, instead of
//! std's SipHash. Their keys are the agent's own (netns keys, inodes,
//! container IDs from the node), looked up many times per event; SipHash's
//! resistance to chosen keys buys nothing there and costs most of a lookup.

use std::collections::{HashMap, HashSet};

pub type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
pub type Set<K> = HashSet<K, foldhash::fast::RandomState>;

/// Room reserved up front by [`sized_map`], at most.
const PRESIZE_MAX: usize = 1024;

/// An empty map for an index built per pass over `n` items: room for them
/// up to [`PRESIZE_MAX`] keys. Beyond that the map grows as it fills: under
/// pod churn thousands of items share a few keys (the kernel reuses the
/// lowest free netns inode and nsid), and a table sized for every item was
/// fresh pages to fault in on every death.
#[must_use]
pub fn sized_map<K, V>(n: usize) -> Map<K, V> {
    Map::with_capacity_and_hasher(n.min(PRESIZE_MAX), foldhash::fast::RandomState::default())
}

/// What an index built per pass files under one key: nearly every key
/// holds one value, kept inline (a `Vec` per key was an allocation per
/// netns, attachment and cache entry of the node, on every death).
#[derive(Debug, Clone)]
pub enum Filed<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> Default for Filed<T> {
    fn default() -> Self {
        Self::Many(Vec::new())
    }
}

impl<T: Copy> Filed<T> {
    pub fn push(&mut self, value: T) {
        match self {
            Self::Many(values) if values.is_empty() => *self = Self::One(value),
            Self::One(first) => *self = Self::Many(vec![*first, value]),
            Self::Many(values) => values.push(value),
        }
    }
}

impl<T> Filed<T> {
    /// The values in the order they were filed.
    #[must_use]
    pub fn as_slice(&self) -> &[T] {
        match self {
            Self::One(value) => std::slice::from_ref(value),
            Self::Many(values) => values,
        }
    }

    /// The values in the order they were filed.
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.as_slice().iter()
    }
}

impl<'a, T> IntoIterator for &'a Filed<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::Filed;

    #[test]
    fn filed_values_keep_their_order() {
        let mut f = Filed::default();
        assert!(f.as_slice().is_empty());
        for i in 0..4 {
            f.push(i);
            assert_eq!(f.as_slice(), (0..=i).collect::<Vec<_>>().as_slice());
        }
        assert_eq!((&f).into_iter().copied().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    }
}
