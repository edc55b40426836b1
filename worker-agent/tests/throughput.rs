//! A measurement, not an assertion (run with `--ignored --nocapture`): how many jobs per
//! second one agent relays from an instant stub model server, and the time to first token
//! it adds. Speed is reported, never asserted.

use crate::common;

use std::time::Instant;

use common::*;
use metronome_protocol::names::event_done_subject;
use metronome_protocol::{CompletionEvent, Endpoint};
use metronome_testkit::wait_for;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run explicitly"]
async fn relay_throughput_and_overhead() {
    const JOBS: usize = 200;
    const TOKENS: u32 = 20;
    let env = Env::start().await;
    let worker = "bench-gpu0";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let mut config = env.config(worker);
    config.max_concurrency = 8;
    config.heartbeat_interval_ms = 1000;
    let (agent, shutdown) = env.start_agent(config).await;
    let start = Instant::now();
    for i in 0..JOBS {
        env.assign(
            worker,
            &job(&format!("bench-{i}"), Endpoint::Chat, TOKENS, 0),
            1,
        )
        .await;
    }
    let evs: Vec<CompletionEvent> = wait_for(
        "all events",
        std::time::Duration::from_secs(120),
        || async {
            let l = events.lock().unwrap();
            (l.len() == JOBS).then(|| {
                l.iter()
                    .map(|m| serde_json::from_slice(&m.payload).unwrap())
                    .collect()
            })
        },
    )
    .await;
    let wall = start.elapsed().as_secs_f64();
    let mut ttft: Vec<f64> = evs.iter().filter_map(|e| e.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let mut e2e: Vec<f64> = evs.iter().map(|e| e.e2e_ms).collect();
    e2e.sort_by(f64::total_cmp);
    let pct = |v: &[f64], p: f64| v[((v.len() - 1) as f64 * p) as usize];
    println!(
        "jobs={JOBS} tokens/job={TOKENS} max_concurrency=8 wall={wall:.2}s jobs/s={:.1} chunks/s={:.0} \
         ttft_ms p50={:.2} p99={:.2} e2e_ms p50={:.2} p99={:.2}",
        JOBS as f64 / wall,
        (JOBS as f64 * f64::from(TOKENS + 3)) / wall,
        pct(&ttft, 0.5),
        pct(&ttft, 0.99),
        pct(&e2e, 0.5),
        pct(&e2e, 0.99),
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}
