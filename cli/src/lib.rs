//! `metronome`, the operator CLI: reads the system through the documented NATS contract
//! (docs/PROTOCOL.md) and answers the operator's questions: who leads, which workers are
//! up and how loaded, what was decided, and why one request went where it went.
//!
//! Layout: [`Cli`] is the command line; what is read and how it is shown (the workers,
//! the status, the decision lines, the story of a job) is the read model,
//! `metronome_readmodel`, which the gateway's console serves too; `drain` asks an agent to
//! drain, `replay` re-decides recorded decisions; [`run`] glues one command to its view and
//! returns what to print.

pub mod drain;
pub mod error;
pub mod keys;
pub mod replay;

use std::io::Write;

use clap::{Parser, Subcommand, ValueEnum};
use futures::StreamExt;

use metronome_protocol::{names, time::unix_ms, Decision, Outcome};

pub use error::CliError;
use metronome_readmodel::source::Nats;
use metronome_readmodel::{decisions, explain, status_report, story, worker_views, workers};

/// Operate a Metronome system from the terminal: leader and workers, the decision log,
/// and why any one request went where it went.
///
/// Talks only the NATS contract of docs/PROTOCOL.md; tables for people, `--json` for
/// scripts. Exit codes: 0 ok, 1 not found (unknown job id or worker), 2 bad usage, 3 NATS
/// or Redis unreachable or unreadable (or the output unwritable), 4 `drain --wait` timed
/// out; a closed output pipe (`metronome decisions --follow | head`) ends it quietly with 0.
#[derive(Parser, Debug, Clone)]
#[command(name = "metronome", version, about, long_about)]
pub struct Cli {
    /// NATS server the system runs on.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true
    )]
    pub nats_url: String,

    /// NATS credentials and TLS, from the `METRONOME_NATS_*` variables like every other
    /// binary (set by `main`; none = an anonymous connection).
    #[arg(skip)]
    pub nats_auth: metronome_runtime::nats::NatsAuth,

    /// Redis TLS for `workers --redis-url rediss://...`, from the `METRONOME_REDIS_*`
    /// variables like every other binary (set by `main`).
    #[arg(skip)]
    pub redis_tls: metronome_runtime::redis::RedisTls,

    /// Print JSON instead of tables (one object; one object per line for `decisions`).
    #[arg(long, global = true)]
    pub json: bool,

    #[command(subcommand)]
    pub command: Command,
}

