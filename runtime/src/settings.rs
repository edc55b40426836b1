//! The settings a binary takes from its command line and its environment, declared once:
//! each [`Setting`] names a configuration key, the flag that sets it, the environment
//! variable that sets it (if any) and the flag's help. The table is both what clap parses
//! ([`SettingFlags`], flattened into the binary's command line, so `--help` lists every
//! flag with its variable) and what the configuration loader reads ([`apply_env`]), so the
//! two cannot disagree.
//!
//! Values stay text until they are applied to the configuration
//! ([`crate::config::apply_overrides`]): a bad value meets the same checks as the file, and
//! the error names the flag or the variable it came from.

use std::marker::PhantomData;

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::config::{apply_overrides, ConfigError, Override};

/// One configuration key settable by a flag and, optionally, an environment variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    /// Dotted TOML path of the key it sets.
    pub key: &'static str,
    /// The long flag, without its dashes.
    pub flag: &'static str,
    /// The environment variable, when there is one.
    pub var: Option<&'static str>,
    /// The flag's value in `--help` (`URL`, `ADDR`).
    pub value_name: &'static str,
    /// The flag's help line.
    pub help: &'static str,
    /// The value is a secret: `--help` never shows the variable's current value.
    pub secret: bool,
}

impl Setting {
    /// `key`, set by `--flag <VALUE_NAME>`.
    pub const fn new(
        key: &'static str,
        flag: &'static str,
        value_name: &'static str,
        help: &'static str,
    ) -> Setting {
        Setting {
            key,
            flag,
            var: None,
            value_name,
            help,
            secret: false,
        }
    }

    /// Also set by the environment variable `var`.
    pub const fn env(self, var: &'static str) -> Setting {
        Setting {
            var: Some(var),
            ..self
        }
    }

    /// The value is a secret (an API key): `--help` does not show the variable's value.
    pub const fn secret(self) -> Setting {
        Setting {
            secret: true,
            ..self
        }
    }

    /// The clap argument for this setting (its id is the key).
    pub fn arg(&self) -> Arg {
        let mut arg = Arg::new(self.key)
            .long(self.flag)
            .value_name(self.value_name)
            .help(self.help)
            .action(ArgAction::Set);
        if let Some(var) = self.var {
            arg = arg.env(var).hide_env_values(self.secret);
        }
        arg
    }
}

/// A binary's settings table, named by a type so clap can build the flags from it.
pub trait SettingTable {
    const SETTINGS: &'static [Setting];
}

/// The flags of a [`SettingTable`], parsed: flatten it into the binary's clap command line
/// (`#[command(flatten)]`). Each flag given, or read from its variable, becomes an
/// [`Override`] of its key.
pub struct SettingFlags<T> {
    pub overrides: Vec<Override>,
    table: PhantomData<T>,
}

impl<T> std::fmt::Debug for SettingFlags<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SettingFlags")
            .field("overrides", &self.overrides)
            .finish()
    }
}

impl<T> Clone for SettingFlags<T> {
    fn clone(&self) -> Self {
        SettingFlags {
            overrides: self.overrides.clone(),
            table: PhantomData,
        }
    }
}

