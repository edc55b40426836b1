//! API keys, tenants and their limits, against a real nats-server: 401 without a valid
//! key, 403 for a model outside the tenant's list, 429 with `Retry-After` over its limits,
//! the tenant in the published job, and `keys create` end to end.

use crate::support;

use metronome_gateway::api_key::key_sha256;
use metronome_gateway::{Config, KeyConfig, ModelList, TenantConfig};
use metronome_protocol::names::SUBJECT_JOBS_SUBMIT_ALL;
use metronome_testkit::wait_for;
use serde_json::{json, Value};
use support::*;

const ACME_KEY: &str = "mtk_test_acme";
const BETA_KEY: &str = "mtk_test_beta";
const REVOKED_KEY: &str = "mtk_test_revoked";
const SLOW_KEY: &str = "mtk_test_slow";
const FRUGAL_KEY: &str = "mtk_test_frugal";
const BULK_KEY: &str = "mtk_test_bulk";

fn key(tenant: &str, key: &str, revoked: bool) -> KeyConfig {
    KeyConfig {
        tenant: tenant.into(),
        sha256: key_sha256(key),
        note: None,
        revoked,
        priority: None,
        operator: false,
    }
}

/// Tenants: `acme` (only [`MODEL`]), `beta` (only another model), `slow` (one request per
/// 1000 s), `frugal` (30 tokens per minute). Anonymous access stays at its default (off).
fn tenants(c: &mut Config) {
    c.allow_anonymous = Config::default().allow_anonymous;
    c.tenants = vec![
        TenantConfig {
            models: ModelList::Only(vec![MODEL.into()]),
            ..TenantConfig::unlimited("acme")
        },
        TenantConfig {
            models: ModelList::Only(vec!["other-model".into()]),
            ..TenantConfig::unlimited("beta")
        },
        TenantConfig {
            requests_per_second: Some(0.001),
            burst: Some(1),
            ..TenantConfig::unlimited("slow")
        },
        TenantConfig {
            tokens_per_minute: Some(30),
            ..TenantConfig::unlimited("frugal")
        },
        TenantConfig::unlimited("bulk"),
    ];
    c.keys = vec![
        key("acme", ACME_KEY, false),
        key("beta", BETA_KEY, false),
        key("beta", REVOKED_KEY, true),
        key("slow", SLOW_KEY, false),
        key("frugal", FRUGAL_KEY, false),
        KeyConfig {
            priority: Some(metronome_protocol::Priority::Batch),
            ..key("bulk", BULK_KEY, false)
        },
    ];
}

async fn post_as(h: &Harness, key: Option<&str>, body: &Value) -> reqwest::Response {
    let request = h.http.post(h.url("/v1/chat/completions")).json(body);
    match key {
        Some(k) => request.bearer_auth(k),
        None => request,
    }
    .send()
    .await
    .expect("request sent")
}

async fn models_as(h: &Harness, key: Option<&str>) -> reqwest::Response {
    let request = h.http.get(h.url("/v1/models"));
    match key {
        Some(k) => request.bearer_auth(k),
        None => request,
    }
    .send()
    .await
    .expect("request sent")
}

