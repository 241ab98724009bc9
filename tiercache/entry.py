"""What every entry point shares (`tiercache` and `tiercache admin` run in-process): logging setup
and the options every subcommand takes. Only entry points configure logging."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def setup_logging(level: str | None, default: str = "INFO") -> None:
    """Log to stderr at `level`, else $TIERCACHE_LOG_LEVEL, else `default` (entry points only)."""
    name = (level or os.environ.get("TIERCACHE_LOG_LEVEL") or default).upper()
    if not isinstance(logging.getLevelName(name), int):
        raise ValueError(f"unknown log level {name!r}")
    logging.basicConfig(level=name, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def common_options(default_level: str = "INFO") -> argparse.ArgumentParser:
    """Options every subcommand takes (pass as parents=[...] to add_parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level",
                        help=f"DEBUG, INFO, WARNING, ... (default: $TIERCACHE_LOG_LEVEL or {default_level})")
    common.set_defaults(default_log_level=default_level)
    return common
