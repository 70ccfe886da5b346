//! The release journal: append-only JSON lines in the state dir. An intent
//! is written and fsync'd before a store is touched, its outcome after. An
//! intent without an outcome at start means netreap died in between: the
//! caller re-verifies it from scratch (see `Releaser::recover`), it is never
//! blindly redone.
//!
//! A crash can tear the last line; loading skips lines that do not parse,
//! with a warning, and never panics. A torn intent is harmless: its fsync
//! never returned, so nothing was acted on.
//!
//! Bounded: past `max_bytes` (at open, or after any append while running)
//! the journal is rotated: the pending intents are carried into a fresh
//! file and the old one is kept as `journal.jsonl.1`, replacing the previous
//! `.1`. So the state dir never holds much more than twice `max_bytes`. At
//! start only what recovery needs is read: after a clean stop (a
//! `clean_stop` record, written only when nothing is pending) just the last
//! line; otherwise a first pass reads each line's kind and id, and a second
//! decodes just the intents left without outcome.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, BufRead, BufReader, Seek, SeekFrom, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::SystemTime,
};

use serde::{Deserialize, Serialize};

use super::outcome::{Outcome, ReleaseTimings};
use crate::{engine::Verdict, ipam::safefs::FlockGuard, timefmt};

/// Default state dir (`--state-dir`).
pub const DEFAULT_STATE_DIR: &str = "/var/lib/netreap";
/// The journal's file name in the state dir.
pub const JOURNAL_FILE: &str = "journal.jsonl";
/// Held (flock) while a journal is open: one releaser per state dir.
pub const JOURNAL_LOCK: &str = "journal.lock";
/// Default size past which the journal is rotated (at open and while
/// running): the pending intents are carried into a fresh file, the old one
/// is kept as `journal.jsonl.1`. Config key `journal_max_bytes`.
pub const ROTATE_BYTES: u64 = 16 * 1024 * 1024;
/// Smallest accepted rotation size: a batch of intents must fit.
pub const MIN_ROTATE_BYTES: u64 = 64 * 1024;

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
    /// The thread syncing a batch's intents panicked: they may not be on
    /// disk, so nothing of the batch is acted on.
    #[error("the thread syncing the journal's intents panicked")]
    SyncPanicked,
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
    /// How long its parts took (batches; not needed for recovery).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<ReleaseTimings>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    Intent(Intent),
    Outcome(OutcomeRecord),
    /// The agent stopped cleanly with no intent pending (see
    /// [`Journal::close_clean`]).
    CleanStop(CleanStop),
}

/// [`Record`] by reference: what the journal writes, without copying an
/// intent to write it.
#[derive(Serialize)]
#[serde(tag = "record", rename_all = "snake_case")]
enum RecordOut<'a> {
    Intent(&'a Intent),
    Outcome(OutcomeRecord),
}

/// How much a batch of records is buffered before it is written: a batch
/// of any size is written through this much memory, never held whole.
const WRITE_BUFFER: usize = 64 * 1024;

/// Writes records as JSON lines through a bounded buffer, counting bytes.
fn write_lines<'r>(file: &File, records: impl IntoIterator<Item = RecordOut<'r>>) -> Result<u64, (JournalError, u64)> {
    struct Counting<'f> {
        out: io::BufWriter<&'f File>,
        bytes: u64,
    }
    impl Write for Counting<'_> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = self.out.write(buf)?;
            self.bytes += n as u64;
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            self.out.flush()
        }
    }
    let mut w = Counting { out: io::BufWriter::with_capacity(WRITE_BUFFER, file), bytes: 0 };
    for record in records {
        if let Err(e) = serde_json::to_writer(&mut w, &record) {
            let bytes = w.bytes;
            let e = if e.is_io() { JournalError::Io { path: PathBuf::new(), source: e.into() } } else { e.into() };
            return Err((e, bytes));
        }
        if let Err(e) = w.write_all(b"\n") {
            let bytes = w.bytes;
            return Err((JournalError::Io { path: PathBuf::new(), source: e }, bytes));
        }
    }
    let bytes = w.bytes;
    w.flush().map_err(|e| (JournalError::Io { path: PathBuf::new(), source: e }, bytes))?;
    Ok(w.bytes)
}

