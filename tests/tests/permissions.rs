//! Every role's NATS permissions and Redis ACL, both ways, against real servers started on
//! the configuration `protocol::permissions` renders: what a role must do works, and what
//! it must not do is refused by the server itself (a `Permissions Violation` error, a
//! `NOPERM` reply, a refused connection), never merely not attempted.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use async_nats::{Event, ServerError};
use futures::StreamExt;
use metronome_protocol::names::{self, BUCKET_LEADER, STREAM_DECISIONS, STREAM_WORK};
use metronome_protocol::permissions::{nats_authorization, redis_acl, Identity, Role};
use metronome_protocol::setup::{ensure_all, ensure_for_worker, Buckets, StreamSettings};
use metronome_runtime::nats::NatsAuth;
use metronome_testkit::{wait_for, NatsServer, RedisServer};

const PREFIX: &str = "metronome";
const MODEL: &str = "llama-3.1-8b";
const WAIT: Duration = Duration::from_secs(20);

fn password(user: &str) -> String {
    format!("pw{}", user.replace('-', ""))
}

fn identities() -> Vec<Identity> {
    let id = |user: &str, role| Identity::new(user, &password(user), role);
    vec![
        id("admin", Role::Admin),
        id("dispatcher-a", Role::Dispatcher),
        id("gateway", Role::Gateway),
        Identity::client(Some("acme"), &password("client-acme")),
        Identity::client(Some("globex"), &password("client-globex")),
        Identity::client(None, &password("client-_anon")),
        id("auditor", Role::Auditor),
        Identity::worker("w1", MODEL, &password("worker-w1")),
        Identity::worker("w2", "qwen2.5-7b", &password("worker-w2")),
    ]
}

/// A connection with the server errors it received (permission violations among them).
struct Conn {
    client: async_nats::Client,
    js: jetstream::Context,
    /// For requests the server is expected to refuse: the refusal is the violation
    /// event; this short timeout only ends the wait for a reply that never comes.
    js_denied: jetstream::Context,
    errors: Arc<Mutex<Vec<String>>>,
    /// A stream whose info this identity may read ([`Conn::handled`]).
    readable_stream: &'static str,
}

impl Conn {
    async fn open(nats: &NatsServer, user: &str) -> Conn {
        let auth = NatsAuth {
            user: Some(user.into()),
            password: Some(password(user)),
            ..NatsAuth::default()
        };
        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        let client = auth
            .connect_options()
            .expect("options")
            .event_callback(move |event| {
                let sink = sink.clone();
                async move {
                    if let Event::ServerError(ServerError::Other(e)) = event {
                        sink.lock().unwrap().push(e);
                    }
                }
            })
            .connect(nats.url())
            .await
            .unwrap_or_else(|e| panic!("{user} connects: {e}"));
        Conn {
            js: jetstream::new(client.clone()),
            js_denied: jetstream::ContextBuilder::new()
                .timeout(Duration::from_millis(500))
                .build(client.clone()),
            client,
            errors,
            readable_stream: if user.starts_with("worker-") {
                STREAM_WORK
            } else {
                names::STREAM_JOBS
            },
        }
    }

    /// Waits until the server has reported a permission violation on `subject`.
    async fn refused(&self, what: &str, subject: &str) {
        let needle = format!("\"{subject}\"");
        let errors = self.errors.clone();
        wait_for(
            &format!("the server to refuse {what} ({subject})"),
            WAIT,
            || {
                let found = errors
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|e| e.contains("Permissions Violation") && e.contains(&needle));
                async move { found.then_some(()) }
            },
        )
        .await;
    }

    /// Publishes on `subject` and waits for the server to refuse it.
    async fn publish_refused(&self, subject: &str) {
        self.client
            .publish(subject.to_string(), "forged".into())
            .await
            .expect("queued");
        self.client.flush().await.expect("flush");
        self.refused("a publish", subject).await;
    }

    /// Subscribes to `subject` and waits for the server to refuse it.
    async fn subscribe_refused(&self, subject: &str) {
        let _sub = self
            .client
            .subscribe(subject.to_string())
            .await
            .expect("sent");
        self.client.flush().await.expect("flush");
        self.refused("a subscription", subject).await;
    }

    /// Returns once the server has handled everything sent on this connection before, such
    /// as a subscription that must be in place before another connection publishes. A
    /// flush only writes to the socket; a request on the same connection is answered after
    /// the server handled what came before it (it handles a connection's messages in
    /// order). Every identity here but the auditor and the workers may read the JOBS
    /// stream's info; the workers read WORK's.
    async fn handled(&self) {
        self.js
            .get_stream(self.readable_stream)
            .await
            .expect("a round trip");
    }

    fn no_violations(&self) {
        let errors = self.errors.lock().unwrap();
        assert!(
            !errors.iter().any(|e| e.contains("Permissions Violation")),
            "unexpected refusals: {errors:?}"
        );
    }
}

struct System {
    nats: NatsServer,
    redis: RedisServer,
    /// The admin's view of the streams and buckets (created by it, as provisioning does).
    admin_buckets: Buckets,
}

async fn system() -> System {
    let ids = identities();
    let nats = NatsServer::start_with_config(&nats_authorization(&ids)).expect("nats-server");
    let redis = RedisServer::start_with_config(&redis_acl(&ids, PREFIX)).expect("redis-server");
    let admin = Conn::open(&nats, "admin").await;
    let admin_buckets = ensure_all(&admin.js, &StreamSettings::default())
        .await
        .expect("admin creates the streams and buckets");
    System {
        nats,
        redis,
        admin_buckets,
    }
}

/// `fut`, or a panic naming `what` after [`WAIT`]: a lost message fails the test instead
/// of hanging it.
async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, fut)
        .await
        .unwrap_or_else(|_| panic!("no {what} within {WAIT:?}"))
}

fn worker_consumer(worker_id: &str, filter: &str) -> consumer::pull::Config {
    let name = names::work_consumer(worker_id);
    consumer::pull::Config {
        durable_name: Some(name),
        filter_subject: filter.to_string(),
        ack_policy: consumer::AckPolicy::Explicit,
        ..Default::default()
    }
}

