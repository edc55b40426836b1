//! HTTPS served by the gateway itself (`tls_cert`, `tls_key`): real handshakes with a
//! throwaway CA (testkit's `TestCa`, made with the `openssl` CLI as provisioning does),
//! plain HTTP refused on the TLS port, graceful shutdown with TLS connections open, and the
//! settings checked as `--check-config` checks them.

use metronome_gateway::{bind, Config, GatewayError};
use metronome_testkit::TestCa;
use serde_json::Value;
use tokio::io::AsyncWriteExt;

use crate::support::{chat_body, https_client, Harness, WAIT};

#[tokio::test]
async fn https_serves_the_api_with_the_configured_certificate() {
    let ca = TestCa::generate().expect("test CA");
    let h = Harness::start_tls(&ca, |_| {}).await;
    assert!(h.base.starts_with("https://"), "{}", h.base);
    // Start waited for the model over HTTPS already; a whole request goes through too.
    let resp = h
        .post("/v1/chat/completions", &chat_body("hello", false))
        .await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello");

    // The certificate is the one configured: a client trusting only another CA refuses it.
    let other = TestCa::generate().expect("another CA");
    let err = https_client(&other.ca_file())
        .get(h.url("/healthz"))
        .send()
        .await
        .expect_err("a certificate of another CA was accepted");
    assert!(err.is_connect(), "{err:?}");
}

#[tokio::test]
async fn plain_http_on_the_tls_port_gets_no_answer() {
    let ca = TestCa::generate().expect("test CA");
    let h = Harness::start_tls(&ca, |_| {}).await;
    let plain = h.url("/healthz").replacen("https://", "http://", 1);
    let err = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(&plain)
        .send()
        .await
        .expect_err("plain HTTP was answered on the TLS port");
    assert!(!err.is_status(), "{err:?}");
    // The failed handshake ended that connection only.
    let ok = h.http.get(h.url("/healthz")).send().await.unwrap();
    assert_eq!(ok.status(), 200);
}

#[tokio::test]
async fn graceful_shutdown_is_not_held_up_by_tls_connections() {
    let ca = TestCa::generate().expect("test CA");
    let mut h = Harness::start_tls(&ca, |_| {}).await;
    // An idle pooled HTTPS connection, and a client that connected but never started
    // its handshake.
    assert_eq!(
        h.http.get(h.url("/healthz")).send().await.unwrap().status(),
        200
    );
    let addr = h.base.trim_start_matches("https://").to_string();
    let mut silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    silent.flush().await.unwrap();
    assert!(h.stop_gateway().await, "the gateway did not stop");
    assert!(
        h.http.get(h.url("/healthz")).send().await.is_err(),
        "still serving after shutdown"
    );
}

fn tls_config(cert: Option<std::path::PathBuf>, key: Option<std::path::PathBuf>) -> Config {
    Config {
        tls_cert: cert,
        tls_key: key,
        ..Config::default()
    }
}

fn only_field(config: &Config) -> (String, String) {
    let errors = config.validate().expect_err("accepted");
    assert_eq!(errors.len(), 1, "{errors:?}");
    (errors[0].field.to_string(), errors[0].to_string())
}

#[test]
fn the_certificate_and_key_are_checked_with_the_configuration() {
    let ca = TestCa::generate().expect("test CA");
    let good = tls_config(Some(ca.server_cert()), Some(ca.server_key()));
    assert_eq!(good.validate(), Ok(()));

    // Both or neither.
    let (field, text) = only_field(&tls_config(Some(ca.server_cert()), None));
    assert_eq!(field, "tls_key", "{text}");
    let (field, text) = only_field(&tls_config(None, Some(ca.server_key())));
    assert_eq!(field, "tls_cert", "{text}");

    // A missing file names the setting and the path.
    let missing = ca.dir().join("missing.pem");
    let (field, text) = only_field(&tls_config(Some(missing.clone()), Some(ca.server_key())));
    assert_eq!(field, "tls_cert");
    assert!(text.contains("missing.pem"), "{text}");

    // Files swapped: no certificate in the certificate file.
    let (field, text) = only_field(&tls_config(Some(ca.server_key()), Some(ca.server_cert())));
    assert_eq!(field, "tls_cert", "{text}");

    // A key that is not the certificate's.
    let (field, text) = only_field(&tls_config(Some(ca.server_cert()), Some(ca.client_key())));
    assert_eq!(field, "tls_key", "{text}");
    assert!(text.contains("client.key"), "{text}");
}

#[tokio::test]
async fn bind_refuses_a_key_that_is_not_the_certificates() {
    let ca = TestCa::generate().expect("test CA");
    let config = Config {
        listen: "127.0.0.1:0".into(),
        ..tls_config(Some(ca.server_cert()), Some(ca.client_key()))
    };
    let result = tokio::time::timeout(WAIT, bind(config)).await.unwrap();
    assert!(
        matches!(result, Err(GatewayError::Config(_))),
        "{:?}",
        result.err()
    );
}
