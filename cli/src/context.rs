//! Saved contexts, like the nats CLI's: each names a system to operate (its NATS servers,
//! the credentials to reach them, a gateway for `keys list`), so an operator switches
//! systems with `metronome context use prod` or `--context staging` instead of
//! re-exporting variables.
//!
//! Contexts live in one TOML file, `$XDG_CONFIG_HOME/metronome/contexts.toml`
//! (`~/.config/metronome/contexts.toml` without `XDG_CONFIG_HOME`), written with mode 0600
//! in a 0700 folder because it may hold a password. The file is replaced whole on every
//! change (written aside, then renamed), so a reader never sees half of it.
//!
//! Which context applies: `--context NAME`, else `METRONOME_CONTEXT`, else the one `context
//! use` selected, else none. Each setting then comes from the first that gives it: a flag
//! (`--nats-url`, `keys list --gateway-url`), the environment (`NATS_URL`,
//! `METRONOME_NATS_*`, `METRONOME_GATEWAY_URL`), the context, the default.
//!
//! Invariant: no command prints a saved password (`ls`, `show` and `--json` say
//! `<redacted>`); paths (a `.creds` file, a password file) are shown, their contents never.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use metronome_runtime::nats::NatsAuth;
use serde::{Deserialize, Serialize};

use crate::CliError;

/// Environment variable choosing the context (below `--context`).
pub const ENV_CONTEXT: &str = "METRONOME_CONTEXT";
/// The contexts file's name in its folder.
pub const FILE_NAME: &str = "contexts.toml";

/// One saved context. Every field is optional: an unset one falls through to the default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Context {
    /// What the context is for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// NATS server(s), comma-separated for a cluster.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    /// A NATS `.creds` file (user JWT and nkey seed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub creds_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// A gateway's base URL (`keys list` reads its `/metrics` for each tenant's usage).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway_url: Option<String>,
}

impl Context {
    /// The NATS credentials and TLS settings this context holds.
    pub fn nats_auth(&self) -> NatsAuth {
        NatsAuth {
            user: self.user.clone(),
            password: self.password.clone(),
            password_file: self.password_file.clone(),
            creds_file: self.creds_file.clone(),
            ca_file: self.ca_file.clone(),
            cert_file: self.cert_file.clone(),
            key_file: self.key_file.clone(),
        }
    }

    /// Every inconsistent setting, as one message per line (for `context add`).
    pub fn check(&self) -> Result<(), String> {
        let mut errors: Vec<String> = self
            .nats_auth()
            .validate()
            .into_iter()
            .map(|(field, message)| {
                format!("{}: {message}", field.trim_start_matches("nats_auth."))
            })
            .collect();
        if let Some(url) = &self.nats_url {
            if let Some(why) = metronome_runtime::nats::check_server_urls(url) {
                errors.push(format!("nats_url: {why}"));
            }
        }
        if let Some(url) = &self.gateway_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                errors.push(format!(
                    "gateway_url: {url:?} is not an http:// or https:// URL"
                ));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("\n  "))
        }
    }

    /// The context as `ls`, `show` and `--json` print it: the password replaced.
    pub fn shown(&self) -> Context {
        Context {
            password: self.password.as_ref().map(|_| "<redacted>".into()),
            ..self.clone()
        }
    }

    /// How it authenticates, in a few words (`ls`).
    fn auth_summary(&self) -> String {
        match (&self.creds_file, &self.user) {
            (Some(path), _) => format!("creds {}", path.display()),
            (None, Some(user)) => format!("user {user}"),
            (None, None) => "none".into(),
        }
    }
}

/// The contexts file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Contexts {
    /// The context `context use` selected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selected: Option<String>,
    pub contexts: BTreeMap<String, Context>,
}

