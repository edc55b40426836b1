//! `metronome`, the operator CLI: reads the system through the documented NATS contract
//! (docs/PROTOCOL.md) and answers the operator's questions: who leads, which workers are
//! up and how loaded, what was decided, and why one request went where it went.
//!
//! Layout: [`Cli`] is the command line; what is read and how it is shown (the workers,
//! the status, the decision lines, the story of a job) is the read model,
//! `metronome_readmodel`, which the gateway's console serves too; `drain` asks an agent to
//! drain, `replay` re-decides recorded decisions; [`run`] glues one command to its view and
//! returns what to print.

pub mod context;
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
/// scripts. Exit codes: 0 ok, 1 not found (unknown job id, worker or context), 2 bad usage,
/// 3 NATS or Redis unreachable or unreadable (or the output unwritable), 4 `drain --wait`
/// timed out; a closed output pipe (`metronome decisions --follow | head`) ends it quietly
/// with 0.
///
/// Connection settings come from the first that gives them: a flag (`--nats-url`, `keys
/// list --gateway-url`), the environment (`NATS_URL`, `METRONOME_GATEWAY_URL` and the NATS
/// credentials `METRONOME_NATS_USER`, `_PASSWORD`, `_PASSWORD_FILE`, `_CREDS` (a `.creds`
/// file), `_CA`, `_CERT`, `_KEY`), the context, the default. The context is `--context`,
/// else `METRONOME_CONTEXT`, else the one `metronome context use` selected; contexts are
/// saved in `$XDG_CONFIG_HOME/metronome/contexts.toml` (`~/.config/metronome/` without
/// `XDG_CONFIG_HOME`), mode 0600.
#[derive(Parser, Debug, Clone)]
#[command(name = "metronome", version, about, long_about)]
pub struct Cli {
    /// NATS server the system runs on (comma-separated for a cluster) [default: the
    /// context's, else nats://127.0.0.1:4222].
    #[arg(long, env = "NATS_URL", global = true)]
    pub nats_url: Option<String>,

    /// The saved context to use instead of the selected one (`metronome context ls`).
    #[arg(long, env = context::ENV_CONTEXT, global = true, value_name = "NAME")]
    pub context: Option<String>,

    /// NATS credentials and TLS: the context's, overridden by the `METRONOME_NATS_*`
    /// variables like every other binary (set by [`Cli::apply_environment`]; none = an
    /// anonymous connection).
    #[arg(skip)]
    pub nats_auth: metronome_runtime::nats::NatsAuth,

    /// The context's gateway, for `keys list` when `--gateway-url` is not given.
    #[arg(skip)]
    pub gateway_url: Option<String>,

    /// The contexts file (set by [`Cli::apply_environment`]); `None` when neither
    /// `XDG_CONFIG_HOME` nor `HOME` is set.
    #[arg(skip)]
    pub contexts_file: Option<std::path::PathBuf>,

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
// A parsed command line, built once per run: a context's settings inline cost nothing worth
// boxing them for.
#[allow(clippy::large_enum_variant)]
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
    /// Saved contexts (like the nats CLI's): `add`, `use`, `ls`, `show`, `rm`. Each names a
    /// system's NATS servers, its credentials (user and password or password file, or a
    /// `.creds` file; TLS files) and a gateway. Kept in
    /// `$XDG_CONFIG_HOME/metronome/contexts.toml`, mode 0600; passwords are never printed.
    /// Needs no NATS.
    Context {
        #[command(subcommand)]
        action: ContextAction,
    },
}

