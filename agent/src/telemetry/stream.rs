//! The event stream: one JSON object per line, to stdout or a file, with
//! optional size-based rotation of the file.
//!
//! Schema (stable): every line has `time` (RFC 3339, UTC) and `event`
//! (`snake_case` name); the other fields depend on `event` and are documented
//! in docs/events.md.

use std::{
    fs::{File, OpenOptions},
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
    time::SystemTime,
};

use super::{clock::rfc3339, event::Event};

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("event file {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("rotating event file {path}: {source}")]
    Rotate { path: PathBuf, source: io::Error },
    #[error("writing an event: {0}")]
    Write(#[from] io::Error),
    #[error("encoding an event: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("an event did not serialize as a JSON object")]
    NotAnObject,
}

/// Where event lines go.
enum Sink {
    Stdout(io::Stdout),
    File(BufWriter<File>),
    Rotating(Rotating),
}

/// A file that is renamed to `<path>.1` (older ones shifted to `.2`, ...)
/// before a line would make it exceed `max_bytes`.
struct Rotating {
    path: PathBuf,
    max_bytes: u64,
    /// Rotated files kept beside the live one; 0 drops the old content.
    keep: u32,
    file: File,
    /// Bytes in the live file, counted from its size at open (append mode).
    written: u64,
}

impl Rotating {
    fn open(path: &Path, max_bytes: u64, keep: u32) -> Result<Self, StreamError> {
        let file = open_append(path)?;
        let written = file.metadata().map_err(|source| StreamError::Open { path: path.to_path_buf(), source })?.len();
        Ok(Self { path: path.to_path_buf(), max_bytes, keep, file, written })
    }

    /// Writes whole lines (`ends`: where each ends in `bytes`), rotating
    /// before a line that would not fit. A line is never split: one longer
    /// than `max_bytes` gets a file of its own.
    fn write_lines(&mut self, bytes: &[u8], ends: &[usize]) -> Result<(), StreamError> {
        // The lines that fit go in one write_all on an O_APPEND file (no
        // BufWriter), so a line is either fully in a file or not written.
        let mut start = 0;
        let mut fits_to = 0;
        for &end in ends {
            let line = (end - fits_to) as u64;
            if self.written > 0 && self.written + line > self.max_bytes {
                self.file.write_all(&bytes[start..fits_to])?;
                self.rotate()?;
                start = fits_to;
            }
            self.written += line;
            fits_to = end;
        }
        self.file.write_all(&bytes[start..fits_to])?;
        Ok(())
    }

    fn rotate(&mut self) -> Result<(), StreamError> {
        let err = |source| StreamError::Rotate { path: self.path.clone(), source };
        self.file.sync_data().map_err(err)?;
        if self.keep == 0 {
            remove_if_present(&self.path).map_err(err)?;
        } else {
            remove_if_present(&numbered(&self.path, self.keep)).map_err(err)?;
            for n in (1..self.keep).rev() {
                rename_if_present(&numbered(&self.path, n), &numbered(&self.path, n + 1)).map_err(err)?;
            }
            std::fs::rename(&self.path, numbered(&self.path, 1)).map_err(err)?;
        }
        self.file = open_append(&self.path)?;
        self.written = 0;
        Ok(())
    }
}

/// `<path>.<n>`: `events.jsonl` -> `events.jsonl.1`.
fn numbered(path: &Path, n: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{n}"));
    PathBuf::from(name)
}

fn open_append(path: &Path) -> Result<File, StreamError> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|source| StreamError::Open { path: path.to_path_buf(), source })
}

