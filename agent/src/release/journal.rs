//! The release journal: append-only JSON lines in the state dir. An intent
//! is written and fsync'd before a store is touched, its outcome after. An
//! intent without an outcome at start means netreap died in between: the
//! caller re-verifies it from scratch (see `Releaser::recover`), it is never
//! blindly redone.
//!
//! A crash can tear the last line; loading skips lines that do not parse,
//! with a warning, and never panics. A torn intent is harmless: its fsync
//! never returned, so nothing was acted on.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, Read, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::SystemTime,
};

use serde::{Deserialize, Serialize};

use super::outcome::Outcome;
use crate::{
    engine::Verdict,
    ipam::{safefs::FlockGuard, timefmt},
};

/// Default state dir (`--state-dir`).
pub const DEFAULT_STATE_DIR: &str = "/var/lib/netreap";
/// The journal's file name in the state dir.
pub const JOURNAL_FILE: &str = "journal.jsonl";
/// Held (flock) while a journal is open: one releaser per state dir.
pub const JOURNAL_LOCK: &str = "journal.lock";
/// Past this size the journal is rotated at open: the pending intents are
/// carried into a fresh file, the old one is kept as `journal.jsonl.1`.
pub const ROTATE_BYTES: u64 = 16 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("journal {path} is held by another netreap process")]
    Busy { path: PathBuf },
    #[error("journal record could not be encoded: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("journal has no pending intent {0}")]
    UnknownIntent(String),
}

/// "About to release this, for these reasons."
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intent {
    pub id: String,
    #[serde(with = "timefmt::rfc3339")]
    pub at: SystemTime,
    /// A dry run never changes a store; its intent is only a record.
    pub dry_run: bool,
    /// The verdict (reservation and evidence) the release acts on.
    pub verdict: Verdict,
}

/// What became of an intent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutcomeRecord {
    pub id: String,
    #[serde(with = "timefmt::rfc3339")]
    pub at: SystemTime,
    pub outcome: Outcome,
    /// The fresh verdict, when the intent was re-verified after a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverified: Option<Verdict>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    Intent(Intent),
    Outcome(OutcomeRecord),
}

/// An open journal. Holds the state dir's lock until dropped.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    pending: Vec<Intent>,
    warnings: Vec<String>,
    _lock: FlockGuard,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> JournalError + '_ {
    move |source| JournalError::Io { path: path.to_owned(), source }
}

/// Makes a created file's directory entry durable.
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// A unique, time-ordered id: wall-clock nanoseconds, pid, counter.
fn new_id(at: SystemTime) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let ns = at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{ns:x}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
}

impl Journal {
    /// Opens (creating) `<state_dir>/journal.jsonl`, takes the state dir's
    /// lock, and loads the intents still pending.
    pub fn open(state_dir: &Path) -> Result<Self, JournalError> {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(state_dir).map_err(io_err(state_dir))?;
        let lock_path = state_dir.join(JOURNAL_LOCK);
        let lock_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        let lock = FlockGuard::try_lock_exclusive(lock_file)
            .map_err(io_err(&lock_path))?
            .ok_or_else(|| JournalError::Busy { path: lock_path.clone() })?;

        let path = state_dir.join(JOURNAL_FILE);
        let existed = path.exists();
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(io_err(&path))?;
        if !existed {
            sync_dir(state_dir).map_err(io_err(state_dir))?;
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io_err(&path))?;
        let (pending, warnings, torn) = load(&bytes);
        for w in &warnings {
            tracing::warn!(journal = %path.display(), "{w}");
        }
        if bytes.len() as u64 > ROTATE_BYTES {
            file = rotate(state_dir, &path, &pending)?;
        } else if torn {
            // Terminate the torn line so the next record starts on its own.
            file.write_all(b"\n").and_then(|()| file.sync_data()).map_err(io_err(&path))?;
        }
        Ok(Self { path, file, pending, warnings, _lock: lock })
    }

    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Intents with no outcome, oldest first.
    #[must_use]
    pub fn pending(&self) -> &[Intent] {
        &self.pending
    }

    /// What loading skipped (torn or garbage lines, stray outcomes).
    #[must_use]
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    fn append(&mut self, record: &Record) -> Result<(), JournalError> {
        let mut line = serde_json::to_vec(record)?;
        line.push(b'\n');
        // One write of the whole line (O_APPEND), then fsync: once this
        // returns, the record survives a crash.
        self.file.write_all(&line).and_then(|()| self.file.sync_data()).map_err(io_err(&self.path))
    }

    /// Records the intents to act on each verdict, with one fsync for all.
    pub fn record_intents(&mut self, verdicts: &[&Verdict], dry_run: bool) -> Result<Vec<Intent>, JournalError> {
        let at = SystemTime::now();
        let mut lines = Vec::new();
        let mut intents = Vec::with_capacity(verdicts.len());
        for (n, v) in verdicts.iter().enumerate() {
            let intent = Intent { id: format!("{}-{n}", new_id(at)), at, dry_run, verdict: (*v).clone() };
            lines.extend(serde_json::to_vec(&Record::Intent(intent.clone()))?);
            lines.push(b'\n');
            intents.push(intent);
        }
        self.file.write_all(&lines).and_then(|()| self.file.sync_data()).map_err(io_err(&self.path))?;
        self.pending.extend(intents.iter().cloned());
        Ok(intents)
    }

