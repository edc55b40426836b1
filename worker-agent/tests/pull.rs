//! Pull requests answered on one inbox, against a real nats-server: giving up on a
//! request's answer (the agent pulls again when a server drops the answer to an expired
//! request) never loses what that request still delivers.

use std::time::Duration;

use async_nats::jetstream;
use metronome_protocol::names::work_subject;
use metronome_protocol::setup::{ensure_all, StreamSettings};
use metronome_testkit::NatsServer;
use metronome_worker_agent::config::Config;
use metronome_worker_agent::pull::{Pulled, Puller, PULL_EXPIRES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_given_up_on_still_delivers_to_the_agent() {
    let nats = NatsServer::start().expect("nats-server");
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    ensure_all(&js, &StreamSettings::default()).await.unwrap();
    let config = Config {
        worker_id: "pull-0".into(),
        ..Config::default()
    };
    metronome_worker_agent::agent::ensure_consumer(&js, &config)
        .await
        .unwrap();
    let mut puller = Puller::new(js.clone(), "pull-0").await.unwrap();

    // Nothing to deliver: the answer is not waited for past the caller's deadline, though
    // the server still holds the request (for a minute: no timing is raced here).
    puller.request(1, Duration::from_secs(60)).await.unwrap();
    let soon = tokio::time::Instant::now() + Duration::from_millis(100);
    assert!(matches!(puller.next(soon).await, Pulled::Unanswered));

    // Work arrives while that request is still open: it is delivered to it, on the same
    // inbox, and read.
    js.publish(work_subject("pull-0"), "assignment".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let later = tokio::time::Instant::now() + Duration::from_secs(30);
    match puller.next(later).await {
        Pulled::Message(m) => {
            assert_eq!(&m.payload[..], b"assignment");
            m.ack().await.unwrap();
        }
        _ => panic!("the message delivered to the earlier request was not read"),
    }

    // A request with nothing to deliver ends with the server's answer (408) by its expiry.
    puller.request(1, PULL_EXPIRES).await.unwrap();
    let deadline = tokio::time::Instant::now() + PULL_EXPIRES * 4;
    assert!(matches!(puller.next(deadline).await, Pulled::Ended));
}
