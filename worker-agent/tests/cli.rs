//! The binary's command line: `--help`, `--check-config` on a good and a bad file, and a
//! SIGTERM that drains and removes the worker from the registry.

use std::process::{Command, Stdio};
use std::time::Duration;

use metronome_testkit::{wait_for, ChildGuard, NatsServer, RedisServer};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_metronome-worker-agent"))
}

#[test]
fn help_names_the_main_flags() {
    let out = bin().arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--config",
        "--check-config",
        "--worker-id",
        "--model-server-url",
        "NATS_URL",
    ] {
        assert!(text.contains(flag), "{flag} missing from --help:\n{text}");
    }
}

#[test]
fn check_config_prints_the_effective_config_or_every_error() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "worker_id = \"n1-gpu0\"\nmodel = \"m\"\nmodel_server_kind = \"sglang\"\n",
    )
    .unwrap();
    let out = bin()
        .args(["--check-config", "--config"])
        .arg(&good)
        .env("NATS_URL", "nats://127.0.0.1:14222")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("nats_url = \"nats://127.0.0.1:14222\""),
        "{text}"
    );
    assert!(text.contains("model_server_kind = \"sglang\""), "{text}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "worker_id = \"a.b\"\nmax_concurrency = 0\n").unwrap();
    let out = bin()
        .args(["--check-config", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for field in ["worker_id", "model", "max_concurrency"] {
        assert!(
            err.contains(&format!("{field}:")),
            "{field} missing:\n{err}"
        );
    }
}

#[test]
fn sigterm_drains_and_leaves_the_registry() {
    let nats = NatsServer::start().expect("nats-server");
    let redis = RedisServer::start().expect("redis-server");
    let mut cmd = bin();
    cmd.args(["--worker-id", "cli-gpu0", "--model", "m"])
        // Nothing listens there: the model server is reported unhealthy, the agent still runs.
        .args(["--model-server-url", "http://127.0.0.1:9"])
        .env("NATS_URL", nats.url())
        .env("REDIS_URL", redis.url())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut agent = ChildGuard::spawn("worker-agent", cmd).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = async_nats::connect(nats.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        wait_for(
            "the agent's heartbeat in the workers bucket",
            Duration::from_secs(15),
            || {
                let js = js.clone();
                async move {
                    let kv = js.get_key_value("workers").await.ok()?;
                    kv.get("cli-gpu0").await.ok()?.map(|_| ())
                }
            },
        )
        .await;
    });
    assert!(
        agent.signal_and_wait(15, Duration::from_secs(15)),
        "exits after SIGTERM"
    );
    rt.block_on(async {
        let client = async_nats::connect(nats.url()).await.unwrap();
        let kv = async_nats::jetstream::new(client)
            .get_key_value("workers")
            .await
            .unwrap();
        assert_eq!(
            kv.get("cli-gpu0").await.unwrap(),
            None,
            "key removed on exit"
        );
    });
}

/// `METRONOME_NATS_*` and `METRONOME_REDIS_*` reach the agent: the identity from the
/// environment is the one it connects as, and a TLS file named there is checked at start.
#[test]
fn nats_and_redis_settings_come_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(&good, "worker_id = \"n1-gpu0\"\nmodel = \"m\"\n").unwrap();
    metronome_testkit::assert_nats_and_redis_settings_from_env(
        || {
            let mut c = bin();
            c.args(["--check-config", "--config"]).arg(&good);
            c
        },
        "worker-n1-gpu0",
    );
}
