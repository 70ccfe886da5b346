//! Which CRI socket to use: the configured one (`--cri-socket`, config key
//! `cri_socket`), else the first known default that exists.

use std::{
    fmt,
    os::unix::fs::FileTypeExt as _,
    path::{Path, PathBuf},
};

/// containerd, then CRI-O: where their packages put the CRI socket.
pub const DEFAULT_SOCKETS: &[&str] = &["/run/containerd/containerd.sock", "/var/run/crio/crio.sock"];

/// The configured value that turns the runtime off.
pub const OFF: &str = "none";

/// The outcome of socket discovery, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketChoice {
    /// Named by the configuration.
    Configured(PathBuf),
    /// Found at a default path.
    Found(PathBuf),
    /// Turned off by the configuration (`cri_socket = "none"`).
    Off,
    /// None given and none of the defaults exists.
    NotFound { tried: Vec<PathBuf> },
}

impl SocketChoice {
    #[must_use]
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Configured(p) | Self::Found(p) => Some(p),
            Self::Off | Self::NotFound { .. } => None,
        }
    }
}

impl fmt::Display for SocketChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Configured(p) => write!(f, "{} (configured)", p.display()),
            Self::Found(p) => write!(f, "{} (found)", p.display()),
            Self::Off => write!(f, "turned off (cri_socket = \"{OFF}\")"),
            Self::NotFound { tried } => {
                let tried: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
                write!(
                    f,
                    "no CRI socket at {}; set cri_socket (--cri-socket) if the runtime listens elsewhere",
                    tried.join(", ")
                )
            }
        }
    }
}

fn is_socket(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

/// The configured socket wins, whether or not it exists yet (a runtime may
/// start after netreap); else the first default that is a socket.
#[must_use]
pub fn choose(configured: Option<&Path>) -> SocketChoice {
    choose_among(configured, DEFAULT_SOCKETS.iter().map(PathBuf::from))
}

fn choose_among(configured: Option<&Path>, defaults: impl Iterator<Item = PathBuf>) -> SocketChoice {
    match configured {
        Some(p) if p.as_os_str() == OFF => SocketChoice::Off,
        Some(p) => SocketChoice::Configured(p.to_path_buf()),
        None => {
            let tried: Vec<PathBuf> = defaults.collect();
            match tried.iter().find(|p| is_socket(p)) {
                Some(p) => SocketChoice::Found(p.clone()),
                None => SocketChoice::NotFound { tried },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_wins_then_the_first_default_socket() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("not-a-socket");
        std::fs::write(&plain, "").unwrap();
        let sock = dir.path().join("crio.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let defaults = || vec![dir.path().join("missing.sock"), plain.clone(), sock.clone()].into_iter();
        assert_eq!(choose_among(None, defaults()), SocketChoice::Found(sock.clone()));
        let named = Path::new("/somewhere/else.sock");
        assert_eq!(choose_among(Some(named), defaults()), SocketChoice::Configured(named.to_path_buf()));
        assert_eq!(choose_among(Some(Path::new("none")), defaults()), SocketChoice::Off);
        let none = choose_among(None, vec![plain.clone()].into_iter());
        assert!(matches!(&none, SocketChoice::NotFound { tried } if tried == &vec![plain.clone()]));
        assert!(none.to_string().contains("--cri-socket"), "{none}");
    }
}
