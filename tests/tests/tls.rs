//! TLS to NATS and Redis through the runtime's connection settings, the way every binary
//! connects ([`NatsAuth::connect_options`], [`RedisTls::client`]), against a real
//! nats-server and a real redis-server serving certificates of a throwaway private CA:
//! trusting that CA connects, and not trusting it (no CA, another CA) is refused by the
//! TLS handshake itself; a missing CA file is refused before any connection, naming the
//! setting.

use std::time::Duration;

use async_nats::ConnectErrorKind;
use futures::StreamExt;
use metronome_runtime::nats::{NatsAuth, NatsAuthError};
use metronome_runtime::redis::{RedisClientError, RedisTls};
use metronome_testkit::{NatsServer, RedisServer, TestCa};

const TIMEOUT: Duration = Duration::from_secs(10);

async fn nats_connect(
    nats: &NatsServer,
    auth: &NatsAuth,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    auth.connect_options()
        .expect("options")
        .connection_timeout(TIMEOUT)
        .connect(nats.url())
        .await
}

/// A message sent and received back on one connection: the session works past the
/// handshake.
async fn round_trip(client: &async_nats::Client) {
    let mut sub = client.subscribe("tls.check").await.expect("subscribe");
    client
        .publish("tls.check", "over tls".into())
        .await
        .expect("publish");
    client.flush().await.expect("flush");
    let msg = tokio::time::timeout(TIMEOUT, sub.next())
        .await
        .expect("message back")
        .expect("subscription open");
    assert_eq!(&msg.payload[..], b"over tls");
}

fn trusting(ca: &TestCa) -> NatsAuth {
    NatsAuth {
        ca_file: Some(ca.ca_file()),
        ..NatsAuth::default()
    }
}

#[tokio::test]
async fn nats_connects_with_the_ca_and_is_refused_without_it() {
    let ca = TestCa::generate().expect("test CA");
    let other = TestCa::generate().expect("another CA");
    let nats = NatsServer::start_tls("", &ca, false).expect("nats-server with TLS");

    let client = nats_connect(&nats, &trusting(&ca))
        .await
        .unwrap_or_else(|e| panic!("connects trusting the CA: {e}\n{}", nats.log_tail()));
    round_trip(&client).await;

    for (what, auth) in [
        ("no CA (the system's roots)", NatsAuth::default()),
        ("another CA", trusting(&other)),
    ] {
        let err = nats_connect(&nats, &auth)
            .await
            .map(|_| ())
            .expect_err(what);
        // async-nats reports a handshake refused by rustls as an I/O error of the TLS
        // stream; the message carries rustls's reason.
        assert!(
            matches!(err.kind(), ConnectErrorKind::Io | ConnectErrorKind::Tls),
            "{what}: {err}"
        );
        assert!(
            err.to_string().contains("invalid peer certificate"),
            "{what}: the error says why: {err}"
        );
        println!("NATS, {what}: {err}");
    }

    let missing = NatsAuth {
        ca_file: Some(ca.dir().join("no-such-ca.pem")),
        ..NatsAuth::default()
    };
    let err = missing.connect_options().map(|_| ()).unwrap_err();
    assert!(matches!(err, NatsAuthError::TlsFile(_)), "{err}");
    assert!(
        err.to_string().starts_with("nats_auth.ca_file: reading "),
        "{err}"
    );
    println!("NATS, missing CA file: {err}");
}

#[tokio::test]
async fn nats_verifying_clients_needs_the_client_certificate() {
    let ca = TestCa::generate().expect("test CA");
    let nats = NatsServer::start_tls("", &ca, true).expect("nats-server with TLS");

    let with_cert = NatsAuth {
        cert_file: Some(ca.client_cert()),
        key_file: Some(ca.client_key()),
        ..trusting(&ca)
    };
    let client = nats_connect(&nats, &with_cert).await.unwrap_or_else(|e| {
        panic!(
            "connects with a client certificate: {e}\n{}",
            nats.log_tail()
        )
    });
    round_trip(&client).await;

    // The server ends the handshake; whatever the client reads then, it is not connected.
    let err = nats_connect(&nats, &trusting(&ca))
        .await
        .map(|_| ())
        .expect_err("no client certificate");
    println!("NATS, no client certificate: {err}");
}

