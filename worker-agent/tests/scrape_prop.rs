//! Properties of the scraper that reads a model server's load: arbitrary input never
//! panics and scraped values stay in their domain. (The SSE and Prometheus parsers
//! themselves are tested in `metronome-protocol`.)

use metronome_worker_agent::metrics_scrape::scrape;
use metronome_worker_agent::ServerKind;
use proptest::prelude::*;

proptest! {
    #[test]
    fn prometheus_text_never_panics_and_kv_stays_a_fraction(text in "\\PC*") {
        for kind in [ServerKind::Vllm, ServerKind::Sglang, ServerKind::Llamacpp, ServerKind::Tgi] {
            if let Some(kv) = scrape(kind, &text).kv {
                prop_assert!((0.0..=1.0).contains(&kv.used_frac));
            }
        }
    }

    #[test]
    fn scraped_gauges_are_read_back(running in 0u32..10_000, waiting in 0u32..10_000, used in 0.0f64..=1.0) {
        let text = format!(
            "vllm:num_requests_running{{model_name=\"m\"}} {running}\nvllm:num_requests_waiting{{model_name=\"m\"}} {waiting}.0\nvllm:kv_cache_usage_perc{{model_name=\"m\"}} {used}\n"
        );
        let load = scrape(ServerKind::Vllm, &text);
        prop_assert_eq!(load.running, Some(running));
        prop_assert_eq!(load.waiting, Some(waiting));
        prop_assert!((load.kv.unwrap().used_frac - used).abs() < 1e-12);
    }
}
