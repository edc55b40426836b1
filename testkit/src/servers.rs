//! `nats-server -js` and `redis-server` on free ports, optionally with extra configuration
//! (users, permissions, ACLs) for tests of authentication; without it they accept anyone,
//! as most tests want.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::error::TestkitError;
use crate::process::find_binary;

const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// A free TCP port on 127.0.0.1 (bound then released). For several ports at once use
/// [`free_ports`]: the OS may hand a released port out again at once.
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free TCP ports on 127.0.0.1, each held bound until all are found. Bound
/// and released one at a time, two of them came out equal (a test's two simulated GPUs
/// were given one port, and the simulator refused its configuration).
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("binding 127.0.0.1:0"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().expect("a bound listener's address").port())
        .collect()
}

fn two_free_ports() -> [u16; 2] {
    let p = free_ports(2);
    [p[0], p[1]]
}

/// Start `server`, on new free ports when the ones it was given were taken meanwhile: a
/// port [`free_port`] found is free only until someone binds it, and with the whole suite
/// starting servers in parallel another test's server sometimes does first.
fn spawn_on_free_ports<S>(
    server: &mut S,
    spawn: impl Fn(&mut S) -> Result<(), TestkitError>,
    new_ports: impl Fn(&mut S),
) -> Result<(), TestkitError> {
    const TRIES: usize = 5;
    for _ in 1..TRIES {
        match spawn(server) {
            Err(TestkitError::NotReady { log, .. })
                if log.to_lowercase().contains("address already in use") =>
            {
                new_ports(server)
            }
            other => return other,
        }
    }
    spawn(server)
}

