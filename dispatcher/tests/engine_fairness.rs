//! Fair sharing on the engine alone (no server, simulated time): the fairness drill's
//! quick version (`fairness.rs`) as a property of the decisions. One GPU runs one job at a
//! time, so the model is at capacity throughout. Tenant A floods with large jobs; tenant B
//! keeps three small ones waiting. Fair queuing must split the served weighted tokens
//! evenly while both wait, give A everything once B stops (work-conserving), and keep the
//! split across a change of leader, which only holds if the new leader starts from the
//! counters the old one handed out to be persisted.

use std::collections::{BTreeMap, HashMap};

use metronome_dispatcher::engine::testing::*;
use metronome_dispatcher::engine::{Effect, Engine, Outcome};
use metronome_protocol::Job;
use metronome_scheduler::FairnessSnapshot;

const GPU: &str = "gpu";
/// A's jobs: 100 prompt + 900 output tokens, weighted 100 + 2 × 900 = 1900.
const A_COST: f64 = 1900.0;
/// B's jobs: 10 prompt + 45 output tokens, weighted 10 + 2 × 45 = 100.
const B_COST: f64 = 100.0;
const A_JOBS: usize = 60;

/// The simulated cluster: the leader, the jobs submitted and not yet assigned (what a new
/// leader reads again from JOBS), and the time.
struct Drill {
    leader: Engine,
    waiting: BTreeMap<u64, Job>,
    seq: u64,
    at: u64,
    /// The counters the leader last handed out to be persisted.
    persisted: Option<FairnessSnapshot>,
}

impl Drill {
    fn new_leader(saved: Option<FairnessSnapshot>) -> Engine {
        let mut e = engine(|_| {});
        e.fairness(saved);
        e
    }

    /// A job of `tenant` submitted now; the jobs the leader assigned at once.
    fn submit(&mut self, id: &str, tenant: &str) -> Vec<(String, String)> {
        let (prompt, max_tokens) = if tenant == "a" { (100, 900) } else { (10, 45) };
        self.seq += 1;
        let job = body(id, "m", Some(tenant), prompt, max_tokens, self.at);
        self.waiting.insert(self.seq, job.clone());
        let out = step(
            &mut self.leader,
            vec![arrival(job, self.seq, self.at)],
            self.at,
        );
        let placed = assigned(&out);
        self.waiting
            .retain(|_, j| placed.iter().all(|(id, _)| *id != j.id));
        placed
    }

    /// Let the leader decide at the next instant: the one job it assigns, and its
    /// tenant's fair-share counter as the decision records it.
    fn next_assignment(&mut self, inputs: Vec<metronome_dispatcher::engine::Event>) -> (Job, f64) {
        self.at += 10;
        let out = step(&mut self.leader, inputs, self.at);
        self.keep_persisted(&out);
        let placed: Vec<(&Job, f64)> = out
            .iter()
            .filter_map(|f| match f {
                Effect::Publish(Outcome::Assign {
                    job,
                    worker_id,
                    decision,
                    ..
                }) => {
                    assert_eq!(worker_id, GPU);
                    let counter = decision.fair_counter.expect("a counter in the decision");
                    Some((job.job.as_ref(), counter))
                }
                _ => None,
            })
            .collect();
        assert_eq!(placed.len(), 1, "one GPU, one job at a time");
        let (job, counter) = (placed[0].0.clone(), placed[0].1);
        self.waiting.retain(|_, j| j.id != job.id);
        (job, counter)
    }

    fn keep_persisted(&mut self, effects: &[Effect]) {
        for f in effects {
            if let Effect::PersistFairness(snapshot) = f {
                self.persisted = Some(snapshot.clone());
            }
        }
    }

    /// The leader's term ends while `running` runs; the next one starts from the counters
    /// handed out, adopts the running job from the GPU's heartbeat and reads every waiting
    /// job again, in stream order.
    fn change_leader(&mut self, running: &Job) {
        self.at += 1;
        self.leader.tick(self.at);
        self.leader.finish();
        let out = self.leader.take_effects();
        self.keep_persisted(&out);
        let mut next = Drill::new_leader(self.persisted.clone());
        let busy = heartbeat_of(
            GPU,
            "m",
            1,
            std::slice::from_ref(&running.id),
            self.seq,
            self.at,
        );
        next.load(vec![busy_update(busy)], None, self.at);
        let again = self
            .waiting
            .iter()
            .map(|(&seq, job)| arrival(job.clone(), seq, self.at))
            .collect();
        let out = step(&mut next, again, self.at);
        assert!(
            assigned(&out).is_empty(),
            "the GPU still runs {}",
            running.id
        );
        self.leader = next;
    }
}

