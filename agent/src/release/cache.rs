//! Removing the released attachment's libcni cache entry: only an entry
//! that names the same network, container and ifname, lists the released IP
//! (or none), and whose attachment holds no other IP in the store.

use std::{
    io,
    net::IpAddr,
    path::{Path, PathBuf},
};

use crate::ipam::{
    Reservation,
    cnicache::{CachedAttachment, entry_name, read_entry},
    safefs::Dir,
};

/// Cache entries that belong to the released attachment, with notes on
/// entries looked at and kept.
pub(crate) fn entries_for(cache_dir: &Path, r: &Reservation) -> (Vec<CachedAttachment>, Vec<String>) {
    let mut notes = Vec::new();
    let dir = match Dir::open(cache_dir) {
        Ok(dir) => dir,
        Err(e) => {
            if e.kind() != io::ErrorKind::NotFound {
                notes.push(format!("cache dir {}: {e}", cache_dir.display()));
            }
            return (Vec::new(), notes);
        }
    };
    // A legacy reservation has no ifname: any ifname of this container in
    // this network.
    let names: Vec<String> = if let Some(ifname) = &r.ifname {
        vec![entry_name(&r.network, &r.container_id, ifname)]
    } else {
        let prefix = format!("{}-{}-", r.network, r.container_id);
        std::fs::read_dir(cache_dir)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                    .filter(|n| n.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut found = Vec::new();
    for name in names {
        match read_entry(&dir, cache_dir, &name) {
            Ok(None) => {}
            Ok(Some(a)) => {
                let same = a.network == r.network
                    && a.container_id == r.container_id
                    && r.ifname.as_ref().is_none_or(|i| *i == a.ifname);
                if !same {
                    notes.push(format!("{}: another attachment; kept", a.path.display()));
                } else if !a.ips.is_empty() && !a.ips.contains(&r.ip) {
                    notes.push(format!("{}: lists other IPs ({}); kept", a.path.display(), ips(&a.ips)));
                } else {
                    found.push(a);
                }
            }
            Err((kind, detail)) => notes.push(format!("{}: {kind:?}: {detail}; kept", cache_dir.join(&name).display())),
        }
    }
    (found, notes)
}

fn ips(ips: &[IpAddr]) -> String {
    ips.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// Removes `entries` (already checked), re-checking each is the same file.
pub(crate) fn remove(cache_dir: &Path, entries: &[CachedAttachment]) -> (Vec<PathBuf>, Vec<String>) {
    let mut removed = Vec::new();
    let mut notes = Vec::new();
    let dir = match Dir::open(cache_dir) {
        Ok(dir) => dir,
        Err(e) => {
            notes.push(format!("cache dir {}: {e}", cache_dir.display()));
            return (removed, notes);
        }
    };
    for a in entries {
        let Some(name) = a.path.file_name().and_then(|n| n.to_str()) else { continue };
        // libcni may have rewritten it (a new ADD of the same attachment).
        match read_entry(&dir, cache_dir, name) {
            Ok(Some(now)) if now.inode == a.inode && now.container_id == a.container_id => match dir.unlink(name) {
                Ok(()) => removed.push(a.path.clone()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => notes.push(format!("{}: {e}", a.path.display())),
            },
            Ok(Some(_)) => notes.push(format!("{}: rewritten since it was checked; kept", a.path.display())),
            Ok(None) => {}
            Err((kind, detail)) => notes.push(format!("{}: {kind:?}: {detail}; kept", a.path.display())),
        }
    }
    (removed, notes)
}
