//! `metronome-gateway`: parse the command line, load the configuration, start tracing,
//! serve until SIGINT or SIGTERM; or `keys create`: make an API key.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use metronome_gateway::config::Settings;
use metronome_gateway::{Config, ModelList, TenantConfig};
use metronome_runtime::config::apply_overrides;
use metronome_runtime::settings::SettingFlags;

/// Metronome's OpenAI-compatible HTTP gateway.
///
/// Serves POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models,
/// /healthz, /readyz, /metrics and the operator console (/console), and turns each request
/// into a job on NATS JetStream. The flags below (or their environment variables) override
/// the file's keys; RUST_LOG sets the log filter (default info), METRONOME_LOG_FORMAT=json
/// writes one JSON object per log line.
#[derive(Debug, Parser)]
#[command(name = "metronome-gateway", version)]
struct Args {
    /// TOML configuration file (every key is optional; defaults otherwise).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Validate the configuration, print the effective configuration and exit (0 when
    /// valid, 2 with every field error otherwise).
    #[arg(long)]
    check_config: bool,
    #[command(flatten)]
    settings: SettingFlags<Settings>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Manage API keys.
    #[command(subcommand)]
    Keys(KeysCommand),
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Generate an API key for a tenant. The key is printed once, on the first line of
    /// standard output; the configuration lines that follow hold only its SHA-256. Nothing
    /// stores the key itself.
    Create(CreateArgs),
}

#[derive(Debug, clap::Args)]
struct CreateArgs {
    /// The tenant the key acts for (ASCII letters, digits, '-' and '_').
    #[arg(long)]
    tenant: String,
    /// Models the tenant may use, comma-separated, or '*' for every model (for a tenant
    /// not configured yet).
    #[arg(long, default_value = "*")]
    models: String,
    /// Sustained requests per second of a new tenant (default: no limit).
    #[arg(long)]
    requests_per_second: Option<f64>,
    /// Burst above that rate (default: the rate rounded up).
    #[arg(long)]
    burst: Option<u32>,
    /// Tokens per minute of a new tenant, prompt estimate + max_tokens (default: no limit).
    #[arg(long)]
    tokens_per_minute: Option<u64>,
    /// A note stored with the hash (who holds the key).
    #[arg(long)]
    note: Option<String>,
    /// The key also opens the operator console (/console): every worker and decision.
    #[arg(long)]
    operator: bool,
    /// Append the entries to this gateway configuration file instead of printing them (the
    /// tenant entry only when the tenant is not in the file yet); only the key is printed.
    #[arg(long, value_name = "FILE")]
    append: Option<PathBuf>,
}

fn keys_create(args: CreateArgs) -> ExitCode {
    let models = match args.models.trim() {
        "*" => ModelList::default(),
        list => ModelList::Only(
            list.split(',')
                .map(|m| m.trim().to_string())
                .filter(|m| !m.is_empty())
                .collect(),
        ),
    };
    let tenant = TenantConfig {
        name: args.tenant,
        models,
        requests_per_second: args.requests_per_second,
        burst: args.burst,
        tokens_per_minute: args.tokens_per_minute,
    };
    let new =
        match metronome_gateway::auth::create_key(&tenant, args.note.as_deref(), args.operator) {
            Ok(k) => k,
            Err(e) => {
                eprintln!("metronome-gateway keys create: {e}");
                return ExitCode::from(2);
            }
        };
    if let Some(path) = args.append {
        if let Err(e) = append_entries(&path, &tenant, &new) {
            eprintln!("metronome-gateway keys create: {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("{}", new.key);
        eprintln!(
            "metronome-gateway: key for tenant {:?} (id {}) added to {}; the key above is shown once and stored nowhere. Restart the gateway to use it.",
            tenant.name,
            metronome_gateway::api_key::key_id(&new.sha256),
            path.display()
        );
        return ExitCode::SUCCESS;
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", new.key);
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "# The key above is shown once and stored nowhere; give it to tenant {:?}.",
        tenant.name
    );
    let _ = writeln!(
        out,
        "# Add the lines below to the gateway configuration (they hold only its SHA-256)."
    );
    let _ = writeln!(
        out,
        "# Leave out [[tenants]] if the tenant is configured already."
    );
    let _ = writeln!(out);
    let _ = write!(out, "{}\n{}", new.tenant_toml, new.key_toml);
    ExitCode::SUCCESS
}

/// Append the key (and the tenant, when new) to `path`, refusing to write a file the
/// gateway would not accept.
fn append_entries(
    path: &Path,
    tenant: &TenantConfig,
    new: &metronome_gateway::auth::NewKey,
) -> Result<(), String> {
    let old = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e.to_string()),
    };
    let current =
        Config::from_toml(&old, &path.display().to_string()).map_err(|e| e.to_string())?;
    let mut text = old.clone();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    if !current.tenants.iter().any(|t| t.name == tenant.name) {
        text.push('\n');
        text.push_str(&new.tenant_toml);
    }
    text.push('\n');
    text.push_str(&new.key_toml);
    let updated =
        Config::from_toml(&text, &path.display().to_string()).map_err(|e| e.to_string())?;
    if let Err(errors) = updated.validate() {
        let errors: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        return Err(format!(
            "the file would not be valid: {}",
            errors.join("; ")
        ));
    }
    std::fs::write(path, text).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Command::Keys(KeysCommand::Create(create))) = args.command {
        return keys_create(create);
    }
    // File, then the environment (`METRONOME_NATS_*`, `METRONOME_REDIS_*` and the
    // variables of `config::SETTINGS`), then flags: the order every binary uses.
    let config = Config::load(args.config.as_deref(), |k| std::env::var(k).ok())
        .and_then(|mut c| apply_overrides(&mut c, args.settings.overrides.clone()).map(|()| c));
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            eprintln!("metronome-gateway: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(errors) = config.validate() {
        return metronome_runtime::report_invalid_config("metronome-gateway: ", &errors);
    }
    if args.check_config {
        print!("{}", config.to_toml());
        return ExitCode::SUCCESS;
    }
    let _tracing = metronome_runtime::init_tracing(metronome_runtime::LogOutput::Stdout);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("metronome-gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let shutdown = metronome_runtime::shutdown_on_signals(|| {
            tracing::info!("shutdown requested; finishing in-flight requests")
        });
        match metronome_gateway::run(config, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "gateway failed");
                ExitCode::FAILURE
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `--help` lists exactly the variables the configuration loader reads, each on the
    /// flag of its key.
    #[test]
    fn help_and_the_configuration_loader_agree() {
        metronome_runtime::settings::assert_help_and_loader_agree(
            &mut Args::command(),
            &metronome_gateway::config::SETTINGS,
            |lookup| {
                let _ = Config::load(None, lookup);
            },
        );
    }
}
