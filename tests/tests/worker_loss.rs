//! A worker-agent killed while it holds work: its queued, unstarted assignments run on
//! another worker; the job that had already streamed tokens ends with a clear error and its
//! output is never duplicated.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use metronome_e2e::{chat_body, worker_id, Cluster, ClusterSpec};
use metronome_protocol::Outcome;

const MODEL: &str = "e2e-model";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_jobs_finish_elsewhere_or_fail_clearly() {
    let mut spec = ClusterSpec::uniform(2, MODEL);
    spec.worker_max_concurrency = 2;
    let mut cluster = Cluster::start(spec).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", cluster.gateway_url);

    // A long streaming job; wait for some of its tokens.
    let resp = http
        .post(&url)
        .json(&chat_body(MODEL, 1500, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let long_job = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let victim_id = resp.headers()["x-metronome-worker"]
        .to_str()
        .unwrap()
        .to_string();
    let victim = (0..2)
        .find(|i| worker_id(*i) == victim_id)
        .expect("known worker");
    let mut body = resp.bytes_stream();
    let mut received = String::new();
    while received.matches("data:").count() < 5 {
        received.push_str(&String::from_utf8_lossy(
            &body.next().await.unwrap().unwrap(),
        ));
    }

    // Crash the victim's agent, then submit short jobs at once: while its heartbeat still
    // looks fresh some are assigned to it and sit in its WORK queue, unstarted.
    cluster.kill_worker(victim);
    let shorts = (0..6).map(|_| http.post(&url).json(&chat_body(MODEL, 4, false)).send());
    let shorts = futures::future::join_all(shorts).await;

    let mut short_workers = BTreeSet::new();
    for resp in shorts {
        let resp = resp.unwrap();
        assert_eq!(resp.status(), 200, "{}", cluster.logs());
        short_workers.insert(
            resp.headers()["x-metronome-worker"]
                .to_str()
                .unwrap()
                .to_string(),
        );
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["usage"]["completion_tokens"], 4);
    }
    assert!(
        !short_workers.contains(&victim_id),
        "a job reported success from the dead worker"
    );

    // The streamed job ends with an error event, not with [DONE], and nothing repeats.
    let rest = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(b) => received.push_str(&String::from_utf8_lossy(&b)),
                Err(_) => break,
            }
        }
    })
    .await;
    assert!(
        rest.is_ok(),
        "stream of the lost job never ended:\n{}",
        cluster.logs()
    );
    let events = metronome_protocol::sse::data_payloads(&received);
    if events.iter().any(|e| e == "[DONE]") {
        let decisions: Vec<_> = cluster
            .all_decisions()
            .await
            .into_iter()
            .filter(|d| d.job_id == long_job)
            .collect();
        panic!(
            "lost job claimed success after {} events on {victim_id}; decisions {decisions:#?}\n{}",
            events.len(),
            cluster.logs()
        );
    }
    let last: serde_json::Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert!(
        last["error"]["message"].is_string(),
        "last event is an error: {last}"
    );
    let ids: Vec<String> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter(|v| v.get("error").is_none())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert!(ids.len() < 1500, "no more tokens than one generation");

    // Exactly one assigned decision for the lost job: it was not dispatched again.
    let decisions = cluster.all_decisions().await;
    let rescued: Vec<_> = decisions
        .iter()
        .filter(|d| d.job_id != long_job && d.outcome == Outcome::Assigned && d.attempt > 1)
        .collect();
    assert!(
        !rescued.is_empty(),
        "no short job was assigned to the dead worker and rescued: {decisions:#?}"
    );
    assert!(rescued
        .iter()
        .all(|d| d.worker_id.as_deref() != Some(victim_id.as_str())));
    let assigned: Vec<_> = decisions
        .iter()
        .filter(|d| d.job_id == long_job && d.outcome == Outcome::Assigned)
        .collect();
    assert_eq!(assigned.len(), 1, "{assigned:#?}");
}
