//! The operator console against a real nats-server: who may open it (anonymous only when
//! anonymous access is on, otherwise only operator keys, as a bearer token or the password
//! of HTTP Basic), what its endpoints return (the explain view without the job's output),
//! and that an open event stream does not hold up a graceful shutdown.

use crate::support;

use base64::Engine as _;
use futures::StreamExt;
use metronome_gateway::api_key::key_sha256;
use metronome_gateway::{Config, KeyConfig, TenantConfig};
use serde_json::Value;
use support::*;

const OPERATOR_KEY: &str = "mtk_test_operator";
const TENANT_KEY: &str = "mtk_test_tenant";
const REVOKED_OPERATOR_KEY: &str = "mtk_test_revoked_operator";

fn keyed(c: &mut Config) {
    c.allow_anonymous = false;
    c.tenants = vec![
        TenantConfig::unlimited("ops"),
        TenantConfig::unlimited("acme"),
    ];
    let key = |tenant: &str, key: &str, revoked: bool, operator: bool| KeyConfig {
        tenant: tenant.into(),
        sha256: key_sha256(key),
        note: None,
        revoked,
        priority: None,
        operator,
    };
    c.keys = vec![
        key("ops", OPERATOR_KEY, false, true),
        key("acme", TENANT_KEY, false, false),
        key("ops", REVOKED_OPERATOR_KEY, true, true),
    ];
}

fn basic(password: &str) -> String {
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("operator:{password}"));
    format!("Basic {encoded}")
}

#[tokio::test]
async fn with_keys_only_operator_keys_open_the_console() {
    let h = Harness::start_with_key(keyed, Some(TENANT_KEY)).await;
    let get = |path: &str, auth: Option<String>| {
        let mut r = h.http.get(h.url(path));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        r.send()
    };

    // No key: 401 asking the browser for Basic credentials, on the page and the data.
    for path in [
        "/console",
        "/console/console.js",
        "/console/api/workers",
        "/console/api/events",
    ] {
        let resp = get(path, None).await.unwrap();
        assert_eq!(resp.status(), 401, "{path}");
        let challenge = resp.headers()["www-authenticate"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(challenge.starts_with("Basic "), "{path}: {challenge}");
    }
    // A tenant's key works for the OpenAI API but not for the console.
    let resp = get("/console/api/workers", Some(format!("Bearer {TENANT_KEY}")))
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "operator_required");
    assert_eq!(
        get("/console", Some(basic(TENANT_KEY)))
            .await
            .unwrap()
            .status(),
        403
    );
    // Unknown and revoked keys are 401, whatever the scheme.
    for auth in [
        format!("Bearer {REVOKED_OPERATOR_KEY}"),
        basic(REVOKED_OPERATOR_KEY),
        basic("mtk_not_a_key"),
        "Basic !!not-base64!!".to_string(),
    ] {
        assert_eq!(
            get("/console", Some(auth.clone())).await.unwrap().status(),
            401,
            "{auth}"
        );
    }
    // The operator key, as a bearer token or as the Basic password.
    for auth in [format!("Bearer {OPERATOR_KEY}"), basic(OPERATOR_KEY)] {
        let page = get("/console", Some(auth.clone())).await.unwrap();
        assert_eq!(page.status(), 200);
        assert!(page.text().await.unwrap().contains("/console/console.js"));
        let workers: Value = get("/console/api/workers", Some(auth))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let ids: Vec<&str> = workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["status"]["worker_id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, [WORKER]);
    }
}

#[tokio::test]
async fn explain_shows_the_decision_and_never_the_output() {
    let h = Harness::start(|_| {}).await;
    let resp = h
        .post(
            "/v1/chat/completions",
            &chat_body("a-private-prompt", false),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let job_id = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let answer: Value = resp.json().await.unwrap();
    let output = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!output.is_empty());

    let resp = h
        .http
        .get(h.url(&format!("/console/api/explain/{job_id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    let story: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(story["job_id"], job_id.as_str());
    assert_eq!(story["summary"]["winner"], WORKER);
    assert_eq!(story["summary"]["outcome"], "assigned");
    assert!(
        story["result"].is_object(),
        "the final result is shown: {story}"
    );
    assert!(story["result"]["response"].is_null(), "{story}");
    assert!(story["text"].as_str().unwrap().contains(&job_id));
    assert!(!text.contains("a-private-prompt"), "{text}");
    assert!(
        !text.contains(&format!("\"{output}\"")),
        "the output leaked: {text}"
    );

    let feed: Vec<Value> = h
        .http
        .get(h.url("/console/api/decisions?n=10"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        feed.iter()
            .any(|d| d["job_id"] == job_id.as_str() && d["worker_id"] == WORKER),
        "{feed:?}"
    );

    let unknown = h
        .http
        .get(h.url("/console/api/explain/no-such-job"))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let bad = h
        .http
        .get(h.url("/console/api/explain/not.a.token"))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
}

#[tokio::test]
async fn an_open_event_stream_pushes_workers_and_ends_at_shutdown() {
    let mut h = Harness::start(|_| {}).await;
    let resp = h
        .http
        .get(h.url("/console/api/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    let first = tokio::time::timeout(WAIT, async {
        while !(seen.contains("event: workers") && seen.contains(WORKER)) {
            match body.next().await {
                Some(Ok(bytes)) => seen.push_str(&String::from_utf8_lossy(&bytes)),
                _ => break,
            }
        }
    })
    .await;
    assert!(
        first.is_ok() && seen.contains(WORKER),
        "no workers snapshot: {seen}"
    );
    // The stream is still open; a graceful stop must not wait for the client to leave.
    assert!(
        h.stop_gateway().await,
        "the gateway did not stop with a console open"
    );
    let ended =
        tokio::time::timeout(WAIT, async { while let Some(Ok(_)) = body.next().await {} }).await;
    assert!(ended.is_ok(), "the event stream stayed open after shutdown");
}
