//! [`Scratch`]: a fresh temporary directory per test, removed on drop.

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh, empty directory under the system's temp dir, removed with its contents on drop.
/// It derefs to its [`Path`], so `scratch.join("x")` and `&scratch` as a `&Path` work.
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// Creates `r3-{name}-{pid}-{n}` under the temp dir (emptied first if a crashed run left
    /// it). `n` counts the scratch dirs of this process, so two tests that pick the same name
    /// still get directories of their own.
    ///
    /// # Panics
    /// When the directory cannot be created: a test cannot run without it.
    pub fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("r3-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("create scratch dir {}: {e}", dir.display()));
        Scratch(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Best effort: a file still open on some systems must not fail the test.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::Scratch;

    #[test]
    fn fresh_distinct_and_removed_on_drop() {
        let a = Scratch::new("support-test");
        let b = Scratch::new("support-test");
        assert_ne!(a.path(), b.path());
        assert!(a.is_dir());
        assert_eq!(std::fs::read_dir(&a).expect("read").count(), 0);
        std::fs::write(a.join("file"), b"x").expect("write");
        let kept = a.path().to_path_buf();
        drop(a);
        assert!(!kept.exists());
        assert!(b.is_dir());
    }
}
