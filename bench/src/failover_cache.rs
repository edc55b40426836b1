//! The prefix-cache hit rate across a leader failover (`metronome-bench --failover-cache`).
//!
//! A new leader must not start blind: it rebuilds every reporting worker's cache from the
//! `CACHE_SNAPSHOTS` and `CACHE_DELTAS` streams before its first decision. This measures
//! what that is worth on a running system: a fresh `./dev up` (four equal simulated GPUs,
//! defaults) under a prefix-heavy workload at a share of its nominal capacity, twice:
//!
//! - *failover*: the leading dispatcher is SIGKILLed (and restarted, to stand by) when the
//!   steady window ends;
//! - *control*: the same plan, nothing killed.
//!
//! Each run samples the simulated GPUs' prefix-cache counters (vLLM's
//! `prefix_cache_queries` and `prefix_cache_hits`, in tokens) at the start of the steady
//! window (after a warm-up in which conversations build their histories), at its end (the
//! kill), and one window later. The hit rate of a window is its hits over its queries. The
//! figure that matters is the failover run's window after the kill against its own
//! steady window and against the control run's same window (the workload's own drift over
//! time, which the control shows, is not the failover's doing).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use metronome_loadgen::process::{signal, stop_restarted, Image};
use metronome_loadgen::run_load;
use metronome_loadgen::system::{System, SystemSpec};

use super::scenarios::{nominal_for, BenchPlan, MODEL, PREFIX_WORKLOADS};

/// What to run.
#[derive(Debug, Clone)]
pub struct FailoverCachePlan {
    pub repo: PathBuf,
    /// A prefix-heavy workload (`multi_turn`, `shared_prefix` or `agent`).
    pub workload: String,
    /// Offered load as a share of the workload's nominal capacity on the cluster.
    pub load: f64,
    /// Seconds of load before the steady window opens.
    pub warmup_s: f64,
    /// Seconds of each window (steady; after the kill).
    pub window_s: f64,
    /// Simulated GPUs, all at speed 1.
    pub gpus: usize,
    /// The build profile of the binaries `./dev up` runs.
    pub profile: String,
}

impl FailoverCachePlan {
    pub fn new(repo: PathBuf) -> FailoverCachePlan {
        FailoverCachePlan {
            repo,
            workload: "multi_turn".into(),
            load: 0.7,
            warmup_s: 60.0,
            window_s: 30.0,
            gpus: 4,
            profile: "release".into(),
        }
    }
}

/// Tokens looked up and found in the GPUs' prefix caches during one window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub queries: f64,
    pub hits: f64,
}

impl Window {
    /// Between two samples of the counters, each `(queries, hits)`.
    pub fn between(from: (f64, f64), to: (f64, f64)) -> Window {
        Window {
            queries: to.0 - from.0,
            hits: to.1 - from.1,
        }
    }

    /// Hits over queries; `None` when nothing was looked up.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.queries > 0.0).then(|| self.hits / self.queries)
    }
}

/// One run's two windows.
#[derive(Debug, Clone)]
pub struct RunWindows {
    pub steady: Window,
    pub after: Window,
    /// Failover run only: the dispatcher killed, and seconds from the kill until a
    /// dispatcher said it leads.
    pub killed: Option<String>,
    pub takeover_s: Option<f64>,
    /// Requests answered without an error, of those sent.
    pub ok: usize,
    pub sent: usize,
}

/// Both runs.
#[derive(Debug, Clone)]
pub struct FailoverCache {
    pub rate_rps: f64,
    pub failover: RunWindows,
    pub control: RunWindows,
}

/// Hit-rate points (0-100) between two windows; `None` when either looked nothing up.
pub fn points_between(a: &Window, b: &Window) -> Option<f64> {
    Some((b.hit_rate()? - a.hit_rate()?) * 100.0)
}

