//! NATS `.creds` files (a user JWT and its nkey seed, as `nsc` writes them) against a real
//! nats-server in operator mode (a memory resolver preloaded with the account,
//! `metronome_testkit::TestOperator`): the runtime's connection settings connect with one
//! and use JetStream; no credentials, or a user of another operator, are refused by the
//! server; a missing or malformed file is refused before any connection, naming the
//! setting; and the whole chain, each of the gateway, the dispatcher and the worker-agent
//! given its file in `METRONOME_NATS_CREDS`, answers a request.

use std::time::Duration;

use async_nats::ConnectErrorKind;
use metronome_e2e::{chat_body, Cluster, ClusterSpec};
use metronome_protocol::setup::{ensure_all, StreamSettings};
use metronome_runtime::nats::{NatsAuth, NatsAuthError};
use metronome_testkit::{NatsServer, TestOperator};

const TIMEOUT: Duration = Duration::from_secs(10);

async fn connect(
    nats: &NatsServer,
    auth: &NatsAuth,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    auth.connect_options()
        .expect("options")
        .connection_timeout(TIMEOUT)
        .connect(nats.url())
        .await
}

fn creds(path: std::path::PathBuf) -> NatsAuth {
    NatsAuth {
        creds_file: Some(path),
        ..NatsAuth::default()
    }
}

#[tokio::test]
async fn a_creds_file_connects_and_anything_else_is_refused() {
    let operator = TestOperator::generate();
    let nats = NatsServer::start_with_config(&operator.server_config())
        .expect("nats-server in operator mode");
    let dir = tempfile::tempdir().unwrap();

    let admin = operator.write_user_creds(dir.path(), "admin").unwrap();
    let client = connect(&nats, &creds(admin))
        .await
        .unwrap_or_else(|e| panic!("connects with the .creds file: {e}\n{}", nats.log_tail()));
    // JetStream in the account: what every binary does first.
    ensure_all(
        &async_nats::jetstream::new(client),
        &StreamSettings::default(),
    )
    .await
    .expect("the streams and buckets, through the creds user");

    let stranger = TestOperator::generate()
        .write_user_creds(dir.path(), "stranger")
        .unwrap();
    for (what, auth) in [
        ("no credentials", NatsAuth::default()),
        ("another operator's user", creds(stranger)),
    ] {
        let err = connect(&nats, &auth).await.map(|_| ()).expect_err(what);
        assert_eq!(
            err.kind(),
            ConnectErrorKind::AuthorizationViolation,
            "{what}: {err}"
        );
    }

    let missing = dir.path().join("missing.creds");
    let garbled = dir.path().join("garbled.creds");
    std::fs::write(&garbled, "not a creds file\n").unwrap();
    for path in [missing, garbled] {
        let err = creds(path.clone())
            .connect_options()
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, NatsAuthError::CredsFile { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.starts_with("nats_auth.creds_file: ") && text.contains(&*path.to_string_lossy()),
            "{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_chain_runs_on_creds_files() {
    const MODEL: &str = "creds-model";
    let operator = TestOperator::generate();
    let dir = tempfile::tempdir().unwrap();
    let creds = operator.write_user_creds(dir.path(), "metronome").unwrap();
    let mut spec = ClusterSpec::uniform(1, MODEL);
    spec.nats_config = operator.server_config();
    spec.env.push((
        metronome_runtime::nats::ENV_CREDS.into(),
        creds.display().to_string(),
    ));
    spec.nats_creds = Some(creds);
    // Ready means the gateway lists the model a worker-agent heartbeats: both connected.
    let cluster = Cluster::start(spec).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .json(&chat_body(MODEL, 4, false))
        .send()
        .await
        .unwrap();
    // Answered: the dispatcher placed it, the agent ran it.
    assert_eq!(resp.status(), 200, "{}", cluster.logs());
}
