//! docs/CONFIG.md documents every key of the `[scheduler]` table with its default; this
//! test reads the table and compares it with `SchedulerConfig::default()`, so the reference
//! cannot drift from the code.

use std::collections::BTreeMap;

use metronome_scheduler::SchedulerConfig;

/// Every leaf key of the default configuration as a dotted path, with its TOML value.
/// Tables that are empty by default (per-model maps) are leaves themselves.
fn flatten(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, String>) {
    for (k, v) in table {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(t) if !t.is_empty() => flatten(&path, t, out),
            toml::Value::Table(_) => {
                out.insert(path, "{}".into());
            }
            other => {
                out.insert(path, other.to_string());
            }
        }
    }
}

/// The `| key | default | meaning |` rows of the scheduler section of docs/CONFIG.md.
fn documented() -> BTreeMap<String, String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CONFIG.md");
    let text = std::fs::read_to_string(path).expect("docs/CONFIG.md");
    let section = text
        .split("\n## ")
        .find(|s| s.starts_with("Scheduler"))
        .expect("a Scheduler section");
    section
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            // ["", "`key`", "`default`", "meaning", ""]
            let key = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            let default = cells.get(2)?.strip_prefix('`')?.strip_suffix('`')?;
            Some((key.to_string(), default.to_string()))
        })
        .collect()
}

#[test]
fn the_scheduler_reference_lists_every_key_with_its_default() {
    let table = toml::Table::try_from(SchedulerConfig::default()).expect("TOML form");
    let mut code = BTreeMap::new();
    flatten("", &table, &mut code);
    let docs = documented();
    assert!(code.len() > 20, "{code:?}");
    for (key, default) in &code {
        assert_eq!(
            docs.get(key),
            Some(default),
            "docs/CONFIG.md: `{key}` should be listed with default `{default}`"
        );
    }
    for key in docs.keys() {
        assert!(
            code.contains_key(key),
            "docs/CONFIG.md lists `{key}`, which SchedulerConfig does not have"
        );
    }
}

/// The documented file form parses: a key path in the table is a key of the TOML table.
#[test]
fn a_documented_table_is_accepted_by_the_dispatcher_format() {
    let text = "[scheduler]\nkv_headroom_frac = 0.1\n[scheduler.weights]\njob_cost = 2.0\n[scheduler.model_slo.\"llama-3.1-8b\"]\nttft_ms = 1000\nmin_tok_s = 40.0\n";
    let c = metronome_cli::replay::config_from_toml(text).expect("valid");
    assert_eq!(c.weights.job_cost, 2.0);
    assert_eq!(c.model_slo["llama-3.1-8b"].ttft_ms, 1000);
}
