//! The fairness drill (`metronome-bench --fairness`): two tenants with real API keys share
//! one model through the gateway, on simulated GPUs, and tenant B's latency must not pay
//! for tenant A's flood.
//!
//! One system (`./dev up --keep-going`, defaults, the gateway given one key per tenant),
//! three phases of the same length, B's arrivals identical in each (same seed, same tenant
//! index; see [`metronome_loadgen::plan::tenants_plan`]):
//!
//! 1. *alone*: B offers `steady_share` of the model's nominal capacity (Poisson, the chat
//!    mix), nobody else;
//! 2. *flood*: B as before, A offers `flood_factor` times its fair share (half the
//!    capacity: two tenants);
//! 3. *failover*: as *flood*, and the leading dispatcher is SIGKILLed at a third of the
//!    phase (restarted 1 s later as a standby); the standby's takeover is timed from the
//!    dispatchers' `metronome_dispatcher_leader` gauges.
//!
//! Judged, by the client's own measurements (never logs): B's TTFT p99 in *flood* within
//! `1.5 ×` of *alone*; every B request served; A served the rest (work-conserving: GPU-
//! seconds idle while a job waited, from [`super::idle`]); after the takeover, B's TTFT p99
//! within `1.5 ×` of *alone* again and B's requests all served. The tenant the gateway
//! wrote into each job is checked against the key's tenant in the decisions.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::idle::{idle_stats, IdleStats};
use super::prediction::predicted;
use super::report::SECTION_FILE;
use super::scenarios::{
    nominal_for, write_agent_metrics, write_samples, BenchPlan, MODEL, SAMPLE_INTERVAL,
};
use metronome_loadgen::process::{signal, stop_restarted, Image};
use metronome_loadgen::stats::percentile;
use metronome_loadgen::system::{System, SystemSpec};
use metronome_loadgen::{
    run_load, write_outputs, LengthDist, LoadSpec, RequestRecord, RunResult, Summary, TenantLoad,
    Workload,
};

/// The tenant with the steady load (B).
pub const STEADY: &str = "steady";
/// The tenant that floods (A).
pub const FLOOD: &str = "flood";
/// Most B's TTFT p99 may grow over its value alone.
pub const P99_BOUND: f64 = 1.5;
/// Most GPU-seconds that may sit idle while a job waits, as a share: work conservation.
pub const IDLE_BOUND: f64 = 0.05;
/// Seed of every phase's arrivals and lengths.
const SEED: u64 = 11;

/// What the drill is parameterised by.
#[derive(Debug, Clone)]
pub struct FairnessPlan {
    pub repo: PathBuf,
    pub profile: String,
    pub gpus: usize,
    /// Seconds of load in each phase.
    pub phase_s: f64,
    /// B's offered rate, as a share of the model's nominal capacity. It must stay under
    /// B's fair share of the *measured* throughput for the drill to test isolation: above
    /// it, fair sharing holds B to half the GPUs, as it should, and B's latency grows.
    pub steady_share: f64,
    /// A's offered rate, as a multiple of its fair share (capacity / 2).
    pub flood_factor: f64,
    pub prompt: LengthDist,
    pub output: LengthDist,
    /// Per-phase outputs (CSV, summary.json).
    pub out: PathBuf,
    /// The file whose `## Fairness` section is written (replaced when present).
    pub report_path: PathBuf,
    pub command: String,
}

impl FairnessPlan {
    pub fn new(repo: PathBuf) -> FairnessPlan {
        let bench = BenchPlan::new(false, repo.clone());
        FairnessPlan {
            out: repo.join("bench-results/fairness"),
            report_path: repo.join("BENCHMARKS.md"),
            repo,
            profile: "release".into(),
            gpus: 4,
            phase_s: 60.0,
            // Well below B's fair share of what the system really serves with the flood
            // on this machine (about two thirds of the nominal capacity, an upper bound):
            // at 0.45 B asked for more than half the measured throughput and was, rightly,
            // held to half; at 0.3 it asked for 90 % of its half and queued for it.
            steady_share: 0.2,
            flood_factor: 10.0,
            prompt: bench.chat_prompt,
            output: bench.chat_output,
            command: String::new(),
        }
    }

    /// The load of one phase: B at `steady_rps`, and A at `flood_rps` when it is given.
    /// B is always tenant 0, so its arrivals are the same in every phase.
    fn spec(
        &self,
        base_url: String,
        keys: &Keys,
        steady_rps: f64,
        flood_rps: Option<f64>,
    ) -> LoadSpec {
        let mut tenants = vec![TenantLoad {
            name: STEADY.into(),
            api_key: Some(keys.steady.clone()),
            rate_rps: steady_rps,
        }];
        if let Some(rate) = flood_rps {
            tenants.push(TenantLoad {
                name: FLOOD.into(),
                api_key: Some(keys.flood.clone()),
                rate_rps: rate,
            });
        }
        LoadSpec {
            base_url,
            model: MODEL.into(),
            workload: Workload::Poisson {
                rate_rps: steady_rps,
                prompt_tokens: self.prompt,
                output_tokens: self.output,
            },
            duration_s: Some(self.phase_s),
            seed: SEED,
            max_in_flight: 8192,
            request_timeout_s: 180.0,
            drain_timeout_s: 120.0,
            progress_interval_s: 10.0,
            tenants,
            ..LoadSpec::default()
        }
    }
}

