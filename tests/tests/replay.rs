//! `metronome replay` against a running system: the decisions the real dispatcher made are
//! re-decided from their records, with the dispatcher's own weights (no placement changes)
//! and with other weights (a number of placements known from how the cluster is built).

use std::process::Command;

use metronome_e2e::{chat_body, worker_id, Cluster, ClusterSpec};
use metronome_testkit::bin_path;

const MODEL: &str = "replay-model";
const JOBS: usize = 4;

/// Every weight 0, or `1.0` for the one term named.
fn weights_toml(only: Option<&str>) -> String {
    let mut text = String::from("[scheduler.weights]\n");
    for term in [
        "active_requests",
        "queue_depth",
        "latency_ewma",
        "job_cost",
        "throughput_ewma",
        "kv_pressure",
        "gpu_utilisation",
    ] {
        let w = if Some(term) == only { 1.0 } else { 0.0 };
        text.push_str(&format!("{term} = {w:.1}\n"));
    }
    text
}

fn replay(cluster: &Cluster, config: &std::path::Path, json: bool) -> String {
    let mut cmd = Command::new(bin_path("metronome"));
    cmd.args(["--nats-url", &cluster.nats.url(), "replay", "--since", "1h"])
        .arg("--config")
        .arg(config);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("run metronome");
    assert!(
        out.status.success(),
        "metronome replay: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_the_same_weights_changes_nothing_and_with_others_a_known_number() {
    let mut spec = ClusterSpec::uniform(2, MODEL);
    // GPU 0's KV cache is a fifth of GPU 1's (the default 40 000 tokens), so on an idle
    // cluster its KV pressure after admitting a job is always the higher of the two.
    spec.gpu_knobs = vec![vec![
        "kv_capacity_tokens = 8192".into(),
        "max_model_len = 4096".into(),
    ]];
    // The dispatcher scores with every weight at 0: all totals tie, so on an idle cluster
    // every job goes to GPU 0 (fewest active, then the lower worker id).
    spec.dispatcher_knobs = weights_toml(None).lines().map(String::from).collect();
    let cluster = Cluster::start(spec).await;
    let http = reqwest::Client::new();
    for _ in 0..JOBS {
        cluster.wait_idle().await;
        let resp = http
            .post(format!("{}/v1/chat/completions", cluster.gateway_url))
            .json(&chat_body(MODEL, 8, false))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{}", cluster.logs());
        assert_eq!(
            resp.headers()["x-metronome-worker"].to_str().unwrap(),
            worker_id(0),
            "an idle tie goes to GPU 0"
        );
    }

    let same = cluster.dir.path().join("same.toml");
    std::fs::write(&same, weights_toml(None)).unwrap();
    let report: serde_json::Value = serde_json::from_str(&replay(&cluster, &same, true)).unwrap();
    assert_eq!(report["replayed"], JOBS, "{report:#}");
    assert_eq!(report["unchanged"], JOBS, "{report:#}");
    assert_eq!(report["changed"], 0, "{report:#}");

    // Weighing KV pressure alone sends every one of those jobs to GPU 1.
    let kv = cluster.dir.path().join("kv.toml");
    std::fs::write(&kv, weights_toml(Some("kv_pressure"))).unwrap();
    let report: serde_json::Value = serde_json::from_str(&replay(&cluster, &kv, true)).unwrap();
    assert_eq!(report["replayed"], JOBS, "{report:#}");
    assert_eq!(report["changed"], JOBS, "{report:#}");
    assert_eq!(report["unchanged"], 0, "{report:#}");
    let shift = |id: String| {
        let w = report["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == id.as_str())
            .unwrap_or_else(|| panic!("{id} in {report:#}"));
        (
            w["recorded_jobs"].as_u64().unwrap(),
            w["replayed_jobs"].as_u64().unwrap(),
        )
    };
    assert_eq!(shift(worker_id(0)), (JOBS as u64, 0));
    assert_eq!(shift(worker_id(1)), (0, JOBS as u64));
    assert_eq!(report["effect"]["moved_jobs"], JOBS);
    for change in report["changes"].as_array().unwrap() {
        assert_eq!(change["replayed_worker"], worker_id(1).as_str());
        assert!(change["replayed"]["ttft_ms"].as_f64().unwrap() > 0.0);
    }

    let text = replay(&cluster, &kv, false);
    assert!(
        text.contains(&format!("placements that would change: {JOBS} of {JOBS}\n")),
        "{text}"
    );
}
