//! One MPS server serves one Linux user at a time: a client of another user waits, silently,
//! until every client of the current user has exited (GPU days, E6 and D). The device-plugin API
//! does not say which pod an Allocate is for, so the agent cannot refuse to put two users on one
//! GPU; instead it reads what the control daemon logs (`<log dir>/control.log`) and reports each
//! client that waits for another user's server, once, at WARN, naming both users. The lines it
//! reads, as the real daemon wrote them on the GPU day:
//!
//! ```text
//! [2026-11-30 21:41:32.773 Control   611] Starting new server 611 for user 0
//! [2026-11-30 21:41:40.742 Control   564] NEW CLIENT 671 from user 1000: Server is not ready, push client to pending list
//! [2026-11-30 21:41:53.425 Control   564] Server 611 exited with status 0
//! ```

use std::collections::BTreeMap;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::Path;

/// A client waiting for another user's server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// The client's process ID.
    pub client_pid: u32,
    /// The client's user.
    pub client_user: u32,
    /// The user the running server serves.
    pub server_user: u32,
}

/// What has been read of one daemon's control log.
#[derive(Debug, Default)]
pub struct LogReader {
    offset: u64,
    partial: String,
    /// Running servers: PID to user.
    servers: BTreeMap<u32, u32>,
}

impl LogReader {
    /// Reads what was appended to `control_log` since the last call; the clients that started
    /// waiting for another user's server in it.
    pub fn read(&mut self, control_log: &Path) -> Vec<Waiting> {
        let Ok(mut file) = std::fs::File::open(control_log) else { return Vec::new() };
        let len = file.metadata().map_or(0, |m| m.len());
        if len < self.offset {
            // A new log (the daemon was restarted over a removed file).
            *self = Self::default();
        }
        let mut text = String::new();
        if file.seek(SeekFrom::Start(self.offset)).is_err()
            || file.read_to_string(&mut text).is_err()
        {
            return Vec::new();
        }
        self.offset += text.len() as u64;
        let text = std::mem::take(&mut self.partial) + &text;
        let (complete, rest) = match text.rfind('\n') {
            Some(end) => text.split_at(end + 1),
            None => ("", text.as_str()),
        };
        self.partial = rest.to_owned();
        complete.lines().filter_map(|line| self.line(line)).collect()
    }

    /// Follows one log line; a waiting client if it starts waiting for another user's server.
    pub fn line(&mut self, line: &str) -> Option<Waiting> {
        let message = line.split_once("] ").map_or(line, |(_, m)| m);
        let words: Vec<&str> = message.split_whitespace().collect();
        match words.as_slice() {
            // A new control daemon: the servers of the one before it are gone with it.
            ["Starting", "control", "daemon", ..] => {
                self.servers.clear();
                None
            }
            ["Starting", "new", "server", pid, "for", "user", user, ..] => {
                self.servers.insert(pid.parse().ok()?, user.parse().ok()?);
                None
            }
            ["Server", pid, "exited", ..] => {
                self.servers.remove(&pid.parse().ok()?);
                None
            }
            ["NEW", "CLIENT", pid, "from", "user", user, rest @ ..]
                if rest.contains(&"pending") =>
            {
                let client_user: u32 = user.trim_end_matches(':').parse().ok()?;
                let server_user = self.servers.values().copied().find(|&u| u != client_user)?;
                Some(Waiting { client_pid: pid.parse().ok()?, client_user, server_user })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real daemon's log of the third GPU day: one client of user 1000 waited for user 0's
    /// server; the clients of user 0 that waited for their own server's start are not reported.
    #[test]
    fn the_gpu_days_second_user_is_found_in_the_real_log() {
        let log = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/gpu-day-2026-11-30-agent-mps/control.log");
        let mut reader = LogReader::default();
        let waiting = reader.read(&log);
        assert_eq!(waiting, [Waiting { client_pid: 671, client_user: 1000, server_user: 0 }]);
        assert!(reader.read(&log).is_empty(), "read once");
    }

    #[test]
    fn lines_are_followed_across_reads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("control.log");
        let mut reader = LogReader::default();
        std::fs::write(
            &log,
            "[t Control 1] Starting new server 9 for user 0\n[t Control 1] NEW CLIENT 5 from us",
        )
        .expect("write");
        assert!(reader.read(&log).is_empty());
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).expect("open");
        std::io::Write::write_all(
            &mut f,
            b"er 7: Server is not ready, push client to pending list\n",
        )
        .expect("append");
        assert_eq!(
            reader.read(&log),
            [Waiting { client_pid: 5, client_user: 7, server_user: 0 }],
            "a line split across two reads"
        );
    }
}
