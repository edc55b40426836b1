//! `METRONOME_LOG_FORMAT=json`: every line every binary writes is one JSON object, and the
//! worker's lines about a job carry the job id and the worker id as fields.

use metronome_e2e::{chat_body, worker_id, Cluster, ClusterSpec};
use metronome_testkit::wait_for;
use serde_json::Value;
use std::time::Duration;

const MODEL: &str = "e2e-model";

/// Every complete line of `text` as JSON (a line still being written is left for the next
/// read); panics naming the first line that is not an object.
fn json_lines(name: &str, text: &str) -> Vec<Value> {
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .map(|line| match serde_json::from_str::<Value>(line) {
            Ok(v) if v.is_object() => v,
            _ => panic!("{name}: a log line that is not a JSON object: {line:?}"),
        })
        .collect()
}

/// Whether `line` (or one of its spans) has `key` equal to `value`.
fn has_field(line: &Value, key: &str, value: &str) -> bool {
    line[key] == value
        || line["spans"]
            .as_array()
            .is_some_and(|spans| spans.iter().any(|s| s[key] == value))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_binary_writes_one_json_object_per_line() {
    let mut spec = ClusterSpec::uniform(1, MODEL);
    spec.env = vec![("METRONOME_LOG_FORMAT".into(), "json".into())];
    let cluster = Cluster::start(spec).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .json(&chat_body(MODEL, 4, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", cluster.logs());
    let job_id = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let worker = worker_id(0);

    // The worker logs the job's start inside its job span; wait for that line.
    let worker_log = cluster.log_path(&worker);
    let lines = wait_for(
        "the worker's log line about the job",
        Duration::from_secs(30),
        || {
            let text = std::fs::read_to_string(&worker_log).unwrap_or_default();
            let job_id = job_id.clone();
            let worker = worker.clone();
            async move {
                let lines = json_lines(&worker, &text);
                lines
                    .iter()
                    .any(|l| has_field(l, "job_id", &job_id) && has_field(l, "worker_id", &worker))
                    .then_some(lines)
            }
        },
    )
    .await;
    assert!(lines
        .iter()
        .all(|l| l["level"].is_string() && l["timestamp"].is_string()));

    for name in ["gateway", "dispatcher-0", "gpu-sim"] {
        let text = std::fs::read_to_string(cluster.log_path(name)).unwrap();
        let lines = json_lines(name, &text);
        assert!(!lines.is_empty(), "{name} logged nothing");
        assert!(
            lines
                .iter()
                .all(|l| l["level"].is_string() && l["timestamp"].is_string()),
            "{name}: {text}"
        );
    }
}
