"""`tiercache admin`: see, explain, pin, flush, verify and move what the daemon holds, through its rpcs only."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from tiercache.admin.output import EXIT_CODES_HELP, EXIT_FAILED, EXIT_NOT_FOUND, EXIT_UNREACHABLE, EXIT_USAGE, Console
from tiercache.admin.prompt import add_prompt_options
from tiercache.config import default_socket
from tiercache.errors import DeadlineExceeded, InvalidArgument, NotFound, TierCacheError, Unavailable

DESCRIPTION = """Inspect and manage a running tiercache daemon. Every command talks to the daemon through
its rpcs (never opening its LMDB files) and prints a human table, or JSON with --json."""


@dataclass
class Context:
    """What a command needs: the daemon client, where to print, and its parsed arguments."""

    client: object
    console: Console
    args: argparse.Namespace


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _connection_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("daemon")
    one = where.add_mutually_exclusive_group()
    one.add_argument("--socket", metavar="PATH", help=f"the daemon's Unix socket (default {default_socket()})")
    one.add_argument("--target", metavar="HOST:PORT", help="the daemon over TCP (needs --token)")
    where.add_argument("--token", help="bearer token for TCP (or $TIERCACHE_TOKEN)")
    where.add_argument("--tls-root-cert", metavar="FILE", help="CA certificate of the daemon's TLS certificate")
    where.add_argument("--timeout", type=_seconds, default=30.0, help="seconds for each call (default 30)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    return common


def _block_options(p: argparse.ArgumentParser) -> None:
    which = p.add_argument_group("blocks (one of)")
    which.add_argument("--chain", metavar="ID", help="a chain as `ls` shows it (its whole prefix tree)")
    which.add_argument("--key", metavar="KEY", action="append", help="a block's store key as `ls --blocks` shows it")
    add_prompt_options(p)


def add_admin_command(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Register `admin` and its subcommands; their modules (torch, grpc) load only when one runs."""
    admin = commands.add_parser("admin", parents=parents, help="inspect and manage a running daemon",
                                description=DESCRIPTION, epilog=EXIT_CODES_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    admin.set_defaults(func=run_admin)
    sub = admin.add_subparsers(dest="admin_command", required=True, metavar="SUBCOMMAND")
    shared = [*parents, _connection_options()]

    def add(name: str, func: str, help_text: str, aliases: Sequence[str] = ()) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=shared, help=help_text, description=help_text, aliases=list(aliases),
                           epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(admin_func=func, command_name=name)
        return p

    add("stats", "commands:cmd_stats",
        "per tier capacity, use, hit rate, promotions, evictions; per namespace and tenant")
    p = add("ls", "commands:cmd_ls",
            "namespaces and their prefix chains: model, tokens, tiers, hits, last use, pinned, preview")
    p.add_argument("--namespace", metavar="NS", help="one namespace: digest prefix or model name")
    p.add_argument("--blocks", action="store_true", help="also list every block (store keys for evict/pin --key)")
    p = add("explain", "explain:cmd_explain",
            "which blocks of a prompt are cached on which tier, and why the rest missed", aliases=["inspect"])
    add_prompt_options(p)
    p = add("flush", "commands:cmd_flush",
            "delete blocks: all of yours, or of one tier, namespace or tenant (asks first)")
    p.add_argument("--tier", choices=("gpu", "host", "disk", "remote"),
                   help="only this tier's copies (remote: the cluster shared with other daemons, never flushed "
                        "without this)")
    p.add_argument("--namespace", metavar="NS", help="only this namespace: digest prefix or model name")
    p.add_argument("--tenant", metavar="NAME", help="another tenant's blocks (tenant local only)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p = add("evict", "commands:cmd_evict",
            "remove blocks (and every block chained after them) from every tier (asks first)")
    _block_options(p)
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p = add("pin", "commands:cmd_pin", "pin blocks so that no tier evicts them")
    _block_options(p)
    p.add_argument("--ttl", type=float, default=0.0, metavar="S", help="the pin lapses after S seconds (default never)")
    p = add("unpin", "commands:cmd_pin", "release pins")
    _block_options(p)
    add("verify", "commands:cmd_verify",
        "re-read every block and check its checksum (progress on stderr); drops damaged ones")
    p = add("export", "transfer:cmd_export", "write one namespace's blocks to a safetensors file")
    p.add_argument("--namespace", metavar="NS", help="digest prefix or model name (default: the only namespace)")
    p.add_argument("-o", "--output", metavar="FILE", required=True, help="the file to write")
    p.add_argument("--yes", action="store_true", help="overwrite FILE without asking")
    p = add("import", "transfer:cmd_import",
            "store the blocks of an exported file (tenant local only; overwrites nothing)")
    p.add_argument("file", metavar="FILE", help="a file written by `tiercache admin export`")


def _error(console: Console, code: int, message: str) -> int:
    console.err.write(f"tiercache admin: {message}\n")
    if console.as_json:
        console.json({"error": message, "exit_code": code})
    return code


def run_admin(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
              inp: TextIO | None = None) -> int:
    """Run the parsed admin command; returns its exit code (see EXIT_CODES_HELP)."""
    from tiercache.client import Client

    console = Console(out or sys.stdout, err or sys.stderr, inp or sys.stdin, args.json)
    target = args.target or f"unix:{args.socket or default_socket()}"
    try:
        with Client(target, token=args.token or os.environ.get("TIERCACHE_TOKEN"), timeout_s=args.timeout,
                    tls_root_cert=args.tls_root_cert) as client:
            module, _, name = args.admin_func.partition(":")
            command = getattr(importlib.import_module(f"tiercache.admin.{module}"), name)
            return command(Context(client, console, args))
    except NotFound as e:
        return _error(console, EXIT_NOT_FOUND, str(e))
    except (InvalidArgument, ValueError) as e:
        return _error(console, EXIT_USAGE, str(e))
    except (Unavailable, DeadlineExceeded) as e:
        return _error(console, EXIT_UNREACHABLE,
                      f"cannot reach the daemon at {target} ({e}); is `tiercache serve` running?")
    except TierCacheError as e:
        return _error(console, EXIT_FAILED, f"{type(e).__name__}: {e}")
    except BrokenPipeError:
        raise  # our reader went away: the entry point stops quietly
    except OSError as e:  # a file this command reads or writes (export, import, --prompt-file)
        where = f"{e.filename}: " if e.filename else ""
        return _error(console, EXIT_USAGE, f"{where}{e.strerror or e}")


def main(argv: Sequence[str], out: TextIO | None = None, err: TextIO | None = None, inp: TextIO | None = None) -> int:
    """`tiercache admin ARGV...` with explicit streams (tests, embedding)."""
    import argparse

    from tiercache.entry import common_options, setup_logging

    parser = argparse.ArgumentParser(prog="tiercache")
    add_admin_command(parser.add_subparsers(dest="command", required=True), [common_options("WARNING")])
    args = parser.parse_args(["admin", *argv])
    setup_logging(args.log_level, args.default_log_level)
    return run_admin(args, out, err, inp)
