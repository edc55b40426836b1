//! `metronome-loadgen`: command-line front end of the load generator. Parses flags, builds
//! the effective spec (TOML file < environment < flags), runs it, writes the outputs and
//! prints the summary table. All behaviour lives in the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_loadgen::spec::Settings;
use metronome_loadgen::{
    load_trace, run_load_until, trace_stats, write_outputs, Endpoint, FieldError, LengthDist,
    LoadSpec, Workload,
};
use metronome_runtime::config::{apply_overrides, ConfigError};
use metronome_runtime::settings::SettingFlags;

/// Open-loop OpenAI-API load generator measuring per-request predictability.
///
/// Replays a trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or sends seeded Poisson
/// arrivals, streams every request, and writes requests.csv, summary.json and SVG plots
/// into --out. Works against any OpenAI-compatible endpoint.
///
/// Prefix-heavy workloads (prompts that repeat earlier prompts, seeded, synthetic) come
/// from a spec file's [workload] table (--rate and --output-tokens still override):
///   kind = "shared_prefix": groups, users_per_group, prefix_tokens, question_tokens,
///     output_tokens, rate_rps: groups × users_per_group requests, each its group's system
///     prompt and a user message of its own.
///   kind = "multi_turn": turns, system_tokens (0: none), user_tokens, output_tokens,
///     think_s, rate_rps: conversations whose every turn re-sends the whole history (an
///     agent loop with long user_tokens as tool results and a small think_s).
///
/// Examples:
///   metronome-loadgen --model m --trace trace.csv --rate 4 --duration 60 --out run1
///   metronome-loadgen --model m --rate 2 --limit 200 --prompt-tokens lognormal:mean=1500,sigma=0.8 --output-tokens fixed:200
///   metronome-loadgen --model m --config multi_turn.toml --rate 3 --limit 300
#[derive(Debug, Parser)]
#[command(name = "metronome-loadgen", version, verbatim_doc_comment)]
struct Cli {
    /// TOML spec file (fields of LoadSpec); flags (or their environment variables)
    /// override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Validate, print the effective spec and exit 0; or print every field error and exit 2.
    #[arg(long)]
    check_config: bool,
    /// Print the trace's statistics (mean rate, length percentiles) as JSON and exit.
    #[arg(long, requires = "trace")]
    trace_stats: bool,

    #[command(flatten)]
    settings: SettingFlags<Settings>,
    /// API endpoint: chat (/chat/completions) or completions (/completions) [default: chat].
    #[arg(long, value_name = "chat|completions")]
    endpoint: Option<Endpoint>,
    /// Replay this trace CSV instead of Poisson arrivals.
    #[arg(long, value_name = "CSV")]
    trace: Option<PathBuf>,
    /// Trace replay: multiply arrival offsets by F (0.5 = twice as fast).
    #[arg(long, value_name = "F", conflicts_with = "rate")]
    time_scale: Option<f64>,
    /// Arrival rate in requests/s: the Poisson rate, or for a trace the target mean rate
    /// (inter-arrival shape kept, gaps rescaled).
    #[arg(long, value_name = "R")]
    rate: Option<f64>,
    /// Trace replay: skip this many seconds of trace at its start.
    #[arg(long, value_name = "S")]
    start_offset: Option<f64>,
    /// Use Poisson arrivals (the default without --trace).
    #[arg(long, conflicts_with = "trace")]
    poisson: bool,
    /// Poisson prompt lengths: fixed:N, uniform:A,B or lognormal:mean=M,sigma=S[,max=X].
    #[arg(long, value_name = "DIST")]
    prompt_tokens: Option<LengthDist>,
    /// Poisson output lengths (max_tokens), same forms as --prompt-tokens.
    #[arg(long, value_name = "DIST")]
    output_tokens: Option<LengthDist>,
    /// Send at most N requests.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Send only requests arriving within S seconds of the start.
    #[arg(long, value_name = "S")]
    duration: Option<f64>,
    /// Seed of arrivals and lengths [default: 42].
    #[arg(long)]
    seed: Option<u64>,

    /// Cap on outstanding requests; arrivals beyond it are dropped and counted as errors.
    #[arg(long, value_name = "N")]
    max_in_flight: Option<usize>,
    /// Per-request timeout in seconds [default: 600].
    #[arg(long, value_name = "S")]
    request_timeout: Option<f64>,
    /// Seconds outstanding requests get after the last arrival [default: 120].
    #[arg(long, value_name = "S")]
    drain_timeout: Option<f64>,
    /// Do not send ignore_eos / metronome_prompt_tokens (for servers rejecting unknown fields).
    #[arg(long)]
    no_extensions: bool,
    /// Let prompts share their prefix (disables the per-request nonce words).
    #[arg(long)]
    shared_prefix: bool,

    /// SLO: TTFT at most this many ms [default: 2000].
    #[arg(long, value_name = "MS")]
    slo_ttft_ms: Option<f64>,
    /// SLO: per-request tokens/s at least this [default: 30].
    #[arg(long, value_name = "TOK_S")]
    slo_tok_s: Option<f64>,

    /// Output directory for requests.csv, summary.json and plots.
    #[arg(long, value_name = "DIR", default_value = "loadgen-out")]
    out: PathBuf,
    /// No progress lines on stderr.
    #[arg(long)]
    quiet: bool,
    /// Seconds between progress lines [default: 5].
    #[arg(long, value_name = "S")]
    progress_interval: Option<f64>,
}

