//! Stream and bucket creation against a real nats-server: idempotent, and safe when every
//! component starts at once and races to create the same streams.

use async_nats::jetstream;
use metronome_protocol::names::*;
use metronome_protocol::setup::{ensure_all, StreamSettings};
use metronome_testkit::NatsServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn components_starting_together_all_find_the_same_streams() {
    let nats = NatsServer::start().expect("nats-server");
    let settings = StreamSettings::default();
    let mut contexts = Vec::new();
    for _ in 0..8 {
        let client = async_nats::connect(nats.url()).await.expect("connect");
        contexts.push(jetstream::new(client));
    }
    let results =
        futures::future::join_all(contexts.iter().map(|js| ensure_all(js, &settings))).await;
    for r in &results {
        assert!(r.is_ok(), "{:?}", r.as_ref().err().map(|e| e.to_string()));
    }
    // Again, now that everything exists.
    ensure_all(&contexts[0], &settings)
        .await
        .expect("second run");
    for name in [
        STREAM_JOBS,
        STREAM_WORK,
        STREAM_DECISIONS,
        STREAM_RESULTS,
        STREAM_EVENTS,
    ] {
        contexts[0].get_stream(name).await.expect(name);
    }
    for bucket in [BUCKET_WORKERS, BUCKET_LEADER] {
        contexts[0].get_key_value(bucket).await.expect(bucket);
    }
}
