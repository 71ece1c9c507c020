//! The client's Prometheus metrics against a real dmkvd: the counters move
//! by exactly the GETs made, and `promtool check metrics` accepts the text.

use dmkv_client::{Client, ClientConfig, ReadPath};
use dmkv_tests::ServerProcess;
use dmkv_tests::prom::{promtool_check, samples};
use prometheus_client::registry::Registry;

fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

#[tokio::test]
async fn client_metrics_count_one_sided_and_rpc_gets_exactly() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    // A fixed one-sided path: no probes, so every count below is exact.
    let cfg = ClientConfig::default().read_path(ReadPath::OneSided).pool_size(1);
    let client = Client::connect_with(&srv.rpc, cfg).await.unwrap();
    for i in 0..10 {
        client.put(format!("k{i}"), "v").await.unwrap();
    }
    let mut registry = Registry::default();
    client.register_metrics(&mut registry);
    let before = samples(&encode(&registry));
    for name in [
        "dmkv_client_gets_total{path=\"one_sided\"}",
        "dmkv_client_gets_total{path=\"rpc\"}",
        "dmkv_client_one_sided_retries_total{cause=\"torn\"}",
        "dmkv_client_rpc_fallbacks_total",
        "dmkv_client_path_switches_total",
        "dmkv_client_path_window{path=\"rpc\"}",
        "dmkv_client_path_delay_seconds{path=\"one_sided\"}",
        "dmkv_client_path_requests_total{path=\"one_sided\"}",
        "dmkv_client_path_failures_total{path=\"rpc\"}",
    ] {
        assert!(before.contains_key(name), "{name} missing from:\n{before:#?}");
    }

    for i in 0..7 {
        assert!(client.get(format!("k{i}")).await.unwrap().is_some());
    }
    assert_eq!(client.get("absent").await.unwrap(), None);
    for i in 0..3 {
        assert!(client.rpc_get(format!("k{i}").as_bytes()).await.unwrap().is_some());
    }
    let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
    client.rpc_multi_get(&keys).await.unwrap();

    let text = encode(&registry);
    let after = samples(&text);
    let moved = |name: &str| after[name] - before[name];
    assert_eq!(moved("dmkv_client_gets_total{path=\"one_sided\"}"), 8.0, "{text}");
    assert_eq!(moved("dmkv_client_gets_total{path=\"rpc\"}"), 3.0 + 5.0, "{text}");
    // Explicit RPC reads bypass the path controller; one-sided GETs do not.
    assert_eq!(moved("dmkv_client_path_requests_total{path=\"one_sided\"}"), 8.0, "{text}");
    assert_eq!(moved("dmkv_client_path_requests_total{path=\"rpc\"}"), 0.0, "{text}");
    assert_eq!(moved("dmkv_client_rpc_fallbacks_total"), 0.0, "{text}");
    assert_eq!(moved("dmkv_client_path_failures_total{path=\"one_sided\"}"), 0.0, "{text}");
    assert!(after["dmkv_client_path_delay_seconds{path=\"one_sided\"}"] > 0.0, "{text}");
    assert!(after["dmkv_client_path_window{path=\"one_sided\"}"] > 0.0, "{text}");
    // The server saw only the RPC reads: the reason these metrics exist.
    assert_eq!(client.stats().await.unwrap()["gets"], 3 + 5);
    promtool_check("client_metrics_count_one_sided_and_rpc_gets_exactly", &text);

    // Two clients in one registry keep apart by a label of their own.
    let mut labelled = Registry::default();
    client.register_metrics(labelled.sub_registry_with_label(("client".into(), "a".into())));
    client.register_metrics(labelled.sub_registry_with_label(("client".into(), "b".into())));
    let both = samples(&encode(&labelled));
    for c in ["a", "b"] {
        let series = format!("dmkv_client_gets_total{{client=\"{c}\",path=\"rpc\"}}");
        assert_eq!(both.get(&series), Some(&8.0), "{series} in {both:#?}");
    }

    // The registry does not keep the client alive; its series go with it.
    drop(client);
    let gone = encode(&registry);
    assert!(!gone.contains("dmkv_client_gets_total"), "{gone}");
}
