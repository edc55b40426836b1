//! A short Poisson load against an in-process simulated GPU: the load generator and the
//! simulator agree on every request's prompt and output token counts.

use metronome_gpu_sim::{SimGpu, SimGpuConfig};
use metronome_loadgen::{run_load, write_outputs, LengthDist, LoadSpec, Workload};
use tokio_util::sync::CancellationToken;

/// A simulated GPU serving `sim-model` with 1 ms steps, until `shutdown`.
async fn fast_gpu(shutdown: &CancellationToken) -> SimGpu {
    SimGpu::spawn(
        SimGpuConfig {
            base_step_ms: 1.0,
            ..SimGpuConfig::new("sim-model")
        },
        shutdown.clone(),
    )
    .await
    .expect("simulated GPU starts")
}

#[tokio::test]
async fn poisson_load_against_the_simulator() {
    let shutdown = CancellationToken::new();
    let gpu = fast_gpu(&shutdown).await;
    let spec = LoadSpec {
        base_url: format!("{}/v1", gpu.base_url()),
        model: "sim-model".into(),
        limit: Some(20),
        seed: 7,
        workload: Workload::Poisson {
            rate_rps: 40.0,
            prompt_tokens: "uniform:16,256".parse::<LengthDist>().unwrap(),
            output_tokens: "uniform:4,24".parse::<LengthDist>().unwrap(),
        },
        ..LoadSpec::default()
    };
    let result = run_load(spec, false).await.unwrap();
    let s = &result.summary;
    assert_eq!(
        (s.count, s.ok, s.errors),
        (20, 20, 0),
        "{:#?}",
        result.records
    );
    for r in &result.records {
        assert_eq!(r.status, Some(200));
        assert!(r.usage_reported, "the simulator reports usage");
        assert_eq!(
            r.output_tokens, r.max_tokens,
            "ignore_eos gives exactly max_tokens"
        );
        assert!(r.ttft_ms.unwrap() <= r.e2e_ms.unwrap());
    }
    let stats = gpu.stats();
    let prompt_sum: u64 = result
        .records
        .iter()
        .map(|r| u64::from(r.prompt_tokens))
        .sum();
    let output_sum: u64 = result
        .records
        .iter()
        .map(|r| u64::from(r.output_tokens))
        .sum();
    assert_eq!(
        stats.prompt_tokens_total, prompt_sum,
        "metronome_prompt_tokens is honoured"
    );
    assert_eq!(stats.generation_tokens_total, output_sum);
    assert_eq!(s.tokens_per_s.n, 20);

    let dir = tempfile::tempdir().unwrap();
    write_outputs(dir.path(), &result).unwrap();
    shutdown.cancel();
    gpu.join().await;
}

/// A shared-system-prompt load, one request at a time, against the simulator: every
/// request after its group's first finds the group's system prompt in the simulator's
/// prefix cache, exactly as its blocks hash (the load generator's text and count agree
/// with the simulator's tokenisation), and a prefix-free load of the same lengths finds
/// nothing.
#[tokio::test]
async fn shared_prefix_load_hits_the_simulators_prefix_cache() {
    let shutdown = CancellationToken::new();
    let gpu = fast_gpu(&shutdown).await;
    let spec = LoadSpec {
        base_url: format!("{}/v1", gpu.base_url()),
        model: "sim-model".into(),
        seed: 7,
        // One at a time (20 ms apart, each done in a few ms): every group's first request
        // has its prompt cached before the next of the group arrives.
        workload: Workload::SharedPrefix {
            rate_rps: 50.0,
            groups: 3,
            users_per_group: 4,
            prefix_tokens: 320,
            question_tokens: LengthDist::Fixed(20),
            output_tokens: LengthDist::Fixed(4),
        },
        ..LoadSpec::default()
    };
    let plan = metronome_loadgen::plan_requests(&spec).unwrap();
    let result = run_load(spec, false).await.unwrap();
    assert_eq!(result.summary.ok, 12, "{:#?}", result.records);
    let stats = gpu.stats();
    let prompts: u64 = plan.iter().map(|r| u64::from(r.prompt_tokens)).sum();
    assert_eq!(stats.prompt_tokens_total, prompts);
    assert_eq!(stats.prefix_cache_queries_total, prompts);
    // 9 requests reuse their group's system message: its 324 tokens (content and
    // template), whole 16-token blocks of them: 320, then the next block holds the user
    // message's start (template and nonce words, the same for every request of the run).
    let hits = stats.prefix_cache_hits_total;
    assert!(
        (9 * 320..=9 * 336).contains(&hits),
        "hits {hits} of {prompts} queried"
    );
    shutdown.cancel();
    gpu.join().await;
}
