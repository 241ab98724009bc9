"""The status page of a daemon run alone (on its metrics port), loaded in headless Chromium after real traffic
from a worker; its token rule; and the hour's arithmetic of the readings it is drawn from."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from status_browser import chromium_page
from test_admin import PROMPTS
from test_metrics import free_port

from benchmarks.daemons import running_server, small_config
from tiercache.client import Client
from tiercache.web.board import History, Reading, TierReading, series
from tiercache.worker.model import load_default_model
from tiercache.worker.request import Request, Worker


def run(address: str, prompts: list[str], salt: str = "") -> list:
    loaded = load_default_model()
    worker = Worker(loaded, lambda: Client(address))
    try:
        results = []
        for prompt in prompts:
            results.append(worker.run(Request(tuple(loaded.tokenizer.encode(prompt)), max_new_tokens=1, salt=salt,
                                              preview="" if salt else prompt[:64])))
            worker.drain()
        return results
    finally:
        worker.close()


def test_a_daemon_alone_shows_its_tiers_namespaces_and_requests_on_its_metrics_port(base) -> None:
    port = free_port()
    with running_server(small_config(base, host_pages=256, disk_bytes=64 << 20, metrics_port=port)) as (_, address):
        plain = run(address, [*PROMPTS, PROMPTS[1]])
        salted = run(address, [PROMPTS[0], PROMPTS[0]], salt="alice's secret")
        assert plain[-1].cached_tokens > 0 and salted[-1].cached_tokens > 0
        with chromium_page(f"http://127.0.0.1:{port}/") as page:  # / leads to /status
            assert page.url.endswith("/status")
            assert sorted(c.get_attribute("data-tier") for c in page.query_selector_all(".tier")) == ["disk", "host"]
            rows = {r.query_selector(".preview").inner_text(): r for r in page.query_selector_all("tr.namespace")}
            assert len(rows) == 2 and "salted: hidden" in rows, list(rows)
            shown = next(text for text in rows if text != "salted: hidden")
            assert PROMPTS[0][:20] in shown or PROMPTS[1][:20] in shown, shown
            assert "alice" not in page.content() and PROMPTS[0][:64] not in rows["salted: hidden"].inner_text()
            cached = [int(r.query_selector(".cached").inner_text()) for r in page.query_selector_all("tr.request")]
            # newest first: the salted repeat, the salted first, then the plain ones in reverse
            expected = [r.cached_tokens for r in reversed(plain + salted)]
            assert cached == expected, (cached, expected)
            assert page.inner_text("#summary").startswith("daemon")


def test_with_server_tokens_the_daemons_status_figures_need_one(base) -> None:
    port = free_port()
    config = small_config(base, metrics_port=port, tokens={"tok-alice-0123456789": "alice"})
    with running_server(config) as (_, address):
        run(address, PROMPTS[:1])  # over the Unix socket: tenant "local"
        url = f"http://127.0.0.1:{port}/status.json"
        try:
            urllib.request.urlopen(url, timeout=10)
            raise AssertionError("status.json answered without a token")
        except urllib.error.HTTPError as e:
            assert e.code == 401 and "server.tokens" in json.loads(e.read())["error"]
        asked = urllib.request.Request(url, headers={"Authorization": "Bearer tok-alice-0123456789"})
        with urllib.request.urlopen(asked, timeout=10) as reply:
            figures = json.loads(reply.read())
        assert figures["namespaces"] == []  # alice sees her own namespaces only: she has none
        assert [t["name"] for t in figures["tiers"]] == ["host", "disk"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as page:  # the page holds no data
            assert b"status.js" in page.read()


def test_the_hours_series_are_differences_of_readings() -> None:
    def reading(host_hits: int, misses: int, reused: int, used: int) -> Reading:
        return Reading([TierReading("host", 1000, used, used // 10, host_hits)], misses, reused, 0)

    history = History(interval_s=10, span_s=60)
    for i, r in enumerate([reading(0, 0, 0, 0), reading(6, 2, 96, 100), reading(6, 2, 96, 100),
                           reading(10, 10, 160, 500)]):
        history.record(1000.0 + 10 * i, r)
    history.record(1031.0, reading(99, 99, 999, 999))  # out of turn (1 s after the last): not kept
    points = history.points(1040.0, reading(10, 14, 160, 500))
    s = series(points)
    assert s["hit_rate"] == [0.75, None, 4 / 12, 0.0]  # no lookups in an interval: no rate, not 0
    assert s["tokens_saved"] == [96, 0, 64, 0] and s["fill"]["host"] == [0.1, 0.1, 0.5, 0.5]
    history.record(1100.0, reading(10, 14, 160, 500))  # the readings more than the span (and one interval) old leave
    assert [p.at for p in history.points(1095.0, reading(10, 14, 160, 500))] == [1030.0, 1095.0]
