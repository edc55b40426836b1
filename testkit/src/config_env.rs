//! The check every binary's `--check-config` must pass: `METRONOME_NATS_*` and
//! `METRONOME_REDIS_*` reach its configuration. One check for the dispatcher, the gateway
//! and the worker-agent, which read them through the same runtime code.

use std::process::Command;

/// Runs `check_config()` (a command that ends in `--check-config`) twice:
/// - with `METRONOME_NATS_USER=user` and a password: it succeeds, prints that user, and
///   never the password;
/// - with a `rediss://` URL, CA files named in `METRONOME_NATS_CA` and `METRONOME_REDIS_CA`
///   and a `.creds` file in `METRONOME_NATS_CREDS` that do not exist: it exits 2 naming
///   each setting and its path.
///
/// Returns the first run's stdout, for checks of the binary's own.
pub fn assert_nats_and_redis_settings_from_env(
    check_config: impl Fn() -> Command,
    user: &str,
) -> String {
    let out = check_config()
        .env("METRONOME_NATS_USER", user)
        .env("METRONOME_NATS_PASSWORD", "from-the-environment")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&format!("user = \"{user}\"")), "{text}");
    assert!(!text.contains("from-the-environment"), "{text}");

    let out = check_config()
        .env("REDIS_URL", "rediss://127.0.0.1:6390/")
        .env("METRONOME_NATS_CA", "/nonexistent/nats-ca.pem")
        .env("METRONOME_REDIS_CA", "/nonexistent/redis-ca.pem")
        .env("METRONOME_NATS_CREDS", "/nonexistent/nats.creds")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for (field, path) in [
        ("nats_auth.ca_file", "/nonexistent/nats-ca.pem"),
        ("redis_tls.ca_file", "/nonexistent/redis-ca.pem"),
        ("nats_auth.creds_file", "/nonexistent/nats.creds"),
    ] {
        assert!(err.contains(field) && err.contains(path), "{field}: {err}");
    }
    text
}