pub(crate) fn read_log(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

fn http_get_ok(port: u16, path: &str) -> bool {
    http_get_body(port, path).is_some()
}

/// The body of a `200` answer to `GET path` on 127.0.0.1:`port`, or `None`.
pub(crate) fn http_get_body(port: u16, path: &str) -> Option<String> {
    let mut s =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
            .ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    if !(buf.starts_with("HTTP/1.1 200") || buf.starts_with("HTTP/1.0 200")) {
        return None;
    }
    Some(
        buf.split_once("\r\n\r\n")
            .map_or(String::new(), |(_, b)| b.to_string()),
    )
}

/// Alive means answering: `+PONG`, or `-NOAUTH` from a server whose default user is off.
fn redis_ping(port: u16) -> bool {
    let Ok(mut s) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
    else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG") || buf[..n].starts_with(b"-NOAUTH"))
}

pub(crate) fn wait_ready(
    what: &str,
    log: &Path,
    child: &mut Child,
    mut ready: impl FnMut() -> bool,
) -> Result<(), TestkitError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    while Instant::now() < deadline {
        if ready() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(TestkitError::NotReady {
                what: format!("{what} (exited with {status})"),
                timeout: READY_TIMEOUT,
                log: read_log(log),
            });
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    Err(TestkitError::NotReady {
        what: what.to_string(),
        timeout: READY_TIMEOUT,
        log: read_log(log),
    })
}

pub(crate) fn kill_child(child: &mut Option<Child>, signal: i32) {
    if let Some(mut c) = child.take() {
        // SIGTERM lets the server flush; SIGKILL simulates a crash.
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(c.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A real `nats-server` with JetStream, on a free port, storing under a temporary folder.
pub struct NatsServer {
    port: u16,
    monitor_port: u16,
    dir: TempDir,
    binary: PathBuf,
    extra_config: String,
    child: Option<Child>,
}

impl NatsServer {
    /// Start a server; fails with an install hint when `nats-server` is missing.
    pub fn start() -> Result<Self, TestkitError> {
        Self::start_with_config("")
    }

    /// Start a server whose config file also holds `extra_config` (nats-server syntax,
    /// e.g. an `authorization { users = [...] }` block).
    pub fn start_with_config(extra_config: &str) -> Result<Self, TestkitError> {
        let binary = find_binary("nats-server", "nats-server")?;
        let dir = tempfile::Builder::new()
            .prefix("metronome-nats-")
            .tempdir()
            .map_err(|source| TestkitError::Io {
                what: "temporary folder".into(),
                source,
            })?;
        let [port, monitor_port] = two_free_ports();
        let mut server = NatsServer {
            port,
            monitor_port,
            dir,
            binary,
            extra_config: extra_config.to_string(),
            child: None,
        };
        spawn_on_free_ports(&mut server, NatsServer::spawn, |s| {
            [s.port, s.monitor_port] = two_free_ports();
        })?;
        Ok(server)
    }

    /// Start a server that requires TLS with `ca`'s server certificate (and, with
    /// `verify_clients`, a client certificate signed by `ca`); `extra_config` as in
    /// [`NatsServer::start_with_config`].
    pub fn start_tls(
        extra_config: &str,
        ca: &crate::TestCa,
        verify_clients: bool,
    ) -> Result<Self, TestkitError> {
        Self::start_with_config(&format!("{}{extra_config}", ca.nats_config(verify_clients)))
    }

    fn spawn(&mut self) -> Result<(), TestkitError> {
        let log = self.dir.path().join("nats.log");
        let store = self.dir.path().join("js");
        // As in production: jobs carry whole prompts, larger than NATS's 1 MiB default.
        let conf = self.dir.path().join("nats.conf");
        std::fs::write(&conf, format!("max_payload: 8MB\n{}\n", self.extra_config)).map_err(
            |source| TestkitError::Io {
                what: "nats.conf".into(),
                source,
            },
        )?;
        let mut child = Command::new(&self.binary)
            .arg("-c")
            .arg(&conf)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-m", &self.monitor_port.to_string()])
            .arg("-js")
            .arg("-sd")
            .arg(&store)
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| TestkitError::Io {
                what: "nats-server".into(),
                source,
            })?;
        let monitor = self.monitor_port;
        let result = wait_ready("nats-server", &log, &mut child, || {
            http_get_ok(monitor, "/healthz?js-enabled=true")
        });
        self.child = Some(child);
        result
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id while it runs (a benchmark reads its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stop gracefully (SIGTERM); the JetStream data stays for [`NatsServer::restart`].
    pub fn stop(&mut self) {
        kill_child(&mut self.child, 15);
    }

    /// Kill without warning (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        kill_child(&mut self.child, 9);
    }

    /// Start again on the same port with the same storage.
    pub fn restart(&mut self) -> Result<(), TestkitError> {
        self.stop();
        self.spawn()
    }

    /// The last lines of the server's log, for test failure messages.
    pub fn log_tail(&self) -> String {
        read_log(&self.dir.path().join("nats.log"))
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        kill_child(&mut self.child, 9);
    }
}

/// A real `redis-server` on a free port, persisting (append-only) under a temporary
/// folder so a restart keeps the data.
pub struct RedisServer {
    port: u16,
    /// The TLS port, for a server started by [`RedisServer::start_tls`].
    tls_port: Option<u16>,
    dir: TempDir,
    binary: PathBuf,
    extra_config: String,
    child: Option<Child>,
}

impl RedisServer {
    /// Start a server; fails with an install hint when `redis-server` is missing.
    pub fn start() -> Result<Self, TestkitError> {
        Self::start_with_config("")
    }

    /// Start a server whose config file holds `extra_config` (redis.conf syntax, e.g.
    /// ACL `user` lines).
    pub fn start_with_config(extra_config: &str) -> Result<Self, TestkitError> {
        let binary = find_binary("redis-server", "redis-server")?;
        let dir = tempfile::Builder::new()
            .prefix("metronome-redis-")
            .tempdir()
            .map_err(|source| TestkitError::Io {
                what: "temporary folder".into(),
                source,
            })?;
        let mut server = RedisServer {
            port: free_port(),
            tls_port: None,
            dir,
            binary,
            extra_config: extra_config.to_string(),
            child: None,
        };
        spawn_on_free_ports(&mut server, RedisServer::spawn, |s| s.port = free_port())?;
        Ok(server)
    }

    /// Start a server that also serves TLS on a second port ([`RedisServer::tls_url`])
    /// with `ca`'s server certificate, accepting clients with or without a certificate
    /// (`tls-auth-clients optional`). The plain port stays open on 127.0.0.1 only for the
    /// readiness check, which speaks plain RESP.
    pub fn start_tls(extra_config: &str, ca: &crate::TestCa) -> Result<Self, TestkitError> {
        let tls_port = free_port();
        let tls = format!(
            "tls-port {tls_port}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\ntls-auth-clients optional\n",
            ca.server_cert().display(),
            ca.server_key().display(),
            ca.ca_file().display()
        );
        let mut server = Self::start_with_config(&format!("{tls}{extra_config}"))?;
        server.tls_port = Some(tls_port);
        Ok(server)
    }

    fn spawn(&mut self) -> Result<(), TestkitError> {
        let log = self.dir.path().join("redis.log");
        let conf = self.dir.path().join("redis.conf");
        std::fs::write(&conf, &self.extra_config).map_err(|source| TestkitError::Io {
            what: "redis.conf".into(),
            source,
        })?;
        let mut child = Command::new(&self.binary)
            .arg(&conf)
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--appendonly", "yes", "--save", "", "--daemonize", "no"])
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| TestkitError::Io {
                what: "redis-server".into(),
                source,
            })?;
        let port = self.port;
        let result = wait_ready("redis-server", &log, &mut child, || redis_ping(port));
        self.child = Some(child);
        result
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// `redis://<user>:<password>@127.0.0.1:<port>/`.
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!("redis://{user}:{password}@127.0.0.1:{}/", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `rediss://127.0.0.1:<tls port>/`, for a server started by [`RedisServer::start_tls`].
    ///
    /// # Panics
    ///
    /// When the server was started without TLS.
    pub fn tls_url(&self) -> String {
        format!(
            "rediss://127.0.0.1:{}/",
            self.tls_port.expect("a server started with start_tls")
        )
    }

    /// Stop gracefully; the append-only file stays for [`RedisServer::restart`].
    pub fn stop(&mut self) {
        kill_child(&mut self.child, 15);
    }

    /// Kill without warning.
    pub fn kill(&mut self) {
        kill_child(&mut self.child, 9);
    }

    /// Start again on the same port with the same data.
    pub fn restart(&mut self) -> Result<(), TestkitError> {
        self.stop();
        self.spawn()
    }

    pub fn log_tail(&self) -> String {
        read_log(&self.dir.path().join("redis.log"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        kill_child(&mut self.child, 9);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nats_starts_stops_and_restarts_on_the_same_port() {
        let mut nats = NatsServer::start().expect("nats-server");
        let port = nats.port();
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        nats.stop();
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
        nats.restart().expect("restart");
        assert_eq!(nats.port(), port);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    }

    #[test]
    fn redis_answers_ping_and_survives_a_kill() {
        let mut redis = RedisServer::start().expect("redis-server");
        assert!(redis_ping(redis.port()));
        redis.kill();
        assert!(!redis_ping(redis.port()));
        redis.restart().expect("restart");
        assert!(redis_ping(redis.port()));
    }
}
