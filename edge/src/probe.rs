//! The exec probe: `baleen-agent probe URL` and `baleen-extender probe URL` GET a daemon's
//! probe endpoint from inside its own container, where the probe listener is bound on the
//! loopback address (a tenant cannot reach it, so cannot fill it), and exit 0 for a 2xx answer,
//! 1 otherwise, printing the answer or why there was none. The kubelet runs it as an `exec`
//! probe; an `httpGet` probe would connect from outside the pod, to a port any pod can reach.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The most of an answer read.
const MAX_ANSWER: u64 = 64 * 1024;

/// Why a probe got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The URL is not `http://<IP>:<port><path>`.
    #[error("{0:?} is not http://<IP address>:<port>/<path>")]
    Url(String),
    /// Connecting, writing or reading.
    #[error("{url}: {source}")]
    Io {
        /// The URL.
        url: String,
        /// What failed.
        source: std::io::Error,
    },
    /// The answer is not HTTP.
    #[error("{url}: not an HTTP answer: {start:?}")]
    NotHttp {
        /// The URL.
        url: String,
        /// Its first line.
        start: String,
    },
}

/// GETs `url` (`http://<IP>:<port><path>`) within `timeout` for each of connecting, writing
/// and reading: its status and body.
pub fn get(url: &str, timeout: Duration) -> Result<(u16, String), ProbeError> {
    let bad = || ProbeError::Url(url.to_owned());
    let rest = url.strip_prefix("http://").ok_or_else(bad)?;
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, "/"),
    };
    let address: SocketAddr = authority.parse().map_err(|_| bad())?;
    let io = |source| ProbeError::Io { url: url.to_owned(), source };
    let mut stream = TcpStream::connect_timeout(&address, timeout).map_err(io)?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(io)?;
    let mut answer = Vec::new();
    stream.take(MAX_ANSWER).read_to_end(&mut answer).map_err(io)?;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let first = head.lines().next().unwrap_or_default();
    let status = first
        .strip_prefix("HTTP/1.")
        .and_then(|r| r.get(2..5))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| ProbeError::NotHttp { url: url.to_owned(), start: first.to_owned() })?;
    Ok((status, body.to_owned()))
}

/// Runs the probe command: prints the answer (or why there was none) and gives the exit code,
/// 0 for a 2xx answer within `timeout`.
pub fn run(url: &str, timeout: Duration) -> u8 {
    match get(url, timeout) {
        Ok((status, body)) => {
            println!("{status} {}", body.trim_end());
            u8::from(!(200..300).contains(&status))
        }
        Err(e) => {
            eprintln!("probe: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_reads_the_status_and_refuses_what_is_not_a_url() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let server = std::thread::spawn(move || {
            for answer in
                ["HTTP/1.1 200 OK\r\n\r\nok\n", "HTTP/1.1 503 X\r\n\r\nstarting\n", "junk"]
            {
                let (mut s, _) = listener.accept().expect("accept");
                let mut buf = [0u8; 1024];
                let n = s.read(&mut buf).expect("read");
                assert!(buf[..n].starts_with(b"GET /readyz HTTP/1.1\r\n"));
                s.write_all(answer.as_bytes()).expect("write");
            }
        });
        let url = format!("http://{address}/readyz");
        let second = Duration::from_secs(5);
        assert_eq!(get(&url, second).expect("answer"), (200, "ok\n".into()));
        assert_eq!(run(&url, second), 1, "503");
        assert!(matches!(get(&url, second), Err(ProbeError::NotHttp { .. })));
        server.join().expect("server");
        assert!(matches!(get("https://x/", second), Err(ProbeError::Url(_))));
        assert!(matches!(get("http://localhost:1/", second), Err(ProbeError::Url(_))));
        // Nothing listening: said, exit 1.
        assert_eq!(run(&url, second), 1);
    }
}
