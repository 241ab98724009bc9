"""Figures per configuration, the targets of issue 6, and the table (text and Markdown) and plot that publish them."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

MB = 1e6


@dataclass
class Row:
    """One configuration's measurements: the household workload, the prefix probes, memory and restart."""

    key: str
    label: str
    results: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    probes: list[dict] = field(default_factory=list)
    cache_rss: str = "n/a"
    peak_bytes: int | None = None  # the peak in cache_rss, to pick the largest of several rounds
    cache_cpu: str = "n/a"  # the cache process's name when cpu_s is measured, else why there is no figure
    cpu_s: float | None = None  # that process's CPU seconds over the household workload (see Bench.phase)
    survives: str = "n/a"
    note: str = ""
    skipped: str = ""  # why the row did not run
    views: bool = False  # its fetch hands back views into the daemon's slab, not bytes of its own

    def ttfts(self) -> list[float]:
        return [r["ttft_s"] for r in self.results]

    def ttft_ms(self, q: float) -> float:
        return percentile(self.ttfts(), q) * 1e3 if self.results else math.nan

    def reused(self) -> tuple[int, int]:
        return sum(r["cached_tokens"] for r in self.results), sum(r["prompt_tokens"] for r in self.results)

    def prompt_tokens_per_s(self) -> float:
        return self.reused()[1] / self.wall_s if self.wall_s else math.nan

    def _timed(self) -> list[dict]:
        """Every request the table's fetch figures pool: the household's and the counted probes'."""
        return self.results + [p for p in self.probes if p["kind"] == "probe"]

    def fetch_bytes_per_s(self) -> float:
        """Bytes fetched / seconds inside fetch(): a view (zero-copy) row's fetch ends elsewhere than
        the others', so it has no figure here (see ready_bytes_per_s)."""
        if self.views:
            return math.nan
        return self.raw_fetch_bytes_per_s()

    def raw_fetch_bytes_per_s(self) -> float:
        nbytes = sum(r["fetch_bytes"] for r in self._timed())
        seconds = sum(r["fetch_s"] for r in self._timed())
        return nbytes / seconds if nbytes and seconds else math.nan

    def ready_bytes_per_s(self) -> float:
        """Bytes fetched / seconds of fetch() plus the Worker's cache build from them: ends, in every
        row, with the model's KV cache built."""
        nbytes = sum(r["fetch_bytes"] for r in self._timed())
        seconds = sum(r["fetch_s"] + r["build_s"] for r in self._timed())
        return nbytes / seconds if nbytes and seconds else math.nan

    def probe_ms(self, length: int) -> float:
        times = [p["ttft_s"] for p in self.probes if p["kind"] == "probe" and p["prefix"] == length]
        return statistics.median(times) * 1e3 if times else math.nan

    def cpu_cell(self) -> str:
        """The cache process's CPU per household request, ms, and whose it is."""
        if self.cpu_s is None or not self.results:
            return self.cache_cpu
        return f"{self.cpu_s / len(self.results) * 1e3:.1f} ({self.cache_cpu})"

    def tiers_hit(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.results:
            for tier in r["tiers"]:
                counts[tier] = counts.get(tier, 0) + 1
        return counts

    def to_json(self) -> dict:
        reused, prompt = self.reused()
        return {"key": self.key, "label": self.label, "skipped": self.skipped, "ttft_p50_ms": self.ttft_ms(0.5),
                "ttft_p95_ms": self.ttft_ms(0.95), "tokens_reused": reused, "prompt_tokens": prompt,
                "prompt_tokens_per_s": self.prompt_tokens_per_s(), "views": self.views,
                "fetch_bytes_per_s": self.fetch_bytes_per_s(), "ready_bytes_per_s": self.ready_bytes_per_s(),
                "views_fetch_bytes_per_s": self.raw_fetch_bytes_per_s() if self.views else math.nan,
                "cache_rss": self.cache_rss, "cache_cpu": self.cpu_cell(), "cache_cpu_s": self.cpu_s,
                "survives_restart": self.survives, "note": self.note,
                "wall_s": self.wall_s, "tiers_hit": self.tiers_hit(),
                "probe_ttft_ms": {str(p["prefix"]): self.probe_ms(p["prefix"]) for p in self.probes},
                "results": self.results, "probes": self.probes}


def merge_rounds(rounds: list[Row]) -> Row:
    """One configuration's rows from several rounds as one: every request and probe (each marked
    with its round), wall time and CPU summed, the largest peak memory, every restart verdict seen."""
    first = rounds[0]
    skipped = next((r for r in rounds if r.skipped), None)
    if skipped is not None or len(rounds) == 1:
        return skipped or first
    merged = Row(first.key, first.label, cache_cpu=first.cache_cpu, views=first.views)
    for n, row in enumerate(rounds, 1):
        merged.results += [{**r, "round": n} for r in row.results]
        merged.probes += [{**p, "round": n} for p in row.probes]
        merged.wall_s += row.wall_s
    unmeasured = next((r for r in rounds if r.cpu_s is None), None)
    if unmeasured is None:
        merged.cpu_s = sum(r.cpu_s for r in rounds)  # type: ignore[misc]
    else:
        merged.cache_cpu = unmeasured.cache_cpu  # why one round has no figure: then the row has none
    biggest = max(rounds, key=lambda r: -1 if r.peak_bytes is None else r.peak_bytes)
    merged.cache_rss, merged.peak_bytes = biggest.cache_rss, biggest.peak_bytes
    merged.survives = "; ".join(dict.fromkeys(r.survives for r in rounds))
    merged.note = "; ".join(dict.fromkeys(r.note for r in rounds if r.note))
    return merged


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 1]): an observed value, honest for small samples."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _fmt(x: float, digits: int = 0) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def _ratio(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.1f}x" if x < 100 else f"{x:,.0f}x"


