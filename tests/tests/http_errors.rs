//! Every HTTP error case returns its status and an OpenAI-shaped error body, and the system
//! keeps serving afterwards.

use metronome_e2e::{chat_body, Cluster, ClusterSpec};
use metronome_protocol::names::{queue_key, BUCKET_QUEUES};
use metronome_protocol::QueueSnapshot;

const MODEL: &str = "e2e-model";

async fn assert_openai_error(resp: reqwest::Response, status: u16) -> serde_json::Value {
    assert_eq!(resp.status(), status);
    let body: serde_json::Value = resp.json().await.unwrap();
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(error["type"].is_string(), "{body}");
    assert!(
        error.get("code").is_some() && error.get("param").is_some(),
        "{body}"
    );
    body
}

async fn assert_still_serving(http: &reqwest::Client, cluster: &Cluster) {
    let resp = http
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .json(&chat_body(MODEL, 3, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", cluster.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_openai_shaped_and_the_system_keeps_serving() {
    // One slow-ish GPU taking one request at a time and a queue of one, so "busy", "queue
    // full" and "no capacity before the deadline" can be produced on purpose.
    let mut spec = ClusterSpec::uniform(1, MODEL);
    spec.worker_max_concurrency = 1;
    spec.dispatcher_knobs = vec!["queue_bound_per_model = 1".into()];
    spec.gateway_knobs = vec!["body_limit_bytes = 65536".into()];
    let mut cluster = Cluster::start(spec).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", cluster.gateway_url);

    // 400: not JSON.
    let resp = http
        .post(&url)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_openai_error(resp, 400).await;
    assert_still_serving(&http, &cluster).await;

    // 400: wrong types.
    let resp = http
        .post(&url)
        .json(&serde_json::json!({"model": MODEL, "messages": "hello", "max_tokens": -3}))
        .send()
        .await
        .unwrap();
    assert_openai_error(resp, 400).await;

    // 404: unknown model.
    let resp = http
        .post(&url)
        .json(&chat_body("no-such-model", 4, false))
        .send()
        .await
        .unwrap();
    let body = assert_openai_error(resp, 404).await;
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no-such-model"));
    assert_still_serving(&http, &cluster).await;

    // 413: body over the limit.
    let mut big = chat_body(MODEL, 4, false);
    big["messages"][0]["content"] = serde_json::Value::String("x".repeat(200_000));
    let resp = http.post(&url).json(&big).send().await.unwrap();
    assert_openai_error(resp, 413).await;
    assert_still_serving(&http, &cluster).await;

    // Occupy the only GPU with a long generation. A streaming response starts when the
    // first token exists, so once its headers are here the job is running.
    let long = http
        .post(&url)
        .json(&chat_body(MODEL, 600, true))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200, "{}", cluster.logs());

    // 503 with Retry-After: nothing can start before a 300 ms deadline.
    let resp = http
        .post(&url)
        .header("x-metronome-deadline-ms", "300")
        .json(&chat_body(MODEL, 2, false))
        .send()
        .await
        .unwrap();
    assert!(
        resp.headers().contains_key("retry-after"),
        "{:?}",
        resp.headers()
    );
    assert_openai_error(resp, 503).await;

    // 429: several at once while the GPU is busy; the queue holds one, the rest are refused.
    // The deadline's job held the queue until it expired: once the leader's snapshot says
    // nothing waits, the gateway (which sheds on that snapshot) leaves the fillers to the
    // leader's own rule.
    wait_queue_empty(&cluster).await;
    let fillers: Vec<_> = (0..4)
        .map(|_| {
            let http = http.clone();
            let url = url.clone();
            tokio::spawn(async move {
                http.post(&url)
                    .json(&chat_body(MODEL, 2, false))
                    .send()
                    .await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    let mut filler_jobs = Vec::new();
    for filler in fillers {
        let resp = filler.await.unwrap().unwrap();
        let status = resp.status().as_u16();
        filler_jobs.push(
            resp.headers()["x-metronome-job-id"]
                .to_str()
                .unwrap()
                .to_string(),
        );
        if status == 429 {
            assert_openai_error(resp, 429).await;
        }
        statuses.push(status);
    }
    statuses.sort();
    if statuses != vec![200, 429, 429, 429] {
        let mut decisions = Vec::new();
        for job in &filler_jobs {
            decisions.push(cluster.decision(job).await);
        }
        panic!(
            "statuses {statuses:?}\ndecisions {decisions:#?}\n{}",
            cluster.logs()
        );
    }
    let events = metronome_protocol::sse::data_payloads(&long.text().await.unwrap());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    // The queued filler ran; until the leader's snapshot says so, the gateway would shed.
    wait_queue_empty(&cluster).await;
    assert_still_serving(&http, &cluster).await;

    // 503: NATS is down. Then NATS comes back and the system serves again.
    cluster.nats.stop();
    let resp = http
        .post(&url)
        .json(&chat_body(MODEL, 2, false))
        .send()
        .await
        .unwrap();
    assert_openai_error(resp, 503).await;
    cluster.nats.restart().expect("restart nats");
    cluster.wait_ready().await;
    assert_still_serving(&http, &cluster).await;
}

/// Waits until the leader's snapshot of `MODEL`'s queue in the `queues` bucket (what the
/// gateway sheds on) says nothing waits.
async fn wait_queue_empty(cluster: &Cluster) {
    let kv = cluster
        .jetstream()
        .await
        .get_key_value(BUCKET_QUEUES)
        .await
        .expect("the queues bucket");
    metronome_testkit::wait_for(
        "the queue's snapshot to say nothing waits",
        std::time::Duration::from_secs(20),
        || {
            let kv = kv.clone();
            async move {
                let value = kv.get(queue_key(MODEL)).await.ok()??;
                let snapshot: QueueSnapshot = serde_json::from_slice(&value).ok()?;
                (snapshot.waiting == 0).then_some(())
            }
        },
    )
    .await;
}

/// `metronome_gateway_shed_total{reason="queue_full"}` at the gateway.
async fn shed_queue_full(http: &reqwest::Client, cluster: &Cluster) -> f64 {
    let text = http
        .get(format!("{}/metrics", cluster.gateway_url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metronome_protocol::prometheus::sum_where(
        &text,
        "metronome_gateway_shed_total",
        &[("reason", "queue_full")],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_whose_queue_is_known_full_is_shed_at_the_gateway_until_it_drains() {
    // One GPU taking one request at a time and a queue of one: a long generation runs, one
    // request waits, and the leader's snapshot of the queue says it is full.
    let mut spec = ClusterSpec::uniform(1, MODEL);
    spec.worker_max_concurrency = 1;
    spec.dispatcher_knobs = vec!["queue_bound_per_model = 1".into()];
    let cluster = Cluster::start(spec).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", cluster.gateway_url);
    let long = http
        .post(&url)
        .json(&chat_body(MODEL, 3000, true))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200, "{}", cluster.logs());
    let waiting = tokio::spawn({
        let (http, url) = (http.clone(), url.clone());
        async move {
            http.post(&url)
                .json(&chat_body(MODEL, 2, false))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    // Until the gateway has read the full queue's snapshot, the leader refuses (429 after
    // the round trip); from then on the gateway does, without publishing.
    let before = shed_queue_full(&http, &cluster).await;
    metronome_testkit::wait_for(
        "the gateway to shed on the queue's snapshot",
        std::time::Duration::from_secs(20),
        || {
            let (http, url) = (http.clone(), url.clone());
            let cluster = &cluster;
            async move {
                let resp = http
                    .post(&url)
                    .json(&chat_body(MODEL, 2, false))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 429, "{}", cluster.logs());
                (shed_queue_full(&http, cluster).await > before).then_some(())
            }
        },
    )
    .await;
    let resp = http
        .post(&url)
        .json(&chat_body(MODEL, 2, false))
        .send()
        .await
        .unwrap();
    let shed_after = shed_queue_full(&http, &cluster).await;
    assert!(
        resp.headers().contains_key("retry-after"),
        "{:?}",
        resp.headers()
    );
    let job = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let body = assert_openai_error(resp, 429).await;
    assert_eq!(body["error"]["code"], "queue_full", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("waiting"),
        "{body}"
    );
    assert!(shed_after >= before + 2.0, "{shed_after} {before}");
    // Shed before publishing: the leader never heard of the job.
    let decisions = cluster.all_decisions().await;
    assert!(
        decisions.iter().all(|d| d.job_id != job),
        "the shed job {job} reached the leader"
    );
    // The long generation's client goes away (its job is cancelled), the waiting request
    // runs, the queue drains and its snapshot says so: requests are taken again.
    drop(long);
    assert_eq!(waiting.await.unwrap(), 200, "{}", cluster.logs());
    metronome_testkit::wait_for(
        "the gateway to take requests again once the queue drained",
        std::time::Duration::from_secs(20),
        || {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let resp = http
                    .post(&url)
                    .json(&chat_body(MODEL, 2, false))
                    .send()
                    .await
                    .unwrap();
                (resp.status() == 200).then_some(())
            }
        },
    )
    .await;
}