impl<T: SettingTable> FromArgMatches for SettingFlags<T> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let overrides = T::SETTINGS
            .iter()
            .filter_map(|s| {
                let value = matches.get_one::<String>(s.key)?;
                let origin = match (matches.value_source(s.key), s.var) {
                    (Some(ValueSource::EnvVariable), Some(var)) => {
                        format!("environment variable {var}")
                    }
                    _ => format!("--{}", s.flag),
                };
                Some(Override {
                    origin,
                    key: s.key.to_string(),
                    value: value.clone(),
                })
            })
            .collect();
        Ok(SettingFlags {
            overrides,
            table: PhantomData,
        })
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl<T: SettingTable> Args for SettingFlags<T> {
    fn augment_args(cmd: Command) -> Command {
        T::SETTINGS.iter().fold(cmd, |cmd, s| cmd.arg(s.arg()))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

/// Apply the variable of every setting that has one and that `lookup` finds
/// (`|k| std::env::var(k).ok()` in a binary, a map in tests).
pub fn apply_env<T: Serialize + DeserializeOwned>(
    config: &mut T,
    settings: &[Setting],
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    apply_overrides(
        config,
        settings.iter().filter_map(|s| {
            let var = s.var?;
            lookup(var).map(|value| Override {
                origin: format!("environment variable {var}"),
                key: s.key.to_string(),
                value,
            })
        }),
    )
}

/// The environment variables `--help` of `command` lists (`[env: NAME=...]`), in order.
pub fn help_env_vars(command: &mut Command) -> Vec<String> {
    let help = command.render_long_help().to_string();
    help.split("[env: ")
        .skip(1)
        .filter_map(|rest| rest.split(['=', ']']).next())
        .map(str::to_string)
        .collect()
}

/// The environment variables a configuration loader asks for: `load` is called with a
/// lookup that records every name and finds nothing.
pub fn loader_env_vars(load: impl FnOnce(&dyn Fn(&str) -> Option<String>)) -> Vec<String> {
    let asked = std::sync::Mutex::new(Vec::new());
    load(&|name: &str| {
        asked.lock().expect("not poisoned").push(name.to_string());
        None
    });
    asked.into_inner().expect("not poisoned")
}

/// The variables every binary's loader reads besides its own settings: NATS credentials
/// and TLS, the Redis password file and TLS. They are documented once (docs/SECURITY.md),
/// not as flags.
pub const SHARED_ENV_VARS: [&str; 11] = [
    crate::nats::ENV_USER,
    crate::nats::ENV_PASSWORD,
    crate::nats::ENV_PASSWORD_FILE,
    crate::nats::ENV_CREDS,
    crate::nats::ENV_CA,
    crate::nats::ENV_CERT,
    crate::nats::ENV_KEY,
    crate::redis::ENV_PASSWORD_FILE,
    crate::redis::ENV_CA,
    crate::redis::ENV_CERT,
    crate::redis::ENV_KEY,
];

/// Asserts that `--help` of `command` lists exactly the variables the loader reads (less
/// [`SHARED_ENV_VARS`]), each on the flag of its setting in `settings`.
pub fn assert_help_and_loader_agree(
    command: &mut Command,
    settings: &[Setting],
    load: impl FnOnce(&dyn Fn(&str) -> Option<String>),
) {
    let mut in_help = help_env_vars(command);
    let mut read = loader_env_vars(load);
    read.retain(|v| !SHARED_ENV_VARS.contains(&v.as_str()));
    in_help.sort();
    in_help.dedup();
    read.sort();
    read.dedup();
    assert_eq!(
        in_help, read,
        "the variables --help lists (left) differ from those the configuration loader reads (right)"
    );
    for s in settings {
        let arg = command
            .get_arguments()
            .find(|a| a.get_long() == Some(s.flag))
            .unwrap_or_else(|| panic!("--{} is not a flag", s.flag));
        assert_eq!(
            arg.get_env().and_then(|e| e.to_str()),
            s.var,
            "--{} reads another variable than its setting",
            s.flag
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    struct Table;
    impl SettingTable for Table {
        const SETTINGS: &'static [Setting] = &[
            Setting::new("url", "url", "URL", "where").env("T_URL"),
            Setting::new("inner.limit", "limit", "N", "how many"),
            Setting::new("key", "key", "KEY", "secret")
                .env("T_KEY")
                .secret(),
        ];
    }

    #[derive(Parser, Debug)]
    struct Cli {
        #[arg(long)]
        config: Option<String>,
        #[command(flatten)]
        settings: SettingFlags<Table>,
    }

    #[test]
    fn flags_become_overrides_of_their_keys_naming_where_they_came_from() {
        let cli = Cli::try_parse_from(["t", "--url", "nats://x", "--limit", "3"]).unwrap();
        let got: Vec<(String, String, String)> = cli
            .settings
            .overrides
            .into_iter()
            .map(|o| (o.origin, o.key, o.value))
            .collect();
        assert_eq!(
            got,
            [
                ("--url".into(), "url".into(), "nats://x".into()),
                ("--limit".into(), "inner.limit".into(), "3".into()),
            ]
        );
    }

    #[test]
    fn help_lists_each_variable_and_hides_secret_values() {
        let mut cmd = <Cli as clap::CommandFactory>::command();
        assert_eq!(help_env_vars(&mut cmd), ["T_URL", "T_KEY"]);
        let help = cmd.render_long_help().to_string();
        assert!(help.contains("--url <URL>"), "{help}");
        assert!(
            help.contains("[env: T_KEY]") || !help.contains("T_KEY="),
            "{help}"
        );
    }

    #[test]
    fn a_loader_that_misses_a_variable_fails_the_agreement() {
        let mut cmd = <Cli as clap::CommandFactory>::command();
        let only_url = |lookup: &dyn Fn(&str) -> Option<String>| {
            lookup("T_URL");
        };
        let missed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            assert_help_and_loader_agree(&mut cmd, Table::SETTINGS, only_url)
        }));
        assert!(missed.is_err());
        assert_help_and_loader_agree(&mut cmd, Table::SETTINGS, |lookup| {
            lookup("T_URL");
            lookup("T_KEY");
            lookup(crate::nats::ENV_USER);
        });
    }
}
