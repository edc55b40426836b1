//! Tests that run the `metronome-dispatcher` binary as real processes: EWMAs read from
//! Redis survive a dispatcher restart (and a Redis outage keeps the last values), and
//! killing the leader with SIGKILL lets a standby take over with every job published
//! before, during and after the kill assigned exactly once.

use crate::common;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use metronome_protocol::{names, CompletionOutcome, Outcome, WorkerStatus};
use metronome_testkit::{wait_for, ChildGuard};
use tokio_util::sync::CancellationToken;

struct Proc {
    guard: ChildGuard,
    metrics_port: u16,
    _dir: tempfile::TempDir,
}

/// `GET /metrics` of a dispatcher process.
async fn scrape(port: u16) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).await.ok()?;
    Some(body)
}

fn spawn_dispatcher(env: &Env, id: &str) -> Proc {
    let dir = tempfile::tempdir().unwrap();
    let metrics_port = metronome_testkit::free_port();
    let config = format!(
        r#"
dispatcher_id = "{id}"
lease_ttl_ms = 1500
lease_renew_ms = 250
fence_after_ms = 1000
standby_poll_ms = 100
tick_ms = 50
ewma_refresh_ms = 200
storage = "memory"
metrics_addr = "127.0.0.1:{metrics_port}"

[scheduler]
heartbeat_timeout_ms = 60000
"#
    );
    let path = dir.path().join("dispatcher.toml");
    std::fs::write(&path, config).unwrap();
    let log = std::fs::File::create(dir.path().join("dispatcher.log")).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_metronome-dispatcher"));
    cmd.arg("--config")
        .arg(&path)
        .env("NATS_URL", env.nats.url())
        .env("REDIS_URL", env.redis.url())
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    Proc {
        guard: ChildGuard::spawn(id, cmd).expect("spawn dispatcher"),
        metrics_port,
        _dir: dir,
    }
}

/// Who holds the lease now, according to the `leader` bucket.
async fn leader(env: &Env) -> Option<String> {
    let kv = env.js.get_key_value(names::BUCKET_LEADER).await.ok()?;
    let v = kv.get(names::LEADER_KEY).await.ok()??;
    let lease: serde_json::Value = serde_json::from_slice(&v).ok()?;
    lease["dispatcher_id"].as_str().map(str::to_string)
}