/// The tenants' API keys (shown once by `metronome-gateway keys create`, kept in memory).
struct Keys {
    steady: String,
    flood: String,
}

/// Make one key per tenant with the gateway's own `keys create`, appending the `[[tenants]]`
/// and `[[keys]]` entries (hashes only) to a file whose text becomes the gateway's extra
/// configuration.
fn create_keys(plan: &FairnessPlan) -> anyhow::Result<(Keys, String)> {
    let bin = plan
        .repo
        .join(format!("target/{}/metronome-gateway", plan.profile));
    // Outside the results folder: nothing of the keys is published, not even their hashes.
    let file = std::env::temp_dir().join(format!(
        "metronome-fairness-keys-{}.toml",
        std::process::id()
    ));
    std::fs::write(&file, "")?;
    let make = |tenant: &str| -> anyhow::Result<String> {
        let out = std::process::Command::new(&bin)
            .args([
                "keys",
                "create",
                "--tenant",
                tenant,
                "--note",
                "fairness drill",
            ])
            .arg("--append")
            .arg(&file)
            .output()
            .with_context(|| format!("running {}", bin.display()))?;
        if !out.status.success() {
            bail!(
                "keys create --tenant {tenant}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        String::from_utf8(out.stdout)?
            .lines()
            .next()
            .map(str::to_string)
            .context("keys create printed no key")
    };
    let keys = (|| {
        anyhow::Ok(Keys {
            steady: make(STEADY)?,
            flood: make(FLOOD)?,
        })
    })();
    let text = std::fs::read_to_string(&file);
    let _ = std::fs::remove_file(&file);
    Ok((keys?, text?))
}

/// The figures of one tenant in one stretch of a phase.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantFigures {
    pub sent: usize,
    pub ok: usize,
    /// Errors by kind and HTTP status, e.g. `http 503: 40`.
    pub errors: BTreeMap<String, usize>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// Output tokens of its successful requests per second of the stretch.
    pub output_tok_s: f64,
}

/// Figures of the requests sent within `[from_s, to_s)` of the run, per tenant. Pure.
pub fn tenant_figures(
    records: &[RequestRecord],
    from_s: f64,
    to_s: f64,
) -> BTreeMap<String, TenantFigures> {
    let mut out: BTreeMap<String, (TenantFigures, Vec<f64>)> = BTreeMap::new();
    for r in records
        .iter()
        .filter(|r| r.scheduled_s >= from_s && r.scheduled_s < to_s)
    {
        let (f, ttfts) = out.entry(r.tenant.clone().unwrap_or_default()).or_default();
        f.sent += 1;
        if r.ok {
            f.ok += 1;
            f.output_tok_s += f64::from(r.output_tokens);
            ttfts.extend(r.ttft_ms);
        } else {
            let kind = r.error_kind.map_or("unknown", |k| k.as_str());
            let label = match r.status {
                Some(s) => format!("{kind} {s}"),
                None => kind.to_string(),
            };
            *f.errors.entry(label).or_default() += 1;
        }
    }
    let span = (to_s - from_s).max(1e-9);
    out.into_iter()
        .map(|(t, (mut f, ttfts))| {
            f.ttft_p50_ms = percentile(&ttfts, 50.0);
            f.ttft_p99_ms = percentile(&ttfts, 99.0);
            f.output_tok_s /= span;
            (t, f)
        })
        .collect()
}

/// One measured phase.
struct Phase {
    name: &'static str,
    result: RunResult,
    idle: IdleStats,
    /// Decisions read for successful requests, and how many named the key's tenant.
    decisions_checked: usize,
    tenant_matched: usize,
    /// Per tenant, each served job's wait in the dispatcher's queue (its decision's
    /// `queue_wait_ms`): the part of its TTFT that admission, not the GPU, decided.
    queue_wait_ms: BTreeMap<String, Vec<f64>>,
    /// Failover only: seconds into the run of the kill and of the standby's takeover.
    kill_s: Option<f64>,
    takeover_s: Option<f64>,
    killed: Option<String>,
    /// Failover only: what the new leader's first seconds looked like ([`after_takeover`]).
    after_takeover: Option<AfterTakeover>,
}

/// The jobs sent after a takeover, as their decisions and TTFTs tell it: how long the
/// steady tenant waited in the new leader's queue at most, and how often a job's first
/// token came more than twice as late as predicted where it went (its TTFT less its
/// queue wait, against the winner's predicted TTFT), in the first
/// [`FIRST_SECONDS_AFTER_TAKEOVER`] and later. A new leader that misjudges the workers it
/// adopted shows as the first share above the second.
#[derive(Debug, Clone, PartialEq)]
pub struct AfterTakeover {
    pub steady_longest_wait_ms: Option<f64>,
    /// (jobs over twice their prediction, jobs judged), in the first seconds and later.
    pub late_first: (usize, usize),
    pub late_later: (usize, usize),
}

/// How long "the first seconds" after a takeover are, in [`AfterTakeover`].
pub const FIRST_SECONDS_AFTER_TAKEOVER: f64 = 10.0;

/// [`AfterTakeover`] from a phase's records and the decisions read for them, counting the
/// requests scheduled at or after `takeover_s`.
pub fn after_takeover(
    records: &[RequestRecord],
    decisions: &[serde_json::Value],
    takeover_s: f64,
) -> AfterTakeover {
    let by_job: BTreeMap<&str, &serde_json::Value> = decisions
        .iter()
        .filter_map(|d| Some((d.get("job_id")?.as_str()?, d)))
        .collect();
    let mut out = AfterTakeover {
        steady_longest_wait_ms: None,
        late_first: (0, 0),
        late_later: (0, 0),
    };
    for r in records.iter().filter(|r| r.scheduled_s >= takeover_s) {
        let Some(d) = r.job_id.as_deref().and_then(|j| by_job.get(j)) else {
            continue;
        };
        let wait = d
            .get("queue_wait_ms")
            .and_then(|w| w.as_f64())
            .unwrap_or(0.0);
        if r.tenant.as_deref() == Some(STEADY) {
            let longest = out.steady_longest_wait_ms.get_or_insert(wait);
            *longest = longest.max(wait);
        }
        // The winner's predicted TTFT on the worker, without the queue wait it adds.
        let on_worker = predicted(d).map(|p| p.ttft_ms - wait);
        let (Some(ttft), Some(on_worker)) = (r.ttft_ms, on_worker) else {
            continue;
        };
        let count = if r.scheduled_s < takeover_s + FIRST_SECONDS_AFTER_TAKEOVER {
            &mut out.late_first
        } else {
            &mut out.late_later
        };
        count.1 += 1;
        if ttft - wait > 2.0 * on_worker.max(1.0) {
            count.0 += 1;
        }
    }
    out
}

impl AfterTakeover {
    /// "; after the takeover: steady's longest wait in the dispatcher's queue …; first
    /// token over twice its prediction …" for the phase's line of the report.
    fn note(&self) -> String {
        let share = |(late, n): (usize, usize)| {
            if n == 0 {
                "no job".to_string()
            } else {
                format!("{:.1} % of {n}", 100.0 * late as f64 / n as f64)
            }
        };
        let wait = self.steady_longest_wait_ms.map_or_else(String::new, |w| {
            format!("{STEADY}'s longest wait in the dispatcher's queue {w:.0} ms; ")
        });
        format!(
            "; after the takeover: {wait}first token more than twice as late as predicted where it went (less the queue wait) in the first {FIRST_SECONDS_AFTER_TAKEOVER:.0} s {}, later {}",
            share(self.late_first),
            share(self.late_later)
        )
    }
}

/// The drill's verdicts, in report order: (what, figure, bound, met).
pub type Verdict = (String, String, String, bool);

/// Run the drill and write its section of the report; the verdicts come back so the
/// binary can exit non-zero when one is missed.
pub async fn run_fairness(plan: &FairnessPlan) -> anyhow::Result<Vec<Verdict>> {
    let t0 = Instant::now();
    let say = |m: String| eprintln!("[fairness {:>5.0}s] {m}", t0.elapsed().as_secs_f64());
    let state_dir = std::env::temp_dir().join(format!("metronome-fairness-{}", std::process::id()));
    let (keys, gateway_toml) = create_keys(plan)?;
    let speeds: Vec<f64> = vec![1.0; plan.gpus];
    let mut bench = BenchPlan::new(false, plan.repo.clone());
    bench.chat_prompt = plan.prompt;
    bench.chat_output = plan.output;
    let nominal = nominal_for(&bench, "chat", &speeds)?;
    let capacity = nominal.capacity_rps;
    let steady_rps = plan.steady_share * capacity;
    let flood_rps = plan.flood_factor * capacity / 2.0;
    say(format!(
        "nominal capacity {capacity:.2} req/s on {} GPUs: B (steady) {steady_rps:.2} req/s, A (flood) {flood_rps:.2} req/s",
        plan.gpus
    ));
    let spec = SystemSpec {
        repo: plan.repo.clone(),
        gpus: plan.gpus,
        model: MODEL.into(),
        speeds: speeds.iter().map(|s| s.to_string()).collect(),
        policy: "metronome".into(),
        state_dir: state_dir.clone(),
        sim_args: Vec::new(),
        worker_max_concurrency: None,
        profile: plan.profile.clone(),
        keep_going: true,
        gateway_extra_toml: Some(gateway_toml),
        nats_cluster: 1,
        first_gateway_port: None,
    };
    let mut sys = System::up(&spec).await.context("starting the system")?;
    let mut restarted = Vec::new();
    let phases = async {
        let mut phases = Vec::new();
        for (name, flood, kill) in [
            ("alone", None, false),
            ("flood", Some(flood_rps), false),
            ("failover", Some(flood_rps), true),
        ] {
            say(format!("phase {name}: {} s of load", plan.phase_s));
            let spec = plan.spec(sys.base_url(), &keys, steady_rps, flood);
            let phase = run_phase(&sys, name, spec, kill, plan, &mut restarted).await?;
            say(format!(
                "phase {name} done:\n{}",
                phase.result.summary.table()
            ));
            phases.push(phase);
        }
        anyhow::Ok(phases)
    }
    .await;
    stop_restarted(&restarted);
    sys.stop().await;
    let phases = phases?;
    let verdicts = verdicts(&phases, plan.phase_s);
    let section = render(plan, capacity, steady_rps, flood_rps, &phases, &verdicts);
    write_section(&plan.report_path, &section)?;
    // Kept beside the results, so `metronome-bench --render` writes the section again.
    let saved = plan.out.join(SECTION_FILE);
    std::fs::write(&saved, &section).with_context(|| format!("writing {}", saved.display()))?;
    println!("{section}");
    Ok(verdicts)
}

async fn run_phase(
    sys: &System,
    name: &'static str,
    spec: LoadSpec,
    kill: bool,
    plan: &FairnessPlan,
    restarted: &mut Vec<u32>,
) -> anyhow::Result<Phase> {
    sys.wait_idle(Duration::from_secs(300)).await?;
    sys.wait_workers_idle(Duration::from_secs(60)).await?;
    let stop = CancellationToken::new();
    let start = Instant::now();
    // Only while load is offered: the drain after it, with the flood's jobs expiring, is
    // not the steady state judged here.
    let sampler = sys.sample_until(&stop, start, SAMPLE_INTERVAL, Some(plan.phase_s));
    let fault = async {
        if !kill {
            return anyhow::Ok((None, None, None));
        }
        tokio::time::sleep(Duration::from_secs_f64(plan.phase_s / 3.0)).await;
        let name = sys.leader_name().await.context("finding the leader")?;
        let pid = sys.pid_of(&name).context("leader pid")?;
        let image = Image::read(pid)?;
        signal(pid, "KILL")?;
        let kill_s = start.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_secs(1)).await;
        restarted.push(image.spawn(&sys.state_dir, &name)?);
        // The killed process answers nothing: the first dispatcher to say it leads after
        // the kill is a new leader (the standby, or the restarted instance if it won the
        // race for the expired lease).
        let deadline = Instant::now() + Duration::from_secs(60);
        let takeover_s = loop {
            if sys.leader_name().await.is_ok() {
                break Some(start.elapsed().as_secs_f64());
            }
            if Instant::now() > deadline {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        Ok((Some(kill_s), takeover_s, Some(name)))
    };
    let run = async {
        let r = run_load(spec, true).await;
        stop.cancel();
        r
    };
    let (samples, result, fault) = tokio::join!(sampler, run, fault);
    let result = result?;
    let (kill_s, takeover_s, killed) = fault?;
    write_outputs(&plan.out.join(name), &result)
        .with_context(|| format!("writing the {name} phase's outputs"))?;
    write_samples(&plan.out.join(name), &samples)?;
    write_agent_metrics(&plan.out.join(name), sys).await?;
    let read = read_decisions(sys, &result.records).await;
    write_decisions(&plan.out.join(name), &read.decisions)?;
    let after_takeover = takeover_s.map(|t| after_takeover(&result.records, &read.decisions, t));
    Ok(Phase {
        name,
        result,
        idle: idle_stats(&samples),
        decisions_checked: read.checked,
        tenant_matched: read.tenant_matched,
        queue_wait_ms: read.queue_wait_ms,
        kill_s,
        takeover_s,
        killed,
        after_takeover,
    })
}

/// What the decisions of a phase's served requests say.
struct DecisionsRead {
    checked: usize,
    /// Decisions whose tenant is the one the request's key belongs to.
    tenant_matched: usize,
    /// Per tenant (the key's), the decisions' `queue_wait_ms`.
    queue_wait_ms: BTreeMap<String, Vec<f64>>,
    /// Every decision read, as stored: where each job went, when, and what was predicted
    /// there, for whoever asks why one request was slow.
    decisions: Vec<serde_json::Value>,
}

/// Reads the decision of every successful request: whether it names the tenant of the
/// request's key, and how long the job waited in the dispatcher's queue.
async fn read_decisions(sys: &System, records: &[RequestRecord]) -> DecisionsRead {
    let jobs: Vec<(String, String)> = records
        .iter()
        .filter(|r| r.ok)
        .filter_map(|r| Some((r.job_id.clone()?, r.tenant.clone()?)))
        .collect();
    let found: Vec<(String, bool, Option<f64>, serde_json::Value)> = futures::stream::iter(jobs)
        .map(|(job, tenant)| async move {
            let d = sys.decision_json(&job).await?;
            let matched = d.get("tenant").and_then(|t| t.as_str()) == Some(tenant.as_str());
            let wait = d.get("queue_wait_ms").and_then(|w| w.as_f64());
            Some((tenant, matched, wait, d))
        })
        .buffer_unordered(16)
        .filter_map(|x| async move { x })
        .collect()
        .await;
    let mut queue_wait_ms: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (tenant, _, wait, _) in &found {
        if let Some(w) = wait {
            queue_wait_ms.entry(tenant.clone()).or_default().push(*w);
        }
    }
    DecisionsRead {
        checked: found.len(),
        tenant_matched: found.iter().filter(|(_, m, _, _)| *m).count(),
        queue_wait_ms,
        decisions: found.into_iter().map(|(_, _, _, d)| d).collect(),
    }
}

/// `decisions.jsonl` in `dir`: one stored decision per line.
fn write_decisions(dir: &Path, decisions: &[serde_json::Value]) -> anyhow::Result<()> {
    let mut text = String::new();
    for d in decisions {
        text.push_str(&d.to_string());
        text.push('\n');
    }
    std::fs::write(dir.join("decisions.jsonl"), text)
        .with_context(|| format!("writing {}", dir.join("decisions.jsonl").display()))
}

/// "; wait in the dispatcher's queue: steady p50 … / p99 …, flood …" from the decisions.
fn queue_waits(by_tenant: &BTreeMap<String, Vec<f64>>) -> String {
    let parts: Vec<String> = by_tenant
        .iter()
        .filter_map(|(tenant, waits)| {
            let p50 = metronome_loadgen::stats::percentile(waits, 50.0)?;
            let p99 = metronome_loadgen::stats::percentile(waits, 99.0)?;
            Some(format!("{tenant} p50 {p50:.0} ms / p99 {p99:.0} ms"))
        })
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("; wait in the dispatcher's queue: {}", parts.join(", "))
    }
}

fn p99(s: &Summary, tenant: &str) -> Option<f64> {
    s.per_tenant.get(tenant)?.ttft_ms.p99
}

fn all_served(f: Option<&TenantFigures>) -> bool {
    f.is_some_and(|f| f.sent > 0 && f.ok == f.sent)
}

/// The judged figures (see the module docs).
fn verdicts(phases: &[Phase], phase_s: f64) -> Vec<Verdict> {
    let mut out = Vec::new();
    let by = |n: &str| phases.iter().find(|p| p.name == n);
    let (Some(alone), Some(flood), Some(failover)) = (by("alone"), by("flood"), by("failover"))
    else {
        return out;
    };
    let base = p99(&alone.result.summary, STEADY);
    let ms = |x: Option<f64>| x.map_or("n/a".into(), |v| format!("{v:.0} ms"));
    let within = |x: Option<f64>| match (x, base) {
        (Some(x), Some(b)) if b > 0.0 => x <= P99_BOUND * b,
        _ => false,
    };
    let ratio = |x: Option<f64>| match (x, base) {
        (Some(x), Some(b)) if b > 0.0 => format!(" ({:.2}×)", x / b),
        _ => String::new(),
    };
    let flood_p99 = p99(&flood.result.summary, STEADY);
    out.push((
        "B's TTFT p99 with A flooding".into(),
        format!("{}{}", ms(flood_p99), ratio(flood_p99)),
        format!("≤ {P99_BOUND} × alone ({})", ms(base)),
        within(flood_p99),
    ));
    let all = tenant_figures(&flood.result.records, 0.0, phase_s);
    out.push((
        "B's requests served with A flooding".into(),
        all.get(STEADY)
            .map_or("none".into(), |f| format!("{} of {}", f.ok, f.sent)),
        "all".into(),
        all_served(all.get(STEADY)),
    ));
    let a = all.get(FLOOD);
    out.push((
        "A served the rest (work-conserving)".into(),
        format!(
            "{:.0} output tok/s for A; GPUs idle while a job waited {:.1} % of GPU-seconds",
            a.map_or(0.0, |f| f.output_tok_s),
            flood.idle.share * 100.0
        ),
        format!("A served > 0, idle ≤ {:.0} %", IDLE_BOUND * 100.0),
        a.is_some_and(|f| f.ok > 0) && flood.idle.share <= IDLE_BOUND,
    ));
    let after = failover
        .takeover_s
        .map(|t| tenant_figures(&failover.result.records, t, phase_s));
    let after_b = after.as_ref().and_then(|f| f.get(STEADY));
    let after_p99 = after_b.and_then(|f| f.ttft_p99_ms);
    out.push((
        "after the leader's SIGKILL and takeover: B's TTFT p99".into(),
        match failover.takeover_s {
            Some(_) => format!("{}{}", ms(after_p99), ratio(after_p99)),
            None => "no takeover seen".into(),
        },
        format!("≤ {P99_BOUND} × alone"),
        within(after_p99),
    ));
    out.push((
        "after the takeover: B's requests served, A served".into(),
        match (after_b, after.as_ref().and_then(|f| f.get(FLOOD))) {
            (Some(b), Some(a)) => format!("B {} of {}; A {} of {}", b.ok, b.sent, a.ok, a.sent),
            _ => "n/a".into(),
        },
        "B all, A > 0".into(),
        all_served(after_b)
            && after
                .as_ref()
                .and_then(|f| f.get(FLOOD))
                .is_some_and(|a| a.ok > 0),
    ));
    let checked: usize = phases.iter().map(|p| p.decisions_checked).sum();
    let matched: usize = phases.iter().map(|p| p.tenant_matched).sum();
    out.push((
        "decisions naming the key's tenant".into(),
        format!("{matched} of {checked}"),
        "all".into(),
        checked > 0 && matched == checked,
    ));
    out
}

fn render(
    plan: &FairnessPlan,
    capacity: f64,
    steady_rps: f64,
    flood_rps: f64,
    phases: &[Phase],
    verdicts: &[Verdict],
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "## Fairness\n");
    let _ = writeln!(
        s,
        "Produced by `{}` on {} ({} CPU cores; other work may have run beside it). One \
         system (`./dev up --keep-going`, defaults: policy metronome, {} simulated GPUs of \
         speed 1 serving `{MODEL}`, dispatcher leader + standby), the gateway holding one API \
         key per tenant (`metronome-gateway keys create`, no per-tenant limits, so only the \
         dispatcher's fair queuing separates them). Chat mix (prompt {}, output {}); nominal \
         capacity {capacity:.2} req/s. Tenant B (`{STEADY}`) offers {steady_rps:.2} req/s \
         ({:.0} % of capacity) in every phase, the same arrivals each time; tenant A \
         (`{FLOOD}`) offers {flood_rps:.2} req/s, {} × its fair share (half the capacity). \
         {} s of load per phase; TTFT measured by the client per request sent in the stretch.\n",
        plan.command,
        super::machine::date_utc(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        plan.gpus,
        plan.prompt,
        plan.output,
        plan.steady_share * 100.0,
        plan.flood_factor,
        plan.phase_s,
    );
    let _ = writeln!(s, "| check | measured | target | met |\n|---|---|---|---|");
    for (what, figure, bound, met) in verdicts {
        let _ = writeln!(
            s,
            "| {what} | {figure} | {bound} | {} |",
            if *met { "yes" } else { "**no**" }
        );
    }
    let _ = writeln!(
        s,
        "\n| phase | stretch | tenant | sent | ok | errors | TTFT p50 | TTFT p99 | output tok/s |\n|---|---|---|---:|---:|---|---:|---:|---:|"
    );
    for p in phases {
        let mut stretches = vec![("whole phase".to_string(), 0.0, plan.phase_s)];
        if let Some(k) = p.kill_s {
            stretches.push((format!("before the kill (0–{k:.1} s)"), 0.0, k));
        }
        if let Some(t) = p.takeover_s {
            stretches.push((
                format!("after the takeover ({t:.1}–{:.0} s)", plan.phase_s),
                t,
                plan.phase_s,
            ));
        }
        for (label, from, to) in stretches {
            for (tenant, f) in tenant_figures(&p.result.records, from, to) {
                let errors: Vec<String> =
                    f.errors.iter().map(|(k, v)| format!("{v} {k}")).collect();
                let ms = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.0} ms"));
                let _ = writeln!(
                    s,
                    "| {} | {label} | {tenant} | {} | {} | {} | {} | {} | {:.0} |",
                    p.name,
                    f.sent,
                    f.ok,
                    if errors.is_empty() {
                        "-".into()
                    } else {
                        errors.join(", ")
                    },
                    ms(f.ttft_p50_ms),
                    ms(f.ttft_p99_ms),
                    f.output_tok_s
                );
            }
        }
    }
    let _ = writeln!(s);
    for p in phases {
        let _ = writeln!(
            s,
            "- {}: GPUs idle while a job waited {:.1} % of {:.0} GPU-seconds (deepest queue {:.0}); decisions read {}, naming the key's tenant {}{}{}{}.",
            p.name,
            p.idle.share * 100.0,
            p.idle.total_gpu_s,
            p.idle.max_queued,
            p.decisions_checked,
            p.tenant_matched,
            queue_waits(&p.queue_wait_ms),
            match (&p.killed, p.kill_s, p.takeover_s) {
                (Some(k), Some(at), Some(t)) => format!(
                    "; SIGKILL {k} at {at:.1} s, the standby led {:.1} s later",
                    t - at
                ),
                (Some(k), Some(at), None) => format!("; SIGKILL {k} at {at:.1} s, no takeover seen"),
                _ => String::new(),
            },
            p.after_takeover
                .as_ref()
                .map_or_else(String::new, AfterTakeover::note)
        );
    }
    let _ = writeln!(
        s,
        "\nA's errors are its flood's jobs refused at once (429 `deadline_unmeetable`, or expired) because they could not start before their deadline: the share it is owed is served, the rest is refused. Per-phase summaries and plots: `{}`.",
        shown_path(&plan.report_path, &plan.out)
    );
    s
}

