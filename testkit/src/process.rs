//! Binaries: system ones found on PATH (or in /usr/sbin, /usr/bin) with an install hint
//! when missing, and Metronome's own run as child processes, killed on drop.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::error::TestkitError;

/// A system binary (`nats-server`, `redis-server`, `openssl`): on PATH, or in /usr/sbin or
/// /usr/bin; missing, an error naming the Debian package that installs it.
pub(crate) fn find_binary(
    binary: &'static str,
    package: &'static str,
) -> Result<PathBuf, TestkitError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(binary))
        .find(|p| p.is_file())
        .ok_or(TestkitError::MissingBinary { binary, package })
}

/// Path of a workspace binary built next to the running test executable
/// (`target/<profile>/<name>`). Panics with a build hint when it is missing.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current test executable");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: build the workspace binaries first (`cargo build --workspace --bins`, which `./dev test` does)",
        path.display()
    );
    path
}

/// A child process that is killed when dropped, so a failing test leaves nothing behind.
pub struct ChildGuard {
    name: String,
    child: Option<Child>,
}

impl ChildGuard {
    /// Spawn `command`, naming it for messages.
    pub fn spawn(name: &str, mut command: Command) -> std::io::Result<Self> {
        let child = command.spawn()?;
        Ok(ChildGuard {
            name: name.to_string(),
            child: Some(child),
        })
    }

    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Send a signal (15 = SIGTERM for a graceful stop, 9 = SIGKILL for a crash) and wait
    /// up to `timeout` for the exit. Returns whether it exited.
    pub fn signal_and_wait(&mut self, signal: i32, timeout: Duration) -> bool {
        let Some(child) = self.child.as_mut() else {
            return true;
        };
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status();
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                self.child = None;
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_binary_names_the_package_to_install() {
        let err = find_binary("metronome-no-such-binary", "some-package").unwrap_err();
        assert!(
            err.to_string().contains("apt-get install -y some-package"),
            "{err}"
        );
    }
}