/// "Stopped cleanly; nothing was pending." When it is the last line, a
/// start needs to read nothing else.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanStop {
    #[serde(with = "timefmt::rfc3339")]
    pub at: SystemTime,
}

/// How much of the file's end is read to find a last `clean_stop` line.
const TAIL_BYTES: u64 = 4096;

/// An open journal. Holds the state dir's lock until dropped.
#[derive(Debug)]
pub struct Journal {
    state_dir: PathBuf,
    path: PathBuf,
    file: File,
    /// Bytes in `file` (kept here: a stat per append is not needed).
    size: u64,
    max_bytes: u64,
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

/// Intents written but maybe not yet on disk ([`Journal::write_intents`]);
/// [`UnsyncedIntents::sync`] can run on another thread.
#[derive(Debug)]
pub struct UnsyncedIntents {
    /// The journal's file, a second descriptor of it.
    file: File,
    path: PathBuf,
}

impl UnsyncedIntents {
    /// Makes the intents durable (fdatasync).
    pub fn sync(&self) -> Result<(), JournalError> {
        self.file.sync_data().map_err(io_err(&self.path))
    }

    /// Intents whose sync fails (EINVAL: a pipe cannot be synced).
    #[cfg(test)]
    pub(crate) fn failing() -> Self {
        let (reader, _) = io::pipe().expect("pipe");
        Self { file: File::from(std::os::fd::OwnedFd::from(reader)), path: PathBuf::from("pipe") }
    }
}

impl Journal {
    /// Opens (creating) `<state_dir>/journal.jsonl`, takes the state dir's
    /// lock, and loads the intents still pending; rotates at [`ROTATE_BYTES`].
    pub fn open(state_dir: &Path) -> Result<Self, JournalError> {
        Self::open_with_limit(state_dir, ROTATE_BYTES)
    }

    /// [`Journal::open`], rotating past `max_bytes` (at least
    /// [`MIN_ROTATE_BYTES`]).
    pub fn open_with_limit(state_dir: &Path, max_bytes: u64) -> Result<Self, JournalError> {
        let max_bytes = max_bytes.max(MIN_ROTATE_BYTES);
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
        let mut size = file.metadata().map_err(io_err(&path))?.len();
        let clean = ends_with_clean_stop(&mut file, size).map_err(io_err(&path))?;
        let Loaded { pending, warnings, torn } =
            if clean { Loaded::default() } else { load(&mut BufReader::new(&file)).map_err(io_err(&path))? };
        for w in &warnings {
            tracing::warn!(journal = %path.display(), "{w}");
        }
        if size > max_bytes {
            (file, size) = rotate(state_dir, &path, &pending)?;
        } else if torn {
            // Terminate the torn line so the next record starts on its own.
            file.write_all(b"\n").and_then(|()| file.sync_data()).map_err(io_err(&path))?;
            size += 1;
        }
        Ok(Self { state_dir: state_dir.to_owned(), path, file, size, max_bytes, pending, warnings, _lock: lock })
    }

    /// Writes `bytes` (whole lines) in one write and fsyncs; then rotates if
    /// the file grew past the limit. Once this returns, the records survive
    /// a crash. A failed rotation is only a warning (the records are
    /// durable; the next append tries again).
    fn write_durably(&mut self, bytes: &[u8]) -> Result<(), JournalError> {
        self.file.write_all(bytes).and_then(|()| self.file.sync_data()).map_err(io_err(&self.path))?;
        self.size += bytes.len() as u64;
        self.rotate_if_full();
        Ok(())
    }

    /// [`Journal::write_durably`] for a batch of records, streamed through
    /// a bounded buffer instead of encoded whole first.
    fn write_records_durably<'r>(
        &mut self,
        records: impl IntoIterator<Item = RecordOut<'r>>,
    ) -> Result<(), JournalError> {
        let with_path = |e: JournalError, path: &Path| match e {
            JournalError::Io { source, .. } => JournalError::Io { path: path.to_owned(), source },
            other => other,
        };
        let written = write_lines(&self.file, records);
        let bytes = match written {
            Ok(bytes) => bytes,
            Err((e, bytes)) => {
                // Whatever reached the file counts toward its size.
                self.size += bytes;
                return Err(with_path(e, &self.path));
            }
        };
        self.size += bytes;
        self.file.sync_data().map_err(io_err(&self.path))?;
        self.rotate_if_full();
        Ok(())
    }