#[tokio::test]
async fn nats_credentials_travel_over_tls() {
    let ca = TestCa::generate().expect("test CA");
    let nats = NatsServer::start_tls(
        "authorization { users = [ { user: gateway, password: \"tls-pw\" } ] }\n",
        &ca,
        false,
    )
    .expect("nats-server with TLS and a user");
    let auth = NatsAuth {
        user: Some("gateway".into()),
        password: Some("tls-pw".into()),
        ..trusting(&ca)
    };
    let client = nats_connect(&nats, &auth)
        .await
        .unwrap_or_else(|e| panic!("user over TLS: {e}\n{}", nats.log_tail()));
    // The per-user inbox is allowed here (no permissions set), so a flush proves the session.
    client.flush().await.expect("flush");
    let wrong = NatsAuth {
        password: Some("wrong".into()),
        ..auth
    };
    let err = nats_connect(&nats, &wrong)
        .await
        .map(|_| ())
        .expect_err("wrong password over TLS");
    assert_eq!(
        err.kind(),
        ConnectErrorKind::AuthorizationViolation,
        "{err}"
    );
}

async fn redis_round_trip(client: &redis::Client) -> redis::RedisResult<String> {
    let mut conn = tokio::time::timeout(TIMEOUT, client.get_multiplexed_async_connection())
        .await
        .expect("redis connection attempt ends")?;
    redis::cmd("SET")
        .arg("metronome:tls:check")
        .arg("over tls")
        .query_async::<()>(&mut conn)
        .await?;
    redis::cmd("GET")
        .arg("metronome:tls:check")
        .query_async(&mut conn)
        .await
}

fn redis_trusting(ca: &TestCa) -> RedisTls {
    RedisTls {
        ca_file: Some(ca.ca_file()),
        ..RedisTls::default()
    }
}

#[tokio::test]
async fn redis_connects_with_the_ca_and_is_refused_without_it() {
    let ca = TestCa::generate().expect("test CA");
    let other = TestCa::generate().expect("another CA");
    let redis = RedisServer::start_tls("user agent on >agent-pw ~metronome:* +@all\n", &ca)
        .expect("redis-server with TLS");
    let url = redis
        .tls_url()
        .replace("rediss://", "rediss://agent:agent-pw@");

    let client = redis_trusting(&ca).client(&url).expect("client");
    let value = redis_round_trip(&client)
        .await
        .unwrap_or_else(|e| panic!("connects trusting the CA: {e}\n{}", redis.log_tail()));
    assert_eq!(value, "over tls");

    let with_cert = RedisTls {
        cert_file: Some(ca.client_cert()),
        key_file: Some(ca.client_key()),
        ..redis_trusting(&ca)
    };
    let client = with_cert.client(&url).expect("client with a certificate");
    assert_eq!(
        redis_round_trip(&client)
            .await
            .expect("with a client certificate"),
        "over tls"
    );

    for (what, tls) in [
        ("no CA (the system's roots)", RedisTls::default()),
        ("another CA", redis_trusting(&other)),
    ] {
        let client = tls.client(&url).expect("client");
        let err = redis_round_trip(&client).await.expect_err(what);
        assert!(err.is_io_error(), "{what}: {err}");
        assert!(
            err.to_string().contains("certificate"),
            "{what}: the error says why: {err}"
        );
        println!("Redis, {what}: {err}");
    }

    let missing = RedisTls {
        ca_file: Some(ca.dir().join("no-such-ca.pem")),
        ..RedisTls::default()
    };
    let err = missing.client(&url).unwrap_err();
    assert!(matches!(err, RedisClientError::TlsFile(_)), "{err}");
    assert!(
        err.to_string().starts_with("redis_tls.ca_file: reading "),
        "{err}"
    );
    println!("Redis, missing CA file: {err}");
}