/// What to show.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Leader and epoch, jobs waiting, decisions/s and rejections per model over the last
    /// minute, workers up/draining/unhealthy/stale.
    Status {
        /// Window for the decision rates, seconds.
        #[arg(long, default_value_t = 60)]
        window_s: u64,
        /// A heartbeat older than this (ms) counts as stale.
        #[arg(long, default_value_t = workers::DEFAULT_STALE_AFTER_MS)]
        stale_after_ms: u64,
    },
    /// One row per worker: model, active/limit, KV use, GPU utilisation, EWMAs (with a
    /// Redis URL), the fitted single-stream rate (1000 / step_base_ms) and its samples,
    /// heartbeat age, state.
    Workers {
        /// Redis holding the workers' EWMAs; without it the EWMA columns read n/a.
        #[arg(long, env = "REDIS_URL")]
        redis_url: Option<String>,
        /// Key prefix of the EWMA hashes.
        #[arg(long, default_value = metronome_protocol::redis_keys::DEFAULT_PREFIX)]
        redis_prefix: String,
        /// A heartbeat older than this (ms) counts as stale.
        #[arg(long, default_value_t = workers::DEFAULT_STALE_AFTER_MS)]
        stale_after_ms: u64,
    },
    /// One line per decision: time, job id, outcome, winner, predicted TTFT and tok/s of
    /// the winner, queue wait, model, reason. The last N from the DECISIONS stream, then
    /// live with --follow.
    Decisions {
        /// Keep printing decisions as they are made (Ctrl-C to stop).
        #[arg(long, short = 'f')]
        follow: bool,
        /// Only decisions for this model.
        #[arg(long)]
        model: Option<String>,
        /// Only decisions that assigned to this worker.
        #[arg(long)]
        worker: Option<String>,
        /// Only decisions with this outcome.
        #[arg(long, value_enum)]
        outcome: Option<OutcomeArg>,
        /// How many past decisions to print (0 with --follow: only new ones).
        #[arg(short = 'n', long = "last", default_value_t = 20)]
        n: usize,
        /// With a filter: how many of the newest stored decisions to search.
        #[arg(long, default_value_t = 10_000)]
        scan: u64,
    },
    /// Stop new work to a worker (its running jobs finish): asks its agent on
    /// `control.<worker_id>.drain`. With --wait, polls until no job runs there.
    Drain {
        /// The worker id (as in `metronome workers`).
        worker: String,
        /// Wait until the worker's running jobs have finished.
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds (exit 4).
        #[arg(long, default_value_t = 600)]
        timeout_s: u64,
    },
    /// Let a drained worker take new work again (`control.<worker_id>.undrain`).
    Undrain {
        /// The worker id.
        worker: String,
    },
    /// The story of one job: SLO, queue wait, every candidate with its seven terms (raw,
    /// normalised, weight, contribution) and prediction, why every other worker was not
    /// eligible, the winner's margin, then what actually happened next to what was
    /// predicted. Exits 1 for an unknown job id.
    Explain {
        /// The job id (the gateway returns it in the `x-metronome-job-id` header).
        job_id: String,
        /// Most completion events to search for the job's own.
        #[arg(long, default_value_t = 100_000)]
        scan: usize,
    },
    /// Re-decide the recorded decisions of a window under other weights or SLOs (the
    /// `[scheduler]` table of a TOML file; a dispatcher's config file works as it is), each
    /// from the state it recorded, and report how many placements would change, which
    /// workers would gain or lose jobs, and the predicted TTFT and decode rate of the jobs
    /// that would move. Nothing is sent to the system. Decisions that lack what a re-decision
    /// needs (rejected, expired, baseline policies, least-harm placements, a refused worker
    /// a looser SLO would admit) are counted as not replayable, with the reason.
    Replay {
        /// How far back to read decisions: 90s, 30m, 1h, 2d.
        #[arg(long, default_value = "1h")]
        since: String,
        /// TOML file whose `[scheduler]` table to replay with (none: the defaults).
        #[arg(long)]
        config: Option<std::path::PathBuf>,
        /// Most decisions to read.
        #[arg(long, default_value_t = 1_000_000)]
        scan: usize,
    },
    /// Print a shell completion script, generated from this command line's definition
    /// (`metronome completions bash > /etc/bash_completion.d/metronome`). Needs no NATS.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), generated from this command line's definition
    /// (`metronome man > /usr/local/share/man/man1/metronome.1`). Needs no NATS.
    Man,
    /// API keys managed live: `create`, `list`, `revoke` (the `api_keys` bucket every
    /// gateway watches; keys in a gateway's configuration file keep working beside them).
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
}

/// `metronome keys` actions.
#[derive(Subcommand, Debug, Clone)]
pub enum KeysAction {
    /// Create an API key for a tenant, served by every gateway within a second. The key is
    /// printed once; only its SHA-256 is stored (in the `api_keys` bucket).
    Create {
        /// The tenant the key acts for (letters, digits, `-`, `_`). Its models and limits
        /// are a gateway's `[[tenants]]` entry of that name; without one, every model and
        /// no limits.
        #[arg(long)]
        tenant: String,
        /// A note kept with the key (who or what it is for).
        #[arg(long)]
        note: Option<String>,
        /// The key may open the gateway's operator console.
        #[arg(long)]
        operator: bool,
        /// The highest priority class the key may ask for (default interactive).
        #[arg(long, value_enum)]
        priority: Option<PriorityArg>,
    },
    /// One row per key: id, tenant, state, note; with a gateway's URL, each tenant's
    /// requests and admitted tokens as that gateway counts them.
    List {
        /// A gateway whose `/metrics` give the tenants' usage.
        #[arg(long, env = "METRONOME_GATEWAY_URL")]
        gateway_url: Option<String>,
    },
    /// Revoke a key: every gateway refuses it within a second. Exits 1 for an unknown id.
    Revoke {
        /// The key's id (at least its first 12 hex digits, as `keys list` shows) or hash.
        id: String,
    },
}

