"""Prometheus's text format as server/metrics.py writes it (fast: no model), read back with the
small parser the live test uses (metrics_text.py), and what serve's metric set makes of a job."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from metrics_text import parse, samples

from localinfer.engine.decode import Stats
from localinfer.server.metrics import CONTENT_TYPE, Registry, escape_label
from localinfer.server.served_metrics import Loaded, ServedMetrics
from localinfer.server.worker import Load


def test_counter_and_gauge_lines_with_help_and_type():
    r = Registry()
    c = r.counter("x_total", "Things.\nSecond line \\ backslash.", ("kind",))
    g = r.gauge("y", "Now.")
    c.inc("a")
    c.inc("a", amount=2)
    c.inc("b", amount=0.5)
    g.set(value=7)
    text = r.render()
    assert text.splitlines() == [
        "# HELP x_total Things.\\nSecond line \\\\ backslash.", "# TYPE x_total counter",
        'x_total{kind="a"} 3', 'x_total{kind="b"} 0.5', "# HELP y Now.", "# TYPE y gauge", "y 7"]
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


@pytest.mark.parametrize("raw, written", [
    ('say "hi"', 'say \\"hi\\"'), ("a\\b", "a\\\\b"), ("two\nlines", "two\\nlines"),
    ('\\"\n', '\\\\\\"\\n'), ("plain/path ünï", "plain/path ünï")])
def test_label_values_escaped_and_read_back(raw, written):
    assert escape_label(raw) == written
    r = Registry()
    r.counter("c_total", "C.", ("v",)).inc(raw)
    assert samples(parse(r.render()), "c_total") == {(("v", raw),): 1}


def test_histogram_buckets_cumulative_with_sum_count_and_inf():
    r = Registry()
    h = r.histogram("lat_seconds", "Latency.", (0.1, 1, 0.5), ("model",))
    for v in (0.05, 0.1, 0.3, 0.7, 3.0):
        h.observe("m", value=v)
    h.observe("m", value=0.2, times=4)      # a request's 4 later tokens at their mean
    h.observe("m", value=9.0, times=0)      # nothing observed
    families = parse(r.render())
    assert families["lat_seconds"]["type"] == "histogram"
    buckets = samples(families, "lat_seconds_bucket")
    le = {dict(k)["le"]: v for k, v in buckets.items()}
    assert list(le) == ["0.1", "0.5", "1", "+Inf"]         # in order, bounds sorted
    assert le == {"0.1": 2, "0.5": 7, "1": 8, "+Inf": 9}
    assert samples(families, "lat_seconds_count") == {(("model", "m"),): 9}
    assert samples(families, "lat_seconds_sum")[(("model", "m"),)] == pytest.approx(
        0.05 + 0.1 + 0.3 + 0.7 + 3.0 + 0.8)


def test_wrong_labels_negative_counts_and_twice_registered_refused():
    r = Registry()
    c = r.counter("c_total", "C.", ("a",))
    with pytest.raises(ValueError):
        c.inc()
    with pytest.raises(ValueError):
        c.inc("x", amount=-1)
    with pytest.raises(ValueError):
        r.gauge("c_total", "again")
    with pytest.raises(ValueError):
        r.histogram("h", "H.", (1,), ("le",))


def test_updates_from_threads_all_counted():
    r = Registry()
    c = r.counter("c_total", "C.")
    h = r.histogram("h", "H.", (1,))

    def work():
        for _ in range(2000):
            c.inc()
            h.observe(value=0.5)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    families = parse(r.render())
    assert samples(families, "c_total") == {(): 8000}
    assert samples(families, "h_count") == {(): 8000}


def _job(prompt=10, cached=4, generated=5, decode_s=0.4, finish="stop", error=None):
    stats = Stats(prompt_tokens=prompt, cached_tokens=cached, generated_tokens=generated,
                  decode_s=decode_s, finish_reason=finish)
    return SimpleNamespace(stats=stats, error=error)


def test_a_generation_counted_and_timed():
    m = ServedMetrics()
    m.generation("smol", _job(), seconds=1.5)
    m.generation("smol", _job(generated=0, decode_s=0, finish="", prompt=3, cached=0), 0.1)
    m.generation("smol", _job(generated=2, error="boom"), seconds=1.0)
    f = parse(m.render([]))
    key = (("model", "smol"),)
    assert samples(f, "localinfer_prompt_tokens_total") == {key: 23}
    assert samples(f, "localinfer_prompt_tokens_cached_total") == {key: 8}
    assert samples(f, "localinfer_generated_tokens_total") == {key: 7}
    assert samples(f, "localinfer_generations_total") == {
        (("model", "smol"), ("finish", "stop")): 1, (("model", "smol"), ("finish", "cancelled")): 1,
        (("model", "smol"), ("finish", "error")): 1}
    # a first token came for two of them: at 1.5 - 0.4 s and 1.0 - 0.4 s
    assert samples(f, "localinfer_time_to_first_token_seconds_count") == {key: 2}
    assert samples(f, "localinfer_time_to_first_token_seconds_sum")[key] == pytest.approx(1.7)
    # 4 + 1 later tokens, at 0.1 s and 0.4 s each
    assert samples(f, "localinfer_time_per_output_token_seconds_count") == {key: 5}
    assert samples(f, "localinfer_time_per_output_token_seconds_sum")[key] == pytest.approx(0.8)


def test_requests_by_endpoint_and_status_unknown_paths_share_a_label():
    m = ServedMetrics()
    known = frozenset({"/v1/models"})
    for path, status in (("/v1/models", 200), ("/v1/models", 401), ("/nope", 404),
                         ("/other/typo", 404), ("/v1/models", 0)):
        m.request(path, status, known)
    got = samples(parse(m.render([])), "localinfer_requests_total")
    assert got == {(("endpoint", "/v1/models"), ("status", "200")): 1,
                   (("endpoint", "/v1/models"), ("status", "401")): 1,
                   (("endpoint", "/v1/models"), ("status", "none")): 1,
                   (("endpoint", "other"), ("status", "404")): 2}


def test_gauges_read_from_the_loaded_models_at_each_scrape():
    m = ServedMetrics()
    worker = SimpleNamespace(load=lambda: Load(waiting=2, running=3, cells_used=300, cells=2048))
    f = parse(m.render([Loaded("a", worker, ram=100, vram=50), Loaded("b", worker)]))
    assert samples(f, "localinfer_models_loaded") == {(): 2}
    assert samples(f, "localinfer_queue_depth") == {(("model", "a"),): 2, (("model", "b"),): 2}
    assert samples(f, "localinfer_running_sequences")[(("model", "a"),)] == 3
    assert samples(f, "localinfer_kv_cells_used")[(("model", "b"),)] == 300
    assert samples(f, "localinfer_kv_cells")[(("model", "b"),)] == 2048
    assert samples(f, "localinfer_model_memory_bytes")[(("model", "a"), ("memory", "gpu"))] == 50
    # "b" unloaded: its series go with it
    f = parse(m.render([Loaded("a", worker)]))
    assert set(samples(f, "localinfer_queue_depth")) == {(("model", "a"),)}
    assert samples(f, "localinfer_models_loaded") == {(): 1}
