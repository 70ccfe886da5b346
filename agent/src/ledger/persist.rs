//! What netreap knows across a restart: container bindings with the netns
//! incarnation (inode, nsid, first sight) they named, the CNI runs seen, the
//! windows in which the probes saw every CNI run, and the boot they belong
//! to. Without it, leaks made while netreap was down wait out the orphan
//! grace, and a reservation made just before a restart waits out the youth
//! grace.
//!
//! One JSON document, replaced atomically (write, fsync, rename, fsync the
//! directory): a crash leaves the old or the new file, never a torn one. A
//! file that does not parse is set aside and reported, never trusted.

use std::{
    fs,
    io::{self, Read as _, Write as _},
    path::{Path, PathBuf},
    time::SystemTime,
};

use serde::{Deserialize, Serialize};

use super::Attachment;
use crate::identity::NetnsId;

/// The file's name in the state dir.
pub const KNOWLEDGE_FILE: &str = "knowledge.json";
const VERSION: u32 = 1;
/// A larger file is not read (and set aside): the ledger's bound keeps real
/// ones far below it.
const MAX_BYTES: u64 = 256 << 20;
/// Watching windows kept (the latest runs).
const MAX_WINDOWS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: {size} bytes is more than netreap ever writes; set aside as {aside}")]
    TooLarge { path: PathBuf, size: u64, aside: PathBuf },
    #[error("{path}: not a knowledge file ({detail}); set aside as {aside}")]
    Malformed { path: PathBuf, detail: String, aside: PathBuf },
    #[error("encoding the knowledge file: {0}")]
    Encode(#[from] serde_json::Error),
}

/// A span of time in which the probes recorded every CNI run (no ring
/// buffer loss): a reservation made inside one, whose ADD the ledger holds,
/// needs no youth grace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    pub since: SystemTime,
    pub until: SystemTime,
}

/// One binding as saved: the attachment, and the netns incarnation it
/// named at the time, alive or dead then.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBinding {
    /// Shared with the ledger while a save is made.
    pub attachment: std::sync::Arc<Attachment>,
    pub netns: Option<NetnsId>,
    /// When the model saw that incarnation die (None: alive when saved).
    pub died_at: Option<SystemTime>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Knowledge {
    pub version: u32,
    /// `/proc/sys/kernel/random/boot_id` when saved.
    pub boot_id: String,
    pub saved_at: SystemTime,
    pub watched: Vec<Window>,
    pub bindings: Vec<SavedBinding>,
}

impl Knowledge {
    #[must_use]
    pub fn new(boot_id: String, saved_at: SystemTime, mut watched: Vec<Window>, bindings: Vec<SavedBinding>) -> Self {
        if watched.len() > MAX_WINDOWS {
            watched.drain(..watched.len() - MAX_WINDOWS);
        }
        Self { version: VERSION, boot_id, saved_at, watched, bindings }
    }
}

/// This boot's id; empty when the kernel does not say (then no record of
/// an earlier boot can be told apart, and none is declared dead for it).
#[must_use]
pub fn boot_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_owned()).unwrap_or_default()
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> PersistError + '_ {
    move |source| PersistError::Io { path: path.to_path_buf(), source }
}

/// Reads the knowledge file of `state_dir`. None when there is none.
pub fn load(state_dir: &Path) -> Result<Option<Knowledge>, PersistError> {
    let path = state_dir.join(KNOWLEDGE_FILE);
    let file = match fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(PersistError::Io { path, source: e }),
    };
    let size = file.metadata().map_err(io_err(&path))?.len();
    if size > MAX_BYTES {
        let aside = set_aside(&path)?;
        return Err(PersistError::TooLarge { path, size, aside });
    }
    let mut text = Vec::with_capacity(size as usize);
    file.take(MAX_BYTES).read_to_end(&mut text).map_err(io_err(&path))?;
    match serde_json::from_slice::<Knowledge>(&text) {
        Ok(k) if k.version == VERSION => Ok(Some(k)),
        Ok(k) => {
            let aside = set_aside(&path)?;
            Err(PersistError::Malformed { path, detail: format!("version {}", k.version), aside })
        }
        Err(e) => {
            let aside = set_aside(&path)?;
            Err(PersistError::Malformed { path, detail: e.to_string(), aside })
        }
    }
}

fn set_aside(path: &Path) -> Result<PathBuf, PersistError> {
    let aside = path.with_extension("json.bad");
    fs::rename(path, &aside).map_err(io_err(path))?;
    Ok(aside)
}

/// Replaces the knowledge file atomically.
pub fn save(state_dir: &Path, knowledge: &Knowledge) -> Result<(), PersistError> {
    let path = state_dir.join(KNOWLEDGE_FILE);
    let tmp = state_dir.join(format!("{KNOWLEDGE_FILE}.tmp"));
    let bytes = serde_json::to_vec(knowledge)?;
    {
        let mut f = fs::File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&bytes).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    fs::rename(&tmp, &path).map_err(io_err(&path))?;
    fs::File::open(state_dir).and_then(|d| d.sync_all()).map_err(io_err(state_dir))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    fn t(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
    }

    fn attachment() -> Attachment {
        Attachment {
            container_id: "c1".into(),
            netns_path: Some("/run/netns/a".into()),
            netns_inode: Some(77),
            netns_nsid: None,
            netns_bound_at: Some(t(1)),
            pinned: None,
            died: None,
            ifnames: vec!["eth0".into()],
            operations: Vec::new(),
            first_seen: t(1),
            last_seen: t(2),
        }
    }

    #[test]
    fn saves_and_loads_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(dir.path()).unwrap(), None);
        let k = Knowledge::new(
            "boot".into(),
            t(5),
            vec![Window { since: t(0), until: t(5) }],
            vec![SavedBinding {
                attachment: std::sync::Arc::new(attachment()),
                netns: Some(NetnsId::new(Some(77), Some(3), Some(t(0)))),
                died_at: None,
            }],
        );
        save(dir.path(), &k).unwrap();
        assert_eq!(load(dir.path()).unwrap(), Some(k));
    }

    #[test]
    fn a_garbage_file_is_set_aside_with_a_clear_error_never_trusted() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(KNOWLEDGE_FILE), b"{\"version\":1,\"boot_id\":").unwrap();
        let err = load(dir.path()).unwrap_err();
        assert!(matches!(err, PersistError::Malformed { .. }), "{err}");
        assert!(dir.path().join("knowledge.json.bad").exists());
        assert_eq!(load(dir.path()).unwrap(), None, "a fresh start after");
    }
}