/// `--priority` values.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PriorityArg {
    Interactive,
    Batch,
}

impl From<PriorityArg> for metronome_protocol::Priority {
    fn from(p: PriorityArg) -> Self {
        match p {
            PriorityArg::Interactive => metronome_protocol::Priority::Interactive,
            PriorityArg::Batch => metronome_protocol::Priority::Batch,
        }
    }
}

/// `--outcome` values.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeArg {
    Assigned,
    Rejected,
    Expired,
}

impl From<OutcomeArg> for Outcome {
    fn from(o: OutcomeArg) -> Outcome {
        match o {
            OutcomeArg::Assigned => Outcome::Assigned,
            OutcomeArg::Rejected => Outcome::Rejected,
            OutcomeArg::Expired => Outcome::Expired,
        }
    }
}

/// Run one command, writing its output to `out`.
pub async fn run(cli: Cli, out: &mut (dyn Write + Send)) -> Result<(), CliError> {
    if let Some(text) = generated(&cli.command)? {
        return out.write_all(&text).map_err(CliError::writing);
    }
    let nats = Nats::connect(&cli.nats_url, &cli.nats_auth).await?;
    let json = cli.json;
    let text = match cli.command {
        Command::Explain { job_id, scan } => explain(&nats, &job_id, scan, json).await?,
        // Answered above, without a connection.
        Command::Completions { .. } | Command::Man => return Ok(()),
        Command::Replay {
            since,
            config,
            scan,
        } => replay(&nats, &since, config.as_deref(), scan, json).await?,
        Command::Status {
            window_s,
            stale_after_ms,
        } => status(&nats, window_s, stale_after_ms, json).await?,
        Command::Workers {
            redis_url,
            redis_prefix,
            stale_after_ms,
        } => {
            let (views, warning) = worker_views(
                &nats,
                stale_after_ms,
                redis_url.as_deref(),
                &cli.redis_tls,
                &redis_prefix,
            )
            .await?;
            if let Some(w) = warning {
                eprintln!("metronome: {w}");
            }
            if json {
                to_json(&views)?
            } else {
                workers::table(&views)
            }
        }
        Command::Drain {
            worker,
            wait,
            timeout_s,
        } => return drain_cmd(&nats, &worker, wait, timeout_s, json, out).await,
        Command::Keys { action } => keys_cmd(&nats, action, json).await?,
        Command::Undrain { worker } => {
            let r = control(&nats, &worker, names::CONTROL_UNDRAIN).await?;
            if json {
                to_json(&r)?
            } else {
                drain::line(&r) + "\n"
            }
        }
        Command::Decisions {
            follow,
            model,
            worker,
            outcome,
            n,
            scan,
        } => {
            let filter = decisions::Filter {
                model,
                worker,
                outcome: outcome.map(Into::into),
            };
            return decisions_cmd(&nats, &filter, n, scan, follow, json, out).await;
        }
    };
    write!(out, "{text}").map_err(CliError::writing)
}