/// Keep heartbeats of `workers` fresh (the bucket forgets silent workers).
fn keep_alive(env: &Env, mut workers: Vec<WorkerStatus>) -> CancellationToken {
    let token = CancellationToken::new();
    let kv = env.workers.clone();
    let stop = token.clone();
    tokio::spawn(async move {
        while !stop.is_cancelled() {
            for w in workers.iter_mut() {
                w.seq += 1;
                w.sent_ms = metronome_protocol::time::unix_ms();
                let _ = kv
                    .put(w.worker_id.as_str(), serde_json::to_vec(w).unwrap().into())
                    .await;
            }
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    });
    token
}

/// Submit one job, check the EWMA terms were available, finish it; returns the winner.
async fn run_one(env: &Env, id: &str) -> String {
    env.submit(id, "model-e", 100, 100).await;
    let d = env
        .decisions_for(&[id.to_string()])
        .await
        .remove(id)
        .unwrap();
    assert_eq!(d.outcome, Outcome::Assigned, "{d:?}");
    let latency =
        d.terms_of(&d.candidates[0])[metronome_protocol::TermName::LatencyEwma.index()].clone();
    assert!(latency.available, "EWMA read from Redis: {latency:?}");
    for (a, _) in env.take_work(d.worker_id.as_deref().unwrap()).await {
        env.complete(&a, CompletionOutcome::Done).await;
    }
    d.worker_id.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_ewmas_steer_away_from_a_slow_worker_across_restarts() {
    let mut env = Env::start().await;
    // The slow worker sorts first, so a tie would pick it: only the EWMAs make "w-b" win.
    env.seed_ewma("w-a", 2_000.0, 5.0).await;
    env.seed_ewma("w-b", 50.0, 100.0).await;
    let slow = worker("w-a", "model-e", 8);
    let fast = worker("w-b", "model-e", 8);
    for w in [&slow, &fast] {
        env.work_consumer(&w.worker_id).await;
        env.heartbeat(w).await;
    }
    let beat = keep_alive(&env, vec![slow, fast]);

    let mut first = spawn_dispatcher(&env, "ewma-1");
    assert_eq!(run_one(&env, "e1").await, "w-b");
    assert!(
        first.guard.signal_and_wait(15, Duration::from_secs(10)),
        "graceful stop"
    );

    let second = spawn_dispatcher(&env, "ewma-2");
    assert_eq!(
        run_one(&env, "e2").await,
        "w-b",
        "after a restart the EWMAs are read again"
    );

    // Redis goes away: the last values stay in use.
    env.redis.kill();
    wait_for("the dispatcher to notice Redis is down", WAIT, || async {
        let text = scrape(second.metrics_port).await?;
        text.contains("metronome_dispatcher_redis_up 0")
            .then_some(())
    })
    .await;
    assert_eq!(
        run_one(&env, "e3").await,
        "w-b",
        "Redis down: last EWMAs kept"
    );
    beat.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_loses_and_duplicates_nothing() {
    let env = Env::start().await;
    let ws: Vec<WorkerStatus> = (0..4)
        .map(|i| worker(&format!("f-{i}"), "model-f", 10_000))
        .collect();
    for w in &ws {
        env.work_consumer(&w.worker_id).await;
        env.heartbeat(w).await;
    }
    let beat = keep_alive(&env, ws.clone());

    let mut a = spawn_dispatcher(&env, "disp-a");
    wait_for("disp-a leads", WAIT, || async {
        (leader(&env).await.as_deref() == Some("disp-a")).then_some(())
    })
    .await;
    let _b = spawn_dispatcher(&env, "disp-b");

    let ids: Vec<String> = (0..300).map(|i| format!("fo-{i}")).collect();
    // Before: A leads and decides some of them.
    for id in &ids[..100] {
        env.submit(id, "model-f", 10, 10).await;
    }
    env.decisions_for(&ids[..20]).await;
    // During: the leader dies mid-stream; jobs keep arriving while nobody leads.
    assert!(
        a.guard.signal_and_wait(9, Duration::from_secs(5)),
        "leader killed"
    );
    for id in &ids[100..200] {
        env.submit(id, "model-f", 10, 10).await;
    }
    // After: the standby has taken over.
    wait_for("disp-b leads", WAIT, || async {
        (leader(&env).await.as_deref() == Some("disp-b")).then_some(())
    })
    .await;
    for id in &ids[200..] {
        env.submit(id, "model-f", 10, 10).await;
    }
    let decisions = env.decisions_for(&ids).await;
    assert!(decisions.values().all(|d| d.outcome == Outcome::Assigned));
    let epochs: std::collections::BTreeSet<u64> = decisions.values().map(|d| d.epoch).collect();
    assert!(epochs.len() >= 2, "decided by two leaders: {epochs:?}");

    // Exactly one decision per job in the whole DECISIONS stream...
    let all = env.all_decisions().await;
    let mut per_job: HashMap<String, usize> = HashMap::new();
    for d in &all {
        *per_job.entry(d.job_id.clone()).or_default() += 1;
    }
    let doubled: Vec<_> = per_job.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        doubled.is_empty(),
        "jobs with several decisions: {doubled:?}"
    );
    assert_eq!(per_job.len(), ids.len());
    // ...and exactly one Assignment per job on WORK.
    let mut work: HashMap<String, usize> = HashMap::new();
    for w in &ws {
        for (asg, _) in env.take_work(&w.worker_id).await {
            *work.entry(asg.job.id.clone()).or_default() += 1;
        }
    }
    let doubled: Vec<_> = work.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "jobs assigned twice: {doubled:?}");
    assert_eq!(work.len(), ids.len(), "every job assigned");
    beat.cancel();
}

/// Store a worker's cache report through JetStream, as its agent does.
async fn report_cache(env: &Env, update: &metronome_protocol::CacheUpdate) {
    let subject = match update.kind {
        metronome_protocol::CacheUpdateKind::Snapshot => {
            names::cache_snapshot_subject(&update.worker_id)
        }
        metronome_protocol::CacheUpdateKind::Delta => names::cache_delta_subject(&update.worker_id),
    };
    env.js
        .publish(subject, serde_json::to_vec(update).unwrap().into())
        .await
        .unwrap()
        .await
        .expect("cache report stored");
}

/// A leader that takes over after the last one was killed rebuilds each worker's prefix
/// cache from the workers' reports (the latest snapshot and the deltas after it): its very
/// first decision sees the cached tokens, by the events, on the worker whose server holds
/// them, though it never placed anything there itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_sees_the_reported_caches_from_its_first_decision() {
    use metronome_protocol::cache_state::{CacheUpdate, CacheUpdateKind, CACHE_UPDATE_VERSION};
    use metronome_protocol::prefix::PrefixFingerprint;
    use metronome_protocol::{Endpoint, PrefixSource};

    let env = Env::start().await;
    let ws: Vec<WorkerStatus> = (0..2)
        .map(|i| worker(&format!("k-{i}"), "model-k", 8))
        .collect();
    for w in &ws {
        env.work_consumer(&w.worker_id).await;
        env.heartbeat(w).await;
    }
    let beat = keep_alive(&env, ws.clone());
    let mut a = spawn_dispatcher(&env, "disp-a");
    wait_for("disp-a leads", WAIT, || async {
        (leader(&env).await.as_deref() == Some("disp-a")).then_some(())
    })
    .await;
    let _b = spawn_dispatcher(&env, "disp-b");

    // A 500-token conversation; k-1's server holds all of it: a snapshot of its first
    // blocks, then a delta with the others (k-0's server reports nothing).
    let request = serde_json::json!({"model": "model-k", "max_tokens": 10, "messages": [
        {"role": "system", "content": "You answer briefly. ".repeat(100)},
        {"role": "user", "content": "And then?"},
    ]});
    let fp = PrefixFingerprint::of_request(Endpoint::Chat, &request).unwrap();
    let n = fp.hashes.len();
    assert!(n >= 30, "{n} blocks");
    let report = |seq, kind, stored: &[u64]| CacheUpdate {
        v: CACHE_UPDATE_VERSION,
        worker_id: "k-1".into(),
        run: 1,
        seq,
        kind,
        block_size: 16,
        cleared: false,
        stored: stored.to_vec(),
        removed: Vec::new(),
        truncated: false,
        sent_ms: metronome_protocol::time::unix_ms(),
    };
    report_cache(
        &env,
        &report(0, CacheUpdateKind::Snapshot, &fp.hashes[..n / 2]),
    )
    .await;
    report_cache(
        &env,
        &report(1, CacheUpdateKind::Delta, &fp.hashes[n / 2..]),
    )
    .await;

    // The leader dies; the job arrives while nobody leads and is the standby's first
    // decision.
    assert!(
        a.guard.signal_and_wait(9, Duration::from_secs(5)),
        "leader killed"
    );
    let mut job = job_json("after-kill", "model-k", fp.tokens, 10);
    job["request"] = request;
    job["prefix"] = serde_json::to_value(&fp).unwrap();
    env.submit_raw("after-kill", job).await;
    wait_for("disp-b leads", WAIT, || async {
        (leader(&env).await.as_deref() == Some("disp-b")).then_some(())
    })
    .await;
    let d = env
        .decisions_for(&["after-kill".to_string()])
        .await
        .remove("after-kill")
        .unwrap();
    let cached = |w: &str| {
        d.candidates
            .iter()
            .find(|c| c.worker_id == w)
            .and_then(|c| c.cached_prefix)
            .map(|c| (c.tokens, c.source))
    };
    let held = (n as u32 * 16).min(fp.tokens - 1);
    assert_eq!(cached("k-1"), Some((held, PrefixSource::Events)), "{d:?}");
    assert_eq!(cached("k-0"), Some((0, PrefixSource::Placements)));
    assert_eq!(
        d.worker_id.as_deref(),
        Some("k-1"),
        "the cached prefill is cheaper"
    );
    // The assignment tells the worker what the decision counted it as holding: its agent
    // charges the job's prefill as the rest when it fits the worker's speed.
    let work = env.take_work("k-1").await;
    let (assignment, _) = work
        .iter()
        .find(|(a, _)| a.job.id == "after-kill")
        .expect("assigned to k-1");
    assert_eq!(
        assignment.cached_prefix.map(|c| (c.tokens, c.source)),
        Some((held, PrefixSource::Events))
    );
    beat.cancel();
}
