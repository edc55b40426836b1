//! The fairness drill, quick version: a real nats-server and redis-server, dispatchers run
//! in-process, and this test acting as one GPU that runs one job at a time (the model
//! is at capacity throughout). Tenant A floods with large jobs; tenant B keeps a steady
//! backlog of small ones. Fair queuing must split the served weighted tokens evenly
//! while both wait, give A everything once B stops (work-conserving), and keep the split
//! across a leader failover, which only holds if the new leader loaded the counters.
//! Assertions are on shares and order, never on timing.

use crate::common;

use std::collections::HashMap;

use common::*;
use futures::StreamExt;
use metronome_protocol::{names, Assignment, CompletionEvent, CompletionOutcome, Decision};

const MODEL: &str = "fair-model";
/// A's jobs: 100 prompt + 900 output tokens, weighted 100 + 2 × 900 = 1900.
const A_COST: f64 = 1900.0;
/// B's jobs: 10 prompt + 45 output tokens, weighted 10 + 2 × 45 = 100.
const B_COST: f64 = 100.0;
/// A floods with this many jobs up front.
const A_JOBS: usize = 60;

async fn submit_for(env: &Env, id: &str, tenant: &str) {
    let (prompt, max_tokens) = if tenant == "a" { (100, 900) } else { (10, 45) };
    let mut body = job_json(id, MODEL, prompt, max_tokens);
    body["tenant"] = tenant.into();
    env.submit_raw(id, body).await;
}

/// The completion a worker-agent publishes after generating every token asked for.
async fn finish(env: &Env, a: &Assignment) {
    let ev = CompletionEvent {
        v: 1,
        job_id: a.job.id.clone(),
        worker_id: a.worker_id.clone(),
        model: a.job.model.clone(),
        epoch: a.epoch,
        attempt: a.attempt,
        outcome: CompletionOutcome::Done,
        streamed: true,
        error: None,
        prompt_tokens: a.job.prompt_tokens,
        output_tokens: a.job.max_tokens,
        ttft_ms: Some(1.0),
        tpot_ms: Some(1.0),
        e2e_ms: 2.0,
        finished_ms: metronome_protocol::time::unix_ms(),
        job: None,
    };
    env.store_json(names::event_done_subject(&a.worker_id), &ev)
        .await;
}

fn a_done(order: &[String]) -> usize {
    order.iter().filter(|id| id.starts_with("a-")).count()
}

fn b_done(order: &[String]) -> usize {
    order.iter().filter(|id| id.starts_with("b-")).count()
}

