//! The leader publishes its admission queues in the `queues` KV bucket: jobs waiting for a
//! model with no free worker show up there with their wait, and once capacity frees up
//! and they are assigned, the model's key says the queue is empty (rather than keeping
//! the last non-empty snapshot). Against a real nats-server; the worker is heartbeats and
//! completion events from the test.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;
use metronome_protocol::names::{queue_key, BUCKET_QUEUES};
use metronome_protocol::{CompletionOutcome, Priority, QueueSnapshot};

async fn snapshot(env: &Env, model: &str) -> Option<QueueSnapshot> {
    let kv = env.js.get_key_value(BUCKET_QUEUES).await.ok()?;
    let bytes = kv.get(queue_key(model)).await.ok()??;
    Some(QueueSnapshot::parse(&bytes).expect("a valid snapshot"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_jobs_are_published_per_model_and_an_emptied_queue_reads_zero() {
    let env = Env::start().await;
    let mut config = env.config("queues");
    config.queue_snapshot_ms = 20;
    let (running, token) = env.dispatcher(config).await;
    env.workers("q", 1, "model.q/1", 1).await;
    metronome_testkit::wait_for("worker registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;

    // One slot: the first job runs, three wait.
    let ids: Vec<String> = (0..4).map(|i| format!("q{i}")).collect();
    for id in &ids {
        env.submit(id, "model.q/1", 10, 10).await;
    }
    metronome_testkit::wait_for("the first job assigned", WAIT, || async {
        env.decision(&ids[0]).await.map(|_| ())
    })
    .await;
    let waiting = metronome_testkit::wait_for("three jobs seen waiting", WAIT, || async {
        snapshot(&env, "model.q/1")
            .await
            .filter(|s| s.waiting == 3 && s.oldest_wait_ms > 0)
    })
    .await;
    assert_eq!(waiting.model, "model.q/1");
    assert!(waiting.oldest_enqueued_ms.is_some());
    assert_eq!(waiting.by_priority[&Priority::Interactive], 3);
    assert_eq!(waiting.epoch, running.metrics.epoch.load(Relaxed));
    assert_eq!(waiting.dispatcher_id, "queues");
    assert!(waiting
        .freshness(metronome_protocol::time::unix_ms(), Some(waiting.epoch))
        .is_fresh());
    let text = running.metrics.render();
    assert!(
        text.contains("metronome_dispatcher_queue_oldest_wait_seconds{model=\"model.q/1\"}"),
        "{text}"
    );

    // Free the slot until every job has run.
    let mut served = 0;
    while served < ids.len() {
        for (a, _) in env.take_work("q-0").await {
            env.complete(&a, CompletionOutcome::Done).await;
            served += 1;
        }
    }
    let empty = metronome_testkit::wait_for("the queue seen empty", WAIT, || async {
        snapshot(&env, "model.q/1").await.filter(|s| s.waiting == 0)
    })
    .await;
    assert_eq!(empty.oldest_enqueued_ms, None);
    assert_eq!(empty.oldest_wait_ms, 0);
    assert!(empty.written_ms >= waiting.written_ms);
    // Every job that left the queue was observed in the wait histogram.
    let text = running.metrics.render();
    assert!(
        text.contains(
            "metronome_dispatcher_queue_wait_seconds_count{model=\"model.q/1\",outcome=\"assigned\"} 4"
        ),
        "{text}"
    );
    token.cancel();
    running.join().await.unwrap();
}