/// `metronome context` actions.
// Built once per run, like [`Command`].
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug, Clone)]
pub enum ContextAction {
    /// Save a context (replacing one of that name). Relative paths are saved absolute.
    Add {
        /// The context's name (letters, digits, `-`, `_`, `.`).
        name: String,
        /// NATS server(s), comma-separated for a cluster.
        #[arg(long, value_name = "URL")]
        server: Option<String>,
        /// NATS user.
        #[arg(long)]
        user: Option<String>,
        /// The user's password, saved in the file (it shows in the shell's history: prefer
        /// --password-file or --password-stdin).
        #[arg(long, conflicts_with_all = ["password_file", "password_stdin"])]
        password: Option<String>,
        /// A file holding the password (its path is saved, not the password).
        #[arg(long, value_name = "PATH", conflicts_with = "password_stdin")]
        password_file: Option<std::path::PathBuf>,
        /// Read the password from the first line of standard input.
        #[arg(long)]
        password_stdin: bool,
        /// A NATS `.creds` file (user JWT and nkey seed, as `nsc` writes it), instead of a
        /// password.
        #[arg(long, value_name = "PATH")]
        creds: Option<std::path::PathBuf>,
        /// PEM CA of the NATS server's certificate (requires TLS).
        #[arg(long, value_name = "PATH")]
        ca: Option<std::path::PathBuf>,
        /// PEM client certificate, for servers that verify clients.
        #[arg(long, value_name = "PATH", requires = "key")]
        cert: Option<std::path::PathBuf>,
        /// Its PEM private key.
        #[arg(long, value_name = "PATH", requires = "cert")]
        key: Option<std::path::PathBuf>,
        /// A gateway's base URL (`keys list` shows each tenant's usage there).
        #[arg(long, value_name = "URL")]
        gateway_url: Option<String>,
        /// What the context is for.
        #[arg(long)]
        description: Option<String>,
        /// Select it too, as `context use` does.
        #[arg(long = "use")]
        select: bool,
    },
    /// Select the context every later command uses (unless --context or
    /// METRONOME_CONTEXT names another). Exits 1 for an unknown name.
    Use { name: String },
    /// One row per context; `*` marks the selected one. Passwords are not shown.
    Ls,
    /// Every setting of one context (default: the one that applies now); the password is
    /// shown as <redacted>. Exits 1 for an unknown name.
    Show { name: Option<String> },
    /// Delete a context (and its selection, if selected). Exits 1 for an unknown name.
    Rm { name: String },
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
        /// A gateway whose `/metrics` give the tenants' usage [default: the context's].
        #[arg(long, env = "METRONOME_GATEWAY_URL")]
        gateway_url: Option<String>,
    },
    /// Revoke a key: every gateway refuses it within a second. An id the bucket has no
    /// record of is taken for a key in gateways' configuration files: its revocation is
    /// stored in the bucket, and every gateway refuses its configured key of that id.
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

/// NATS server of a command line, a context and an environment that name none.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

impl Cli {
    /// Apply the environment and the context: the contexts file's place (`XDG_CONFIG_HOME`,
    /// `HOME`), the context that applies (`--context`, `METRONOME_CONTEXT`, the selected
    /// one), then, for what no flag set, the environment's `METRONOME_NATS_*` over the
    /// context's credentials, the context's NATS URL and gateway; Redis TLS from
    /// `METRONOME_REDIS_*`. `lookup` is `std::env::var(..).ok()` in `main`. `NATS_URL`,
    /// `METRONOME_CONTEXT` and `METRONOME_GATEWAY_URL` were read by clap, as the flags'
    /// variables.
    pub fn apply_environment(
        &mut self,
        lookup: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), CliError> {
        self.contexts_file = context::file_path(lookup);
        self.redis_tls.apply_env(lookup);
        if let Command::Context { .. } | Command::Completions { .. } | Command::Man = self.command {
            // These manage or describe contexts; none applies to them.
            return Ok(());
        }
        let contexts = match &self.contexts_file {
            Some(path) => context::Contexts::load(path)?,
            None => context::Contexts::default(),
        };
        let mut auth = metronome_runtime::nats::NatsAuth::default();
        if let Some((_, c)) = contexts.active(self.context.as_deref())? {
            auth = c.nats_auth();
            if self.nats_url.is_none() {
                self.nats_url.clone_from(&c.nats_url);
            }
            self.gateway_url.clone_from(&c.gateway_url);
        }
        auth.apply_env(lookup);
        self.nats_auth = auth;
        Ok(())
    }
}