fn cost(a: &Assignment) -> f64 {
    f64::from(a.job.prompt_tokens) + 2.0 * f64::from(a.job.max_tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_gets_the_rest_and_shares_hold_across_a_failover() {
    let env = Env::start().await;
    let mut status = worker("fair-gpu0", MODEL, 1);
    let consumer = env.work_consumer(&status.worker_id).await;
    env.heartbeat(&status).await;
    let mut config = env.config("d1");
    config.fairness_persist_ms = 20;
    let mut leader = Some(env.dispatcher(config.clone()).await);

    // A floods; B then keeps three small jobs waiting.
    for i in 0..A_JOBS {
        submit_for(&env, &format!("a-{i}"), "a").await;
    }
    let mut b_sent = 0;
    for _ in 0..3 {
        submit_for(&env, &format!("b-{b_sent}"), "b").await;
        b_sent += 1;
    }
    // Every job read before the GPU frees up (a-0 runs, the rest wait): otherwise a slow
    // intake (each job is looked up in DECISIONS first) leaves B's jobs unread when the
    // next job is chosen, and A's are served whatever the counters say.
    let metrics = leader.as_ref().expect("a leader").0.metrics.clone();
    metronome_testkit::wait_for("every job queued", WAIT, || {
        let m = metrics.clone();
        async move {
            let depth = m.queue_depth.lock().unwrap().get(MODEL).copied();
            (depth == Some(A_JOBS - 1 + b_sent)).then_some(())
        }
    })
    .await;

    let mut work = consumer.messages().await.unwrap();
    // Weighted tokens served per tenant since B started waiting (A's first job was
    // assigned on arrival, before any of B's existed).
    let mut served: HashMap<String, f64> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut failover_done = false;
    let mut b_stopped = false;
    let mut last_a_counter_d1 = 0.0;
    // Weighted tokens per tenant: before the failover, after it while B sends, after B stops.
    let mut phases: [HashMap<String, f64>; 3] = Default::default();
    loop {
        let m = tokio::time::timeout(WAIT, work.next())
            .await
            .unwrap_or_else(|_| panic!("no assignment after {order:?}"))
            .unwrap()
            .unwrap();
        m.ack().await.unwrap();
        let a: Assignment = serde_json::from_slice(&m.payload).unwrap();
        let tenant = a.job.tenant.clone().unwrap();
        if !order.is_empty() {
            *served.entry(tenant.clone()).or_default() += cost(&a);
            let phase = usize::from(failover_done) + usize::from(b_stopped);
            *phases[phase].entry(tenant.clone()).or_default() += cost(&a);
        }
        order.push(a.job.id.clone());
        let (sa, sb) = (
            served.get("a").copied().unwrap_or(0.0),
            served.get("b").copied().unwrap_or(0.0),
        );
        if !b_stopped {
            // While both wait, neither is ahead by more than one of its own jobs.
            assert!(
                sa - sb <= A_COST && sb - sa <= B_COST,
                "after {order:?}: A served {sa}, B served {sb}"
            );
        }
        if tenant == "b" && !b_stopped {
            submit_for(&env, &format!("b-{b_sent}"), "b").await;
            b_sent += 1;
            // B keeps three jobs waiting: its new one must be queued before the GPU frees
            // up, or B has none waiting when the next job is chosen (the intake looks every
            // job up in DECISIONS first, which can take as long as this loop's turn).
            let waiting = (A_JOBS - a_done(&order)) + (b_sent - b_done(&order));
            let metrics = leader.as_ref().expect("a leader").0.metrics.clone();
            metronome_testkit::wait_for("B's new job queued", WAIT, || {
                let m = metrics.clone();
                async move {
                    let depth = m.queue_depth.lock().unwrap().get(MODEL).copied();
                    (depth == Some(waiting)).then_some(())
                }
            })
            .await;
        }
        // The worker reports the job it runs, so a new leader adopts it rather than
        // assigning a second job to a full GPU.
        status.active = 1;
        status.in_flight = vec![a.job.id.clone()];
        status.seq += 1;
        env.heartbeat(&status).await;

        // Fail over right after A was served, when B is owed the most: a leader that
        // started from zero counters would serve A's (older) jobs first.
        if !failover_done && tenant == "a" && order.len() >= 25 {
            let id = a.job.id.clone();
            let d: Decision = env
                .decisions_for(std::slice::from_ref(&id))
                .await
                .remove(&id)
                .unwrap();
            last_a_counter_d1 = d.fair_counter.expect("counter in the decision");
            assert_eq!(d.tenant.as_deref(), Some("a"));
            assert_eq!(d.priority, Some(metronome_protocol::Priority::Interactive));
            let (running, stop) = leader.take().unwrap();
            stop.cancel();
            running.join().await.unwrap();
            let (d2, stop_d2) = env.dispatcher(env.config("d2")).await;
            // Let the new leader read every waiting job again before the GPU frees up:
            // capacity freed earlier would go to whichever jobs it had read so far, A's
            // (they come first in the stream), whatever the counters.
            let waiting = (A_JOBS - a_done(&order)) + (b_sent - b_done(&order));
            let metrics = d2.metrics.clone();
            metronome_testkit::wait_for("d2 to queue the waiting jobs", WAIT, || {
                let m = metrics.clone();
                async move {
                    let depth = m.queue_depth.lock().unwrap().get(MODEL).copied();
                    (depth == Some(waiting)).then_some(())
                }
            })
            .await;
            leader = Some((d2, stop_d2));
            failover_done = true;
        }
        finish(&env, &a).await;
        if failover_done && order.len() >= 100 {
            // B stops sending: A must get every remaining dispatch.
            b_stopped = true;
        }
        if a_done(&order) == A_JOBS && b_done(&order) == b_sent {
            break;
        }
    }

    for (name, p) in ["leader d1", "leader d2, B sending", "leader d2, B stopped"]
        .iter()
        .zip(&phases)
    {
        eprintln!(
            "{name}: weighted tokens served A {} B {}",
            p.get("a").copied().unwrap_or(0.0),
            p.get("b").copied().unwrap_or(0.0)
        );
    }
    eprintln!("jobs served: A {}, B {}", a_done(&order), b_done(&order));

    // Work-conserving: every job of both tenants was served on the one busy GPU, and B
    // got its half of the weighted tokens as many small jobs per large one of A's.
    let b_done = b_done(&order);
    assert!(b_done >= 60, "B served {b_done} jobs: {order:?}");
    assert!(b_stopped, "{order:?}");

    // The new leader's decisions continue the counters: A's next charge builds on d1's.
    let decisions = env.all_decisions().await;
    let first_a_d2 = decisions
        .iter()
        .find(|d| d.dispatcher_id == "d2" && d.tenant.as_deref() == Some("a"))
        .expect("d2 assigned A's jobs");
    assert!(
        first_a_d2.fair_counter.unwrap() > last_a_counter_d1,
        "d2 started A at {:?}, d1 had it at {last_a_counter_d1}",
        first_a_d2.fair_counter
    );
    let (running, stop) = leader.take().unwrap();
    let t = running.metrics.tenant("b");
    assert!(t.requests > 0 && t.tokens > 0, "{t:?}");
    stop.cancel();
    running.join().await.unwrap();
}