impl FailoverCache {
    /// The result in a few lines, with the figures and how far apart they are.
    pub fn render(&self, plan: &FailoverCachePlan) -> String {
        let pct = |w: &Window| {
            w.hit_rate()
                .map_or("-".into(), |r| format!("{:.1} %", r * 100.0))
        };
        let pts = |a: &Window, b: &Window| {
            points_between(a, b).map_or("-".into(), |p| format!("{p:+.1} points"))
        };
        let f = &self.failover;
        let c = &self.control;
        let mut out = format!(
            "Prefix-cache hit rate across a leader failover: {} at {:.0} % of nominal capacity ({:.2} req/s), {} equal GPUs, {:.0} s warm-up, {:.0} s windows\n",
            plan.workload,
            plan.load * 100.0,
            self.rate_rps,
            plan.gpus,
            plan.warmup_s,
            plan.window_s
        );
        out.push_str(&format!(
            "  failover run: steady {} · after the kill {} ({} against steady){}\n",
            pct(&f.steady),
            pct(&f.after),
            pts(&f.steady, &f.after),
            match (&f.killed, f.takeover_s) {
                (Some(k), Some(t)) => format!("; SIGKILL {k}, a dispatcher led {t:.1} s later"),
                (Some(k), None) => format!("; SIGKILL {k}, no takeover seen"),
                _ => String::new(),
            }
        ));
        out.push_str(&format!(
            "  control run:  steady {} · same window {} ({} against steady)\n",
            pct(&c.steady),
            pct(&c.after),
            pts(&c.steady, &c.after)
        ));
        out.push_str(&format!(
            "  after the kill against the control's same window: {}\n",
            pts(&c.after, &f.after)
        ));
        out.push_str(&format!(
            "  requests answered: failover {}/{}, control {}/{}\n",
            f.ok, f.sent, c.ok, c.sent
        ));
        out
    }
}

/// Run both runs, each on a fresh system.
pub async fn run_failover_cache(plan: &FailoverCachePlan) -> anyhow::Result<FailoverCache> {
    anyhow::ensure!(
        PREFIX_WORKLOADS.contains(&plan.workload.as_str()),
        "{} is not a prefix-heavy workload ({})",
        plan.workload,
        PREFIX_WORKLOADS.join(", ")
    );
    let speeds = vec![1.0; plan.gpus];
    let bench = BenchPlan::new(false, plan.repo.clone());
    let nominal = nominal_for(&bench, &plan.workload, &speeds)?;
    let rate_rps = plan.load * nominal.capacity_rps;
    let failover = run_once(plan, &bench, rate_rps, true).await?;
    let control = run_once(plan, &bench, rate_rps, false).await?;
    Ok(FailoverCache {
        rate_rps,
        failover,
        control,
    })
}

