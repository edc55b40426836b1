//! Stopping, killing and restarting the processes of a running system (drills and the
//! fairness benchmark both do) by their pid files under `<state>/run/`: a restarted process
//! gets the command line, environment and working folder of the one it replaces (read from
//! `/proc`), its log appended, and its new pid written back, so a later run finds it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

pub fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()?;
    if !status.success() {
        bail!("kill -{sig} {pid} failed");
    }
    Ok(())
}

pub fn stop_restarted(pids: &[u32]) {
    for pid in pids.iter().rev() {
        let _ = signal(*pid, "TERM");
    }
    // A process that does not end on SIGTERM within 5 s (an agent whose NATS is already
    // gone waits for it) is killed: a drill leaves nothing running behind it.
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && pids.iter().any(|p| alive(*p)) {
        std::thread::sleep(Duration::from_millis(100));
    }
    for pid in pids {
        if alive(*pid) {
            let _ = signal(*pid, "KILL");
        }
    }
}

/// Whether `pid` runs (an exited child not yet reaped, a zombie, does not).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next())
        })
        .is_some_and(|state| state != 'Z')
}

/// What it takes to start a process again as it was.
pub struct Image {
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
}

impl Image {
    pub fn read(pid: u32) -> anyhow::Result<Image> {
        let split = |bytes: Vec<u8>| -> Vec<String> {
            // NUL-terminated entries; an empty argument (`--save ""`) is kept.
            let body = bytes.strip_suffix(&[0]).unwrap_or(&bytes);
            if body.is_empty() {
                return Vec::new();
            }
            body.split(|b| *b == 0)
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        };
        let argv = split(std::fs::read(format!("/proc/{pid}/cmdline"))?);
        let env = split(std::fs::read(format!("/proc/{pid}/environ"))?)
            .into_iter()
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.into(), v.into())))
            .collect();
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))?;
        if argv.is_empty() {
            bail!("process {pid} has no command line");
        }
        Ok(Image { argv, env, cwd })
    }

    /// redis-server rewrites its command line (`redis-server 127.0.0.1:PORT`), so its
    /// arguments are rebuilt as `./dev up` passes them, with the port from the env file.
    pub fn redis(pid: u32, state_dir: &Path) -> anyhow::Result<Image> {
        let mut image = Image::read(pid)?;
        let env = read_env(&state_dir.join("env"))?;
        let url = env.get("REDIS_URL").context("REDIS_URL in the env file")?;
        let port = url
            .trim_end_matches('/')
            .rsplit(':')
            .next()
            .context("a port in REDIS_URL")?
            .to_string();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))?;
        let dir = state_dir.join("redis");
        image.argv = vec![
            exe.display().to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port,
            "--dir".into(),
            dir.display().to_string(),
            "--appendonly".into(),
            "yes".into(),
            "--save".into(),
            String::new(),
            "--maxmemory".into(),
            "256mb".into(),
            "--maxmemory-policy".into(),
            "noeviction".into(),
        ];
        Ok(image)
    }

    /// Start it again, appending to `<state>/logs/<name>.log`, and record its pid.
    pub fn spawn(&self, state_dir: &Path, name: &str) -> anyhow::Result<u32> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(state_dir.join(format!("logs/{name}.log")))?;
        let child = std::process::Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.cwd)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("restarting {name}"))?;
        let pid = child.id();
        std::fs::write(state_dir.join(format!("run/{name}.pid")), pid.to_string())?;
        Ok(pid)
    }
}

pub fn read_env(path: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect())
}