/// Where the contexts file is, from `XDG_CONFIG_HOME` or `HOME` (found through `lookup`);
/// `None` when neither is set.
pub fn file_path(lookup: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let non_empty = |k: &str| lookup(k).filter(|v| !v.is_empty());
    let base = non_empty("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| non_empty("HOME").map(|h| Path::new(&h).join(".config")))?;
    Some(base.join("metronome").join(FILE_NAME))
}

/// A context name: letters, digits, `-`, `_`, `.`; at most 64.
pub fn check_name(name: &str) -> Result<(), CliError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(CliError::Usage(format!(
            "{name:?} is not a context name (letters, digits, '-', '_' and '.', at most 64)"
        )))
    }
}

impl Contexts {
    /// The file at `path`, or no contexts when there is none.
    pub fn load(path: &Path) -> Result<Contexts, CliError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Contexts::default()),
            Err(e) => return Err(CliError::Usage(format!("reading {}: {e}", path.display()))),
        };
        warn_if_readable_by_others(path);
        toml::from_str(&text)
            .map_err(|e| CliError::Usage(format!("parsing {}: {e}", path.display())))
    }

    /// Write to `path` with mode 0600 (its folder created with mode 0700): written aside,
    /// then renamed over the old file.
    pub fn save(&self, path: &Path) -> Result<(), CliError> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let failed =
            |e: std::io::Error| CliError::Usage(format!("writing {}: {e}", path.display()));
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(failed)?;
        }
        let text = toml::to_string(self).map_err(|e| CliError::Usage(e.to_string()))?;
        let aside = path.with_extension(format!("toml.{}", std::process::id()));
        let written = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&aside)
            .and_then(|mut f| {
                f.write_all(
                    format!("# metronome contexts (`metronome context --help`); mode 0600: it may hold passwords\n{text}")
                        .as_bytes(),
                )?;
                f.sync_all()
            })
            .and_then(|()| std::fs::rename(&aside, path));
        if written.is_err() {
            let _ = std::fs::remove_file(&aside);
        }
        written.map_err(failed)
    }

    /// The context that applies: `chosen` (from `--context` or `METRONOME_CONTEXT`), else
    /// the selected one; `None` when neither names one. A name without a context is a
    /// usage error.
    pub fn active<'a>(
        &'a self,
        chosen: Option<&'a str>,
    ) -> Result<Option<(&'a str, &'a Context)>, CliError> {
        let Some(name) = chosen.or(self.selected.as_deref()) else {
            return Ok(None);
        };
        self.contexts
            .get(name)
            .map(|c| Some((name, c)))
            .ok_or_else(|| {
                CliError::Usage(format!(
                    "no context named {name:?} (`metronome context ls` lists them)"
                ))
            })
    }

    /// `context ls` as a table; `*` marks the selected context.
    pub fn table(&self) -> String {
        if self.contexts.is_empty() {
            return "no contexts saved (`metronome context add NAME --server URL`)\n".into();
        }
        let mut out = format!(
            "  {:<16} {:<28} {:<30} {:<24} DESCRIPTION\n",
            "NAME", "NATS", "AUTH", "GATEWAY"
        );
        for (name, c) in &self.contexts {
            let mark = if self.selected.as_deref() == Some(name) {
                '*'
            } else {
                ' '
            };
            out.push_str(&format!(
                "{mark} {:<16} {:<28} {:<30} {:<24} {}\n",
                name,
                c.nats_url.as_deref().unwrap_or("-"),
                c.auth_summary(),
                c.gateway_url.as_deref().unwrap_or("-"),
                c.description.as_deref().unwrap_or("")
            ));
        }
        out
    }

    /// `context ls --json`: every context, passwords replaced.
    pub fn shown(&self) -> Contexts {
        Contexts {
            selected: self.selected.clone(),
            contexts: self
                .contexts
                .iter()
                .map(|(n, c)| (n.clone(), c.shown()))
                .collect(),
        }
    }
}