async fn run_once(
    plan: &FailoverCachePlan,
    bench: &BenchPlan,
    rate_rps: f64,
    kill: bool,
) -> anyhow::Result<RunWindows> {
    let tag = if kill { "failover" } else { "control" };
    let t0 = Instant::now();
    let say = |m: String| {
        eprintln!(
            "[failover-cache {tag} {:>4.0}s] {m}",
            t0.elapsed().as_secs_f64()
        )
    };
    let spec = SystemSpec {
        repo: plan.repo.clone(),
        gpus: plan.gpus,
        model: MODEL.into(),
        speeds: vec!["1".into(); plan.gpus],
        policy: "metronome".into(),
        state_dir: std::env::temp_dir().join(format!(
            "metronome-failover-cache-{}-{tag}",
            std::process::id()
        )),
        sim_args: Vec::new(),
        worker_max_concurrency: None,
        profile: plan.profile.clone(),
        keep_going: true,
        gateway_extra_toml: None,
        nats_cluster: 1,
        first_gateway_port: None,
    };
    let mut sys = System::up(&spec).await.context("starting the system")?;
    let mut restarted = Vec::new();
    let result = async {
        // Enough requests for the warm-up, both windows and a little more: the load ends
        // by itself after the last window.
        let total_s = plan.warmup_s + 2.0 * plan.window_s + 5.0;
        let mut load = bench.spec(&plan.workload, sys.base_url(), rate_rps);
        load.limit = Some((rate_rps * total_s).ceil() as usize);
        say(format!(
            "{} at {rate_rps:.2} req/s for ~{total_s:.0} s",
            plan.workload
        ));
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        let probe = async {
            tokio::time::sleep_until(at(plan.warmup_s).into()).await;
            let open = counters(&sys).await?;
            tokio::time::sleep_until(at(plan.warmup_s + plan.window_s).into()).await;
            let kill_at = counters(&sys).await?;
            let (mut killed, mut takeover_s) = (None, None);
            if kill {
                let name = sys.leader_name().await.context("finding the leader")?;
                let pid = sys.pid_of(&name).context("the leader's pid")?;
                let image = Image::read(pid)?;
                signal(pid, "KILL")?;
                let killed_at = Instant::now();
                say(format!("SIGKILL {name}"));
                tokio::time::sleep(Duration::from_secs(1)).await;
                restarted.push(image.spawn(&sys.state_dir, &name)?);
                let deadline = killed_at + Duration::from_secs(60);
                while Instant::now() < deadline {
                    if sys.leader_name().await.is_ok() {
                        takeover_s = Some(killed_at.elapsed().as_secs_f64());
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                killed = Some(name);
            }
            tokio::time::sleep_until(at(plan.warmup_s + 2.0 * plan.window_s).into()).await;
            let close = counters(&sys).await?;
            anyhow::Ok((open, kill_at, close, killed, takeover_s))
        };
        let (result, probe) = tokio::join!(run_load(load, true), probe);
        let result = result?;
        let (open, kill_at, close, killed, takeover_s) = probe?;
        let ok = result.records.iter().filter(|r| r.ok).count();
        anyhow::Ok(RunWindows {
            steady: Window::between(open, kill_at),
            after: Window::between(kill_at, close),
            killed,
            takeover_s,
            ok,
            sent: result.records.len(),
        })
    }
    .await;
    stop_restarted(&restarted);
    sys.stop().await;
    result
}

/// The simulated GPUs' prefix-cache counters summed: (queries, hits), in tokens.
async fn counters(sys: &System) -> anyhow::Result<(f64, f64)> {
    Ok((
        sys.sim_metric_sum("vllm:prefix_cache_queries_total")
            .await?,
        sys.sim_metric_sum("vllm:prefix_cache_hits_total").await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_the_difference_of_two_samples_and_its_rate_hits_over_queries() {
        let w = Window::between((1_000.0, 600.0), (3_000.0, 2_200.0));
        assert_eq!(
            w,
            Window {
                queries: 2_000.0,
                hits: 1_600.0
            }
        );
        assert_eq!(w.hit_rate(), Some(0.8));
        assert_eq!(Window::between((5.0, 1.0), (5.0, 1.0)).hit_rate(), None);
    }

    #[test]
    fn points_between_windows_are_signed_percentage_points() {
        let steady = Window {
            queries: 100.0,
            hits: 70.0,
        };
        let after = Window {
            queries: 100.0,
            hits: 64.0,
        };
        let p = points_between(&steady, &after).unwrap();
        assert!((p + 6.0).abs() < 1e-9, "{p}");
        let empty = Window {
            queries: 0.0,
            hits: 0.0,
        };
        assert_eq!(points_between(&steady, &empty), None);
    }

    #[test]
    fn the_rendered_lines_name_both_runs_and_the_difference() {
        let run = |hits: f64, killed: Option<&str>| RunWindows {
            steady: Window {
                queries: 100.0,
                hits: 70.0,
            },
            after: Window {
                queries: 100.0,
                hits,
            },
            killed: killed.map(str::to_string),
            takeover_s: killed.map(|_| 2.5),
            ok: 300,
            sent: 300,
        };
        let r = FailoverCache {
            rate_rps: 2.0,
            failover: run(66.0, Some("dispatcher-a")),
            control: run(69.0, None),
        };
        let text = r.render(&FailoverCachePlan::new(PathBuf::from(".")));
        assert!(text.contains("steady 70.0 % · after the kill 66.0 % (-4.0 points against steady); SIGKILL dispatcher-a, a dispatcher led 2.5 s later"), "{text}");
        assert!(
            text.contains("control run:  steady 70.0 % · same window 69.0 %"),
            "{text}"
        );
        assert!(
            text.contains("against the control's same window: -3.0 points"),
            "{text}"
        );
    }
}
