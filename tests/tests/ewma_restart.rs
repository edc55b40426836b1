//! Averages live in Redis and outlast every Metronome process: a GPU at half speed gets a
//! worse EWMA, and after all Metronome processes restart the dispatcher's first decision
//! still prefers the fast GPU.

use metronome_e2e::{chat_body, worker_id, Cluster, ClusterSpec, GpuSpec};
use metronome_protocol::Outcome;

const MODEL: &str = "e2e-model";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ewmas_survive_a_restart_and_keep_the_fast_gpu_preferred() {
    // GPU 0 is slow. Worker ids break ties in GPU 0's favour, so a dispatcher that forgot the
    // averages would pick the slow one.
    let mut spec = ClusterSpec::uniform(2, MODEL);
    spec.gpus[0] = GpuSpec {
        model: MODEL.into(),
        speed: 0.5,
    };
    let mut cluster = Cluster::start(spec).await;
    let http = reqwest::Client::new();

    // Pairs of simultaneous requests on two idle GPUs land one on each, so both get samples.
    for _ in 0..4 {
        let pair = (0..2).map(|_| {
            http.post(format!("{}/v1/chat/completions", cluster.gateway_url))
                .json(&chat_body(MODEL, 24, false))
                .send()
        });
        for resp in futures::future::join_all(pair).await {
            assert_eq!(resp.unwrap().status(), 200, "{}", cluster.logs());
        }
    }

    let (slow, fast) = (
        cluster.ewma(&worker_id(0)).await,
        cluster.ewma(&worker_id(1)).await,
    );
    for field in ["ttft_ms", "tpot_ms", "tok_s", "samples", "updated_ms"] {
        assert!(
            slow.contains_key(field) && fast.contains_key(field),
            "{field}: {slow:?} {fast:?}"
        );
    }
    assert!(
        slow["tpot_ms"] > fast["tpot_ms"],
        "slow {slow:?} fast {fast:?}"
    );
    assert!(slow["tok_s"] < fast["tok_s"], "slow {slow:?} fast {fast:?}");

    cluster.restart_metronome().await;

    let resp = http
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .json(&chat_body(MODEL, 4, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", cluster.logs());
    let job = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let decision = cluster.decision(&job).await;
    assert_eq!(decision.outcome, Outcome::Assigned);
    assert_eq!(
        decision.worker_id.as_deref(),
        Some(worker_id(1).as_str()),
        "{decision:#?}"
    );
    let slow_candidate = decision
        .candidates
        .iter()
        .find(|c| c.worker_id == worker_id(0))
        .expect("slow GPU was a candidate");
    let latency = slow_candidate.term(
        metronome_protocol::TermName::ThroughputEwma,
        &decision.scoring.unwrap_or_default(),
    );
    assert!(
        latency.available,
        "EWMA known right after restart: {decision:#?}"
    );
}