    /// Rotates past the limit; a failed rotation is only a warning (the
    /// records are durable; the next append tries again).
    fn rotate_if_full(&mut self) {
        if self.size > self.max_bytes {
            match rotate(&self.state_dir, &self.path, &self.pending) {
                Ok((file, size)) => (self.file, self.size) = (file, size),
                Err(e) => tracing::warn!(journal = %self.path.display(), "rotation failed; kept appending: {e}"),
            }
        }
    }

    /// Records a clean stop when no intent is pending, so the next start
    /// reads only the last line. Returns whether it was written (with
    /// intents pending, the next start must find them: nothing is written).
    pub fn close_clean(&mut self) -> Result<bool, JournalError> {
        if !self.pending.is_empty() {
            return Ok(false);
        }
        let line = Self::encode(&Record::CleanStop(CleanStop { at: SystemTime::now() }))?;
        self.write_durably(&line)?;
        Ok(true)
    }

    /// Current size of `journal.jsonl` in bytes.
    #[must_use]
    pub fn size(&self) -> u64 {
        self.size
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

    fn encode(record: &Record) -> Result<Vec<u8>, JournalError> {
        let mut line = serde_json::to_vec(record)?;
        line.push(b'\n');
        Ok(line)
    }

    /// Records the intents to act on each verdict, with one fsync for all.
    pub fn record_intents(&mut self, verdicts: &[&Verdict], dry_run: bool) -> Result<Vec<Intent>, JournalError> {
        let (intents, unsynced) = self.write_intents(verdicts, dry_run)?;
        if let Err(e) = unsynced.sync() {
            self.forget_intents(&intents);
            return Err(e);
        }
        self.rotate_if_full();
        Ok(intents)
    }

    /// Writes the intents to act on each verdict without waiting for the
    /// disk, so the caller can take locks and look while the fsync runs
    /// (`Releaser`). Nothing may change in a store before
    /// [`UnsyncedIntents::sync`] returns; when it fails, the caller gives
    /// the intents back with [`Journal::forget_intents`]. The journal is not
    /// rotated here: the outcomes' write does it.
    pub fn write_intents(
        &mut self,
        verdicts: &[&Verdict],
        dry_run: bool,
    ) -> Result<(Vec<Intent>, UnsyncedIntents), JournalError> {
        let at = SystemTime::now();
        let batch = new_id(at);
        let before = self.pending.len();
        self.pending.extend(verdicts.iter().enumerate().map(|(n, v)| Intent {
            id: format!("{batch}-{n}"),
            at,
            dry_run,
            verdict: (*v).clone(),
        }));
        let path = &self.path;
        let synced = match write_lines(&self.file, self.pending[before..].iter().map(RecordOut::Intent)) {
            Ok(bytes) => {
                self.size += bytes;
                self.file.try_clone().map_err(io_err(path))
            }
            Err((e, bytes)) => {
                self.size += bytes;
                Err(match e {
                    JournalError::Io { source, .. } => JournalError::Io { path: path.clone(), source },
                    other => other,
                })
            }
        };
        match synced {
            Ok(file) => Ok((self.pending[before..].to_vec(), UnsyncedIntents { file, path: path.clone() })),
            Err(e) => {
                self.pending.truncate(before);
                Err(e)
            }
        }
    }

    /// Takes back intents whose fsync failed: they were never acted on.
    pub fn forget_intents(&mut self, intents: &[Intent]) {
        self.pending.retain(|p| !intents.iter().any(|i| i.id == p.id));
    }

    /// Records what became of each intent, with one fsync for all.
    pub fn record_outcomes(&mut self, outcomes: &[(&str, &Outcome)]) -> Result<(), JournalError> {
        let untimed: Vec<(&str, &Outcome, Option<ReleaseTimings>)> =
            outcomes.iter().map(|(id, outcome)| (*id, *outcome, None)).collect();
        self.record_timed_outcomes(&untimed)
    }

    /// Like [`Journal::record_outcomes`], each with how long its parts took.
    pub fn record_timed_outcomes(
        &mut self,
        outcomes: &[(&str, &Outcome, Option<ReleaseTimings>)],
    ) -> Result<(), JournalError> {
        let at = SystemTime::now();
        let open: std::collections::HashSet<&str> = self.pending.iter().map(|i| i.id.as_str()).collect();
        if let Some((id, ..)) = outcomes.iter().find(|(id, ..)| !open.contains(id)) {
            return Err(JournalError::UnknownIntent((*id).to_owned()));
        }
        let done: std::collections::HashSet<&str> = outcomes.iter().map(|(id, ..)| *id).collect();
        // Settled before the write, so a rotation right after it does not
        // carry them; put back in their places if the write fails.
        let mut settled: Vec<(usize, Intent)> = Vec::new();
        for (pos, intent) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            if done.contains(intent.id.as_str()) {
                settled.push((pos, intent));
            } else {
                self.pending.push(intent);
            }
        }
        // One record at a time: a batch of outcomes is never held encoded.
        let records = outcomes.iter().map(|(id, outcome, timings)| OutcomeRecord {
            id: (*id).to_owned(),
            at,
            outcome: (*outcome).clone(),
            reverified: None,
            timings: *timings,
        });
        let result = self.write_records_durably(records.map(RecordOut::Outcome));
        if let Err(e) = result {
            for (pos, intent) in settled {
                self.pending.insert(pos.min(self.pending.len()), intent);
            }
            return Err(e);
        }
        Ok(())
    }

