"""A benchmark's printed output as its page in docs/benchmarks/: the command, the machine, the text."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import platform
import sys
import time
from collections.abc import Iterator

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
_IMPORTED = time.time()  # the scripts import this module first thing: about when their run began
_LOAD_AT_IMPORT = os.getloadavg()


def machine() -> str:
    """CPU model, cores, OS and torch version of this machine, in one line."""
    model = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        import torch

        torch_version = f", torch {torch.__version__}"
    except ImportError:
        torch_version = ""
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}{torch_version}"


class _Tee(io.TextIOBase):
    def __init__(self, out: io.TextIOBase) -> None:
        self.out, self.parts = out, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def recorded(path: str | None, title: str) -> Iterator[None]:
    """Within the block, what the script prints also goes to the markdown page `path` (no-op
    without one): its title, the command that ran, the machine, the date and load, the output."""
    if not path:
        yield
        return
    tee, started, load = _Tee(sys.stdout), _IMPORTED, _LOAD_AT_IMPORT  # type: ignore[arg-type]
    sys.stdout = tee  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = tee.out  # type: ignore[assignment]
    root = str(DOCS.parent.parent) + "/"
    command = " ".join(["python3", *[a.removeprefix(root) for a in sys.argv if a]])  # paths as from the checkout
    text = (f"# {title}\n\nWritten by `{command}`; every figure below was printed by that run.\n\n"
            f"- machine: {machine()}\n- run: {time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))} UTC, "
            f"{time.time() - started:.0f} s; load average at start {load[0]:.1f}\n\n"
            f"```\n{''.join(tee.parts).rstrip()}\n```\n")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(text)
