//! The EWMA update function against a real redis-server: values stay within the range of
//! the samples, the counters and timestamps advance, the data survives a restart, and an
//! outage is an error that is counted, after which writes resume. Until the function is
//! loaded (the dispatcher's part) an update is a counted error.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::common::load_ewma_function;
use metronome_protocol::redis_keys::{ewma_key, output_len_key};
use metronome_testkit::{wait_for, RedisServer};
use metronome_worker_agent::ewma_store::{EwmaStore, JobSample};
use metronome_worker_agent::AgentMetrics;
use redis::AsyncCommands;

const PREFIX: &str = "t";

fn sample(ttft: f64, tpot: f64, tok_s: f64, e2e: f64, tokens: u32) -> JobSample {
    JobSample {
        ttft_ms: Some(ttft),
        tpot_ms: Some(tpot),
        tok_s: Some(tok_s),
        e2e_ms: Some(e2e),
        output_tokens: Some(tokens),
    }
}

async fn hash(url: &str, key: &str) -> HashMap<String, f64> {
    let mut c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let h: HashMap<String, String> = c.hgetall(key).await.unwrap();
    h.into_iter()
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn averages_stay_in_range_and_survive_a_restart_and_an_outage() {
    let mut redis = RedisServer::start().expect("redis-server");
    let metrics = Arc::new(AgentMetrics::default());
    let store = EwmaStore::new(&redis.url(), PREFIX, 0.3, 60_000, metrics.clone()).unwrap();
    let key = ewma_key(PREFIX, "w1");

    // An agent runs no Lua of its own: before the function is loaded, an update fails.
    let early = sample(1.0, 1.0, 1.0, 1.0, 1);
    let error = store.record("w1", "m", &early, 500).await.unwrap_err();
    assert!(error.to_string().contains("Function not found"), "{error}");
    assert_eq!(metrics.redis_errors.get(), 1);
    load_ewma_function(redis::Client::open(redis.url()).unwrap()).await;

    // The first sample sets the average.
    store
        .record("w1", "m", &sample(100.0, 10.0, 50.0, 1000.0, 20), 1_000)
        .await
        .unwrap();
    let h = hash(&redis.url(), &key).await;
    assert_eq!(
        (h["ttft_ms"], h["samples"], h["updated_ms"], h["alpha"]),
        (100.0, 1.0, 1_000.0, 1.0)
    );

    // Back to back: alpha as configured.
    store
        .record("w1", "m", &sample(200.0, 20.0, 30.0, 3000.0, 40), 1_000)
        .await
        .unwrap();
    let h = hash(&redis.url(), &key).await;
    assert!((h["alpha"] - 0.3).abs() < 1e-9);
    assert!((h["ttft_ms"] - 130.0).abs() < 1e-9, "{h:?}");
    assert!((h["tok_s"] - 44.0).abs() < 1e-9);
    assert_eq!(h["samples"], 2.0);

    // One half-life later the old average weighs half as much as it would have.
    store
        .record("w1", "m", &sample(300.0, 30.0, 10.0, 5000.0, 60), 61_000)
        .await
        .unwrap();
    let h = hash(&redis.url(), &key).await;
    assert!((h["alpha"] - (1.0 - 0.7 * 0.5)).abs() < 1e-9, "{h:?}");
    assert!(h["ttft_ms"] > 100.0 && h["ttft_ms"] < 300.0);

    // A job without a first token leaves the latency averages alone.
    let before = h.clone();
    let no_token = JobSample {
        e2e_ms: Some(10.0),
        output_tokens: Some(0),
        ..JobSample::default()
    };
    store.record("w1", "m", &no_token, 61_001).await.unwrap();
    let h = hash(&redis.url(), &key).await;
    assert_eq!(h["ttft_ms"], before["ttft_ms"]);
    assert_eq!(h["samples"], 4.0);

    let out = hash(&redis.url(), &output_len_key(PREFIX, "m", "w1")).await;
    assert!(out["tokens"] >= 0.0 && out["tokens"] <= 60.0, "{out:?}");
    assert_eq!(out["samples"], 4.0);

    // Restart: the append-only file keeps the averages, and writes land again.
    redis.restart().expect("redis restart");
    assert_eq!(hash(&redis.url(), &key).await["samples"], 4.0);
    wait_for("a write after the restart", Duration::from_secs(15), || {
        let store = store.clone();
        async move {
            store
                .record("w1", "m", &sample(100.0, 10.0, 50.0, 1000.0, 20), 61_002)
                .await
                .ok()
        }
    })
    .await;
    assert_eq!(hash(&redis.url(), &key).await["samples"], 5.0);

    // Outage: an error, counted; after the server is back, writes resume.
    let errors_before = metrics.redis_errors.get();
    redis.stop();
    let err = store
        .record("w1", "m", &sample(1.0, 1.0, 1.0, 1.0, 1), 61_003)
        .await;
    assert!(err.is_err());
    assert!(metrics.redis_errors.get() > errors_before);
    redis.restart().expect("redis back");
    wait_for(
        "writes to resume after the outage",
        Duration::from_secs(15),
        || {
            let store = store.clone();
            async move {
                store
                    .record("w1", "m", &sample(100.0, 10.0, 50.0, 1000.0, 20), 61_004)
                    .await
                    .ok()
            }
        },
    )
    .await;
    assert!(hash(&redis.url(), &key).await["samples"] >= 6.0);
}

/// Concurrent updates from several writers are never lost: the script is atomic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_updates_are_all_counted() {
    let redis = RedisServer::start().expect("redis-server");
    load_ewma_function(redis::Client::open(redis.url()).unwrap()).await;
    let metrics = Arc::new(AgentMetrics::default());
    let store = EwmaStore::new(&redis.url(), PREFIX, 0.2, 60_000, metrics).unwrap();
    let writes = (0..50u32).map(|i| {
        let store = store.clone();
        async move {
            let v = 10.0 + f64::from(i);
            store
                .record("w2", "m2", &sample(v, v, v, v, i), 5_000)
                .await
                .unwrap();
        }
    });
    futures::future::join_all(writes).await;
    let h = hash(&redis.url(), &ewma_key(PREFIX, "w2")).await;
    assert_eq!(h["samples"], 50.0);
    for f in ["ttft_ms", "tpot_ms", "tok_s", "e2e_ms"] {
        assert!(
            (10.0..=59.0).contains(&h[f]),
            "{f} = {} outside the samples' range",
            h[f]
        );
    }
}