async fn metrics(h: &Harness) -> String {
    h.http
        .get(h.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn without_a_key_every_openai_endpoint_is_401_and_anonymous_is_off_by_default() {
    assert!(!Config::default().allow_anonymous);
    let h = Harness::start_with_key(tenants, Some(ACME_KEY)).await;
    let resp = post_as(&h, None, &chat_body("hello", false)).await;
    assert_eq!(
        resp.headers()["www-authenticate"],
        "Bearer realm=\"metronome\""
    );
    let error = assert_openai_error(resp, 401, "invalid_request_error").await;
    assert_eq!(error["code"], "invalid_api_key");
    assert!(error["param"].is_null());
    let resp = models_as(&h, None).await;
    assert_eq!(resp.status(), 401);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_api_key");
    // Probes and metrics stay open.
    for path in ["/healthz", "/metrics"] {
        let resp = h.http.get(h.url(path)).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
    }
    let readyz = h.http.get(h.url("/readyz")).send().await.unwrap();
    assert_ne!(readyz.status(), 401);
    let text = metrics(&h).await;
    assert!(
        text.contains("metronome_gateway_auth_failures_total{reason=\"missing\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("metronome_gateway_jobs_submitted_total 0"),
        "nothing published"
    );
}

#[tokio::test]
async fn a_wrong_revoked_or_malformed_key_is_401_and_never_echoed() {
    let h = Harness::start_with_key(tenants, Some(ACME_KEY)).await;
    let wrong = "mtk_not_a_configured_key_0123456789";
    for (key, message) in [
        (wrong, "incorrect API key"),
        (REVOKED_KEY, "revoked"),
        (&format!("{ACME_KEY}x") as &str, "incorrect API key"),
    ] {
        let resp = post_as(&h, Some(key), &chat_body("hello", false)).await;
        let raw = resp.text().await.unwrap();
        assert!(!raw.contains(key), "the key is not echoed: {raw}");
        let body: Value = serde_json::from_str(&raw).unwrap();
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(message),
            "{body}"
        );
    }
    let resp = h
        .http
        .post(h.url("/v1/chat/completions"))
        .header("authorization", format!("Basic {ACME_KEY}"))
        .json(&chat_body("hello", false))
        .send()
        .await
        .unwrap();
    let error = assert_openai_error(resp, 401, "invalid_request_error").await;
    assert_eq!(error["code"], "invalid_api_key");
    let text = metrics(&h).await;
    for line in [
        "metronome_gateway_auth_failures_total{reason=\"invalid\"} 2",
        "metronome_gateway_auth_failures_total{reason=\"revoked\"} 1",
        "metronome_gateway_auth_failures_total{reason=\"malformed\"} 1",
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
}

#[tokio::test]
async fn a_valid_key_publishes_the_job_with_its_tenant_and_lists_only_its_models() {
    let h = Harness::start_with_key(tenants, Some(ACME_KEY)).await;
    let mut submitted = h.client.subscribe(SUBJECT_JOBS_SUBMIT_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let resp = post_as(&h, Some(ACME_KEY), &chat_body("hello", false)).await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello");
    let (message, job) = next_job(&mut submitted).await;
    assert_eq!(job.tenant.as_deref(), Some("acme"));
    assert_eq!(
        message.subject.as_str(),
        "jobs.submit.acme",
        "submitted on its tenant's subject, which the dispatcher believes"
    );
    job.validate(&Default::default()).expect("a valid job");
    assert!(
        !String::from_utf8_lossy(&message.payload).contains(ACME_KEY),
        "the key does not travel in the job"
    );
    // The model list is the tenant's.
    let listed = |resp: reqwest::Response| async move {
        let body: Value = resp.json().await.unwrap();
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        listed(models_as(&h, Some(ACME_KEY)).await).await,
        [MODEL.to_string()]
    );
    assert!(listed(models_as(&h, Some(BETA_KEY)).await).await.is_empty());
    let one = h
        .http
        .get(h.url(&format!("/v1/models/{MODEL}")))
        .bearer_auth(BETA_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(one.status(), 404, "a model outside the list is not shown");
    let text = metrics(&h).await;
    assert!(text.contains("metronome_gateway_tenant_requests_total{tenant=\"acme\"} 1"));
    assert!(text.contains("metronome_gateway_tenant_admitted_tokens_total{tenant=\"acme\"}"));
}

#[tokio::test]
async fn the_priority_class_is_the_keys_or_a_lower_one_the_request_asks_for() {
    use metronome_protocol::Priority;
    let h = Harness::start_with_key(tenants, Some(ACME_KEY)).await;
    let mut submitted = h.client.subscribe(SUBJECT_JOBS_SUBMIT_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let post = |key: &'static str, class: Option<&'static str>| {
        let mut request = h
            .http
            .post(h.url("/v1/chat/completions"))
            .bearer_auth(key)
            .json(&chat_body("hello", false));
        if let Some(class) = class {
            request = request.header(metronome_gateway::HEADER_PRIORITY, class);
        }
        request.send()
    };
    let mut classes = Vec::new();
    for (key, asked) in [
        (ACME_KEY, None),
        (ACME_KEY, Some("batch")),
        (BULK_KEY, None),
    ] {
        assert_eq!(post(key, asked).await.unwrap().status(), 200);
        let (_, job) = next_job(&mut submitted).await;
        classes.push(job.priority);
    }
    assert_eq!(
        classes,
        [
            Some(Priority::Interactive),
            Some(Priority::Batch),
            Some(Priority::Batch)
        ]
    );
    // A batch key cannot raise its class; an unknown class is a bad request.
    let error = assert_openai_error(
        post(BULK_KEY, Some("interactive")).await.unwrap(),
        403,
        "invalid_request_error",
    )
    .await;
    assert_eq!(error["code"], "priority_not_allowed");
    let error = assert_openai_error(
        post(ACME_KEY, Some("urgent")).await.unwrap(),
        400,
        "invalid_request_error",
    )
    .await;
    assert_eq!(error["param"], metronome_gateway::HEADER_PRIORITY);
    let text = metrics(&h).await;
    assert!(text.contains(
        "metronome_gateway_tenant_rejections_total{tenant=\"bulk\",reason=\"priority_not_allowed\"} 1"
    ));
}

#[tokio::test]
async fn a_model_outside_the_tenants_list_is_403() {
    let h = Harness::start_with_key(tenants, Some(ACME_KEY)).await;
    for model in [MODEL, "not-served-anywhere"] {
        let mut body = chat_body("hello", false);
        body["model"] = json!(model);
        let resp = post_as(&h, Some(BETA_KEY), &body).await;
        let error = assert_openai_error(resp, 403, "invalid_request_error").await;
        assert_eq!(error["code"], "model_not_allowed", "{model}");
        assert_eq!(error["param"], "model");
    }
    let text = metrics(&h).await;
    assert!(text.contains(
        "metronome_gateway_tenant_rejections_total{tenant=\"beta\",reason=\"model_not_allowed\"} 2"
    ));
    assert!(text.contains("metronome_gateway_jobs_submitted_total 0"));
}

fn retry_after(resp: &reqwest::Response) -> u64 {
    resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn over_the_tenants_limits_is_429_with_retry_after() {
    let h = Harness::start_with_key(tenants, Some(ACME_KEY)).await;
    // Requests: a burst of one, then one per 1000 s.
    let ok = post_as(&h, Some(SLOW_KEY), &chat_body("hello", false)).await;
    assert_eq!(ok.status(), 200);
    let resp = post_as(&h, Some(SLOW_KEY), &chat_body("hello", false)).await;
    let wait = retry_after(&resp);
    assert!((1..=1000).contains(&wait), "{wait}");
    let error = assert_openai_error(resp, 429, "rate_limit_error").await;
    assert_eq!(error["code"], "rate_limit_exceeded");
    // Tokens: 30 per minute; a request costs 9 (prompt estimate) + 16 (max_tokens).
    let ok = post_as(&h, Some(FRUGAL_KEY), &chat_body("hello", false)).await;
    assert_eq!(ok.status(), 200);
    let resp = post_as(&h, Some(FRUGAL_KEY), &chat_body("hello", false)).await;
    let wait = retry_after(&resp);
    assert!((1..=60).contains(&wait), "{wait}");
    let error = assert_openai_error(resp, 429, "rate_limit_error").await;
    assert_eq!(error["code"], "rate_limit_exceeded");
    assert!(error["message"]
        .as_str()
        .unwrap()
        .contains("tokens per minute"));
    // A request larger than a minute's budget can never fit: no Retry-After.
    let mut big = chat_body("hello", false);
    big["max_tokens"] = json!(1000);
    let resp = post_as(&h, Some(FRUGAL_KEY), &big).await;
    assert!(!resp.headers().contains_key("retry-after"));
    let error = assert_openai_error(resp, 429, "rate_limit_error").await;
    assert_eq!(error["param"], "max_tokens");
    // Other tenants are not affected.
    let ok = post_as(&h, Some(ACME_KEY), &chat_body("hello", false)).await;
    assert_eq!(ok.status(), 200);
    let text = metrics(&h).await;
    for line in [
        "metronome_gateway_tenant_rejections_total{tenant=\"slow\",reason=\"requests_per_second\"} 1",
        "metronome_gateway_tenant_rejections_total{tenant=\"frugal\",reason=\"tokens_per_minute\"} 1",
        "metronome_gateway_tenant_rejections_total{tenant=\"frugal\",reason=\"request_too_large\"} 1",
        "metronome_gateway_tenant_admitted_tokens_total{tenant=\"frugal\"} 25",
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
}

/// Input a chat template renders into the prompt counts against `tokens_per_minute` like
/// the messages do: a two-character message with a long tool list, a response schema or
/// an image costs far more than the message.
#[tokio::test]
async fn tools_schemas_and_images_count_against_tokens_per_minute() {
    let h = Harness::start_with_key(tenants, Some(ACME_KEY)).await;
    let mut body = chat_body("hi", false);
    body["max_tokens"] = json!(1);
    let padding = "x".repeat(400);
    let with = |field: &str, value: Value| {
        let mut b = body.clone();
        b[field] = value;
        b
    };
    let hostile = [
        with(
            "tools",
            json!([{"type": "function", "function": {"name": "f", "description": padding}}]),
        ),
        with(
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "s", "description": padding}}),
        ),
        with(
            "messages",
            json!([{"role": "user", "content": [{"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}]}]),
        ),
    ];
    for b in &hostile {
        let resp = post_as(&h, Some(FRUGAL_KEY), b).await;
        let error = assert_openai_error(resp, 429, "rate_limit_error").await;
        assert!(
            error["message"]
                .as_str()
                .unwrap()
                .contains("tokens per minute"),
            "{error}"
        );
    }
    // The message alone fits.
    let ok = post_as(&h, Some(FRUGAL_KEY), &body).await;
    assert_eq!(ok.status(), 200);
}

#[tokio::test]
async fn anonymous_access_when_enabled_runs_as_tenant_anonymous() {
    let h = Harness::start(|c| {
        tenants(c);
        c.allow_anonymous = true;
        c.tenants.push(TenantConfig {
            models: ModelList::Only(vec![MODEL.into()]),
            ..TenantConfig::unlimited("anonymous")
        });
    })
    .await;
    let mut submitted = h.client.subscribe(SUBJECT_JOBS_SUBMIT_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let resp = post_as(&h, None, &chat_body("hello", false)).await;
    assert_eq!(resp.status(), 200);
    let (_, job) = next_job(&mut submitted).await;
    assert_eq!(job.tenant.as_deref(), Some("anonymous"));
    // OpenAI clients always send a key: an unknown one is anonymous too, a revoked one
    // is refused, a configured one keeps its tenant.
    let resp = post_as(&h, Some("unused"), &chat_body("hello", false)).await;
    assert_eq!(resp.status(), 200);
    let (_, job) = next_job(&mut submitted).await;
    assert_eq!(job.tenant.as_deref(), Some("anonymous"));
    let resp = post_as(&h, Some(REVOKED_KEY), &chat_body("hello", false)).await;
    assert_openai_error(resp, 401, "invalid_request_error").await;
    let resp = post_as(&h, Some(BETA_KEY), &chat_body("hello", false)).await;
    let error = assert_openai_error(resp, 403, "invalid_request_error").await;
    assert_eq!(error["code"], "model_not_allowed");
}

/// Runs `metronome-gateway keys create` and returns its standard output.
fn keys_create(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_metronome-gateway"))
        .args(["keys", "create"])
        .args(args)
        .output()
        .expect("metronome-gateway runs");
    assert!(
        out.status.success(),
        "keys create failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn keys_create_prints_a_key_that_then_authenticates() {
    let stdout = keys_create(&["--tenant", "cli", "--models", MODEL, "--note", "test"]);
    let (key, config_lines) = stdout.split_once('\n').unwrap();
    assert!(key.starts_with("mtk_") && key.len() == 68, "{key}");
    assert!(
        !config_lines.contains(key),
        "only the hash is in the config lines"
    );
    assert!(config_lines.contains(&key_sha256(key)));
    let printed = Config::from_toml(config_lines, "stdout").expect("the lines are TOML");
    printed
        .validate()
        .expect("the lines are a valid configuration");
    let h = Harness::start_with_key(
        |c| {
            c.allow_anonymous = false;
            c.tenants = printed.tenants.clone();
            c.keys = printed.keys.clone();
        },
        Some(key),
    )
    .await;
    let mut submitted = h.client.subscribe(SUBJECT_JOBS_SUBMIT_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let resp = h
        .post("/v1/chat/completions", &chat_body("hello", false))
        .await;
    assert_eq!(resp.status(), 200);
    let (_, job) = next_job(&mut submitted).await;
    assert_eq!(job.tenant.as_deref(), Some("cli"));

    // --append: the key alone on stdout, the entries in the file (the tenant once).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gateway.toml");
    std::fs::write(&file, "allow_anonymous = false\n").unwrap();
    let first = keys_create(&["--tenant", "cli", "--append", file.to_str().unwrap()]);
    let second = keys_create(&["--tenant", "cli", "--append", file.to_str().unwrap()]);
    assert_eq!(first.lines().count(), 1);
    let (first, second) = (first.trim(), second.trim());
    let saved = Config::load_valid(Some(&file), |_| None).expect("the file stays valid");
    assert_eq!(saved.tenants.len(), 1);
    assert_eq!(
        saved
            .keys
            .iter()
            .map(|k| k.sha256.clone())
            .collect::<Vec<_>>(),
        [key_sha256(first), key_sha256(second)]
    );
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(!text.contains(first) && !text.contains(second));
}

/// `metronome keys create|list|revoke` against a running gateway on a real nats-server:
/// a created key is served without a restart (with its configured tenant's model list, or
/// every model for a tenant the file does not name), `list` shows it with the tenant's
/// usage at this gateway, and a revoked one is refused. Each change is polled for (the
/// watch brings it within a second), never timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_created_and_revoked_live_take_effect_without_a_restart() {
    use metronome_cli::keys;
    let h = Harness::start_with_key(tenants, Some(ACME_KEY)).await;
    let nats = metronome_readmodel::source::Nats {
        client: h.client.clone(),
        js: h.js.clone(),
    };
    let status_of = |key: String| {
        let request = h.http.get(h.url("/v1/models")).bearer_auth(key);
        async move {
            request
                .send()
                .await
                .expect("request sent")
                .status()
                .as_u16()
        }
    };

    let acme = keys::create(&nats, "acme", Some("ci".into()), false, None)
        .await
        .expect("create");
    wait_for("the gateway serves the new key", WAIT, || {
        let status = status_of(acme.key.clone());
        async move { (status.await == 200).then_some(()) }
    })
    .await;
    let mut submitted = h.client.subscribe(SUBJECT_JOBS_SUBMIT_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let resp = post_as(&h, Some(&acme.key), &chat_body("hello", false)).await;
    assert_eq!(resp.status(), 200);
    let (_, job) = next_job(&mut submitted).await;
    assert_eq!(job.tenant.as_deref(), Some("acme"));
    // The configuration's tenant: its model list holds.
    let body: Value = models_as(&h, Some(&acme.key)).await.json().await.unwrap();
    assert_eq!(body["data"].as_array().unwrap().len(), 1);

    // A tenant the file does not name: every model, and its jobs carry it.
    let newco = keys::create(&nats, "newco", None, false, None)
        .await
        .unwrap();
    wait_for("the gateway serves the second key", WAIT, || {
        let status = status_of(newco.key.clone());
        async move { (status.await == 200).then_some(()) }
    })
    .await;
    let resp = post_as(&h, Some(&newco.key), &chat_body("hello", false)).await;
    assert_eq!(resp.status(), 200);
    let (_, job) = next_job(&mut submitted).await;
    assert_eq!(job.tenant.as_deref(), Some("newco"));

    // `list`: both keys, with each tenant's usage as this gateway counts it.
    let text = metrics(&h).await;
    let rows = keys::rows(keys::records(&nats).await.unwrap(), Some(&text));
    let row = |tenant: &str| rows.iter().find(|r| r.record.tenant == tenant).unwrap();
    assert_eq!(row("acme").id, acme.id);
    assert_eq!(row("acme").record.note.as_deref(), Some("ci"));
    assert_eq!(row("acme").usage.unwrap().requests, 1.0, "its one chat");
    assert!(row("newco").usage.unwrap().admitted_tokens > 0.0);
    assert!(!rows.iter().any(|r| r.record.revoked));

    // Revoke: refused as revoked; the other key still served.
    match keys::revoke(&nats, &acme.id).await.expect("revoke") {
        keys::Revoked::Record(r) => assert!(r.revoked && r.revoked_ms.is_some()),
        other => panic!("the bucket's record is revoked: {other:?}"),
    }
    wait_for("the gateway refuses the revoked key", WAIT, || {
        let status = status_of(acme.key.clone());
        async move { (status.await == 401).then_some(()) }
    })
    .await;
    let refused = post_as(&h, Some(&acme.key), &chat_body("hello", false)).await;
    let error = assert_openai_error(refused, 401, "invalid_request_error").await;
    assert!(error.to_string().contains("revoked"), "{error}");
    assert_eq!(status_of(newco.key.clone()).await, 200);
    assert_eq!(
        status_of(ACME_KEY.into()).await,
        200,
        "the file's keys keep working"
    );
    let listed = keys::records(&nats).await.unwrap();
    assert!(
        listed.iter().any(|r| r.tenant == "acme" && r.revoked),
        "a revoked key stays listed"
    );
    assert!(matches!(
        keys::revoke(&nats, "fffff").await,
        Err(metronome_cli::CliError::Usage(_))
    ));
}

/// A key of the gateway's configuration file revoked live: `metronome keys revoke <id>`
/// finds no record of the id in the bucket, stores a revocation of it, and the running
/// gateway refuses the key, without a restart, while the file's other keys keep working;
/// deleting the revocation lets the key in again. Polled for, never timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_key_is_revoked_live_by_its_id() {
    use metronome_cli::keys;
    use metronome_protocol::api_keys::Revocation;
    let h = Harness::start_with_key(tenants, Some(ACME_KEY)).await;
    let nats = metronome_readmodel::source::Nats {
        client: h.client.clone(),
        js: h.js.clone(),
    };
    let status_of = |key: &'static str| {
        let request = h.http.get(h.url("/v1/models")).bearer_auth(key);
        async move {
            request
                .send()
                .await
                .expect("request sent")
                .status()
                .as_u16()
        }
    };
    assert_eq!(status_of(BETA_KEY).await, 200);
    let id = metronome_gateway::api_key::key_id(&key_sha256(BETA_KEY)).to_string();

    let revocation = match keys::revoke(&nats, &id).await.expect("revoke") {
        keys::Revoked::Configured(r) => r,
        other => panic!("the bucket has no record of a file's key: {other:?}"),
    };
    assert_eq!(revocation.id, id);
    wait_for("the gateway refuses the revoked file key", WAIT, || {
        let status = status_of(BETA_KEY);
        async move { (status.await == 401).then_some(()) }
    })
    .await;
    let refused = post_as(&h, Some(BETA_KEY), &chat_body("hello", false)).await;
    let error = assert_openai_error(refused, 401, "invalid_request_error").await;
    assert!(error.to_string().contains("revoked"), "{error}");
    assert_eq!(status_of(ACME_KEY).await, 200, "the file's other keys");
    assert_eq!(
        keys::revocations(&nats).await.unwrap(),
        std::slice::from_ref(&revocation),
        "listed"
    );
    assert!(
        keys::records(&nats).await.unwrap().is_empty(),
        "a revocation is not a key record"
    );
    // Revoking it again finds the revocation stored before.
    match keys::revoke(&nats, &id).await.unwrap() {
        keys::Revoked::Configured(again) => assert_eq!(again, revocation),
        other => panic!("{other:?}"),
    }

    // Deleting the revocation lets the key in again.
    h.js.get_key_value(metronome_protocol::names::BUCKET_API_KEYS)
        .await
        .unwrap()
        .delete(Revocation::bucket_key(&id))
        .await
        .unwrap();
    wait_for("the gateway serves the key again", WAIT, || {
        let status = status_of(BETA_KEY);
        async move { (status.await == 200).then_some(()) }
    })
    .await;
}