#[tokio::test]
async fn unauthenticated_and_wrong_passwords_are_refused() {
    let sys = system().await;
    let anonymous = async_nats::ConnectOptions::new()
        .max_reconnects(Some(1))
        .connect(sys.nats.url())
        .await;
    assert!(
        anonymous.is_err(),
        "an anonymous NATS connection was accepted"
    );
    let wrong = NatsAuth {
        user: Some("gateway".into()),
        password: Some("not-the-password".into()),
        ..NatsAuth::default()
    };
    let wrong = wrong
        .connect_options()
        .unwrap()
        .max_reconnects(Some(1))
        .connect(sys.nats.url())
        .await;
    assert!(wrong.is_err(), "a wrong NATS password was accepted");

    let mut conn = redis::Client::open(sys.redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("redis accepts the TCP connection");
    let err = redis::cmd("GET")
        .arg("metronome:ewma:w1")
        .query_async::<Option<String>>(&mut conn)
        .await
        .expect_err("redis answered a command without authentication");
    assert_eq!(err.code(), Some("NOAUTH"), "{err}");
    let wrong = redis::Client::open(sys.redis.url_as("worker-w1", "wrong"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await;
    assert!(wrong.is_err(), "a wrong redis password was accepted");
}

#[tokio::test]
async fn a_worker_uses_its_own_consumer_heartbeat_and_events_and_nothing_else() {
    let sys = system().await;
    let w1 = Conn::open(&sys.nats, "worker-w1").await;
    let w2 = Conn::open(&sys.nats, "worker-w2").await;
    let dispatcher = Conn::open(&sys.nats, "dispatcher-a").await;

    // What a worker-agent does at start and per job works.
    let buckets = ensure_for_worker(&w1.js, &StreamSettings::default())
        .await
        .expect("a worker opens the existing streams and buckets");
    let work = w1.js.get_stream(STREAM_WORK).await.expect("WORK info");
    let own = work
        .get_or_create_consumer("worker-w1", worker_consumer("w1", "work.w1"))
        .await
        .expect("its own consumer");
    w2.js
        .get_stream(STREAM_WORK)
        .await
        .unwrap()
        .get_or_create_consumer("worker-w2", worker_consumer("w2", "work.w2"))
        .await
        .expect("w2's own consumer");
    dispatcher
        .js
        .publish("work.w1", "assignment for w1".into())
        .await
        .expect("dispatcher publishes")
        .await
        .expect("stored");
    dispatcher
        .js
        .publish("work.w2", "assignment for w2".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let mut batch = own.fetch().max_messages(1).messages().await.expect("pull");
    let msg = within("assignment", batch.next())
        .await
        .expect("one")
        .expect("message");
    assert_eq!(msg.payload.as_ref(), b"assignment for w1");
    msg.ack().await.expect("ack");
    buckets
        .workers
        .put("w1", "heartbeat".into())
        .await
        .expect("own heartbeat");
    w1.client
        .publish(names::heartbeat_subject("w1"), "hb".into())
        .await
        .unwrap();
    w1.js
        .publish(names::event_done_subject("w1"), "done".into())
        .await
        .unwrap()
        .await
        .expect("own completion event stored");
    // Results of any tenant's job, under its own id.
    w1.client
        .publish(
            names::result_chunk_subject(Some("acme"), "job-1", "w1"),
            "chunk".into(),
        )
        .await
        .unwrap();
    w1.js
        .publish(
            names::result_final_subject(Some("acme"), "job-1", "w1"),
            "final".into(),
        )
        .await
        .unwrap()
        .await
        .expect("final result stored");
    // It answers operator requests on its control subject.
    let mut control = w1
        .client
        .subscribe(names::control_subject_all("w1"))
        .await
        .unwrap();
    w1.handled().await;
    let w1_client = w1.client.clone();
    let responder = tokio::spawn(async move {
        let req = control.next().await.expect("request");
        w1_client
            .publish(req.reply.expect("reply"), "draining".into())
            .await
            .unwrap();
        w1_client.flush().await.unwrap();
    });
    let admin = Conn::open(&sys.nats, "admin").await;
    let reply = admin
        .client
        .request(
            names::control_subject("w1", names::CONTROL_DRAIN),
            "".into(),
        )
        .await
        .expect("the worker answers");
    assert_eq!(reply.payload.as_ref(), b"draining");
    within("control responder", responder).await.unwrap();
    w1.no_violations();

    // Another worker's work: neither its consumer nor a consumer of its own on w2's subject.
    let denied_work = w1.js_denied.get_stream(STREAM_WORK).await.unwrap();
    assert!(denied_work
        .get_or_create_consumer("worker-w2", worker_consumer("w2", "work.w2"))
        .await
        .is_err());
    w1.refused(
        "reading w2's consumer",
        "$JS.API.CONSUMER.INFO.WORK.worker-w2",
    )
    .await;
    assert!(denied_work
        .create_consumer(worker_consumer("w1", "work.w2"))
        .await
        .is_err());
    w1.refused(
        "its consumer filtered on w2's work",
        "$JS.API.CONSUMER.CREATE.WORK.worker-w1.work.w2",
    )
    .await;
    w1.publish_refused("$JS.API.CONSUMER.MSG.NEXT.WORK.worker-w2")
        .await;
    w1.publish_refused("$JS.API.CONSUMER.DURABLE.CREATE.WORK.worker-w1")
        .await;
    w1.subscribe_refused("_INBOX.>").await;
    w1.subscribe_refused("work.w2").await;
    let w2_info = w2
        .js
        .get_stream(STREAM_WORK)
        .await
        .unwrap()
        .consumer_info("worker-w2")
        .await
        .expect("w2 reads its consumer");
    assert_eq!(
        w2_info.num_pending, 1,
        "w2's assignment is still waiting for w2"
    );

    // Another worker's heartbeat and events, decisions, assignments, the lease, streams.
    sys.admin_buckets
        .workers
        .put("w2", "w2's heartbeat".into())
        .await
        .unwrap();
    w1.publish_refused("$KV.workers.w2").await;
    let w2_entry = sys.admin_buckets.workers.get("w2").await.unwrap();
    assert_eq!(w2_entry.as_deref(), Some(&b"w2's heartbeat"[..]));
    w1.publish_refused(&names::event_done_subject("w2")).await;
    w1.publish_refused(&names::heartbeat_subject("w2")).await;
    // Issue 10: results under another worker's id, or the leader's, or with no publisher
    // (the subjects of version 2), are refused: a worker can only answer as itself.
    w1.publish_refused(&names::result_chunk_subject(Some("acme"), "job-2", "w2"))
        .await;
    w1.publish_refused(&names::result_final_subject(Some("acme"), "job-2", "w2"))
        .await;
    w1.publish_refused(&names::dispatcher_final_subject(Some("acme"), "job-2"))
        .await;
    w1.publish_refused("results.acme.job-2.final").await;
    w1.publish_refused("results.acme.job-2.chunk").await;
    // Nor does it cancel anyone's jobs (it only hears cancellations).
    w1.publish_refused(&names::cancel_subject(Some("acme"), "job-2"))
        .await;
    w1.publish_refused(&names::decision_subject(Some("acme"), "job-1"))
        .await;
    w1.publish_refused("work.w2").await;
    let leader = w1
        .js_denied
        .get_key_value(BUCKET_LEADER)
        .await
        .expect("lease bucket info");
    assert!(leader
        .create(names::LEADER_KEY, "w1 leads".into())
        .await
        .is_err());
    w1.refused("taking the lease", "$KV.leader.dispatcher")
        .await;
    assert_eq!(
        sys.admin_buckets
            .leader
            .get(names::LEADER_KEY)
            .await
            .unwrap(),
        None
    );
    // It reads the lease key, to check an assignment's new epoch against it.
    sys.admin_buckets
        .leader
        .put(names::LEADER_KEY, "the lease".into())
        .await
        .unwrap();
    let lease = w1
        .js
        .get_key_value(BUCKET_LEADER)
        .await
        .expect("lease bucket info");
    let read = lease
        .entry(names::LEADER_KEY)
        .await
        .expect("w1 reads the lease");
    assert_eq!(read.map(|e| e.value.to_vec()), Some(b"the lease".to_vec()));
    assert!(w1
        .js_denied
        .create_stream(jetstream::stream::Config {
            name: "SNOOP".into(),
            subjects: vec!["results.>".into()],
            ..Default::default()
        })
        .await
        .is_err());
    w1.refused("creating a stream", "$JS.API.STREAM.CREATE.SNOOP")
        .await;
    // Nor reads a stream's info where its subjects name tenants' jobs: a request with a
    // subjects filter lists every job id (and a forged refusal needs only the id).
    for stream in [STREAM_DECISIONS, names::STREAM_RESULTS, names::STREAM_JOBS] {
        assert!(
            w1.js_denied.get_stream(stream).await.is_err(),
            "a worker reads {stream}'s info"
        );
        w1.refused("a stream's info", &format!("$JS.API.STREAM.INFO.{stream}"))
            .await;
    }
}

#[tokio::test]
async fn a_client_submits_and_reads_results_but_cannot_touch_the_fleet() {
    let sys = system().await;
    let client = Conn::open(&sys.nats, "client-acme").await;
    let dispatcher = Conn::open(&sys.nats, "dispatcher-a").await;
    let acme = Some("acme");

    let mut results = client
        .client
        .subscribe(names::results_subject_all(acme, "job-7"))
        .await
        .expect("subscribes to its job's results");
    let mut decisions = client
        .client
        .subscribe(names::tenant_decisions_all(acme))
        .await
        .expect("subscribes to its tenant's decisions");
    client.client.flush().await.unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(names::HEADER_MSG_ID, "job-7");
    client
        .js
        .publish_with_headers(names::submit_subject(acme), headers, "{}".into())
        .await
        .expect("publish")
        .await
        .expect("JOBS stores the job");
    store_decision_and_final(&dispatcher.js, acme, "job-7", "assigned", "final").await;
    let got = within("final result", results.next())
        .await
        .expect("the final result");
    assert_eq!(got.payload.as_ref(), b"final");
    let got = within("decision", decisions.next())
        .await
        .expect("the decision");
    assert_eq!(got.payload.as_ref(), b"assigned");
    let decision = client
        .js
        .get_stream_no_info(STREAM_DECISIONS)
        .await
        .expect("stream handle")
        .direct_get_last_for_subject(names::decision_subject(acme, "job-7"))
        .await
        .expect("direct get of its decision");
    assert_eq!(decision.payload.as_ref(), b"assigned");
    let stored = client
        .js
        .get_stream_no_info(names::STREAM_RESULTS)
        .await
        .expect("stream handle")
        .direct_get_last_for_subject(names::dispatcher_final_subject(acme, "job-7"))
        .await
        .expect("direct get of its final result");
    assert_eq!(stored.payload.as_ref(), b"final");
    // Whoever published it: the publisher token is a wildcard of the subject in the
    // request subject, and the record says whose it is.
    let stored = client
        .js
        .get_stream_no_info(names::STREAM_RESULTS)
        .await
        .unwrap()
        .direct_get_last_for_subject("results.acme.job-7.*.final")
        .await
        .expect("direct get of its final result, any publisher");
    assert_eq!(
        stored.subject.as_str(),
        names::dispatcher_final_subject(acme, "job-7")
    );
    client.no_violations();

    client.publish_refused("$KV.workers.w1").await;
    client.publish_refused("work.w1").await;
    client.publish_refused(names::SUBJECT_JOBS_RETRY).await;
    client
        .publish_refused(&names::decision_subject(acme, "job-7"))
        .await;
    client
        .publish_refused(&names::event_done_subject("w1"))
        .await;
    client.subscribe_refused("work.w1").await;
    client.subscribe_refused("_INBOX.>").await;
    client.subscribe_refused("control.w1.drain").await;
}

/// Issue 10: a client cannot submit for, nor read the results or decisions of, another
/// tenant; the server refuses it, live and stored.
#[tokio::test]
async fn a_client_cannot_submit_for_or_read_another_tenant() {
    let sys = system().await;
    let acme = Conn::open(&sys.nats, "client-acme").await;
    let globex = Conn::open(&sys.nats, "client-globex").await;
    let dispatcher = Conn::open(&sys.nats, "dispatcher-a").await;
    let g = Some("globex");

    // globex's own job, stored: globex reads it.
    let mut own = globex
        .client
        .subscribe(names::tenant_results_all(g))
        .await
        .unwrap();
    // In place before the dispatcher's connection publishes (a flush does not wait for it).
    globex.handled().await;
    store_decision_and_final(&dispatcher.js, g, "job-8", "g-assigned", "g-final").await;
    let got = within("globex's final result", own.next())
        .await
        .expect("globex's result");
    assert_eq!(got.payload.as_ref(), b"g-final");
    globex.no_violations();

    // acme: not live...
    acme.subscribe_refused(&names::tenant_results_all(g)).await;
    acme.subscribe_refused(&names::results_subject_all(g, "job-8"))
        .await;
    acme.subscribe_refused(&names::tenant_decisions_all(g))
        .await;
    acme.subscribe_refused(&names::decision_subject(g, "job-8"))
        .await;
    acme.subscribe_refused("results.>").await;
    acme.subscribe_refused("results.*.job-8.>").await;
    acme.subscribe_refused("results.*.*.*.final").await;
    acme.subscribe_refused("decisions.>").await;
    acme.subscribe_refused(&names::tenant_results_all(None))
        .await;
    // ...nor stored: not by subject, nor by the requests that name it in their body.
    let results = acme
        .js_denied
        .get_stream_no_info(names::STREAM_RESULTS)
        .await
        .unwrap();
    assert!(results
        .direct_get_last_for_subject(names::dispatcher_final_subject(g, "job-8"))
        .await
        .is_err());
    acme.refused(
        "a direct get of globex's result",
        "$JS.API.DIRECT.GET.RESULTS.results.globex.job-8._dispatcher.final",
    )
    .await;
    // A wildcard in the tenant's place is no way around it.
    assert!(results
        .direct_get_last_for_subject(names::result_final_subject_any_tenant("job-8"))
        .await
        .is_err());
    acme.refused(
        "a direct get of any tenant's result",
        "$JS.API.DIRECT.GET.RESULTS.results.*.job-8.*.final",
    )
    .await;
    assert!(results
        .direct_get_next_for_subject(names::dispatcher_final_subject(g, "job-8"), None)
        .await
        .is_err());
    acme.refused("a body-addressed direct get", "$JS.API.DIRECT.GET.RESULTS")
        .await;
    assert!(results
        .get_last_raw_message_by_subject(&names::dispatcher_final_subject(g, "job-8"))
        .await
        .is_err());
    acme.refused("a stored-message get", "$JS.API.STREAM.MSG.GET.RESULTS")
        .await;
    acme.publish_refused("$JS.API.DIRECT.GET.DECISIONS.decisions.globex.job-8")
        .await;
    acme.publish_refused("$JS.API.STREAM.MSG.GET.DECISIONS")
        .await;
    // ...and it cannot submit for globex, nor for no tenant, nor on the version-1 subject.
    acme.publish_refused(&names::submit_subject(g)).await;
    acme.publish_refused(&names::submit_subject(None)).await;
    acme.publish_refused(names::SUBJECT_JOBS_SUBMIT_V1).await;

    // The client of no tenant is one more tenant (`_anon`), no wider.
    let anon = Conn::open(&sys.nats, "client-_anon").await;
    anon.js
        .publish(names::submit_subject(None), "{}".into())
        .await
        .unwrap()
        .await
        .expect("JOBS stores the job of no tenant");
    let _own = anon
        .client
        .subscribe(names::tenant_results_all(None))
        .await
        .unwrap();
    anon.client.flush().await.unwrap();
    anon.no_violations();
    anon.subscribe_refused(&names::tenant_results_all(g)).await;
    anon.publish_refused(&names::submit_subject(g)).await;
}

/// The subject of the next message `sub` hears.
async fn next(sub: &mut async_nats::Subscriber, what: &str) -> String {
    within(what, sub.next())
        .await
        .expect("subscription open")
        .subject
        .to_string()
}

/// Issue 10: a client cancels only under its own tenant (`cancel.<tenant>.<job>`): the
/// server refuses its cancels under another tenant, of no tenant, and on the version-2
/// `cancel.<job>`, and none reaches the dispatcher. The gateway cancels for any tenant (its
/// API keys'); only the dispatcher hears clients' cancellations. A worker hears only the
/// cancels the leader relays to it on its own `control.<id>.cancel`: the server refuses it
/// `cancel.*.*` (every job's id) and another worker's control subject, and refuses a
/// worker (and a client) relaying a cancel.
#[tokio::test]
async fn a_client_cancels_only_its_own_tenants_jobs() {
    let sys = system().await;
    let acme = Conn::open(&sys.nats, "client-acme").await;
    let gateway = Conn::open(&sys.nats, "gateway").await;
    let dispatcher = Conn::open(&sys.nats, "dispatcher-a").await;
    let w1 = Conn::open(&sys.nats, "worker-w1").await;
    let w2 = Conn::open(&sys.nats, "worker-w2").await;
    let mut heard = dispatcher
        .client
        .subscribe(names::SUBJECT_CANCEL_ALL)
        .await
        .expect("the dispatcher hears cancellations");
    let mut relayed_to_w1 = w1
        .client
        .subscribe(names::control_subject_all("w1"))
        .await
        .expect("a worker hears its own control subject");
    dispatcher.handled().await;
    w1.handled().await;

    acme.client
        .publish(names::cancel_subject(Some("acme"), "job-1"), "".into())
        .await
        .unwrap();
    acme.client.flush().await.unwrap();
    assert_eq!(next(&mut heard, "acme's cancel").await, "cancel.acme.job-1");
    gateway
        .client
        .publish(names::cancel_subject(Some("globex"), "job-2"), "".into())
        .await
        .unwrap();
    gateway.client.flush().await.unwrap();
    assert_eq!(
        next(&mut heard, "the gateway's cancel").await,
        "cancel.globex.job-2"
    );
    let relay = names::control_subject("w1", names::CONTROL_CANCEL);
    dispatcher
        .client
        .publish(relay.clone(), "{}".into())
        .await
        .unwrap();
    dispatcher.client.flush().await.unwrap();
    assert_eq!(
        next(&mut relayed_to_w1, "the dispatcher's relay").await,
        relay
    );
    for conn in [&acme, &gateway, &dispatcher, &w1] {
        conn.no_violations();
    }

    // Workers: no clients' cancellations, no other worker's control subject, no relays.
    w1.subscribe_refused(names::SUBJECT_CANCEL_ALL).await;
    w1.subscribe_refused(&names::cancel_subject(Some("acme"), "job-1"))
        .await;
    w1.subscribe_refused(&names::control_subject_all("w2"))
        .await;
    w1.subscribe_refused(&names::control_subject("w2", names::CONTROL_CANCEL))
        .await;
    w2.publish_refused(&relay).await;
    w2.publish_refused(&names::cancel_subject(Some("acme"), "job-1"))
        .await;
    // The dispatcher relays only to a worker's control subject, never as a client.
    dispatcher
        .publish_refused(&names::cancel_subject(Some("acme"), "job-1"))
        .await;

    acme.publish_refused(&names::cancel_subject(Some("globex"), "job-2"))
        .await;
    acme.publish_refused(&names::cancel_subject(None, "job-2"))
        .await;
    acme.publish_refused("cancel.job-2").await;
    acme.publish_refused(&relay).await;
    acme.subscribe_refused(names::SUBJECT_CANCEL_ALL).await;
    // Published after the refused ones on the same connection: it is the next heard, so
    // none of them got through.
    acme.client
        .publish(names::cancel_subject(Some("acme"), "marker"), "".into())
        .await
        .unwrap();
    acme.client.flush().await.unwrap();
    assert_eq!(
        next(&mut heard, "acme's marker").await,
        "cancel.acme.marker"
    );
    // And nothing but the dispatcher's relay reached w1's control subject (the refused
    // relays of w2 and acme were sent before this one, by the dispatcher, after them).
    dispatcher
        .client
        .publish(relay.clone(), "{}".into())
        .await
        .unwrap();
    dispatcher.client.flush().await.unwrap();
    assert_eq!(next(&mut relayed_to_w1, "the second relay").await, relay);
}

#[tokio::test]
async fn an_auditor_reads_decisions_only() {
    let sys = system().await;
    let auditor = Conn::open(&sys.nats, "auditor").await;
    let dispatcher = Conn::open(&sys.nats, "dispatcher-a").await;
    let mut live = auditor
        .client
        .subscribe("decisions.>")
        .await
        .expect("decisions feed");
    auditor.client.flush().await.unwrap();
    // Published until the feed shows it: a core subscription may be registered on the
    // server a moment after the flush on a loaded machine (seen about once in six runs), and
    // what is checked here is that the auditor may read the feed, not that timing.
    let received = within("live decision", async {
        loop {
            dispatcher
                .js
                .publish(
                    names::decision_subject(Some("acme"), "job-9"),
                    "rejected".into(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            if let Ok(m) = tokio::time::timeout(Duration::from_secs(1), live.next()).await {
                break m;
            }
        }
    })
    .await;
    assert_eq!(received.unwrap().payload.as_ref(), b"rejected");
    let stored = auditor
        .js
        .get_stream_no_info(STREAM_DECISIONS)
        .await
        .expect("stream handle")
        .direct_get_last_for_subject(names::decision_subject(Some("acme"), "job-9"))
        .await
        .expect("direct get");
    assert_eq!(stored.payload.as_ref(), b"rejected");
    auditor.no_violations();

    auditor.subscribe_refused("results.acme.job-9.>").await;
    auditor.subscribe_refused("work.*").await;
    auditor
        .publish_refused(&names::submit_subject(Some("acme")))
        .await;
    auditor
        .publish_refused(&names::decision_subject(Some("acme"), "job-9"))
        .await;
}

#[tokio::test]
async fn gateway_and_dispatcher_do_their_part_only() {
    let sys = system().await;
    let gateway = Conn::open(&sys.nats, "gateway").await;
    let dispatcher = Conn::open(&sys.nats, "dispatcher-a").await;

    let gw_buckets = ensure_all(&gateway.js, &StreamSettings::default())
        .await
        .expect("the gateway opens the streams");
    let mut watch = gw_buckets
        .workers
        .watch_with_history(">")
        .await
        .expect("the gateway watches the workers");
    sys.admin_buckets
        .workers
        .put("w1", "hb".into())
        .await
        .unwrap();
    let entry = within("workers entry", watch.next())
        .await
        .expect("entry")
        .expect("ok");
    assert_eq!(entry.key, "w1");
    // For the tenant of each API key.
    for tenant in [Some("acme"), Some("globex"), None] {
        gateway
            .js
            .publish(names::submit_subject(tenant), "{}".into())
            .await
            .unwrap()
            .await
            .expect("the gateway submits");
    }
    gateway.no_violations();
    gateway.publish_refused("work.w1").await;
    // Retries (whose headers place a job in its queue) come from dispatchers only.
    gateway.publish_refused(names::SUBJECT_JOBS_RETRY).await;
    gateway
        .publish_refused(&names::decision_subject(Some("acme"), "j"))
        .await;
    gateway.publish_refused("$KV.workers.w1").await;
    gateway.subscribe_refused("work.w1").await;

    let d_buckets = ensure_all(&dispatcher.js, &StreamSettings::default())
        .await
        .expect("the dispatcher opens the streams");
    d_buckets
        .leader
        .create(names::LEADER_KEY, "dispatcher-a".into())
        .await
        .expect("the dispatcher takes the lease");
    // Declaring a silent worker dead: a conditional delete of its key (refused while the
    // revision is not the latest), and the purge of its pending assignments.
    let rev = sys
        .admin_buckets
        .workers
        .put("w1", "hb2".into())
        .await
        .unwrap();
    d_buckets
        .workers
        .delete_expect_revision("w1", Some(rev - 1))
        .await
        .expect_err("a stale revision is refused by the server");
    d_buckets
        .workers
        .delete_expect_revision("w1", Some(rev))
        .await
        .expect("the dispatcher deletes a silent worker's key");
    let work = dispatcher.js.get_stream(names::STREAM_WORK).await.unwrap();
    work.purge()
        .filter(names::work_subject("w1"))
        .await
        .expect("the dispatcher purges a dead worker's assignments");
    // RESULTS and EVENTS get their byte and per-worker bounds at the dispatcher's start.
    let tighter = StreamSettings {
        results_max_bytes: 1 << 20,
        events_max_bytes: 1 << 20,
        events_max_per_worker: 1_000,
        ..StreamSettings::default()
    };
    metronome_protocol::setup::apply_stream_limits(&dispatcher.js, &tighter)
        .await
        .expect("the dispatcher bounds RESULTS and EVENTS");
    dispatcher.no_violations();
    dispatcher
        .publish_refused(&names::event_done_subject("w1"))
        .await;
}

/// The leader's per-model queue snapshots: the dispatcher writes them; the gateway (the
/// console), the auditor and the admin (the CLI) list and read them the way
/// `metronome status` does (the keys, then each value); a worker and the gateway may not
/// write one.
#[tokio::test]
async fn queue_snapshots_are_written_by_the_dispatcher_and_read_by_operators() {
    let sys = system().await;
    let dispatcher = Conn::open(&sys.nats, "dispatcher-a").await;
    let d_buckets = ensure_all(&dispatcher.js, &StreamSettings::default())
        .await
        .expect("the dispatcher opens the buckets");
    let key = names::queue_key(MODEL);
    d_buckets
        .queues
        .put(key.as_str(), "snapshot".into())
        .await
        .expect("the dispatcher writes a queue snapshot");
    dispatcher.no_violations();

    for reader in ["gateway", "auditor", "admin"] {
        let conn = Conn::open(&sys.nats, reader).await;
        let kv = conn
            .js
            .get_key_value(names::BUCKET_QUEUES)
            .await
            .unwrap_or_else(|e| panic!("{reader} opens the queues bucket: {e}"));
        let keys: Vec<String> = within(
            "the keys of the queues bucket",
            kv.keys()
                .await
                .expect("keys")
                .filter_map(|k| async { k.ok() })
                .collect(),
        )
        .await;
        assert_eq!(
            keys,
            std::slice::from_ref(&key),
            "{reader} lists the snapshots"
        );
        let value = kv.get(key.as_str()).await.expect("get").expect("a value");
        assert_eq!(value.as_ref(), b"snapshot", "{reader} reads a snapshot");
        conn.no_violations();
    }

    let worker = Conn::open(&sys.nats, "worker-w1").await;
    worker
        .publish_refused(&format!("$KV.{}.{key}", names::BUCKET_QUEUES))
        .await;
    let gateway = Conn::open(&sys.nats, "gateway").await;
    gateway
        .publish_refused(&format!("$KV.{}.{key}", names::BUCKET_QUEUES))
        .await;
    // Seen from the admin: nothing but the dispatcher's snapshot was stored.
    let stored = sys
        .admin_buckets
        .queues
        .get(key.as_str())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.as_ref(), b"snapshot");
}

#[tokio::test]
async fn redis_lets_each_agent_write_only_its_own_keys_and_the_dispatcher_only_read() {
    // Redis 7's functions: the EWMA update is loaded by the dispatcher and called by
    // workers, which may run no Lua of their own.
    let sys = system().await;
    let connect = |user: &str| {
        let url = sys.redis.url_as(user, &password(user));
        async move {
            redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .expect("authenticated connection")
        }
    };
    let mut w1 = connect("worker-w1").await;
    let hset = |key: String| {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(key).arg("ttft_ms").arg(120);
        cmd
    };
    let own = metronome_protocol::redis_keys::ewma_key(PREFIX, "w1");
    let other = metronome_protocol::redis_keys::ewma_key(PREFIX, "w2");
    hset(own.clone())
        .query_async::<i64>(&mut w1)
        .await
        .expect("own EWMA");
    redis::cmd("SET")
        .arg(metronome_protocol::redis_keys::perf_key(PREFIX, "w1"))
        .arg("{}")
        .query_async::<()>(&mut w1)
        .await
        .expect("own performance model");
    hset(metronome_protocol::redis_keys::output_len_key(
        PREFIX, MODEL, "w1",
    ))
    .query_async::<i64>(&mut w1)
    .await
    .expect("its own output length of its model");
    // The EWMA update is a function the dispatcher loads; a worker may only call it, and
    // it runs under the caller's ACL.
    let mut dispatcher = connect("dispatcher-a").await;
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(metronome_protocol::redis_keys::EWMA_LIBRARY)
        .query_async::<String>(&mut dispatcher)
        .await
        .expect("the dispatcher loads the EWMA update");
    let fcall = |key: &str| {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(metronome_protocol::redis_keys::EWMA_UPDATE_FUNCTION)
            .arg(2)
            .arg(key)
            .arg(metronome_protocol::redis_keys::output_len_key(
                PREFIX, MODEL, "w1",
            ))
            .arg(1_000)
            .arg(0.5)
            .arg(60_000)
            .arg(1)
            .arg(metronome_protocol::redis_keys::FIELD_SAMPLES)
            .arg(metronome_protocol::redis_keys::FIELD_UPDATED_MS)
            .arg(metronome_protocol::redis_keys::FIELD_ALPHA)
            .arg("ttft_ms")
            .arg(1)
            .arg(metronome_protocol::redis_keys::FIELD_TOKENS)
            .arg("");
        cmd
    };
    fcall(&own)
        .query_async::<i64>(&mut w1)
        .await
        .expect("own key through the update function");

    for (what, cmd) in [
        ("another worker's EWMA", hset(other.clone())),
        (
            "another model's output length",
            hset(metronome_protocol::redis_keys::output_len_key(
                PREFIX,
                "qwen2.5-7b",
                "w1",
            )),
        ),
        (
            "another worker's output length of its model",
            hset(metronome_protocol::redis_keys::output_len_key(
                PREFIX, MODEL, "w3",
            )),
        ),
        (
            // What every worker of the model once shared: one worker could move the
            // prediction of every job of its model.
            "a shared output length of its model",
            hset(format!("{PREFIX}:outlen:{MODEL}")),
        ),
        ("flushing everything", redis::cmd("FLUSHALL")),
    ] {
        let err = cmd
            .query_async::<redis::Value>(&mut w1)
            .await
            .expect_err(what);
        assert_eq!(err.code(), Some("NOPERM"), "{what}: {err}");
    }
    let err = fcall(&other)
        .query_async::<i64>(&mut w1)
        .await
        .expect_err("another worker's key through the update function");
    assert!(
        err.code() == Some("NOPERM") || err.to_string().contains("NOPERM"),
        "{err}"
    );
    // No Lua of its own: a script (even a loop that would hold Redis for every role) or a
    // function library of its own is refused before it runs.
    for (what, cmd) in [
        ("a script", {
            let mut c = redis::cmd("EVAL");
            c.arg("while true do end").arg(0);
            c
        }),
        ("loading a script", {
            let mut c = redis::cmd("SCRIPT");
            c.arg("LOAD").arg("return 1");
            c
        }),
        ("loading a function", {
            let mut c = redis::cmd("FUNCTION");
            c.arg("LOAD")
                .arg("REPLACE")
                .arg("#!lua name=mine\nredis.register_function('spin', function() while true do end end)");
            c
        }),
        ("deleting the functions", {
            let mut c = redis::cmd("FUNCTION");
            c.arg("FLUSH");
            c
        }),
    ] {
        let err = cmd
            .query_async::<redis::Value>(&mut w1)
            .await
            .expect_err(what);
        assert_eq!(err.code(), Some("NOPERM"), "{what}: {err}");
    }

    let read: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(&own)
        .query_async(&mut dispatcher)
        .await
        .expect("the dispatcher reads");
    assert_eq!(read.get("ttft_ms").map(String::as_str), Some("1"));
    let err = hset(own.clone())
        .query_async::<i64>(&mut dispatcher)
        .await
        .expect_err("the dispatcher writes nothing");
    assert_eq!(err.code(), Some("NOPERM"), "{err}");

    // The gateway's console reads the EWMA hashes, and nothing else, and writes nothing.
    let mut gateway = connect("gateway").await;
    let read: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(&own)
        .query_async(&mut gateway)
        .await
        .expect("the gateway reads the EWMAs");
    assert_eq!(read.get("ttft_ms").map(String::as_str), Some("1"));
    for (what, cmd) in [
        ("the gateway writing an EWMA", hset(own.clone())),
        ("the gateway deleting an EWMA", {
            let mut c = redis::cmd("DEL");
            c.arg(&own);
            c
        }),
        ("the gateway reading a performance model", {
            let mut c = redis::cmd("GET");
            c.arg(metronome_protocol::redis_keys::perf_key(PREFIX, "w1"));
            c
        }),
    ] {
        let err = cmd
            .query_async::<redis::Value>(&mut gateway)
            .await
            .expect_err(what);
        assert_eq!(err.code(), Some("NOPERM"), "{what}: {err}");
    }
}

/// Store a job's decision and final result in their streams, as the dispatcher and a
/// worker would, waiting for both acks.
async fn store_decision_and_final(
    js: &async_nats::jetstream::Context,
    tenant: Option<&str>,
    job: &str,
    decision: &'static str,
    result: &'static str,
) {
    for (subject, payload) in [
        (names::decision_subject(tenant, job), decision),
        (names::dispatcher_final_subject(tenant, job), result),
    ] {
        js.publish(subject, payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

/// The probe of a stolen worker identity, end to end: the dispatcher binary runs as its
/// own identity with the provisioning record `scripts/render-auth.py` writes; `worker-w2`
/// (provisioned for qwen2.5-7b) heartbeats under its own key, as NATS lets it, claiming
/// the llama model with room for 100,000 jobs and near-zero step times. A tenant's llama
/// job goes to the honest llama worker, and the decision names w2 `not_provisioned`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_identity_heartbeating_as_another_model_gets_none_of_its_jobs() {
    let sys = system().await;
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("workers.json");
    std::fs::write(
        &record,
        serde_json::json!({"v": 1, "workers": {
            "w1": {"model": MODEL, "max_concurrency": 4},
            "w2": {"model": "qwen2.5-7b", "max_concurrency": 4},
        }})
        .to_string(),
    )
    .unwrap();
    let config = dir.path().join("dispatcher.toml");
    std::fs::write(
        &config,
        format!(
            "nats_url = \"{}\"\nredis_url = \"{}\"\ndispatcher_id = \"a\"\nstorage = \"memory\"\n\
             provisioning_file = \"{}\"\n\
             nats_auth = {{ user = \"dispatcher-a\", password = \"{}\" }}\n\
             [scheduler]\nheartbeat_timeout_ms = 60000\n",
            sys.nats.url(),
            sys.redis.url_as("dispatcher-a", &password("dispatcher-a")),
            record.display(),
            password("dispatcher-a"),
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("dispatcher.log")).unwrap();
    let mut command =
        std::process::Command::new(metronome_testkit::bin_path("metronome-dispatcher"));
    command
        .arg("--config")
        .arg(&config)
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    let _dispatcher = metronome_testkit::ChildGuard::spawn("dispatcher", command).unwrap();
    let logs = || std::fs::read_to_string(dir.path().join("dispatcher.log")).unwrap_or_default();

    let fast = metronome_protocol::PerfCoefficients {
        step_base_ms: 0.001,
        step_per_stream_ms: 0.0,
        step_per_ktok_ms: 0.0,
        stall_per_prefill_token_ms: 0.0,
        ttft_base_ms: 0.001,
        prefill_per_token_ms: 0.0,
        ttft_per_stream_ms: 0.0,
        step_error_ms: 0.0,
        samples: 1_000,
    };
    for (user, id, cap) in [("worker-w1", "w1", 4), ("worker-w2", "w2", 100_000)] {
        let conn = Conn::open(&sys.nats, user).await;
        let buckets = ensure_for_worker(&conn.js, &StreamSettings::default())
            .await
            .expect("a worker opens its buckets");
        let status = metronome_protocol::WorkerStatus {
            v: metronome_protocol::PROTOCOL_VERSION,
            worker_id: id.into(),
            model: MODEL.into(),
            node: None,
            gpu_index: None,
            healthy: true,
            draining: false,
            max_concurrency: cap,
            active: 0,
            queued: 0,
            in_flight: Vec::new(),
            kv: Some(metronome_protocol::KvUsage {
                used_frac: 0.0,
                capacity_tokens: Some(1_000_000),
            }),
            gpu: None,
            prefill_pending_tokens: 0,
            perf: Some(fast),
            decoding: None,
            max_epoch: 0,
            seq: 1,
            sent_ms: metronome_protocol::time::unix_ms(),
        };
        buckets
            .workers
            .put(id, serde_json::to_vec(&status).unwrap().into())
            .await
            .unwrap_or_else(|e| panic!("{user} heartbeats under its own key: {e}"));
        conn.no_violations();
    }

    let client = Conn::open(&sys.nats, "client-acme").await;
    let acme = Some("acme");
    let job = serde_json::json!({
        "v": metronome_protocol::PROTOCOL_VERSION, "id": "job-llama", "model": MODEL,
        "endpoint": "chat", "request": {"messages": [{"role": "user", "content": "secret"}]},
        "prompt_tokens": 10, "max_tokens": 10, "tenant": "acme",
        "submitted_ms": metronome_protocol::time::unix_ms(),
    });
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(names::HEADER_MSG_ID, "job-llama");
    client
        .js
        .publish_with_headers(
            names::submit_subject(acme),
            headers,
            serde_json::to_vec(&job).unwrap().into(),
        )
        .await
        .expect("publish")
        .await
        .expect("JOBS stores the job");

    let decisions = client
        .js
        .get_stream_no_info(STREAM_DECISIONS)
        .await
        .expect("stream handle");
    let decision: metronome_protocol::Decision = wait_for("the job's decision", WAIT, || {
        let decisions = decisions.clone();
        async move {
            let m = decisions
                .direct_get_last_for_subject(names::decision_subject(acme, "job-llama"))
                .await
                .ok()?;
            serde_json::from_slice(&m.payload).ok()
        }
    })
    .await;
    assert_eq!(
        decision.worker_id.as_deref(),
        Some("w1"),
        "{decision:?}\n{}",
        logs()
    );
    let w2 = decision
        .rejected
        .iter()
        .find(|r| r.worker_id == "w2")
        .unwrap_or_else(|| panic!("w2 is not among the rejected: {decision:?}"));
    assert_eq!(
        (w2.code, w2.reason.as_str()),
        (
            metronome_protocol::RejectionCode::NotProvisioned,
            "not provisioned: provisioned for model 'qwen2.5-7b', its heartbeat claims 'llama-3.1-8b'"
        )
    );
}

/// A push consumer's messages go to the `deliver_subject` its creator names in the request
/// body, which nats-server (2.9.10) does not check against the creator's publish
/// permissions, and a stream whose subjects match stores them: a worker's consumer of its
/// own WORK subject delivering on `jobs.submit.acme` submits jobs as `acme`, the auditor's
/// consumer of DECISIONS delivering on `work.w2` feeds another worker's queue. The server
/// accepts both consumers; the leader's sweep (`setup::sweep_push_consumers`) deletes
/// every push consumer that does not deliver to an inbox, and then nothing is delivered.
#[tokio::test]
async fn push_consumers_delivering_beyond_an_inbox_are_swept() {
    let sys = system().await;
    let admin = Conn::open(&sys.nats, "admin").await;
    let w1 = Conn::open(&sys.nats, "worker-w1").await;
    let auditor = Conn::open(&sys.nats, "auditor").await;
    let dispatcher = Conn::open(&sys.nats, "dispatcher-a").await;
    let target_jobs = names::submit_subject(Some("acme"));
    let mut seen_jobs = admin.client.subscribe(target_jobs.clone()).await.unwrap();
    let mut seen_work = admin.client.subscribe("work.w2").await.unwrap();
    admin.handled().await;
    w1.js
        .get_stream(STREAM_WORK)
        .await
        .unwrap()
        .create_consumer(consumer::push::Config {
            durable_name: Some(names::work_consumer("w1")),
            filter_subject: "work.w1".into(),
            deliver_subject: target_jobs.clone(),
            ..Default::default()
        })
        .await
        .expect("the server accepts a worker's push consumer to any subject");
    auditor
        .js
        .get_stream_no_info(STREAM_DECISIONS)
        .await
        .unwrap()
        .create_consumer(consumer::push::Config {
            deliver_subject: "work.w2".into(),
            ..Default::default()
        })
        .await
        .expect("the server accepts the auditor's push consumer to any subject");
    let swept = metronome_protocol::setup::sweep_push_consumers(&dispatcher.js)
        .await
        .expect("the leader sweeps");
    let mut delivering: Vec<&str> = swept.iter().map(|s| s.deliver_subject.as_str()).collect();
    delivering.sort();
    assert_eq!(delivering, [target_jobs.as_str(), "work.w2"], "{swept:?}");
    dispatcher
        .js
        .publish("work.w1", "assignment for w1".into())
        .await
        .unwrap()
        .await
        .unwrap();
    dispatcher
        .js
        .publish(
            names::decision_subject(Some("acme"), "job-p"),
            "decision".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    // Nothing comes: a delivery would arrive within milliseconds on loopback (it did,
    // before the sweep existed, and JOBS stored it).
    let jobs = tokio::time::timeout(Duration::from_secs(2), seen_jobs.next()).await;
    let work = tokio::time::timeout(Duration::from_secs(2), seen_work.next()).await;
    assert!(
        jobs.is_err(),
        "a worker's consumer delivered on {target_jobs}"
    );
    assert!(work.is_err(), "the auditor's consumer delivered on work.w2");
    let jobs_stored = admin
        .js
        .get_stream(names::STREAM_JOBS)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(jobs_stored, 0, "JOBS stored a consumer's delivery");
    // An inbox delivery (what ordered consumers use) is left alone.
    auditor
        .js
        .get_stream_no_info(STREAM_DECISIONS)
        .await
        .unwrap()
        .create_consumer(consumer::push::Config {
            deliver_subject: "_INBOX.auditor.feed".into(),
            ..Default::default()
        })
        .await
        .expect("an inbox delivery");
    let swept = metronome_protocol::setup::sweep_push_consumers(&dispatcher.js)
        .await
        .unwrap();
    assert!(swept.is_empty(), "{swept:?}");
}

/// Upgrades in any order: a gateway started before any dispatcher that creates the
/// `api_keys` bucket (the bucket is missing, and the gateway's identity may not create
/// streams) starts anyway, serves the keys of its configuration file, and serves the
/// bucket's keys as soon as a dispatcher (here the admin) creates it, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_before_the_api_keys_bucket_exists_serves_it_once_created() {
    use metronome_protocol::api_keys::{key_sha256, KeyRecord, KEY_RECORD_VERSION};
    use metronome_testkit::{bin_path, free_port, ChildGuard};
    const FILE_KEY: &str = "mtk_from_the_file";
    const LIVE_KEY: &str = "mtk_from_the_bucket";
    let sys = system().await;
    let admin = Conn::open(&sys.nats, "admin").await;
    admin
        .js
        .delete_stream(format!("KV_{}", names::BUCKET_API_KEYS))
        .await
        .expect("the bucket of an older version is missing");

    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{port}\"\nnats_url = \"{}\"\nallow_anonymous = false\n\
             [[tenants]]\nname = \"acme\"\n[[keys]]\ntenant = \"acme\"\nsha256 = \"{}\"\n",
            sys.nats.url(),
            key_sha256(FILE_KEY)
        ),
    )
    .unwrap();
    let log = dir.path().join("gateway.log");
    let mut cmd = std::process::Command::new(bin_path("metronome-gateway"));
    cmd.arg("--config")
        .arg(&config)
        .env_remove("NATS_URL")
        .env("METRONOME_NATS_USER", "gateway")
        .env("METRONOME_NATS_PASSWORD", password("gateway"))
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::process::Stdio::null());
    let _gateway = ChildGuard::spawn("gateway", cmd).expect("the gateway starts");

    let http = reqwest::Client::new();
    let status_of = |key: &'static str| {
        let request = http
            .get(format!("http://127.0.0.1:{port}/v1/models"))
            .bearer_auth(key);
        async move { request.send().await.ok().map(|r| r.status().as_u16()) }
    };
    // Its refused attempts to create the bucket wait out their request time-outs first.
    wait_for(
        "the gateway serves its configuration file's key",
        3 * WAIT,
        || {
            let status = status_of(FILE_KEY);
            async move { (status.await == Some(200)).then_some(()) }
        },
    )
    .await;
    assert_eq!(status_of(LIVE_KEY).await, Some(401));
    // The gateway may serve before its last refused attempt has timed out and been logged.
    wait_for(
        "the gateway logs that it cannot open the bucket",
        3 * WAIT,
        || {
            let logged = std::fs::read_to_string(&log).unwrap_or_default();
            async move {
                logged
                    .contains("cannot open the api_keys bucket")
                    .then_some(())
            }
        },
    )
    .await;

    // A dispatcher of the new version starts: the bucket exists, a key is created.
    ensure_all(&admin.js, &StreamSettings::default())
        .await
        .expect("the admin creates the bucket");
    let record = KeyRecord {
        v: KEY_RECORD_VERSION,
        tenant: "acme".into(),
        sha256: key_sha256(LIVE_KEY),
        note: None,
        revoked: false,
        operator: false,
        priority: None,
        created_ms: 1,
        revoked_ms: None,
    };
    admin
        .js
        .get_key_value(names::BUCKET_API_KEYS)
        .await
        .expect("the bucket exists")
        .put(&record.sha256, serde_json::to_vec(&record).unwrap().into())
        .await
        .unwrap();
    wait_for("the gateway serves the bucket's key", WAIT, || {
        let status = status_of(LIVE_KEY);
        async move { (status.await == Some(200)).then_some(()) }
    })
    .await;
}