/// The output of the commands generated from the command line's own definition
/// (completions, man page); `None` for the commands that read the system.
fn generated(command: &Command) -> Result<Option<Vec<u8>>, CliError> {
    let definition = <Cli as clap::CommandFactory>::command;
    let mut text = Vec::new();
    match command {
        Command::Completions { shell } => {
            clap_complete::generate(*shell, &mut definition(), "metronome", &mut text);
        }
        Command::Man => clap_mangen::Man::new(definition())
            .render(&mut text)
            .map_err(CliError::writing)?,
        _ => return Ok(None),
    }
    Ok(Some(text))
}

/// `keys create|list|revoke`.
async fn keys_cmd(nats: &Nats, action: KeysAction, json: bool) -> Result<String, CliError> {
    match action {
        KeysAction::Create {
            tenant,
            note,
            operator,
            priority,
        } => {
            let created =
                keys::create(nats, &tenant, note, operator, priority.map(Into::into)).await?;
            if json {
                to_json(&created)
            } else {
                Ok(format!(
                    "key {} for tenant {} (shown once; only its hash is stored):\n{}\n",
                    created.id, created.tenant, created.key
                ))
            }
        }
        KeysAction::List { gateway_url } => {
            let metrics = match gateway_url {
                Some(url) => Some(gateway_metrics(&url).await?),
                None => None,
            };
            let rows = keys::rows(keys::records(nats).await?, metrics.as_deref());
            if json {
                to_json(&rows)
            } else {
                Ok(keys::table(&rows))
            }
        }
        KeysAction::Revoke { id } => {
            let record = keys::revoke(nats, &id).await?;
            if json {
                to_json(&record)
            } else {
                Ok(format!(
                    "key {} of tenant {} is revoked\n",
                    record.id(),
                    record.tenant
                ))
            }
        }
    }
}

/// A gateway's `/metrics` text.
async fn gateway_metrics(url: &str) -> Result<String, CliError> {
    let url = format!("{}/metrics", url.trim_end_matches('/'));
    let unreachable = |e: reqwest::Error| CliError::Nats(format!("reading {url}: {e}"));
    reqwest::Client::new()
        .get(&url)
        .timeout(std::time::Duration::from_secs(5))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(unreachable)?
        .text()
        .await
        .map_err(unreachable)
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, CliError> {
    serde_json::to_string_pretty(v)
        .map(|s| s + "\n")
        .map_err(|e| CliError::Usage(format!("encoding JSON: {e}")))
}

/// `explain`: the text (or JSON) story of one job; [`CliError::NotFound`] for an unknown id.
pub async fn explain(
    nats: &Nats,
    job_id: &str,
    scan: usize,
    json: bool,
) -> Result<String, CliError> {
    let story = story(nats, job_id, scan).await?;
    if json {
        to_json(&explain::to_json(&story))
    } else {
        Ok(story.render())
    }
}

/// `replay`: the recorded decisions of the window re-decided under the `[scheduler]`
/// table of `config_path` (the defaults without one).
pub async fn replay(
    nats: &Nats,
    since: &str,
    config_path: Option<&std::path::Path>,
    scan: usize,
    json: bool,
) -> Result<String, CliError> {
    let window_ms = replay::parse_window(since).map_err(CliError::Usage)?;
    let config = match config_path {
        None => metronome_scheduler::SchedulerConfig::default(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| CliError::Usage(format!("reading {}: {e}", path.display())))?;
            replay::config_from_toml(&text).map_err(|errors| {
                CliError::Usage(format!(
                    "{}: invalid configuration:\n  {}",
                    path.display(),
                    errors.join("\n  ")
                ))
            })?
        }
    };
    let decisions: Vec<Decision> = nats
        .decisions_since(unix_ms().saturating_sub(window_ms), scan)
        .await?;
    let report = replay::replay(&decisions, &config);
    if json {
        to_json(&report)
    } else {
        Ok(report.render(since))
    }
}

/// `status`.
pub async fn status(
    nats: &Nats,
    window_s: u64,
    stale_after_ms: u64,
    json: bool,
) -> Result<String, CliError> {
    let now = unix_ms();
    let report = status_report(nats, window_s, stale_after_ms, now).await?;
    if json {
        to_json(&report)
    } else {
        Ok(report.render(now))
    }
}

