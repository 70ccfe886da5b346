//! Hash maps for the hot paths: foldhash, seeded per process, instead of
//! std's SipHash. Their keys are the agent's own (netns keys, inodes,
//! container IDs from the node), looked up many times per event; SipHash's
//! resistance to chosen keys buys nothing there and costs most of a lookup.

use std::collections::{HashMap, HashSet};

pub type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
pub type Set<K> = HashSet<K, foldhash::fast::RandomState>;