/// `path` as the report links it: relative to the report's folder when it lies under it.
fn shown_path(report: &Path, path: &Path) -> String {
    let base = report.parent().unwrap_or(Path::new("."));
    path.strip_prefix(base)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Replace the `## Fairness` section of `path` (from its heading to the next `## ` heading,
/// a hand-written subsection or the end) with `section`, or append it.
fn write_section(path: &Path, section: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let new = replace_section(&text, "## Fairness", section);
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

/// What marks a subsection as written by hand: its `### ` heading ends with it. The
/// generated part of a section ends where the first such subsection starts, so a rerun
/// replaces its own figures and keeps the analysis people wrote under them.
pub const HAND_WRITTEN: &str = "(written by hand)";

/// `text` with the section under `heading` replaced by `section` (appended when absent).
/// The old section ends at the next `## ` heading or at the first `### ` subsection marked
/// [`HAND_WRITTEN`], which is kept. Pure.
pub fn replace_section(text: &str, heading: &str, section: &str) -> String {
    let section = section.trim_end();
    let start = text
        .lines()
        .scan(0usize, |pos, line| {
            let at = *pos;
            *pos += line.len() + 1;
            Some((at, line))
        })
        .find(|(_, l)| l.trim_end() == heading)
        .map(|(at, _)| at);
    match start {
        None => {
            let body = text.trim_end();
            if body.is_empty() {
                format!("{section}\n")
            } else {
                format!("{body}\n\n{section}\n")
            }
        }
        Some(at) => {
            let rest = &text[at + heading.len()..];
            let hand_written = rest.match_indices("\n### ").map(|(i, _)| i).find(|&i| {
                rest[i + 1..]
                    .lines()
                    .next()
                    .is_some_and(|l| l.trim_end().ends_with(HAND_WRITTEN))
            });
            let end = [rest.find("\n## "), hand_written]
                .into_iter()
                .flatten()
                .min()
                .map_or(text.len(), |i| at + heading.len() + i + 1);
            let tail = text[end..].trim_end();
            let head = text[..at].trim_end();
            let mut out = String::new();
            if !head.is_empty() {
                out.push_str(head);
                out.push_str("\n\n");
            }
            out.push_str(section);
            out.push('\n');
            if !tail.is_empty() {
                out.push('\n');
                out.push_str(tail);
                out.push('\n');
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_loadgen::ErrorKind;

    fn rec(tenant: &str, at: f64, ttft: Option<f64>, tokens: u32) -> RequestRecord {
        RequestRecord {
            scheduled_s: at,
            tenant: Some(tenant.into()),
            ok: ttft.is_some(),
            ttft_ms: ttft,
            output_tokens: tokens,
            status: Some(if ttft.is_some() { 200 } else { 503 }),
            error_kind: ttft.is_none().then_some(ErrorKind::Http),
            ..Default::default()
        }
    }

    #[test]
    fn queue_waits_are_told_per_tenant_and_absent_without_decisions() {
        assert_eq!(queue_waits(&BTreeMap::new()), "");
        let mut waits = BTreeMap::new();
        waits.insert("steady".to_string(), (1..=100).map(f64::from).collect());
        waits.insert("flood".to_string(), vec![7.0]);
        assert_eq!(
            queue_waits(&waits),
            "; wait in the dispatcher's queue: flood p50 7 ms / p99 7 ms, steady p50 50 ms / p99 99 ms"
        );
    }

    #[test]
    fn after_a_takeover_the_late_first_tokens_and_the_steady_tenants_longest_wait_are_counted() {
        let job = |id: &str, tenant: &str, at: f64, ttft: f64| RequestRecord {
            job_id: Some(id.into()),
            ..rec(tenant, at, Some(ttft), 10)
        };
        let decision = |id: &str, wait: f64, predicted: f64| {
            serde_json::json!({
                "job_id": id, "worker_id": "w1", "queue_wait_ms": wait,
                "candidates": [
                    {"worker_id": "w0", "prediction": {"ttft_ms": 10_000.0}},
                    {"worker_id": "w1", "prediction": {"ttft_ms": predicted}},
                ],
            })
        };
        let records = vec![
            job("before", STEADY, 19.0, 9_000.0),
            job("s1", STEADY, 21.0, 1_100.0),
            job("f1", FLOOD, 22.0, 450.0),
            job("s2", STEADY, 35.0, 300.0),
            job("f2", FLOOD, 40.0, 900.0),
            job("undecided", FLOOD, 41.0, 100.0),
        ];
        let decisions = vec![
            decision("before", 5_000.0, 100.0),
            // 1,100 ms less 900 ms queued against 200 predicted: on time.
            decision("s1", 900.0, 200.0),
            decision("f1", 0.0, 200.0),
            decision("s2", 40.0, 250.0),
            decision("f2", 0.0, 400.0),
        ];
        let a = after_takeover(&records, &decisions, 20.0);
        assert_eq!(
            a.steady_longest_wait_ms,
            Some(900.0),
            "the job before is left out"
        );
        assert_eq!(
            a.late_first,
            (1, 2),
            "f1: 450 ms against 200 predicted on w1"
        );
        assert_eq!(a.late_later, (1, 2), "f2: 900 against 400");
        assert_eq!(
            a.note(),
            "; after the takeover: steady's longest wait in the dispatcher's queue 900 ms; first token more than twice as late as predicted where it went (less the queue wait) in the first 10 s 50.0 % of 2, later 50.0 % of 2"
        );
        let none = after_takeover(&records, &[], 20.0);
        assert_eq!(none.steady_longest_wait_ms, None);
        assert!(none
            .note()
            .contains("in the first 10 s no job, later no job"));
    }

    #[test]
    fn figures_count_only_the_stretch_and_split_by_tenant() {
        let records = vec![
            rec("b", 0.5, Some(100.0), 10),
            rec("b", 1.5, Some(300.0), 10),
            rec("a", 1.0, None, 0),
            rec("a", 1.2, Some(900.0), 40),
            rec("b", 5.0, Some(5000.0), 10),
        ];
        let f = tenant_figures(&records, 0.0, 2.0);
        assert_eq!(f["b"].sent, 2);
        assert_eq!(f["b"].ttft_p99_ms, Some(300.0), "nearest rank");
        assert_eq!(f["b"].output_tok_s, 10.0, "20 tokens over 2 s");
        assert_eq!(f["a"].errors["http 503"], 1);
        assert_eq!(f["a"].ok, 1);
        let later = tenant_figures(&records, 2.0, 10.0);
        assert_eq!(later.len(), 1);
        assert_eq!(later["b"].ttft_p50_ms, Some(5000.0));
    }

    #[test]
    fn the_section_replaces_its_old_self_or_is_appended() {
        let doc = "# B\n\n## Setup\nx\n\n## Fairness\nold\n| t |\n\n## Later\ny\n";
        let new = replace_section(doc, "## Fairness", "## Fairness\n\nnew\n");
        assert_eq!(
            new,
            "# B\n\n## Setup\nx\n\n## Fairness\n\nnew\n\n## Later\ny\n"
        );
        let at_end = "# B\n\n## Fairness\nold\n";
        assert_eq!(
            replace_section(at_end, "## Fairness", "## Fairness\nnew"),
            "# B\n\n## Fairness\nnew\n"
        );
        let absent = "# B\n\n## Setup\nx\n";
        assert_eq!(
            replace_section(absent, "## Fairness", "## Fairness\nnew\n"),
            "# B\n\n## Setup\nx\n\n## Fairness\nnew\n"
        );
        // A heading that only starts the same way is not the section.
        let similar = "## Fairness notes\nkeep\n";
        assert!(replace_section(similar, "## Fairness", "## Fairness\nnew").contains("keep"));
    }

    #[test]
    fn hand_written_subsections_survive_a_rerun() {
        let doc = "## Fairness\nold\n\n### Runs (written by hand)\nmine\n\n### More (written by hand)\nalso\n\n## Later\ny\n";
        assert_eq!(
            replace_section(doc, "## Fairness", "## Fairness\n\nnew\n"),
            "## Fairness\n\nnew\n\n### Runs (written by hand)\nmine\n\n### More (written by hand)\nalso\n\n## Later\ny\n"
        );
        // A generated subsection is replaced with the rest.
        let generated = "## Fairness\nold\n### Phase\nx\n\n## Later\ny\n";
        assert_eq!(
            replace_section(generated, "## Fairness", "## Fairness\nnew"),
            "## Fairness\nnew\n\n## Later\ny\n"
        );
    }
}
