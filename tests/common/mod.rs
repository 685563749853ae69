//! What the root integration tests share: a scratch directory per test.
#![allow(dead_code)]

use std::path::PathBuf;

/// A scratch directory for one test (under the system's temp dir, named after the test binary,
/// the test and the process), emptied when made and removed at the end.
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// A fresh directory for the test `name`.
    pub fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "{}-{name}-{}",
            env!("CARGO_CRATE_NAME"),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// The path of `f` inside the directory.
    pub fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }

    /// [`Self::path`] as a string (for command-line arguments).
    pub fn s(&self, f: &str) -> String {
        self.path(f).to_string_lossy().into_owned()
    }

    /// Writes `text` to `name` inside the directory; its path.
    pub fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
