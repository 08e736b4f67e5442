//! Reading files a daemon does not control the type of: the agent's state files (the
//! checkpoint, the co-location state) and the DRA driver's CDI specs, which anyone with the host
//! path could replace, and the files it is pointed at (configuration, simulated topology, the
//! boot ID). Nothing read here can block (a FIFO), never end (`/dev/zero`) or fill the memory
//! (a huge file).

use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// Whether [`read_bounded`] follows a symbolic link at the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// Refused: a file the agent wrote itself is never a link (its state files).
    Refuse,
    /// Followed: a mounted ConfigMap's files are links.
    Follow,
}

/// The bytes of the regular file at `path`, at most `max` (`Ok(None)`: there is none). A FIFO,
/// a device, a directory, a file larger than `max` (or one that grows past it while read), and
/// with [`Links::Refuse`] a symbolic link, are errors saying so: nothing here can block or
/// fill the memory. The file is opened non-blocking and checked again once open, so that one
/// swapped in between the check and the open is caught too.
pub fn read_bounded(path: &Path, max: u64, links: Links) -> io::Result<Option<Vec<u8>>> {
    use std::io::Read as _;
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let kind = |t: fs::FileType| {
        use std::os::unix::fs::FileTypeExt as _;
        if t.is_symlink() {
            "a symbolic link"
        } else if t.is_dir() {
            "a directory"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_socket() {
            "a socket"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else {
            "not a regular file"
        }
    };
    let meta = match links {
        Links::Refuse => fs::symlink_metadata(path),
        Links::Follow => fs::metadata(path),
    };
    let meta = match meta {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_file() {
        return Err(invalid(format!("{} is {}", path.display(), kind(meta.file_type()))));
    }
    if meta.len() > max {
        return Err(invalid(format!(
            "{} holds {} bytes, more than the {max} accepted",
            path.display(),
            meta.len()
        )));
    }
    let mut flags = nix::libc::O_NONBLOCK;
    if links == Links::Refuse {
        flags |= nix::libc::O_NOFOLLOW;
    }
    let file = OpenOptions::new().read(true).custom_flags(flags).open(path)?;
    let opened = file.metadata()?;
    if !opened.file_type().is_file() {
        return Err(invalid(format!("{} is {}", path.display(), kind(opened.file_type()))));
    }
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(invalid(format!("{} grew past the {max} bytes accepted", path.display())));
    }
    Ok(Some(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 22, item 2: what may sit at a state path, and what a read of it gives.
    #[test]
    fn only_regular_files_within_the_cap_are_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let at = |name: &str| dir.path().join(name);
        std::fs::write(at("ok"), b"{}").expect("write");
        assert_eq!(read_bounded(&at("ok"), 16, Links::Refuse).expect("read"), Some(b"{}".to_vec()));
        assert_eq!(read_bounded(&at("absent"), 16, Links::Refuse).expect("none"), None);
        let made = std::process::Command::new("mkfifo").arg(at("fifo")).status();
        assert!(made.expect("mkfifo (coreutils)").success());
        std::os::unix::fs::symlink("/dev/zero", at("zero")).expect("symlink");
        std::os::unix::fs::symlink(at("ok"), at("link")).expect("symlink");
        std::fs::create_dir(at("dir")).expect("dir");
        std::fs::write(at("big"), vec![b'x'; 17]).expect("write");
        for (name, links, says) in [
            ("fifo", Links::Refuse, "is a FIFO"),
            ("fifo", Links::Follow, "is a FIFO"),
            ("zero", Links::Refuse, "is a symbolic link"),
            ("zero", Links::Follow, "is a device"),
            ("link", Links::Refuse, "is a symbolic link"),
            ("dir", Links::Refuse, "is a directory"),
            ("big", Links::Refuse, "holds 17 bytes, more than the 16 accepted"),
        ] {
            let err = read_bounded(&at(name), 16, links).expect_err(name);
            assert!(err.to_string().contains(says), "{name}: {err}");
        }
        // A ConfigMap's file is a link: followed where asked.
        assert_eq!(
            read_bounded(&at("link"), 16, Links::Follow).expect("read"),
            Some(b"{}".to_vec())
        );
    }
}