fn busy_update(
    event: metronome_dispatcher::engine::Event,
) -> metronome_dispatcher::engine::WorkerUpdate {
    match event {
        metronome_dispatcher::engine::Event::Worker(update) => update,
        _ => unreachable!("a heartbeat"),
    }
}

fn weight(job: &Job) -> f64 {
    f64::from(job.prompt_tokens) + 2.0 * f64::from(job.max_tokens)
}

#[test]
fn a_flooding_tenant_gets_the_rest_and_shares_hold_across_a_change_of_leader() {
    let mut drill = Drill {
        leader: Drill::new_leader(None),
        waiting: BTreeMap::new(),
        seq: 0,
        at: T0,
        persisted: None,
    };
    step(
        &mut drill.leader,
        vec![heartbeat_of(GPU, "m", 1, &[], 1, T0)],
        T0,
    );
    // A floods (its first job goes at once, before any of B's exists); B then keeps three
    // small jobs waiting.
    let mut placed = Vec::new();
    for i in 0..A_JOBS {
        placed.extend(drill.submit(&format!("a-{i}"), "a"));
    }
    assert_eq!(placed, [("a-0".to_string(), GPU.to_string())]);
    let mut running = Some(body("a-0", "m", Some("a"), 100, 900, T0));
    let mut b_sent = 0;
    for _ in 0..3 {
        assert!(drill.submit(&format!("b-{b_sent}"), "b").is_empty());
        b_sent += 1;
    }
    let mut served: HashMap<String, f64> = HashMap::new();
    let mut order: Vec<String> = vec!["a-0".into()];
    let (mut changed_leader, mut b_stopped) = (false, false);
    // A's counter as the old leader's last decision for A recorded it, and as the new
    // leader's first one does.
    let mut last_a_counter = 0.0;
    let mut first_a_counter_after: Option<f64> = None;
    let mut hb_seq = 1;
    loop {
        let finished = running.take().expect("a job runs");
        hb_seq += 1;
        let inputs = vec![
            done(
                &finished.id,
                GPU,
                "m",
                finished.prompt_tokens,
                finished.max_tokens,
                drill.at,
            ),
            heartbeat_of(GPU, "m", 1, &[], hb_seq, drill.at),
        ];
        assert!(order.len() < 1_000, "no end after {order:?}");
        if drill.waiting.is_empty() {
            drill.at += 10;
            step(&mut drill.leader, inputs, drill.at);
            break;
        }
        let (job, counter) = drill.next_assignment(inputs);
        let tenant = job.tenant.clone().expect("a tenant");
        *served.entry(tenant.clone()).or_default() += weight(&job);
        order.push(job.id.clone());
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
            assert!(drill.submit(&format!("b-{b_sent}"), "b").is_empty());
            b_sent += 1;
        }
        if tenant == "a" {
            if changed_leader {
                first_a_counter_after.get_or_insert(counter);
            } else {
                last_a_counter = counter;
            }
        }
        // Change leader right after A was served, when B is owed the most: a leader that
        // started from zero counters would serve A's (older) jobs first.
        if !changed_leader && tenant == "a" && order.len() >= 25 {
            drill.change_leader(&job);
            changed_leader = true;
        }
        if changed_leader && order.len() >= 100 {
            // B stops sending: A must get every remaining dispatch.
            b_stopped = true;
        }
        running = Some(job);
    }
    let a_done = order.iter().filter(|id| id.starts_with("a-")).count();
    let b_done = order.iter().filter(|id| id.starts_with("b-")).count();
    assert_eq!(a_done, A_JOBS, "{order:?}");
    assert_eq!(b_done, b_sent, "{order:?}");
    // Work-conserving, and B got its half as many small jobs per large one of A's.
    assert!(b_done >= 60, "B served {b_done} jobs: {order:?}");
    assert!(b_stopped && changed_leader, "{order:?}");
    // The new leader's decisions continue the counters: A's next charge builds on the old
    // leader's.
    let after = first_a_counter_after.expect("the new leader assigned A's jobs");
    assert!(
        after > last_a_counter,
        "the new leader started A at {after}, the old one had it at {last_a_counter}"
    );
}
