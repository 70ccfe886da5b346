//! The event stream: one JSON object per line, to stdout or a file.
//!
//! Schema (stable): every line has `time` (RFC 3339, UTC) and `event`
//! (snake_case name); the other fields depend on `event` and are documented
//! in README.md.

use std::{
    fs::{File, OpenOptions},
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
    time::SystemTime,
};

use serde::Serialize;
use serde_json::{Map, Value};

use super::clock::rfc3339;

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("event file {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("writing an event: {0}")]
    Write(#[from] io::Error),
    #[error("encoding an event: {0}")]
    Encode(#[from] serde_json::Error),
}

enum Target {
    Stdout(io::Stdout),
    File(BufWriter<File>),
}

/// Writes events as JSON lines; each line is flushed, so a crash loses none.
pub struct EventStream {
    target: Target,
}

impl EventStream {
    #[must_use]
    pub fn stdout() -> Self {
        Self { target: Target::Stdout(io::stdout()) }
    }

    /// Appends to `path` (created if missing).
    pub fn file(path: &Path) -> Result<Self, StreamError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| StreamError::Open { path: path.to_path_buf(), source })?;
        Ok(Self { target: Target::File(BufWriter::new(file)) })
    }

    /// `-` is stdout; anything else a file.
    pub fn open(spec: &str) -> Result<Self, StreamError> {
        if spec == "-" { Ok(Self::stdout()) } else { Self::file(Path::new(spec)) }
    }

    /// Writes `{"time":..., "event": name, ...fields of payload}`.
    pub fn emit<T: Serialize>(&mut self, time: SystemTime, event: &str, payload: &T) -> Result<(), StreamError> {
        let mut line = Map::new();
        line.insert("time".into(), Value::String(rfc3339(time)));
        line.insert("event".into(), Value::String(event.to_owned()));
        match serde_json::to_value(payload)? {
            Value::Object(fields) => line.extend(fields),
            Value::Null => {}
            other => {
                line.insert("value".into(), other);
            }
        }
        let mut bytes = serde_json::to_vec(&Value::Object(line))?;
        bytes.push(b'\n');
        match &mut self.target {
            Target::Stdout(out) => {
                let mut out = out.lock();
                out.write_all(&bytes)?;
                out.flush()?;
            }
            Target::File(file) => {
                file.write_all(&bytes)?;
                file.flush()?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_json_with_time_and_event() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let mut s = EventStream::file(&path).unwrap();
        s.emit(SystemTime::UNIX_EPOCH, "netns_entered", &serde_json::json!({"netns_inode": 5})).unwrap();
        s.emit(SystemTime::UNIX_EPOCH, "probe_drops", &3u64).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["event"], "netns_entered");
        assert_eq!(lines[0]["netns_inode"], 5);
        assert_eq!(lines[0]["time"], "1970-01-01T00:00:00.000Z");
        assert_eq!(lines[1]["value"], 3);
    }
}