fn remove_if_present(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn rename_if_present(from: &Path, to: &Path) -> io::Result<()> {
    match std::fs::rename(from, to) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Writes events as JSON lines; each line is flushed, so a crash loses none
/// (but for the lines of a batch held by [`EventStream::hold`]).
pub struct EventStream {
    sink: Sink,
    /// Lines emitted while held, written by [`EventStream::release`].
    held: Option<Held>,
}

/// Lines waiting for one write.
#[derive(Default)]
struct Held {
    bytes: Vec<u8>,
    /// Where each line ends in `bytes`.
    ends: Vec<usize>,
}

impl EventStream {
    #[must_use]
    pub fn stdout() -> Self {
        Self { sink: Sink::Stdout(io::stdout()), held: None }
    }

    /// Appends to `path` (created if missing).
    pub fn file(path: &Path) -> Result<Self, StreamError> {
        Ok(Self { sink: Sink::File(BufWriter::new(open_append(path)?)), held: None })
    }

    /// Appends to `path` (created if missing); before a line would take it
    /// past `max_bytes`, renames it to `<path>.1` (shifting older files up
    /// to `<path>.<keep>`, dropping the oldest) and starts a new one. Lines
    /// are never split across files.
    pub fn file_rotating(path: &Path, max_bytes: u64, keep: u32) -> Result<Self, StreamError> {
        Ok(Self { sink: Sink::Rotating(Rotating::open(path, max_bytes, keep)?), held: None })
    }

    /// `-` is stdout; anything else a file.
    pub fn open(spec: &str) -> Result<Self, StreamError> {
        if spec == "-" { Ok(Self::stdout()) } else { Self::file(Path::new(spec)) }
    }

    /// `-` is stdout (never rotated); anything else a rotating file (see
    /// [`EventStream::file_rotating`]).
    pub fn open_rotating(spec: &str, max_bytes: u64, keep: u32) -> Result<Self, StreamError> {
        if spec == "-" { Ok(Self::stdout()) } else { Self::file_rotating(Path::new(spec), max_bytes, keep) }
    }

    /// Flushes, and for a file also fsyncs: call at shutdown so the last
    /// events survive a power loss too.
    pub fn sync(&mut self) -> Result<(), StreamError> {
        match &mut self.sink {
            Sink::Stdout(out) => out.flush()?,
            Sink::File(file) => {
                file.flush()?;
                file.get_ref().sync_data()?;
            }
            Sink::Rotating(r) => r.file.sync_data()?,
        }
        Ok(())
    }

    /// Writes `{"time":..., "event": name, ...fields}`: the event is
    /// serialized once, straight into the line (no intermediate JSON tree).
    pub fn emit(&mut self, time: SystemTime, event: &Event<'_>) -> Result<(), StreamError> {
        let mut bytes = Vec::with_capacity(256);
        bytes.extend_from_slice(b"{\"time\":\"");
        bytes.extend_from_slice(rfc3339(time).as_bytes());
        bytes.extend_from_slice(b"\",");
        let fields_at = bytes.len();
        serde_json::to_writer(&mut bytes, event)?;
        // The event is an object (its tag is always there): drop its own
        // opening brace so its fields follow `time`.
        if bytes.get(fields_at) != Some(&b'{') {
            return Err(StreamError::NotAnObject);
        }
        bytes.remove(fields_at);
        bytes.push(b'\n');
        if let Some(held) = &mut self.held {
            held.bytes.extend_from_slice(&bytes);
            held.ends.push(held.bytes.len());
            return Ok(());
        }
        self.write(&bytes, &[bytes.len()])
    }

    /// Holds the lines emitted from now on until [`EventStream::release`]:
    /// the events of one batch of kernel records (a CNI run's exec and
    /// exits, read together) then cost one write, not one each.
    pub fn hold(&mut self) {
        self.held.get_or_insert_with(Held::default);
    }

    /// Writes what was held, in order, and stops holding.
    pub fn release(&mut self) -> Result<(), StreamError> {
        match self.held.take() {
            Some(held) if !held.ends.is_empty() => self.write(&held.bytes, &held.ends),
            _ => Ok(()),
        }
    }

    /// Writes whole lines (`ends`: where each ends in `bytes`) and flushes.
    fn write(&mut self, bytes: &[u8], ends: &[usize]) -> Result<(), StreamError> {
        match &mut self.sink {
            Sink::Stdout(out) => {
                let mut out = out.lock();
                out.write_all(bytes)?;
                out.flush()?;
            }
            Sink::File(file) => {
                file.write_all(bytes)?;
                file.flush()?;
            }
            Sink::Rotating(r) => r.write_lines(bytes, ends)?,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    #[test]
    fn lines_are_json_with_time_and_event() {
        let dir = tempfile::tempdir().expect("event file I/O");
        let path = dir.path().join("events.jsonl");
        let mut s = EventStream::file(&path).expect("event file I/O");
        s.emit(SystemTime::UNIX_EPOCH, &Event::RecordsDropped { dropped: 5 }).expect("event file I/O");
        s.emit(SystemTime::UNIX_EPOCH, &Event::MalformedRecord { error: "short \"x\"".into() })
            .expect("event file I/O");
        let text = std::fs::read_to_string(&path).expect("event file I/O");
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("event file I/O")).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["event"], "records_dropped");
        assert_eq!(lines[0]["dropped"], 5);
        assert_eq!(lines[0]["time"], "1970-01-01T00:00:00.000Z");
        assert_eq!(lines[1]["error"], "short \"x\"");
    }

    fn read_lines(path: &Path) -> Vec<Value> {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(text.is_empty() || text.ends_with('\n'), "{} ends mid-line", path.display());
        text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("split line {l:?}: {e}"))).collect()
    }

    /// Events whose `error` is `<seq> xxx...`.
    fn emit_n(s: &mut EventStream, from: u64, n: u64) {
        for seq in from..from + n {
            let error = format!("{seq} {}", "x".repeat(40));
            s.emit(SystemTime::UNIX_EPOCH, &Event::MalformedRecord { error }).expect("event file I/O");
        }
    }

    fn seq(line: &Value) -> u64 {
        line["error"].as_str().and_then(|e| e.split(' ').next()).and_then(|n| n.parse().ok()).expect("a seq")
    }

    #[test]
    fn rotates_at_size_keeps_n_files_and_never_splits_a_line() {
        let dir = tempfile::tempdir().expect("event file I/O");
        let path = dir.path().join("events.jsonl");
        let max = 1000;
        let mut s = EventStream::file_rotating(&path, max, 2).expect("event file I/O");
        emit_n(&mut s, 0, 100);
        s.sync().expect("event file I/O");

        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .expect("event file I/O")
            .map(|e| e.expect("event file I/O").file_name().into_string().expect("event file I/O"))
            .collect();
        names.sort();
        assert_eq!(names, ["events.jsonl", "events.jsonl.1", "events.jsonl.2"], "keeps 2 rotated files");
        let (live, one, two) = (read_lines(&path), read_lines(&numbered(&path, 1)), read_lines(&numbered(&path, 2)));
        for p in [path.clone(), numbered(&path, 1), numbered(&path, 2)] {
            let len = std::fs::metadata(&p).expect("event file I/O").len();
            assert!(len <= max, "{} is {len} bytes, over {max}", p.display());
        }
        // Newest last in the live file; the rotated files hold the lines
        // just before it, with no gap and no duplicate.
        let seqs: Vec<u64> = [&two, &one, &live].iter().flat_map(|f| f.iter().map(seq)).collect();
        assert_eq!(seqs.last(), Some(&99));
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "consecutive: {seqs:?}");
        assert!(one.len() > 1 && two.len() > 1);
    }

    #[test]
    fn reopening_counts_the_existing_size_and_a_huge_line_gets_its_own_file() {
        let dir = tempfile::tempdir().expect("event file I/O");
        let path = dir.path().join("events.jsonl");
        emit_n(&mut EventStream::file_rotating(&path, 300, 1).expect("event file I/O"), 0, 2);
        let before = read_lines(&path).len();
        assert_eq!(before, 2);
        // A restart appends, and rotates as soon as the old content plus the
        // new line would pass the limit.
        let mut s = EventStream::file_rotating(&path, 300, 1).expect("event file I/O");
        emit_n(&mut s, 2, 1);
        assert_eq!(read_lines(&numbered(&path, 1)).len(), 2);
        assert_eq!(seq(&read_lines(&path)[0]), 2);
        s.emit(SystemTime::UNIX_EPOCH, &Event::MalformedRecord { error: "y".repeat(1000) }).expect("event file I/O");
        let huge = read_lines(&path);
        assert_eq!(huge.len(), 1, "the oversized line is alone and whole");
        assert_eq!(huge[0]["error"].as_str().map(str::len), Some(1000));
    }

    #[test]
    fn held_lines_wait_for_release_and_rotate_as_single_lines_do() {
        let dir = tempfile::tempdir().expect("event file I/O");
        let path = dir.path().join("events.jsonl");
        let max = 1000;
        let mut s = EventStream::file_rotating(&path, max, 5).expect("event file I/O");
        emit_n(&mut s, 0, 3);
        s.hold();
        emit_n(&mut s, 3, 20);
        assert_eq!(read_lines(&path).len(), 3, "held lines are not written before the release");
        s.release().expect("event file I/O");
        emit_n(&mut s, 23, 1);
        let files = [numbered(&path, 2), numbered(&path, 1), path.clone()];
        assert!(!numbered(&path, 3).exists(), "24 lines of about 120 bytes fill three files");
        for p in &files {
            let len = std::fs::metadata(p).expect("event file I/O").len();
            assert!(len <= max, "{} is {len} bytes, over {max}", p.display());
        }
        let seqs: Vec<u64> = files.iter().flat_map(|p| read_lines(p).iter().map(seq).collect::<Vec<_>>()).collect();
        assert_eq!(seqs, (0..24).collect::<Vec<_>>(), "every line once, in order, none split");
        assert!(read_lines(&numbered(&path, 1)).len() > 1, "rotated within the held lines");
        // Released, it writes each line at once again.
        emit_n(&mut s, 24, 1);
        assert_eq!(read_lines(&path).last().map(seq), Some(24));
    }

    #[test]
    fn keep_zero_truncates_instead_of_keeping_old_files() {
        let dir = tempfile::tempdir().expect("event file I/O");
        let path = dir.path().join("events.jsonl");
        let mut s = EventStream::file_rotating(&path, 200, 0).expect("event file I/O");
        emit_n(&mut s, 0, 10);
        assert_eq!(std::fs::read_dir(dir.path()).expect("event file I/O").count(), 1);
        assert_eq!(seq(read_lines(&path).last().expect("a line")), 9);
    }
}