async fn decisions_cmd(
    nats: &Nats,
    filter: &decisions::Filter,
    n: usize,
    scan: u64,
    follow: bool,
    json: bool,
    out: &mut (dyn Write + Send),
) -> Result<(), CliError> {
    let print = |out: &mut (dyn Write + Send), d: &Decision| -> Result<(), CliError> {
        let line = if json {
            serde_json::to_string(d).map_err(|e| CliError::Usage(format!("encoding JSON: {e}")))?
        } else {
            decisions::line(d)
        };
        writeln!(out, "{line}")
            .and_then(|()| out.flush())
            .map_err(CliError::writing)
    };
    // Subscribe before reading the past so nothing decided in between is lost.
    let mut live = if follow {
        Some(nats.follow_decisions().await?)
    } else {
        None
    };
    // A decision made between the subscription and the read shows in both: print it once.
    let mut printed = std::collections::HashSet::new();
    if n > 0 {
        let unfiltered = *filter == decisions::Filter::default();
        let window = if unfiltered {
            n as u64
        } else {
            scan.max(n as u64)
        };
        let past = nats.last_decisions(window).await?;
        for d in decisions::last_n(past, filter, n) {
            print(out, &d)?;
            if live.is_some() {
                printed.insert((d.job_id.clone(), d.attempt));
            }
        }
    }
    if let Some(sub) = live.as_mut() {
        while let Some(msg) = sub.next().await {
            if let Ok(d) = serde_json::from_slice::<Decision>(&msg.payload) {
                if filter.matches(&d) && !printed.remove(&(d.job_id.clone(), d.attempt)) {
                    print(out, &d)?;
                }
            }
        }
    }
    Ok(())
}

/// One control request to a worker-agent; [`CliError::NotFound`] when no agent answers.
pub async fn control(
    nats: &Nats,
    worker: &str,
    action: &str,
) -> Result<metronome_protocol::ControlReply, CliError> {
    if !names::is_subject_token(worker) {
        return Err(CliError::Usage(format!(
            "{worker:?} is not a worker id (letters, digits, '-' and '_' only)"
        )));
    }
    let subject = names::control_subject(worker, action);
    let reply = match tokio::time::timeout(
        std::time::Duration::from_secs(5),
        nats.client.request(subject.clone(), bytes::Bytes::new()),
    )
    .await
    {
        Ok(Ok(m)) => m,
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            return Err(CliError::NotFound(format!(
                "no worker-agent answers on {subject}: {worker} is not running (see `metronome workers`)"
            )))
        }
        Ok(Err(e)) => return Err(CliError::Nats(format!("{subject}: {e}"))),
        Err(_) => return Err(CliError::Nats(format!("{subject}: no answer within 5 s"))),
    };
    serde_json::from_slice(&reply.payload).map_err(|e| CliError::Decode {
        what: format!("the answer on {subject}"),
        message: e.to_string(),
    })
}

async fn drain_cmd(
    nats: &Nats,
    worker: &str,
    wait: bool,
    timeout_s: u64,
    json: bool,
    out: &mut (dyn Write + Send),
) -> Result<(), CliError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout_s);
    let mut last_line = String::new();
    loop {
        let r = control(nats, worker, names::CONTROL_DRAIN).await?;
        let line = if json {
            serde_json::to_string(&r).map_err(|e| CliError::Usage(format!("encoding JSON: {e}")))?
        } else {
            drain::line(&r)
        };
        if line != last_line {
            writeln!(out, "{line}")
                .and_then(|()| out.flush())
                .map_err(CliError::writing)?;
            last_line = line;
        }
        if !wait || r.running == 0 {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(CliError::TimedOut(format!(
                "{worker} still runs {} job(s) after {timeout_s} s; it stays draining",
                r.running
            )));
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}