/// Run one command, writing its output to `out`.
pub async fn run(cli: Cli, out: &mut (dyn Write + Send)) -> Result<(), CliError> {
    if let Some(text) = generated(&cli.command)? {
        return out.write_all(&text).map_err(CliError::writing);
    }
    if let Command::Context { action } = cli.command {
        let text = context_cmd(
            cli.contexts_file.as_deref(),
            cli.context.as_deref(),
            action,
            cli.json,
        )?;
        return write!(out, "{text}").map_err(CliError::writing);
    }
    let nats_url = cli.nats_url.as_deref().unwrap_or(DEFAULT_NATS_URL);
    let nats = Nats::connect(nats_url, &cli.nats_auth).await?;
    let json = cli.json;
    let text = match cli.command {
        Command::Explain { job_id, scan } => explain(&nats, &job_id, scan, json).await?,
        // Answered above, without a connection.
        Command::Completions { .. } | Command::Man | Command::Context { .. } => return Ok(()),
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
        Command::Keys { action } => keys_cmd(&nats, action, cli.gateway_url, json).await?,
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

/// `context add|use|ls|show|rm` on the contexts file at `path`; `chosen` is `--context`
/// (or `METRONOME_CONTEXT`), what `show` shows without a name.
fn context_cmd(
    path: Option<&std::path::Path>,
    chosen: Option<&str>,
    action: ContextAction,
    json: bool,
) -> Result<String, CliError> {
    let path = path.ok_or_else(|| {
        CliError::Usage("no place for contexts: set XDG_CONFIG_HOME or HOME".into())
    })?;
    let mut contexts = context::Contexts::load(path)?;
    let unknown = |name: &str| {
        CliError::NotFound(format!(
            "no context named {name:?} (`metronome context ls` lists them)"
        ))
    };
    match action {
        ContextAction::Add {
            name,
            server,
            user,
            password,
            password_file,
            password_stdin,
            creds,
            ca,
            cert,
            key,
            gateway_url,
            description,
            select,
        } => {
            context::check_name(&name)?;
            let password = if password_stdin {
                let mut line = String::new();
                std::io::stdin()
                    .read_line(&mut line)
                    .map_err(|e| CliError::Usage(format!("reading the password: {e}")))?;
                Some(line.trim_end_matches(['\n', '\r']).to_string())
            } else {
                password
            };
            let c = context::Context {
                description,
                nats_url: server,
                user,
                password,
                password_file: password_file.map(context::absolute),
                creds_file: creds.map(context::absolute),
                ca_file: ca.map(context::absolute),
                cert_file: cert.map(context::absolute),
                key_file: key.map(context::absolute),
                gateway_url,
            };
            c.check()
                .map_err(|e| CliError::Usage(format!("context {name:?} is not usable:\n  {e}")))?;
            let replaced = contexts.contexts.insert(name.clone(), c).is_some();
            if select {
                contexts.selected = Some(name.clone());
            }
            contexts.save(path)?;
            Ok(format!(
                "{} context {name}{} in {}\n",
                if replaced { "replaced" } else { "saved" },
                if select { " (selected)" } else { "" },
                path.display()
            ))
        }
        ContextAction::Use { name } => {
            if !contexts.contexts.contains_key(&name) {
                return Err(unknown(&name));
            }
            contexts.selected = Some(name.clone());
            contexts.save(path)?;
            Ok(format!("selected context {name}\n"))
        }
        ContextAction::Ls => {
            if json {
                to_json(&contexts.shown())
            } else {
                Ok(contexts.table())
            }
        }
        ContextAction::Show { name } => {
            let name = match name.as_deref().or(chosen).or(contexts.selected.as_deref()) {
                Some(n) => n.to_string(),
                None => {
                    return Err(CliError::Usage(
                        "no context is selected: name one (`metronome context show NAME`)".into(),
                    ))
                }
            };
            let c = contexts.contexts.get(&name).ok_or_else(|| unknown(&name))?;
            let selected = contexts.selected.as_deref() == Some(name.as_str());
            if json {
                to_json(&c.shown())
            } else {
                Ok(context::render(&name, selected, c, path))
            }
        }
        ContextAction::Rm { name } => {
            if contexts.contexts.remove(&name).is_none() {
                return Err(unknown(&name));
            }
            if contexts.selected.as_deref() == Some(name.as_str()) {
                contexts.selected = None;
            }
            contexts.save(path)?;
            Ok(format!("removed context {name}\n"))
        }
    }
}

/// `keys create|list|revoke`; `context_gateway` is the context's gateway, for `list`
/// without `--gateway-url`.
async fn keys_cmd(
    nats: &Nats,
    action: KeysAction,
    context_gateway: Option<String>,
    json: bool,
) -> Result<String, CliError> {
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
            let metrics = match gateway_url.or(context_gateway) {
                Some(url) => Some(gateway_metrics(&url).await?),
                None => None,
            };
            let rows = keys::rows(keys::records(nats).await?, metrics.as_deref());
            let revoked = keys::revocations(nats).await?;
            if json {
                // The configuration files' revoked ids follow the records, marked as such.
                let all: Vec<serde_json::Value> = rows
                    .iter()
                    .map(serde_json::to_value)
                    .chain(revoked.iter().map(|r| {
                        serde_json::to_value(r).map(|mut v| {
                            v["revoked"] = true.into();
                            v["configured"] = true.into();
                            v
                        })
                    }))
                    .collect::<Result<_, _>>()
                    .map_err(|e| CliError::Usage(format!("encoding JSON: {e}")))?;
                to_json(&all)
            } else {
                Ok(keys::table(&rows) + &keys::revocations_table(&revoked))
            }
        }
        KeysAction::Revoke { id } => {
            let revoked = keys::revoke(nats, &id).await?;
            if json {
                to_json(&revoked)
            } else {
                Ok(match revoked {
                    keys::Revoked::Record(record) => format!(
                        "key {} of tenant {} is revoked\n",
                        record.id(),
                        record.tenant
                    ),
                    keys::Revoked::Configured(r) => format!(
                        "no key with id {} in the {} bucket: its revocation is stored, and every gateway refuses a key of its configuration file with this id\n",
                        r.id,
                        metronome_protocol::names::BUCKET_API_KEYS
                    ),
                })
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