/// `context show` as text: one `key: value` line per setting, the password replaced.
pub fn render(name: &str, selected: bool, c: &Context, path: &Path) -> String {
    let shown = c.shown();
    let mut out = format!(
        "context:  {name}{}\nfile:     {}\n",
        if selected { " (selected)" } else { "" },
        path.display()
    );
    let table = toml::Table::try_from(&shown).unwrap_or_default();
    for (k, v) in &table {
        let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
        out.push_str(&format!("{:<9} {v}\n", format!("{k}:")));
    }
    out
}

/// A relative path made absolute (from the current folder), so the context works from
/// anywhere.
pub fn absolute(path: PathBuf) -> PathBuf {
    if path.is_absolute() {
        return path;
    }
    std::env::current_dir()
        .map(|cwd| cwd.join(&path))
        .unwrap_or(path)
}

fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            eprintln!(
                "metronome: warning: {} is readable by others (mode {mode:o}) and may hold passwords: chmod 600 it",
                path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_file_is_under_xdg_config_home_or_home() {
        assert_eq!(
            file_path(&lookup(&[("XDG_CONFIG_HOME", "/x"), ("HOME", "/h")])),
            Some(PathBuf::from("/x/metronome/contexts.toml"))
        );
        assert_eq!(
            file_path(&lookup(&[("XDG_CONFIG_HOME", ""), ("HOME", "/h")])),
            Some(PathBuf::from("/h/.config/metronome/contexts.toml"))
        );
        assert_eq!(file_path(&lookup(&[])), None);
    }

    #[test]
    fn saved_with_mode_0600_and_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metronome").join(FILE_NAME);
        let mut contexts = Contexts::default();
        contexts.contexts.insert(
            "prod".into(),
            Context {
                nats_url: Some("nats://10.0.0.1:4222".into()),
                user: Some("admin".into()),
                password: Some("hunter2".into()),
                ..Context::default()
            },
        );
        contexts.selected = Some("prod".into());
        contexts.save(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700);
        assert_eq!(Contexts::load(&path).unwrap(), contexts);
        assert_eq!(
            Contexts::load(&dir.path().join("none.toml")).unwrap(),
            Contexts::default()
        );
    }

    #[test]
    fn no_listing_shows_a_password() {
        let mut contexts = Contexts::default();
        contexts.contexts.insert(
            "prod".into(),
            Context {
                user: Some("admin".into()),
                password: Some("hunter2".into()),
                ..Context::default()
            },
        );
        let c = &contexts.contexts["prod"];
        for text in [
            contexts.table(),
            serde_json::to_string(&contexts.shown()).unwrap(),
            render("prod", true, c, Path::new("/c.toml")),
        ] {
            assert!(!text.contains("hunter2"), "{text}");
        }
        assert!(render("prod", true, c, Path::new("/c.toml")).contains("<redacted>"));
    }

    #[test]
    fn the_active_context_is_the_chosen_one_else_the_selected_one() {
        let mut contexts = Contexts::default();
        for name in ["a", "b"] {
            contexts.contexts.insert(name.into(), Context::default());
        }
        assert_eq!(contexts.active(None).unwrap(), None);
        contexts.selected = Some("a".into());
        assert_eq!(contexts.active(None).unwrap().unwrap().0, "a");
        assert_eq!(contexts.active(Some("b")).unwrap().unwrap().0, "b");
        assert!(matches!(
            contexts.active(Some("c")),
            Err(CliError::Usage(_))
        ));
    }

    #[test]
    fn inconsistent_settings_are_refused() {
        let both = Context {
            user: Some("admin".into()),
            password: Some("p".into()),
            creds_file: Some("/nonexistent/admin.creds".into()),
            ..Context::default()
        };
        let err = both.check().unwrap_err();
        assert!(err.contains("creds_file"), "{err}");
        let bad_url = Context {
            nats_url: Some("http://x:1".into()),
            gateway_url: Some("x:8080".into()),
            ..Context::default()
        };
        let err = bad_url.check().unwrap_err();
        assert!(
            err.contains("nats_url") && err.contains("gateway_url"),
            "{err}"
        );
        assert!(check_name("prod-eu.1").is_ok());
        assert!(check_name("a b").is_err());
    }
}