/// The Redis script and the scheduling core's EWMA maths are one formula: the agent writes
/// what the dispatcher's model of the average says it should.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_applies_the_cores_ewma_formula() {
    use metronome_scheduler::ewma::{decayed_alpha, update};
    let redis = RedisServer::start().expect("redis-server");
    load_ewma_function(redis::Client::open(redis.url()).unwrap()).await;
    let (alpha, half_life) = (0.3, 2_000u64);
    let store = EwmaStore::new(
        &redis.url(),
        PREFIX,
        alpha,
        half_life,
        Arc::new(AgentMetrics::default()),
    )
    .unwrap();
    let samples = [
        (1_000u64, 40.0),
        (1_000, 10.0),
        (1_500, 25.0),
        (9_000, 70.0),
        (9_100, 5.0),
    ];
    let mut expected: Option<f64> = None;
    let mut last_ms: Option<u64> = None;
    for (now_ms, ttft) in samples {
        store
            .record("w-formula", "m", &sample(ttft, 1.0, 1.0, 1.0, 1), now_ms)
            .await
            .expect("record");
        let a = match last_ms {
            None => 1.0,
            Some(prev) => decayed_alpha(alpha, half_life as f64, now_ms as f64 - prev as f64),
        };
        expected = Some(update(expected, ttft, a));
        last_ms = Some(now_ms);
        let got = hash(&redis.url(), &ewma_key(PREFIX, "w-formula")).await["ttft_ms"];
        let want = expected.unwrap();
        assert!(
            (got - want).abs() < 1e-9,
            "at {now_ms}: redis {got}, core {want}"
        );
    }
}
