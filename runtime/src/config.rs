//! Loading configuration, the same way in every binary: a TOML file (every key optional),
//! then overrides from the environment and the command line, then each binary's own
//! validation into [`FieldError`]s.
//!
//! Each binary keeps its typed configuration struct and its checks; what is shared is the
//! plumbing: reading and parsing the file with its path in the error ([`read_file`],
//! [`file_or_default`]), the field error type, and overriding a key from an environment
//! variable or a flag ([`apply_overrides`]; the binary's settings table, [`crate::settings`],
//! names which).
//!
//! An override is applied to the TOML form of the configuration and read back through
//! serde, so a bad value meets the same checks as the file (unknown enum variants, integer
//! ranges) and the error names the variable or flag it came from. The text of an override
//! takes the type of the key's current value: `8` stays text for a text key and becomes a
//! number for a numeric one. An empty value counts as unset, as in most shells' idiom
//! `VAR= command`.
//!
//! Environment lookups are a function argument, so tests never touch the process
//! environment.

use std::fmt;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// One invalid configuration field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field's TOML path (`max_concurrency`, `scheduler.weights.job_cost`, `gpu[1].speed`).
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: String,
        source: Box<toml::de::Error>,
    },
    /// An environment variable or flag whose value the key does not accept.
    #[error("{origin}={value:?} is not valid for {key}: {message}")]
    Override {
        /// `environment variable NATS_URL`, `--max-concurrency`.
        origin: String,
        key: String,
        value: String,
        message: String,
    },
    #[error("invalid configuration:\n{}", .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<FieldError>),
}

/// One value to set: where it came from (for errors), the key, the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    pub origin: String,
    pub key: String,
    pub value: String,
}

impl Override {
    /// A value given on the command line (or through the flag's environment variable).
    pub fn flag(flag: &str, key: &str, value: impl Into<String>) -> Self {
        Override {
            origin: flag.to_string(),
            key: key.to_string(),
            value: value.into(),
        }
    }
}

/// Parse a TOML document; `origin` names it in errors.
pub fn parse_toml<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|source| ConfigError::Parse {
        path: origin.to_string(),
        source: Box::new(source),
    })
}

/// Read and parse a TOML file.
pub fn read_file<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_toml(&text, &path.display().to_string())
}

/// The file's configuration, or the defaults without a file.
pub fn file_or_default<T: DeserializeOwned + Default>(
    path: Option<&Path>,
) -> Result<T, ConfigError> {
    path.map_or_else(|| Ok(T::default()), read_file)
}

/// Set each override's key, in order (a later one wins); empty values are skipped.
pub fn apply_overrides<T: Serialize + DeserializeOwned>(
    config: &mut T,
    overrides: impl IntoIterator<Item = Override>,
) -> Result<(), ConfigError> {
    let overrides: Vec<Override> = overrides
        .into_iter()
        .filter(|o| !o.value.trim().is_empty())
        .collect();
    if overrides.is_empty() {
        return Ok(());
    }
    let invalid = |o: &Override, message: String| ConfigError::Override {
        origin: o.origin.clone(),
        key: o.key.clone(),
        value: o.value.clone(),
        message,
    };
    let mut table = toml::Table::try_from(&*config).map_err(|e| {
        invalid(
            &overrides[0],
            format!("the configuration has no TOML form: {e}"),
        )
    })?;
    for o in &overrides {
        let parts: Vec<&str> = o.key.split('.').collect();
        let (leaf, parents) = parts.split_last().expect("split yields at least one part");
        let current = get(&table, parents, leaf).cloned();
        let text = o.value.trim();
        let mut candidates = vec![typed(current.as_ref(), text).map_err(|m| invalid(o, m))?];
        if current.is_none() {
            // An unset key has no type to follow: `9100` may be a port or a text.
            candidates.push(toml::Value::String(text.to_string()));
        }
        let mut outcome = Err(String::new());
        for value in candidates {
            set(&mut table, parents, leaf, value).map_err(|m| invalid(o, m))?;
            // Read back after each override, so an error names the one that caused it.
            outcome = T::deserialize(toml::Value::Table(table.clone()))
                .map_err(|e| e.message().to_string());
            if outcome.is_ok() {
                break;
            }
        }
        *config = outcome.map_err(|m| invalid(o, m))?;
    }
    Ok(())
}

fn get<'a>(table: &'a toml::Table, parents: &[&str], leaf: &str) -> Option<&'a toml::Value> {
    let mut t = table;
    for p in parents {
        t = t.get(*p)?.as_table()?;
    }
    t.get(leaf)
}

fn set(
    table: &mut toml::Table,
    parents: &[&str],
    leaf: &str,
    value: toml::Value,
) -> Result<(), String> {
    let mut t = table;
    for p in parents {
        t = t
            .entry(*p)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| format!("{p} is not a table"))?;
    }
    t.insert(leaf.to_string(), value);
    Ok(())
}