    /// Records (and fsyncs) the intent to act on `verdict`.
    pub fn record_intent(&mut self, verdict: &Verdict, dry_run: bool) -> Result<Intent, JournalError> {
        let at = SystemTime::now();
        let intent = Intent { id: new_id(at), at, dry_run, verdict: verdict.clone() };
        let line = Self::encode(&Record::Intent(intent.clone()))?;
        self.pending.push(intent.clone());
        if let Err(e) = self.write_durably(&line) {
            self.pending.pop();
            return Err(e);
        }
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
            timings: None,
        };
        let line = Self::encode(&Record::Outcome(record))?;
        let intent = self.pending.remove(pos);
        if let Err(e) = self.write_durably(&line) {
            self.pending.insert(pos, intent);
            return Err(e);
        }
        Ok(())
    }
}

/// Replaces the journal with one holding only the pending intents; returns
/// it and its size. At every step `journal.jsonl` is either the whole old
/// file or the new one.
fn rotate(state_dir: &Path, path: &Path, pending: &[Intent]) -> Result<(File, u64), JournalError> {
    let tmp = state_dir.join(format!("{JOURNAL_FILE}.tmp"));
    let old = state_dir.join(format!("{JOURNAL_FILE}.1"));
    let old_tmp = state_dir.join(format!("{JOURNAL_FILE}.1.tmp"));
    let new = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    // Streamed: the pending intents are never held encoded whole.
    let size = write_lines(&new, pending.iter().map(RecordOut::Intent)).map_err(|(e, _)| match e {
        JournalError::Io { source, .. } => JournalError::Io { path: tmp.clone(), source },
        other => other,
    })?;
    new.sync_all().map_err(io_err(&tmp))?;
    drop(new);
    let _ = fs::remove_file(&old_tmp);
    fs::hard_link(path, &old_tmp).map_err(io_err(&old_tmp))?;
    fs::rename(&old_tmp, &old).map_err(io_err(&old))?;
    fs::rename(&tmp, path).map_err(io_err(path))?;
    sync_dir(state_dir).map_err(io_err(state_dir))?;
    tracing::info!(journal = %path.display(), kept = pending.len(), "journal rotated; the old one is {}", old.display());
    let file = OpenOptions::new()
        .read(true)
        .append(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err(path))?;
    Ok((file, size))
}

/// What loading found.
#[derive(Debug, Default)]
struct Loaded {
    /// Intents with no outcome, in file order.
    pending: Vec<Intent>,
    /// What was skipped (torn or garbage lines, stray outcomes).
    warnings: Vec<String>,
    /// The last line has no newline: a crash cut it short.
    torn: bool,
}

/// Only the kind and id of a record: enough to pair intents with outcomes
/// without decoding verdicts.
#[derive(Deserialize)]
struct RecordHead {
    record: RecordKind,
    #[serde(default)]
    id: String,
}

#[derive(Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum RecordKind {
    Intent,
    Outcome,
    CleanStop,
}

