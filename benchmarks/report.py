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

    def ttfts(self) -> list[float]:
        return [r["ttft_s"] for r in self.results]

    def ttft_ms(self, q: float) -> float:
        return percentile(self.ttfts(), q) * 1e3 if self.results else math.nan

    def reused(self) -> tuple[int, int]:
        return sum(r["cached_tokens"] for r in self.results), sum(r["prompt_tokens"] for r in self.results)

    def prompt_tokens_per_s(self) -> float:
        return self.reused()[1] / self.wall_s if self.wall_s else math.nan

    def transfer_bytes_per_s(self) -> float:
        nbytes = sum(r["fetch_bytes"] for r in self.results + self.probes)
        seconds = sum(r["fetch_s"] for r in self.results + self.probes)
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
                "prompt_tokens_per_s": self.prompt_tokens_per_s(), "transfer_bytes_per_s": self.transfer_bytes_per_s(),
                "cache_rss": self.cache_rss, "cache_cpu": self.cpu_cell(), "survives_restart": self.survives, "note": self.note,
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
    merged = Row(first.key, first.label, cache_cpu=first.cache_cpu)
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
              "KV transfer MB/s", "cache CPU ms/req", "cache peak RSS", "survives restart"] + [f"TTFT@{n} ms" for n in lengths]
    cells = []
    for row in rows:
        if row.skipped:
            cells.append([row.label, f"skipped: {row.skipped}"] + [""] * (len(header) - 2))
            continue
        reused, prompt = row.reused()
        speedup = base.ttft_ms(0.5) / row.ttft_ms(0.5) if base else math.nan
        cells.append([row.label, _fmt(row.ttft_ms(0.5), 1), _fmt(row.ttft_ms(0.95), 1), _ratio(speedup),
                      f"{reused:,} ({100 * reused / prompt:.0f}%)" if prompt else "—",
                      _fmt(row.prompt_tokens_per_s()), _fmt(row.transfer_bytes_per_s() / MB),
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


@dataclass(frozen=True)
class Target:
    text: str
    measured: str
    status: str  # PASS, MISS or SKIP
    ratio: float = math.nan


def per_round(verdicts: list[list[Target]]) -> list[str]:
    """For each target, what every round measured on its own: "3.10x, 2.95x, 3.40x (2 of 3 met)"."""
    out = []
    for same in zip(*verdicts):
        met = sum(t.status == "PASS" for t in same)
        judged = sum(t.status != "SKIP" for t in same)
        out.append(", ".join(_ratio2(t.ratio) for t in same) + f" ({met} of {judged} met)" if judged else "")
    return out


def _ratio2(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}x"


def targets(rows: list[Row], longest: int) -> list[Target]:
    """The three targets of issue 6, each judged on figures measured in this run."""
    by = {r.key: r for r in rows if not r.skipped}
    out = []
    shm = by.get("tc-shm")
    for key, name in (("redis", "Redis"), ("files", "one file per chunk")):
        text = f"tiercache shared-memory KV transfer >= 3x {name}"
        if shm is None or key not in by:
            out.append(Target(text, "not measured", "SKIP"))
            continue
        ratio = shm.transfer_bytes_per_s() / by[key].transfer_bytes_per_s()
        out.append(Target(text, f"{shm.transfer_bytes_per_s() / MB:,.0f} vs {by[key].transfer_bytes_per_s() / MB:,.0f}"
                                f" MB/s = {ratio:.2f}x", "PASS" if ratio >= 3 else "MISS", ratio))
    text = "tiercache host-tier TTFT p50 <= 1.3x in-process cache"
    if shm is None or "inproc" not in by:
        out.append(Target(text, "not measured", "SKIP"))
    else:
        ratio = shm.ttft_ms(0.5) / by["inproc"].ttft_ms(0.5)
        out.append(Target(text, f"{shm.ttft_ms(0.5):.1f} vs {by['inproc'].ttft_ms(0.5):.1f} ms = {ratio:.2f}x",
                          "PASS" if ratio <= 1.3 else "MISS", ratio))
    text = f"after a restart, disk-tier TTFT at {longest} tokens >= 10x faster than no cache"
    disk, none = by.get("tc-disk"), by.get("none")
    if disk is None or none is None:
        out.append(Target(text, "not measured", "SKIP"))
    else:
        ratio = none.probe_ms(longest) / disk.probe_ms(longest)
        out.append(Target(text, f"{none.probe_ms(longest):.0f} vs {disk.probe_ms(longest):.1f} ms = {ratio:.1f}x",
                          "PASS" if ratio >= 10 else "MISS", ratio))
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