/// `text` as a value of the type of `current` (text when the key is unset and the text is
/// not a TOML number, boolean, array or table).
fn typed(current: Option<&toml::Value>, text: &str) -> Result<toml::Value, String> {
    let literal = || -> Option<toml::Value> {
        let doc: toml::Table = toml::from_str(&format!("v = {text}")).ok()?;
        doc.get("v").cloned()
    };
    match current {
        Some(toml::Value::String(_)) => Ok(toml::Value::String(text.to_string())),
        Some(toml::Value::Integer(_)) => text
            .parse::<i64>()
            .map(toml::Value::Integer)
            .map_err(|_| "expected an integer".to_string()),
        Some(toml::Value::Float(_)) => text
            .parse::<f64>()
            .map(toml::Value::Float)
            .map_err(|_| "expected a number".to_string()),
        Some(toml::Value::Boolean(_)) => text
            .parse::<bool>()
            .map(toml::Value::Boolean)
            .map_err(|_| "expected true or false".to_string()),
        Some(_) => literal().ok_or_else(|| "expected a TOML value".to_string()),
        None => Ok(literal()
            .filter(|v| !matches!(v, toml::Value::Datetime(_)))
            .unwrap_or_else(|| toml::Value::String(text.to_string()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{apply_env, Setting};
    use serde::Deserialize;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Inner {
        ratio: f64,
    }

    impl Default for Inner {
        fn default() -> Self {
            Inner { ratio: 0.5 }
        }
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Mode {
        Fast,
        Careful,
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Sample {
        url: String,
        id: String,
        limit: u32,
        port: Option<u16>,
        addr: Option<String>,
        on: bool,
        mode: Mode,
        inner: Inner,
    }

    impl Default for Sample {
        fn default() -> Self {
            Sample {
                url: "nats://127.0.0.1:4222".into(),
                id: "a".into(),
                limit: 4,
                port: None,
                addr: None,
                on: false,
                mode: Mode::Fast,
                inner: Inner { ratio: 0.5 },
            }
        }
    }

    const VARS: [Setting; 8] = [
        Setting::new("url", "url", "V", "").env("URL"),
        Setting::new("id", "id", "V", "").env("ID"),
        Setting::new("limit", "limit", "V", "").env("LIMIT"),
        Setting::new("port", "port", "V", "").env("PORT"),
        Setting::new("addr", "addr", "V", "").env("ADDR"),
        Setting::new("on", "on", "V", "").env("ON"),
        Setting::new("mode", "mode", "V", "").env("MODE"),
        Setting::new("inner.ratio", "inner.ratio", "V", "").env("RATIO"),
    ];

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn each_value_takes_the_type_of_its_key() {
        let mut c = Sample::default();
        apply_env(
            &mut c,
            &VARS,
            env(&[
                ("URL", "nats://10.0.0.1:4222"),
                ("ID", "8"),
                ("LIMIT", "8"),
                ("PORT", "9100"),
                ("ADDR", "9091"),
                ("ON", "true"),
                ("MODE", "careful"),
                ("RATIO", "2"),
            ]),
        )
        .unwrap();
        assert_eq!(
            c,
            Sample {
                url: "nats://10.0.0.1:4222".into(),
                id: "8".into(),
                limit: 8,
                port: Some(9100),
                addr: Some("9091".into()),
                on: true,
                mode: Mode::Careful,
                inner: Inner { ratio: 2.0 },
            }
        );
    }

    #[test]
    fn empty_or_absent_values_change_nothing() {
        let mut c = Sample::default();
        apply_env(&mut c, &VARS, env(&[("URL", ""), ("LIMIT", "  ")])).unwrap();
        assert_eq!(c, Sample::default());
    }

    #[test]
    fn a_bad_value_names_its_origin_and_key() {
        for (var, value, needle) in [
            ("LIMIT", "many", "expected an integer"),
            ("LIMIT", "-1", "invalid value"),
            ("MODE", "fastest", "unknown variant"),
            ("ON", "yes", "expected true or false"),
        ] {
            let mut c = Sample::default();
            let e = apply_env(&mut c, &VARS, env(&[(var, value)])).unwrap_err();
            let text = e.to_string();
            assert!(
                text.starts_with(&format!(
                    "environment variable {var}={value:?} is not valid for"
                )),
                "{text}"
            );
            assert!(text.contains(needle), "{text}");
            assert_eq!(c, Sample::default(), "nothing applied on error");
        }
    }

    #[test]
    fn a_flag_overrides_the_environment_when_applied_after_it() {
        let mut c = Sample::default();
        apply_env(&mut c, &VARS, env(&[("LIMIT", "8")])).unwrap();
        apply_overrides(&mut c, [Override::flag("--limit", "limit", "16")]).unwrap();
        assert_eq!(c.limit, 16);
    }

    #[test]
    fn files_parse_with_their_path_in_errors() {
        let dir = std::env::temp_dir().join(format!("metronome-runtime-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, "limit = 2\n[inner]\nratio = 0.25\n").unwrap();
        let c: Sample = file_or_default(Some(&good)).unwrap();
        assert_eq!((c.limit, c.inner.ratio, c.id.as_str()), (2, 0.25, "a"));
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "limitt = 2\n").unwrap();
        let e = file_or_default::<Sample>(Some(&bad))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(&format!("parsing {}", bad.display())), "{e}");
        let missing = dir.join("missing.toml");
        let e = file_or_default::<Sample>(Some(&missing))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("reading {}", missing.display())),
            "{e}"
        );
        assert_eq!(file_or_default::<Sample>(None).unwrap(), Sample::default());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn field_errors_read_path_then_message() {
        let errors = [FieldError::new("a.b", "bad"), FieldError::new("c", "worse")];
        assert_eq!(errors[0].to_string(), "a.b: bad");
        assert_eq!(
            ConfigError::Invalid(errors.to_vec()).to_string(),
            "invalid configuration:\n  a.b: bad\n  c: worse"
        );
    }
}