def table(rows: list[Row], lengths: list[int]) -> tuple[list[str], list[list[str]]]:
    """Header and cells: one line per configuration, ratios against the no-cache row of the same run."""
    base = next((r for r in rows if r.key == "none" and not r.skipped), None)
    header = ["configuration", "TTFT p50 ms", "TTFT p95 ms", "p50 speedup", "tokens reused", "prompt tok/s",
              "KV fetch MB/s", "KV fetch+build MB/s", "cache CPU ms/req", "cache peak RSS", "survives restart"
              ] + [f"TTFT@{n} ms" for n in lengths]
    cells = []
    for row in rows:
        if row.skipped:
            cells.append([row.label, f"skipped: {row.skipped}"] + [""] * (len(header) - 2))
            continue
        reused, prompt = row.reused()
        speedup = base.ttft_ms(0.5) / row.ttft_ms(0.5) if base else math.nan
        fetch = "n/a (views)" if row.views else _fmt(row.fetch_bytes_per_s() / MB)
        cells.append([row.label, _fmt(row.ttft_ms(0.5), 1), _fmt(row.ttft_ms(0.95), 1), _ratio(speedup),
                      f"{reused:,} ({100 * reused / prompt:.0f}%)" if prompt else "—",
                      _fmt(row.prompt_tokens_per_s()), fetch, _fmt(row.ready_bytes_per_s() / MB),
                      row.cpu_cell(), row.cache_rss, row.survives] + [_fmt(row.probe_ms(n), 1) for n in lengths])
    return header, cells


def text_table(header: list[str], cells: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def markdown_table(header: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    return "\n".join(lines)


MET, MISSED, NOT_MEASURED = "MET", "MISSED", "NOT MEASURED"


@dataclass(frozen=True)
class Target:
    text: str
    measured: str
    status: str  # MET, MISSED or NOT MEASURED
    ratio: float = math.nan


def per_round(verdicts: list[list[Target]]) -> list[str]:
    """For each target, what every round measured on its own: "3.10x, 2.95x, 3.40x (2 of 3 met)"."""
    out = []
    for same in zip(*verdicts):
        met = sum(t.status == MET for t in same)
        judged = sum(t.status != NOT_MEASURED for t in same)
        out.append(", ".join(_ratio2(t.ratio) for t in same) + f" ({met} of {judged} met)" if judged else "")
    return out


def _ratio2(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}x"


def _judged(text: str, measured: str, ratio: float, met: bool) -> Target:
    if math.isnan(ratio):
        return Target(text, f"not measured ({measured})", NOT_MEASURED)
    return Target(text, measured, MET if met else MISSED, ratio)


def targets(rows: list[Row], longest: int) -> list[Target]:
    """The targets of issue 6, each judged on figures measured in this run, tiercache's side always
    by its copy row (tc-shm): its fetch, like the baselines', ends with the bytes in the caller's memory."""
    by = {r.key: r for r in rows if not r.skipped}
    out = []
    copy = by.get("tc-shm")
    for key, name in (("redis", "Redis"), ("files", "one file per chunk")):
        text = f"tiercache shared-memory KV fetch (copy) >= 3x {name}"
        if copy is None or key not in by:
            out.append(Target(text, "not measured (row not run)", NOT_MEASURED))
            continue
        ours, theirs = copy.fetch_bytes_per_s(), by[key].fetch_bytes_per_s()
        ratio = ours / theirs
        measured = f"{_fmt(ours / MB)} vs {_fmt(theirs / MB)} MB/s = {_ratio2(ratio)}"
        out.append(_judged(text, measured, ratio, ratio >= 3))
    text = "tiercache host-tier TTFT p50 (copy) <= 1.3x in-process cache"
    if copy is None or "inproc" not in by:
        out.append(Target(text, "not measured (row not run)", NOT_MEASURED))
    else:
        ratio = copy.ttft_ms(0.5) / by["inproc"].ttft_ms(0.5)
        out.append(_judged(text, f"{copy.ttft_ms(0.5):.1f} vs {by['inproc'].ttft_ms(0.5):.1f} ms = {_ratio2(ratio)}",
                           ratio, ratio <= 1.3))
    text = f"after a restart, disk-tier TTFT at {longest} tokens >= 10x faster than no cache"
    disk, none = by.get("tc-disk"), by.get("none")
    if disk is None or none is None:
        out.append(Target(text, "not measured (row not run)", NOT_MEASURED))
    else:
        ratio = none.probe_ms(longest) / disk.probe_ms(longest)
        out.append(_judged(text, f"{none.probe_ms(longest):.0f} vs {disk.probe_ms(longest):.1f} ms = {ratio:.1f}x",
                           ratio, ratio >= 10))
    return out


def plot(rows: list[Row], lengths: list[int], path: str, title: str) -> None:
    """TTFT against prefix length, one line per configuration (log scale: no cache is orders slower)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for row in rows:
        if row.skipped:
            continue
        ys = [row.probe_ms(n) for n in lengths]
        if all(math.isnan(y) for y in ys):
            continue
        ax.plot(lengths, ys, marker="o", label=row.label)
    ax.set_xlabel("cached prefix length (tokens)")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_yscale("log")
    ax.set_xticks(lengths)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
