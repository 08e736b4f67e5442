//! A fake CUDA driver library for the agent's MPS client probe
//! (`baleen_agent::isolation::mps::client_probe`), compiled from `tests/fake-cuda/fake_cuda.c`
//! into a temp dir of its own, so that a probe's client runs without a GPU. What it does is
//! described at the top of the C source: an MPS client (its free memory bounded by the limit)
//! where the pipe directory's fake daemon answers, the whole GPU free where none does, and
//! directives to fail, hang or ignore MPS. Each probe's environment is logged beside it.

use std::path::{Path, PathBuf};

/// The C source of the fake library.
pub const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fake-cuda/fake_cuda.c");

/// One compiled copy of the fake library.
pub struct FakeCuda {
    dir: tempfile::TempDir,
}

impl FakeCuda {
    /// Compiles the library with `$CC` (default `cc`).
    pub fn new() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let library = dir.path().join("libcuda.so.1");
        crate::tools::compile_shared_library(SOURCE, &library, "the fake CUDA library")?;
        Ok(Self { dir })
    }

    /// The library's path (what `health.cudaLibrary` names).
    pub fn library(&self) -> PathBuf {
        self.dir.path().join("libcuda.so.1")
    }

    /// Sets the directive (`fail`, `hang`, `nomps`, or `""` for none).
    pub fn set_directive(&self, word: &str) -> anyhow::Result<()> {
        std::fs::write(self.dir.path().join("fake-cuda-directives"), word)?;
        Ok(())
    }

    /// The probes so far, one line each (see the C source).
    pub fn probes(&self) -> Vec<String> {
        let log = self.dir.path().join("fake-cuda.log");
        std::fs::read_to_string(log)
            .map(|t| t.lines().map(str::to_owned).collect())
            .unwrap_or_default()
    }

    /// The directory the library is in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
