//! The `metronome-gpu-sim` binary: `--check-config`, field errors, several GPUs in one
//! process, graceful stop on SIGTERM.

use std::process::{Command, Stdio};
use std::time::Duration;

use metronome_testkit::{free_port, wait_for, ChildGuard};

const BIN: &str = env!("CARGO_BIN_EXE_metronome-gpu-sim");

#[test]
fn check_config_prints_the_effective_config() {
    let out = Command::new(BIN)
        .args([
            "--check-config",
            "--seed",
            "7",
            "--gpu",
            "model=llama-3.1-8b,port=8001",
            "--gpu",
            "model=llama-3.1-8b,port=8002,speed=0.5",
        ])
        .env_remove("METRONOME_SIM_GPUS")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8(out.stdout).unwrap();
    let config = metronome_gpu_sim::SimConfig::from_toml(&printed).unwrap();
    assert_eq!(config.gpu.len(), 2);
    assert_eq!(config.gpu[1].speed, 0.5);
    assert!(config.gpu.iter().all(|g| g.seed == 7));
}

#[test]
fn check_config_reports_every_field_error_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sim.toml");
    std::fs::write(
        &path,
        "[[gpu]]\nmodel = \"a\"\nport = 8001\nspeed = 0.0\n[[gpu]]\nmodel = \"b\"\nport = 8001\nkv_capacity_tokens = 4\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .arg("--check-config")
        .arg("--config")
        .arg(&path)
        .env_remove("METRONOME_SIM_GPUS")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    for field in ["gpu[0].speed", "gpu[1].port", "gpu[1].kv_capacity_tokens"] {
        assert!(stderr.contains(field), "{field} not in:\n{stderr}");
    }
    let bad_spec = Command::new(BIN)
        .args(["--check-config", "--gpu", "modle=x"])
        .output()
        .unwrap();
    assert_eq!(bad_spec.status.code(), Some(2));
}

#[tokio::test]
async fn serves_several_gpus_and_stops_on_sigterm() {
    let (a, b) = (free_port(), free_port());
    let mut command = Command::new(BIN);
    command
        .args([
            "--gpu",
            &format!("model=m-a,port={a},base_step_ms=1"),
            "--gpu",
            &format!("model=m-b,port={b},base_step_ms=1,speed=0.5"),
        ])
        .env_remove("METRONOME_SIM_GPUS")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null());
    let mut child = ChildGuard::spawn("metronome-gpu-sim", command).unwrap();
    let http = reqwest::Client::new();
    for (port, model) in [(a, "m-a"), (b, "m-b")] {
        let url = format!("http://127.0.0.1:{port}");
        wait_for(
            "the simulated GPU to answer /health",
            Duration::from_secs(20),
            || async {
                let r = http.get(format!("{url}/health")).send().await.ok()?;
                r.status().is_success().then_some(())
            },
        )
        .await;
        let body: serde_json::Value = http
            .post(format!("{url}/v1/completions"))
            .json(&serde_json::json!({"model": model, "prompt": "x", "max_tokens": 3}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(body["usage"]["completion_tokens"], 3);
    }
    assert!(
        child.signal_and_wait(15, Duration::from_secs(10)),
        "exits on SIGTERM"
    );
}
