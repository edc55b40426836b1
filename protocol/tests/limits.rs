//! RESULTS and EVENTS are bounded in bytes, and EVENTS per worker, against a real
//! nats-server: any worker may store finals under its own id and events on its own
//! subject, as many as it likes (NATS permissions cannot count), so a flood from one
//! identity must neither grow the streams past their bounds nor push out another worker's
//! event. Streams made by an earlier version, without bounds, get them from
//! `apply_stream_limits` (the dispatcher's start).

use async_nats::jetstream::{self, stream};
use metronome_protocol::names::*;
use metronome_protocol::setup::{apply_stream_limits, ensure_all, StreamSettings};
use metronome_testkit::NatsServer;

const BOUND: i64 = 64 * 1024;

fn bounded() -> StreamSettings {
    StreamSettings {
        storage: stream::StorageType::Memory,
        results_max_bytes: BOUND,
        events_max_bytes: BOUND,
        events_max_per_worker: 10,
        ..StreamSettings::default()
    }
}

async fn stored(js: &jetstream::Context, subject: String, payload: Vec<u8>) {
    js.publish(subject, payload.into())
        .await
        .expect("sent")
        .await
        .expect("stored");
}

async fn subject_count(js: &jetstream::Context, stream: &str, subject: &str) -> u64 {
    use futures::StreamExt;
    let s = js.get_stream(stream).await.expect("stream");
    let counts: Vec<(String, usize)> = s
        .info_with_subjects(subject)
        .await
        .expect("info")
        .filter_map(|r| async move { r.ok() })
        .collect()
        .await;
    counts.iter().map(|(_, n)| *n as u64).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_finals_and_events_stays_within_the_bounds_and_spares_other_workers() {
    let nats = NatsServer::start().expect("nats-server");
    let js = jetstream::new(async_nats::connect(nats.url()).await.expect("connect"));
    ensure_all(&js, &bounded()).await.expect("streams");

    // A real worker's final and event, then one identity's flood of each.
    stored(&js, "results.t.j0.victim.final".into(), vec![b'v'; 512]).await;
    stored(&js, "events.done.victim".into(), b"victim's event".to_vec()).await;
    for i in 0..400 {
        stored(
            &js,
            format!("results.t.f{i}.attacker.final"),
            vec![b'x'; 1024],
        )
        .await;
        stored(&js, "events.done.attacker".into(), vec![b'y'; 1024]).await;
    }

    for name in [STREAM_RESULTS, STREAM_EVENTS] {
        let info = js
            .get_stream(name)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .clone();
        assert!(
            info.state.bytes as i64 <= BOUND,
            "{name} holds {} bytes, above its bound {BOUND}",
            info.state.bytes
        );
    }
    assert_eq!(
        subject_count(&js, STREAM_EVENTS, "events.done.attacker").await,
        10
    );
    let victim = js
        .get_stream(STREAM_EVENTS)
        .await
        .unwrap()
        .get_last_raw_message_by_subject("events.done.victim")
        .await
        .expect("the other worker's event is still stored");
    assert_eq!(victim.payload.as_ref(), b"victim's event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_made_without_bounds_get_them_from_the_dispatchers_start() {
    let nats = NatsServer::start().expect("nats-server");
    let js = jetstream::new(async_nats::connect(nats.url()).await.expect("connect"));
    // As an earlier version made them: no byte or per-subject bound.
    for (name, subject) in [
        (STREAM_RESULTS, SUBJECT_RESULTS_FINAL_ALL),
        (STREAM_EVENTS, SUBJECT_EVENTS_ALL),
    ] {
        js.create_stream(stream::Config {
            name: name.into(),
            subjects: vec![subject.into()],
            storage: stream::StorageType::Memory,
            allow_direct: name == STREAM_RESULTS,
            ..Default::default()
        })
        .await
        .expect("an unbounded stream");
    }
    let settings = bounded();
    ensure_all(&js, &settings).await.expect("streams");
    assert_eq!(
        apply_stream_limits(&js, &settings).await.expect("limits"),
        vec![STREAM_RESULTS, STREAM_EVENTS]
    );
    let results = js
        .get_stream(STREAM_RESULTS)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    assert_eq!(results.max_bytes, BOUND);
    let events = js
        .get_stream(STREAM_EVENTS)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    assert_eq!(
        (events.max_bytes, events.max_messages_per_subject),
        (BOUND, 10)
    );
    // Nothing left to change.
    assert!(apply_stream_limits(&js, &settings)
        .await
        .expect("limits")
        .is_empty());
}