    /// Records what became of each intent, with one fsync for all.
    pub fn record_outcomes(&mut self, outcomes: &[(&str, &Outcome)]) -> Result<(), JournalError> {
        let at = SystemTime::now();
        let mut lines = Vec::new();
        for (id, outcome) in outcomes {
            if !self.pending.iter().any(|i| i.id == *id) {
                return Err(JournalError::UnknownIntent((*id).to_owned()));
            }
            let record = OutcomeRecord { id: (*id).to_owned(), at, outcome: (*outcome).clone(), reverified: None };
            lines.extend(serde_json::to_vec(&Record::Outcome(record))?);
            lines.push(b'\n');
        }
        self.file.write_all(&lines).and_then(|()| self.file.sync_data()).map_err(io_err(&self.path))?;
        let done: std::collections::HashSet<&str> = outcomes.iter().map(|(id, _)| *id).collect();
        self.pending.retain(|i| !done.contains(i.id.as_str()));
        Ok(())
    }

    /// Records (and fsyncs) the intent to act on `verdict`.
    pub fn record_intent(&mut self, verdict: &Verdict, dry_run: bool) -> Result<Intent, JournalError> {
        let at = SystemTime::now();
        let intent = Intent { id: new_id(at), at, dry_run, verdict: verdict.clone() };
        self.append(&Record::Intent(intent.clone()))?;
        self.pending.push(intent.clone());
        Ok(intent)
    }

    /// Records (and fsyncs) what became of intent `id`.
    pub fn record_outcome(
        &mut self,
        id: &str,
        outcome: &Outcome,
        reverified: Option<&Verdict>,
    ) -> Result<(), JournalError> {
        let Some(pos) = self.pending.iter().position(|i| i.id == id) else {
            return Err(JournalError::UnknownIntent(id.to_owned()));
        };
        let record = OutcomeRecord {
            id: id.to_owned(),
            at: SystemTime::now(),
            outcome: outcome.clone(),
            reverified: reverified.cloned(),
        };
        self.append(&Record::Outcome(record))?;
        self.pending.remove(pos);
        Ok(())
    }
}

/// Replaces the journal with one holding only the pending intents. At
/// every step `journal.jsonl` is either the whole old file or the new one.
fn rotate(state_dir: &Path, path: &Path, pending: &[Intent]) -> Result<File, JournalError> {
    let tmp = state_dir.join(format!("{JOURNAL_FILE}.tmp"));
    let old = state_dir.join(format!("{JOURNAL_FILE}.1"));
    let old_tmp = state_dir.join(format!("{JOURNAL_FILE}.1.tmp"));
    let mut body = Vec::new();
    for intent in pending {
        body.extend(serde_json::to_vec(&Record::Intent(intent.clone()))?);
        body.push(b'\n');
    }
    let mut new = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    new.write_all(&body).and_then(|()| new.sync_all()).map_err(io_err(&tmp))?;
    drop(new);
    let _ = fs::remove_file(&old_tmp);
    fs::hard_link(path, &old_tmp).map_err(io_err(&old_tmp))?;
    fs::rename(&old_tmp, &old).map_err(io_err(&old))?;
    fs::rename(&tmp, path).map_err(io_err(path))?;
    sync_dir(state_dir).map_err(io_err(state_dir))?;
    tracing::info!(journal = %path.display(), kept = pending.len(), "journal rotated; the old one is {}", old.display());
    OpenOptions::new()
        .read(true)
        .append(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err(path))
}

/// Parses the journal's bytes: (pending intents, warnings, last line torn).
fn load(bytes: &[u8]) -> (Vec<Intent>, Vec<String>, bool) {
    let mut pending: Vec<Intent> = Vec::new();
    let mut warnings = Vec::new();
    let torn = !bytes.is_empty() && !bytes.ends_with(b"\n");
    let lines: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
    let last = lines.len().saturating_sub(1);
    for (n, line) in lines.iter().enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<Record>(line) {
            Ok(Record::Intent(intent)) => pending.push(intent),
            Ok(Record::Outcome(outcome)) => match pending.iter().position(|i| i.id == outcome.id) {
                Some(pos) => {
                    pending.remove(pos);
                }
                None => warnings.push(format!("line {}: outcome for unknown intent {}", n + 1, outcome.id)),
            },
            Err(e) if n == last && torn => warnings.push(format!(
                "line {}: torn last record ({} bytes, {e}); skipped: a crash cut it short before it was acted on",
                n + 1,
                line.len()
            )),
            Err(e) => warnings.push(format!("line {}: not a journal record ({e}); skipped", n + 1)),
        }
    }
    (pending, warnings, torn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_skipped_with_warnings() {
        let (pending, warnings, torn) = load(b"not json\n{\"record\":\"outcome\"}\n\n{\"record\":\"int");
        assert!(pending.is_empty());
        assert!(torn);
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        assert!(warnings[2].contains("torn last record"));
        let (_, warnings, torn) = load(b"");
        assert!(warnings.is_empty() && !torn);
        let (_, _, torn) = load(&[0xff, 0x00, b'\n']);
        assert!(!torn);
    }

    #[test]
    fn ids_are_unique() {
        let at = SystemTime::now();
        assert_ne!(new_id(at), new_id(at));
    }
}
