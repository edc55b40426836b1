//! The benchmark's system start survives a port taken between picking it and binding it: a
//! first `./dev up` handed a port another process holds exits, and the system starts on a
//! second try with fresh ports, keeping the failed start's log.
//!
//! Starts a real system (NATS, Redis, dispatcher, gateway, one agent, one simulated GPU) from
//! `target/debug`, which `./dev test` builds before the tests run.

use std::path::{Path, PathBuf};

use metronome_loadgen::system::{System, SystemSpec};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the loadgen crate sits in the repository")
        .to_path_buf()
}

#[tokio::test]
async fn a_start_that_finds_its_gateway_port_taken_is_retried_on_a_fresh_port() {
    let repo = repo();
    let bin = repo.join("target/debug");
    for b in [
        "metronome-dispatcher",
        "metronome-gateway",
        "metronome-worker-agent",
        "metronome-gpu-sim",
    ] {
        assert!(
            bin.join(b).exists(),
            "{} is missing: run `cargo build --bins` (./dev test does) first",
            bin.join(b).display()
        );
    }
    // Another process holds the port the first start is handed.
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap().port();
    let tmp = tempfile::tempdir().unwrap();
    let state_dir = tmp.path().join("system");
    let spec = SystemSpec {
        repo,
        gpus: 1,
        model: "sim-model".into(),
        speeds: vec!["1".into()],
        policy: "metronome".into(),
        state_dir: state_dir.clone(),
        sim_args: Vec::new(),
        worker_max_concurrency: None,
        profile: "debug".into(),
        keep_going: false,
        gateway_extra_toml: None,
        nats_cluster: 1,
        first_gateway_port: Some(taken),
    };

    let mut system = System::up(&spec).await.expect("the second start succeeds");

    assert!(
        !system.gateway_url.ends_with(&format!(":{taken}")),
        "the second start took a fresh port, not {taken}: {}",
        system.gateway_url
    );
    let models: serde_json::Value = reqwest::get(format!("{}/v1/models", system.gateway_url))
        .await
        .expect("the gateway answers")
        .json()
        .await
        .expect("/v1/models is JSON");
    assert_eq!(models["data"][0]["id"], "sim-model", "{models}");
    let failed_log = tmp.path().join("system.failed-start.up.log");
    let log = std::fs::read_to_string(&failed_log)
        .unwrap_or_else(|e| panic!("{} kept: {e}", failed_log.display()));
    assert!(
        log.contains(&format!("port {taken} is in use")),
        "the failed start's log says why: {log}"
    );
    system.stop().await;
    drop(holder);
}
