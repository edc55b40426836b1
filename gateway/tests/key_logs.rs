//! Keys never reach the logs: one run of the gateway with every log event at TRACE
//! captured (a global subscriber, so this test has its binary to itself), then a search of
//! the captured text for each key used.

use crate::support;

use std::sync::{Arc, Mutex};

use metronome_gateway::api_key::key_sha256;
use metronome_gateway::{Config, KeyConfig, TenantConfig};
use support::*;

const ACME_KEY: &str = "mtk_test_acme_for_the_log_test";

/// Collects every log line.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn keys_never_appear_in_the_logs() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
    let h = Harness::start_with_key(
        |c: &mut Config| {
            c.allow_anonymous = false;
            c.tenants = vec![TenantConfig::unlimited("acme")];
            c.keys = vec![KeyConfig {
                tenant: "acme".into(),
                sha256: key_sha256(ACME_KEY),
                note: None,
                revoked: false,
                priority: None,
                operator: false,
            }];
        },
        Some(ACME_KEY),
    )
    .await;
    let wrong = "mtk_wrong_key_for_the_log_test";
    assert_eq!(
        post_as(&h, Some(ACME_KEY), &chat_body("hello", true))
            .await
            .status(),
        200
    );
    assert_eq!(
        post_as(&h, Some(ACME_KEY), &chat_body("hello", false))
            .await
            .status(),
        200
    );
    assert_eq!(
        post_as(&h, Some(wrong), &chat_body("hello", false))
            .await
            .status(),
        401
    );
    drop(h);
    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    // The capture works: the job span names the tenant and the key's public id.
    let acme_id = metronome_gateway::api_key::key_id(&key_sha256(ACME_KEY)).to_string();
    assert!(logs.contains("tenant=\"acme\""), "{logs}");
    assert!(logs.contains(&acme_id), "{logs}");
    for secret in [ACME_KEY, wrong, "Bearer"] {
        assert!(!logs.contains(secret), "{secret} appears in the logs");
    }
}

async fn post_as(h: &Harness, key: Option<&str>, body: &serde_json::Value) -> reqwest::Response {
    let request = h.http.post(h.url("/v1/chat/completions")).json(body);
    match key {
        Some(k) => request.bearer_auth(k),
        None => request,
    }
    .send()
    .await
    .expect("request sent")
}