impl Cli {
    /// Applies the flags over `spec`; flags that do not fit the workload are field errors.
    fn apply(&self, spec: &mut LoadSpec) -> Vec<FieldError> {
        let mut errs = Vec::new();
        let mut bad = |field: &str, message: &str| {
            errs.push(FieldError {
                field: field.into(),
                message: message.into(),
            })
        };
        macro_rules! set {
            ($flag:expr, $field:expr) => {
                if let Some(v) = $flag.clone() {
                    $field = v;
                }
            };
        }
        if let Err(e) = apply_overrides(spec, self.settings.overrides.clone()) {
            let key = match &e {
                ConfigError::Override { key, .. } => key.clone(),
                _ => String::new(),
            };
            bad(&key, &e.to_string());
        }
        set!(self.endpoint, spec.endpoint);
        if self.limit.is_some() {
            spec.limit = self.limit;
        }
        if self.duration.is_some() {
            spec.duration_s = self.duration;
        }
        set!(self.seed, spec.seed);
        set!(self.max_in_flight, spec.max_in_flight);
        set!(self.request_timeout, spec.request_timeout_s);
        set!(self.drain_timeout, spec.drain_timeout_s);
        set!(self.slo_ttft_ms, spec.slo.ttft_ms);
        set!(self.slo_tok_s, spec.slo.tok_s);
        set!(self.progress_interval, spec.progress_interval_s);
        if self.no_extensions {
            spec.extensions = false;
        }
        if self.shared_prefix {
            spec.unique_prompts = false;
        }
        if let Some(path) = &self.trace {
            spec.workload = Workload::Trace {
                path: path.clone(),
                time_scale: None,
                rate_rps: None,
                start_offset_s: 0.0,
            };
        } else if self.poisson && !matches!(spec.workload, Workload::Poisson { .. }) {
            spec.workload = Workload::default();
        }
        match &mut spec.workload {
            Workload::Trace {
                time_scale,
                rate_rps,
                start_offset_s,
                ..
            } => {
                if self.time_scale.is_some() {
                    *time_scale = self.time_scale;
                    *rate_rps = None;
                }
                if self.rate.is_some() {
                    *rate_rps = self.rate;
                    *time_scale = None;
                }
                set!(self.start_offset, *start_offset_s);
                if self.prompt_tokens.is_some() || self.output_tokens.is_some() {
                    bad(
                        "prompt_tokens",
                        "--prompt-tokens/--output-tokens apply to Poisson workloads; a trace has its own lengths",
                    );
                }
            }
            Workload::Poisson {
                rate_rps,
                prompt_tokens,
                output_tokens,
            } => {
                set!(self.rate, *rate_rps);
                set!(self.prompt_tokens, *prompt_tokens);
                set!(self.output_tokens, *output_tokens);
                if self.time_scale.is_some() || self.start_offset.is_some() {
                    bad(
                        "time_scale",
                        "--time-scale/--start-offset apply to trace replay (--trace)",
                    );
                }
            }
            Workload::SharedPrefix {
                rate_rps,
                output_tokens,
                ..
            }
            | Workload::MultiTurn {
                rate_rps,
                output_tokens,
                ..
            } => {
                set!(self.rate, *rate_rps);
                set!(self.output_tokens, *output_tokens);
                if self.prompt_tokens.is_some() {
                    bad(
                        "prompt_tokens",
                        "--prompt-tokens applies to Poisson workloads; prefix workloads set their lengths in the spec file",
                    );
                }
                if self.time_scale.is_some() || self.start_offset.is_some() {
                    bad(
                        "time_scale",
                        "--time-scale/--start-offset apply to trace replay (--trace)",
                    );
                }
            }
        }
        errs
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let _tracing = metronome_runtime::init_tracing(metronome_runtime::LogOutput::Stderr);

    if cli.trace_stats {
        let path = cli.trace.as_ref().expect("clap requires --trace");
        return match load_trace(path) {
            Ok(t) => {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&trace_stats(&t)).expect("stats serialise")
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        };
    }

    let mut spec = match &cli.config {
        Some(path) => match LoadSpec::from_file(path) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        },
        None => LoadSpec::default(),
    };
    // The flags carry their environment variables (clap reads them).
    let mut errs = cli.apply(&mut spec);
    if let Err(more) = spec.validate() {
        errs.extend(more);
    }
    if cli.check_config {
        if !errs.is_empty() {
            return metronome_runtime::report_invalid_config("", &errs);
        }
        print!("{}", toml::to_string(&spec).expect("spec serialises"));
        return ExitCode::SUCCESS;
    }
    if !errs.is_empty() {
        return metronome_runtime::report_invalid_config("", &errs);
    }

    // SIGINT or SIGTERM cancels the run; the partial results are still written.
    let cancel = metronome_runtime::shutdown_on_signals(|| {
        tracing::warn!("signal received, stopping the run")
    });
    tracing::info!(url = %spec.request_url(), model = %spec.model, out = %cli.out.display(), "starting load run");
    let result = match run_load_until(spec, !cli.quiet, cancel).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = write_outputs(&cli.out, &result) {
        eprintln!("error: {e}");
        print!("{}", result.summary.table());
        return ExitCode::FAILURE;
    }
    print!("{}", result.summary.table());
    eprintln!("outputs written to {}", cli.out.display());
    if result.cancelled {
        eprintln!("run was cancelled: the figures cover a partial run");
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `--help` lists exactly the variables the spec loader reads, each on the flag of its
    /// key.
    #[test]
    fn help_and_the_spec_loader_agree() {
        metronome_runtime::settings::assert_help_and_loader_agree(
            &mut Cli::command(),
            &metronome_loadgen::spec::SETTINGS,
            |lookup| {
                let _ = LoadSpec::default().apply_env(lookup);
            },
        );
    }
}
