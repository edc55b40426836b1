//! The binary's command line: `--check-config` prints the effective configuration and
//! exits 0, or prints every invalid field and exits 2; `--help` describes the flags.

use std::process::Command;

fn dispatcher() -> Command {
    Command::new(env!("CARGO_BIN_EXE_metronome-dispatcher"))
}

#[test]
fn check_config_prints_the_effective_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ok.toml");
    std::fs::write(
        &path,
        "queue_bound_per_model = 42\n[scheduler]\nheartbeat_timeout_ms = 5000\n",
    )
    .unwrap();
    let out = dispatcher()
        .arg("--config")
        .arg(&path)
        .arg("--check-config")
        .env("NATS_URL", "nats://10.1.2.3:4222")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("queue_bound_per_model = 42"), "{stdout}");
    assert!(
        stdout.contains("nats://10.1.2.3:4222"),
        "environment overrides the file: {stdout}"
    );
    assert!(stdout.contains("heartbeat_timeout_ms = 5000"), "{stdout}");
}

#[test]
fn check_config_lists_every_invalid_field_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "queue_bound_per_model = 0\nfence_after_ms = 9000\nredis_url = \"http://x\"\n",
    )
    .unwrap();
    let out = dispatcher()
        .arg("--config")
        .arg(&path)
        .arg("--check-config")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for field in ["queue_bound_per_model", "fence_after_ms", "redis_url"] {
        assert!(stderr.contains(field), "{field} missing: {stderr}");
    }
    let out = dispatcher()
        .arg("--config")
        .arg(dir.path().join("missing.toml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = dispatcher().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("--check-config") && help.contains("--config"),
        "{help}"
    );
}

/// `METRONOME_NATS_*` and `METRONOME_REDIS_*` reach the dispatcher like every other binary:
/// the identity from the environment is the one it connects as, and a TLS file named there
/// is checked at start.
#[test]
fn nats_and_redis_settings_come_from_the_environment() {
    let stdout = metronome_testkit::assert_nats_and_redis_settings_from_env(
        || {
            let mut c = dispatcher();
            c.arg("--check-config");
            c
        },
        "dispatcher-env",
    );
    assert!(stdout.contains("<redacted>"), "{stdout}");
}