/// Whether the file's last line is a `clean_stop` record (read from the
/// end, at most [`TAIL_BYTES`]).
fn ends_with_clean_stop(file: &mut File, size: u64) -> io::Result<bool> {
    use std::io::Read as _;
    let start = size.saturating_sub(TAIL_BYTES);
    file.seek(SeekFrom::Start(start))?;
    let mut tail = Vec::with_capacity((size - start) as usize);
    file.take(size - start).read_to_end(&mut tail)?;
    // Back to the start for a full load (appends go to the end regardless).
    file.seek(SeekFrom::Start(0))?;
    let Some(body) = tail.strip_suffix(b"\n") else { return Ok(false) };
    let last = body.rsplit(|b| *b == b'\n').next().unwrap_or(body);
    Ok(matches!(serde_json::from_slice::<RecordHead>(last), Ok(RecordHead { record: RecordKind::CleanStop, .. })))
}

/// Reads the journal in two passes: the kind and id of every line, then
/// the full records of the intents left without outcome (usually none).
/// Memory holds one line at a time plus the ids of open intents.
fn load<R: BufRead + Seek>(reader: &mut R) -> io::Result<Loaded> {
    let mut out = Loaded::default();
    // (id, offset, length) of intents not yet settled, in file order.
    let mut open: Vec<(String, u64, usize)> = Vec::new();
    let mut line = Vec::new();
    let mut offset = 0u64;
    let mut n = 0usize;
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line)?;
        if read == 0 {
            break;
        }
        n += 1;
        let at = offset;
        offset += read as u64;
        let complete = line.last() == Some(&b'\n');
        let body = if complete { &line[..line.len() - 1] } else { &line[..] };
        if body.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if !complete {
            out.torn = true;
        }
        match serde_json::from_slice::<RecordHead>(body) {
            Ok(RecordHead { record: RecordKind::Intent, id }) => open.push((id, at, body.len())),
            Ok(RecordHead { record: RecordKind::CleanStop, .. }) => {}
            Ok(RecordHead { record: RecordKind::Outcome, id }) => match open.iter().rposition(|(i, _, _)| *i == id) {
                Some(pos) => {
                    open.remove(pos);
                }
                None => out.warnings.push(format!("line {n}: outcome for unknown intent {id}")),
            },
            Err(e) if !complete => out.warnings.push(format!(
                "line {n}: torn last record ({} bytes, {e}); skipped: a crash cut it short before it was acted on",
                body.len()
            )),
            Err(e) => out.warnings.push(format!("line {n}: not a journal record ({e}); skipped")),
        }
    }
    for (id, at, len) in open {
        reader.seek(SeekFrom::Start(at))?;
        let mut body = vec![0u8; len];
        reader.read_exact(&mut body)?;
        match serde_json::from_slice::<Record>(&body) {
            Ok(Record::Intent(intent)) => out.pending.push(intent),
            Ok(Record::Outcome(_) | Record::CleanStop(_)) => {}
            Err(e) => out.warnings.push(format!("intent {id}: not a complete record ({e}); skipped")),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_bytes(bytes: &[u8]) -> Loaded {
        load(&mut io::Cursor::new(bytes)).expect("reading memory")
    }

    #[test]
    fn garbage_is_skipped_with_warnings() {
        let Loaded { pending, warnings, torn } = load_bytes(b"not json\n{\"record\":\"outcome\"}\n\n{\"record\":\"int");
        assert!(pending.is_empty());
        assert!(torn);
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        assert!(warnings[2].contains("torn last record"));
        let Loaded { warnings, torn, .. } = load_bytes(b"");
        assert!(warnings.is_empty() && !torn);
        let Loaded { torn, .. } = load_bytes(&[0xff, 0x00, b'\n']);
        assert!(!torn);
    }

    #[test]
    fn only_open_intents_are_decoded_and_a_bad_one_is_a_warning() {
        // The settled intent is not valid as a full record: the first pass
        // never needs it, so it costs nothing and warns nothing.
        let text = b"{\"record\":\"intent\",\"id\":\"a\",\"broken\":true}\n\
            {\"record\":\"outcome\",\"id\":\"a\"}\n\
            {\"record\":\"intent\",\"id\":\"b\"}\n";
        let Loaded { pending, warnings, torn } = load_bytes(text);
        assert!(pending.is_empty() && !torn);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("intent b:"), "{warnings:?}");
    }

    #[test]
    fn ids_are_unique() {
        let at = SystemTime::now();
        assert_ne!(new_id(at), new_id(at));
    }
}
