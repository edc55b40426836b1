//! Saved contexts, through the binary: `context add|use|ls|show|rm` keep a 0600 file under
//! `$XDG_CONFIG_HOME/metronome/` whose passwords no command prints; the settings apply in
//! the documented order (flags, then the environment, then the context; `--context`, then
//! `METRONOME_CONTEXT`, then the selected context); a context with a `.creds` file reaches
//! an operator-mode nats-server.

use std::path::Path;
use std::process::{Command, Output};

use async_nats::jetstream;
use metronome_protocol::setup;
use metronome_runtime::nats::NatsAuth;
use metronome_testkit::{free_port, NatsServer, TestOperator};

/// The binary with its contexts under `config_home` and no connection settings from the
/// test's own environment.
fn metronome(config_home: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_metronome"));
    cmd.args(args).env("XDG_CONFIG_HOME", config_home);
    for var in [
        "NATS_URL",
        "METRONOME_CONTEXT",
        "METRONOME_GATEWAY_URL",
        "METRONOME_NATS_USER",
        "METRONOME_NATS_PASSWORD",
        "METRONOME_NATS_PASSWORD_FILE",
        "METRONOME_NATS_CREDS",
        "METRONOME_NATS_CA",
        "METRONOME_NATS_CERT",
        "METRONOME_NATS_KEY",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("run metronome")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn code(out: &Output) -> Option<i32> {
    out.status.code()
}

#[test]
fn contexts_are_saved_0600_listed_without_secrets_and_removed() {
    use std::os::unix::fs::PermissionsExt;
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    std::fs::write(h.join("ops.creds"), "creds").unwrap();
    let add = metronome(
        h,
        &[
            "context",
            "add",
            "prod",
            "--server",
            "nats://10.0.0.1:4222,nats://10.0.0.2:4222",
            "--user",
            "admin",
            "--password",
            "hunter2-secret",
            "--gateway-url",
            "http://10.0.0.1:8080",
            "--description",
            "production",
        ],
        &[],
    );
    assert_eq!(code(&add), Some(0), "{add:?}");
    // A relative .creds path is saved absolute; --use selects it.
    let add = Command::new(env!("CARGO_BIN_EXE_metronome"))
        .current_dir(h)
        .env("XDG_CONFIG_HOME", h)
        .args([
            "context",
            "add",
            "staging",
            "--server",
            "nats://10.0.1.1:4222",
            "--creds",
            "ops.creds",
            "--use",
        ])
        .output()
        .unwrap();
    assert_eq!(code(&add), Some(0), "{add:?}");

    let file = h.join("metronome").join("contexts.toml");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let saved = std::fs::read_to_string(&file).unwrap();
    assert!(
        saved.contains("hunter2-secret"),
        "the file keeps the password"
    );
    assert!(
        saved.contains(&*h.join("ops.creds").to_string_lossy()),
        "{saved}"
    );

    let ls = metronome(h, &["context", "ls"], &[]);
    let table = stdout(&ls);
    assert!(table.contains("* staging"), "{table}");
    assert!(
        table.contains("  prod") && table.contains("user admin"),
        "{table}"
    );
    let ls_json = metronome(h, &["--json", "context", "ls"], &[]);
    let shown = metronome(h, &["context", "show", "prod"], &[]);
    let shown_json = metronome(h, &["--json", "context", "show", "prod"], &[]);
    for out in [&ls, &ls_json, &shown, &shown_json] {
        assert_eq!(code(out), Some(0), "{out:?}");
        assert!(!stdout(out).contains("hunter2"), "{}", stdout(out));
    }
    assert!(stdout(&shown).contains("<redacted>"), "{}", stdout(&shown));
    let listed: serde_json::Value = serde_json::from_str(&stdout(&ls_json)).unwrap();
    assert_eq!(listed["selected"], "staging");
    assert_eq!(listed["contexts"]["prod"]["password"], "<redacted>");
    // Without a name: the context that applies (the selected one, or --context's).
    assert!(
        stdout(&metronome(h, &["context", "show"], &[])).contains("context:  staging (selected)")
    );
    assert!(stdout(&metronome(
        h,
        &["--context", "prod", "context", "show"],
        &[]
    ))
    .contains("context:  prod\n"));

    // Refusals: an unknown context is "not found", a bad one "bad usage".
    assert_eq!(
        code(&metronome(h, &["context", "use", "nope"], &[])),
        Some(1)
    );
    assert_eq!(
        code(&metronome(h, &["context", "show", "nope"], &[])),
        Some(1)
    );
    assert_eq!(
        code(&metronome(h, &["context", "add", "a b"], &[])),
        Some(2)
    );
    let both = metronome(
        h,
        &[
            "context",
            "add",
            "x",
            "--user",
            "u",
            "--password",
            "p",
            "--creds",
            "ops.creds",
        ],
        &[],
    );
    assert_eq!(code(&both), Some(2), "{both:?}");
    assert!(
        String::from_utf8_lossy(&both.stderr).contains("creds_file"),
        "{both:?}"
    );
    let bad = metronome(h, &["--context", "nope", "status"], &[]);
    assert_eq!(code(&bad), Some(2), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no context named \"nope\""));

    // rm: gone, and no longer selected.
    assert_eq!(
        code(&metronome(h, &["context", "rm", "staging"], &[])),
        Some(0)
    );
    assert_eq!(
        code(&metronome(h, &["context", "rm", "staging"], &[])),
        Some(1)
    );
    let listed: serde_json::Value =
        serde_json::from_str(&stdout(&metronome(h, &["--json", "context", "ls"], &[]))).unwrap();
    assert!(listed.get("selected").is_none(), "{listed}");
    assert_eq!(listed["contexts"].as_object().unwrap().len(), 1);
}

async fn streams(nats: &NatsServer, auth: &NatsAuth) {
    let client = auth
        .connect_options()
        .unwrap()
        .connect(nats.url())
        .await
        .unwrap_or_else(|e| panic!("connect: {e}\n{}", nats.log_tail()));
    setup::ensure_all(&jetstream::new(client), &setup::StreamSettings::default())
        .await
        .expect("streams and buckets");
}

/// Each setting from the first that gives it: a flag, then the environment, then the
/// context; the context from `--context`, then `METRONOME_CONTEXT`, then the selection.
/// Made visible by pointing the loser at a port nothing listens on (exit 3).
#[tokio::test]
async fn flags_beat_the_environment_which_beats_the_context() {
    let nats = NatsServer::start().expect("nats-server");
    streams(&nats, &NatsAuth::default()).await;
    let good = nats.url();
    let closed = format!("nats://127.0.0.1:{}", free_port());
    let (good, closed) = (good.as_str(), closed.as_str());
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    for (name, url) in [("down", closed), ("up", good)] {
        let out = metronome(h, &["context", "add", name, "--server", url], &[]);
        assert_eq!(code(&out), Some(0), "{out:?}");
    }
    assert_eq!(
        code(&metronome(h, &["context", "use", "down"], &[])),
        Some(0)
    );

    let status = |args: &[&str], env: &[(&str, &str)]| {
        let mut argv = args.to_vec();
        argv.push("status");
        code(&metronome(h, &argv, env))
    };
    // The selected context's server.
    assert_eq!(status(&[], &[]), Some(3));
    // The environment's URL over the context's; the flag's over the environment's.
    assert_eq!(status(&[], &[("NATS_URL", good)]), Some(0));
    assert_eq!(
        status(&["--nats-url", good], &[("NATS_URL", closed)]),
        Some(0)
    );
    assert_eq!(
        status(&["--nats-url", closed], &[("NATS_URL", good)]),
        Some(3)
    );
    // METRONOME_CONTEXT over the selection; --context over METRONOME_CONTEXT.
    assert_eq!(status(&[], &[("METRONOME_CONTEXT", "up")]), Some(0));
    assert_eq!(
        status(&["--context", "down"], &[("METRONOME_CONTEXT", "up")]),
        Some(3)
    );
    assert_eq!(status(&["--context", "up"], &[]), Some(0));
}

#[tokio::test]
async fn a_context_with_a_creds_file_reaches_an_operator_mode_server() {
    let operator = TestOperator::generate();
    let nats = NatsServer::start_with_config(&operator.server_config())
        .expect("nats-server in operator mode");
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    let creds = operator.write_user_creds(h, "admin").unwrap();
    streams(
        &nats,
        &NatsAuth {
            creds_file: Some(creds.clone()),
            ..NatsAuth::default()
        },
    )
    .await;
    let url = nats.url();
    let creds = creds.to_string_lossy().into_owned();
    let (url, creds) = (url.as_str(), creds.as_str());

    // No context: anonymous, refused.
    let out = metronome(h, &["--nats-url", url, "status"], &[]);
    assert_eq!(code(&out), Some(3), "{out:?}");
    let add = metronome(
        h,
        &[
            "context", "add", "ops", "--server", url, "--creds", creds, "--use",
        ],
        &[],
    );
    assert_eq!(code(&add), Some(0), "{add:?}");
    let out = metronome(h, &["status"], &[]);
    assert_eq!(code(&out), Some(0), "{out:?}");
    // The environment's credentials over the context's: an empty METRONOME_NATS_CREDS
    // clears the context's file, and the connection is anonymous again.
    let out = metronome(h, &["status"], &[("METRONOME_NATS_CREDS", "")]);
    assert_eq!(code(&out), Some(3), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot connect to NATS"),
        "{out:?}"
    );
}
