"""How the admin commands talk to a person or a script: tables, sizes, ages, JSON, progress, confirmation."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TextIO

from tiercache.errors import InvalidArgument

# Exit codes of `tiercache admin` (also in its --help).
EXIT_OK = 0
EXIT_NOT_FOUND = 1  # nothing matched: unknown namespace/chain/key, prompt not cached
EXIT_USAGE = 2  # bad arguments or input, or a destructive command without --yes off a terminal
EXIT_UNREACHABLE = 3  # the daemon cannot be reached or did not answer in time
EXIT_FAILED = 4  # the daemon refused or failed the call (auth, permission, full, damaged file, ...)
EXIT_DAMAGED = 5  # verify found damaged blocks (dropped) or a broken store invariant
EXIT_DECLINED = 6  # the operator answered no at the confirmation prompt

EXIT_CODES_HELP = """exit codes:
  0  success
  1  not found: nothing matched (unknown namespace, chain or key; prompt not cached)
  2  usage: bad arguments or input; a destructive command without --yes when stdin is not a terminal
  3  the daemon cannot be reached or did not answer in time
  4  the daemon refused or failed the call (authentication, permission, capacity, damaged input)
  5  verify found damaged blocks (they were dropped) or a broken store invariant
  6  declined at the confirmation prompt"""


class Console:
    """stdout for results, stderr for progress and questions, stdin for answers."""

    def __init__(self, out: TextIO, err: TextIO, inp: TextIO, as_json: bool) -> None:
        self.out, self.err, self.inp = out, err, inp
        self.as_json = as_json

    def print(self, text: str = "") -> None:
        self.out.write(text + "\n")

    def json(self, obj: object) -> None:
        self.out.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    @property
    def live(self) -> bool:
        """Whether progress is drawn: stderr is a terminal and the output is not --json."""
        return self.err.isatty() and not self.as_json

    def progress(self, total: int, label: str) -> Progress:
        return Progress(self.err, total, label, on=self.live)

    def confirm(self, question: str, assume_yes: bool) -> bool:
        """True to go ahead. Without --yes a terminal is asked; anything else is refused with
        InvalidArgument, since a script that forgot --yes must not delete anything."""
        if assume_yes:
            return True
        if not self.inp.isatty():
            raise InvalidArgument(f"{question} — refusing without confirmation: stdin is not a terminal; "
                                  "pass --yes to go ahead")
        self.err.write(f"{question} [y/N] ")
        self.err.flush()
        return self.inp.readline().strip().lower() in ("y", "yes")


class Progress:
    """A progress bar on stderr (tqdm: count, rate, time left), drawn only when `on` (stderr a terminal and
    no --json)."""

    def __init__(self, err: TextIO, total: int, label: str, on: bool | None = None) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=label, unit="block", file=err, leave=True, ascii=" #", ncols=100,
                         bar_format="{desc} [{bar:30}] {n_fmt}/{total_fmt} {elapsed}<{remaining} {rate_fmt}",
                         disable=not (err.isatty() if on is None else on))
        self._done = 0

    def update(self, done: int) -> None:
        self._bar.update(done - self._done)
        self._done = done

    def close(self) -> None:
        self._bar.close()


@contextlib.contextmanager
def waiting(err: TextIO, label: str, on: bool) -> Iterator[None]:
    """While one long call runs (a flush: one rpc that the daemon does whole), `label` and the time so far on
    stderr, redrawn a few times a second; nothing unless `on`."""
    if not on:
        yield
        return
    done = threading.Event()
    start = time.monotonic()

    def draw() -> None:
        while not done.wait(0.2):
            err.write(f"\r{label} {time.monotonic() - start:.1f}s")
            err.flush()

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        err.write(f"\r{label} {time.monotonic() - start:.1f}s, done\n")
        err.flush()


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns at GiB


def _span(seconds: float) -> str:
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if seconds < limit:
            return f"{seconds / div:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


def fmt_age(unix_s: float, now: float | None = None) -> str:
    """ "12s ago", "3m ago", ... or "never" for 0."""
    return f"{_span(max(0.0, (now or time.time()) - unix_s))} ago" if unix_s else "never"


def fmt_until(unix_s: float, now: float | None = None) -> str:
    """ "in 5m", "expired", or "never" for 0."""
    if not unix_s:
        return "never"
    left = unix_s - (now or time.time())
    return f"in {_span(left)}" if left > 0 else "expired"


def fmt_pin(pinned: bool, lapses_at: float, now: float | None = None) -> str:
    """ "no", "yes" (until unpinned), or the time a pin with a TTL has left: "23h left"."""
    if not pinned:
        return "no"
    return f"{_span(max(0.0, lapses_at - (now or time.time())))} left" if lapses_at else "yes"


def fmt_pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def short(key: bytes) -> str:
    """The 12-hex-digit form the commands show and accept for keys, chains and namespaces."""
    return key.hex()[:12]


def quoted(text: str, limit: int = 40) -> str:
    """A preview as one printable line, cut at `limit` characters."""
    flat = text.replace("\n", "\\n").replace("\t", " ")
    return '"' + (flat if len(flat) <= limit else flat[: limit - 1] + "…") + '"' if text else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart, with a header line."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)
