"""The `tiercache` command: a small dispatcher of subcommands (serve here; worker and admin register alongside)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from tiercache.config import load_config
from tiercache.entry import common_options, setup_logging
from tiercache.errors import AlreadyRunning, TierCacheError

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_ALREADY_RUNNING = 3
EXIT_BROKEN_PIPE = 1
EXIT_INTERRUPTED = 130  # what a shell reports for a process ended by SIGINT


def _token(value: str) -> tuple[str, str]:
    token, sep, tenant = value.partition("=")
    if not sep or not token or not tenant:
        raise argparse.ArgumentTypeError(f"expected TOKEN=TENANT, got {value!r}")
    return token, tenant


def _serve(args: argparse.Namespace) -> int:
    overrides: list[tuple[str, object]] = []
    if args.socket is not None:
        overrides.append(("server.socket", args.socket))
    if args.data_dir is not None:
        overrides.append(("data_dir", args.data_dir))
    if args.listen is not None:
        overrides.append(("server.listen", args.listen))
    if args.token:
        overrides.append(("server.tokens", dict(args.token)))
    if args.metrics_port is not None:
        overrides.append(("server.metrics_port", args.metrics_port))
    config = load_config(args.config, overrides=overrides)
    from server.main import serve  # the one upward import: the entry point starts the daemon

    return serve(config)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("serve", parents=[common_options()], help="run the cache daemon until SIGTERM/SIGINT")
    p.add_argument("--config", metavar="FILE", help="TOML config file (then TIERCACHE_* variables, then these flags)")
    p.add_argument("--socket", metavar="PATH", help="Unix socket to listen on (server.socket)")
    p.add_argument("--data-dir", metavar="DIR", help="directory of the disk tier and the lock (data_dir)")
    p.add_argument("--listen", metavar="HOST:PORT", help="also listen on TCP; needs --token (server.listen)")
    p.add_argument("--token", metavar="TOKEN=TENANT", type=_token, action="append",
                   help="accept this bearer token as TENANT (repeatable; server.tokens)")
    p.add_argument("--metrics-port", metavar="N", type=int,
                   help="serve Prometheus metrics on http://HOST:N/metrics, HOST being server.metrics_host "
                        "(127.0.0.1 unless the config opens it) (server.metrics_port; default off)")
    p.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiercache", description="Tiered KV-cache offload service.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands)
    from tiercache.worker.cli import add_worker_command

    add_worker_command(commands, [common_options()])
    from tiercache.api.cli import add_api_command

    add_api_command(commands, [common_options()])
    from tiercache.admin import add_admin_command

    add_admin_command(commands, [common_options("WARNING")])  # a tool's stderr is for its own messages
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        setup_logging(getattr(args, "log_level", None), getattr(args, "default_log_level", "INFO"))
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader that went away is caught
        return code
    except AlreadyRunning as e:
        print(f"tiercache: {e}", file=sys.stderr)
        return EXIT_ALREADY_RUNNING
    except (ValueError, TierCacheError) as e:  # config and argument errors name the bad field
        print(f"tiercache: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C: what was running has cleaned up on its way out
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail too
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
