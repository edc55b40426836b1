//! The contract's streams and buckets on a real three-node JetStream cluster: created with
//! three copies when configured so, they keep every message and take new ones when the
//! node leading them is killed; the same setting on one server is refused; streams made
//! earlier with fewer copies are named.

use std::time::Duration;

use async_nats::jetstream;
use metronome_protocol::names::*;
use metronome_protocol::setup::{ensure_all, under_replicated, StreamSettings, ALL_STREAMS};
use metronome_testkit::{wait_for, NatsCluster, NatsServer};

const WAIT: Duration = Duration::from_secs(30);

async fn connect(urls: &str) -> jetstream::Context {
    let urls: Vec<&str> = urls.split(',').collect();
    let client = async_nats::connect(urls).await.expect("connect");
    jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(2))
        .build(client)
}

fn r3() -> StreamSettings {
    StreamSettings {
        replicas: 3,
        ..StreamSettings::default()
    }
}

/// The JOBS stream's leader and whether every copy is current, once it has a leader.
async fn jobs_cluster(js: &jetstream::Context) -> Option<(String, bool, u64)> {
    let mut stream = js.get_stream(STREAM_JOBS).await.ok()?;
    let info = stream.info().await.ok()?;
    let cluster = info.cluster.clone()?;
    let leader = cluster.leader?;
    let all_current = cluster.replicas.len() == 2 && cluster.replicas.iter().all(|p| p.current);
    Some((leader, all_current, info.state.messages))
}

/// Publish job `id` on `jobs.submit.t`, retrying until JetStream acknowledges it (a
/// stream without a leader answers nothing until it has elected one).
async fn submit(js: &jetstream::Context, id: &str) {
    wait_for(&format!("JOBS to take {id}"), WAIT, || async {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(HEADER_MSG_ID, id);
        let ack = js
            .publish_with_headers("jobs.submit.t", headers, id.to_string().into())
            .await
            .ok()?;
        ack.await.ok().map(|_| ())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_copies_keep_every_job_and_take_new_ones_when_the_leading_node_dies() {
    let mut cluster = NatsCluster::start(3).expect("nats cluster");
    let js = connect(&cluster.urls()).await;
    let buckets = ensure_all(&js, &r3()).await.expect("setup with 3 replicas");
    for name in ALL_STREAMS {
        let mut stream = js.get_stream(name).await.expect(name);
        let info = stream.info().await.expect(name);
        assert_eq!(info.config.num_replicas, 3, "{name}");
    }
    assert!(under_replicated(&js, 3).await.is_empty());

    for n in 0..50 {
        submit(&js, &format!("before-{n}")).await;
    }
    let (leader, _, _) = wait_for("JOBS with every copy current", WAIT, || async {
        jobs_cluster(&js).await.filter(|(_, current, _)| *current)
    })
    .await;
    let dead = cluster
        .index_of(&leader)
        .expect("a node of the cluster leads");
    cluster.kill(dead);

    // The other two copies elect a leader, and every job stored before the kill is there.
    let (new_leader, _, _) = wait_for("a new JOBS leader", WAIT, || async {
        jobs_cluster(&js).await.filter(|(l, _, _)| *l != leader)
    })
    .await;
    assert_ne!(new_leader, leader);
    // A client given every node connects although one is down.
    let late = connect(&cluster.urls()).await;
    for n in 0..50 {
        submit(&late, &format!("after-{n}")).await;
    }
    // Stream info is answered by the stream's leader; right after an election a request
    // can time out, so it is read until it answers.
    let (_, _, messages) = wait_for("JOBS info", WAIT, || jobs_cluster(&late)).await;
    assert_eq!(messages, 100, "every job before and after the kill, once");
    // The dispatchers' lease bucket takes writes too. Its info, like the stream's, is
    // answered by its leader, which a loaded machine may still be electing: read until it
    // answers.
    let leader_kv = wait_for("the leader bucket", WAIT, || async {
        late.get_key_value(BUCKET_LEADER).await.ok()
    })
    .await;
    wait_for("a write to the leader bucket", WAIT, || async {
        leader_kv.put("probe", "x".into()).await.ok()
    })
    .await;
    drop(buckets);

    // Back, the killed node catches up: every copy current again, nothing doubled.
    cluster.restart(dead).expect("restart");
    let (leader, _, messages) = wait_for("the restarted node current again", WAIT, || async {
        jobs_cluster(&late).await.filter(|(_, current, _)| *current)
    })
    .await;
    assert_eq!(messages, 100, "leader {leader}, {}", cluster.log_tail(dead));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_one_server_are_refused_at_setup() {
    let nats = NatsServer::start().expect("nats-server");
    let js = connect(&nats.url()).await;
    let err = ensure_all(&js, &r3()).await.err().expect("refused");
    assert!(err.to_string().contains(STREAM_JOBS), "{err}");
    // One copy is what a single server keeps.
    ensure_all(&js, &StreamSettings::default())
        .await
        .expect("setup with 1 replica");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_made_with_fewer_copies_are_named_and_left_as_they_are() {
    let cluster = NatsCluster::start(3).expect("nats cluster");
    let js = connect(&cluster.urls()).await;
    ensure_all(&js, &StreamSettings::default())
        .await
        .expect("setup with 1 replica");
    // A component configured for three finds them and starts; each is reported.
    ensure_all(&js, &r3()).await.expect("setup with 3 replicas");
    let short = under_replicated(&js, 3).await;
    let names: Vec<&str> = short.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ALL_STREAMS, "{short:?}");
    assert!(short.iter().all(|(_, have)| *have == 1), "{short:?}");
}
