"""A prompt and a model named on the command line, turned into the block keys a worker would compute."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from tiercache.errors import InvalidArgument
from tiercache.keys import Namespace, block_keys, chain_key

DTYPES = ("float32", "float16", "bfloat16")


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    """--prompt/--prompt-file/--tokens and the options that make a worker's namespace."""
    what = p.add_argument_group("prompt (as a worker would see it)")
    one = what.add_mutually_exclusive_group()
    one.add_argument("--prompt", metavar="TEXT", help="prompt text (tokenized by the model's tokenizer)")
    one.add_argument("--prompt-file", metavar="FILE", help="prompt text from a file ('-': stdin)")
    one.add_argument("--tokens", metavar="IDS", help="token ids: '1,2,3', '1 2 3' or a JSON list")
    model = p.add_argument_group("namespace (as the worker was started)")
    model.add_argument("--model", metavar="DIR",
                       help="local Hugging Face model directory (default: the embedded model)")
    model.add_argument("--dtype", choices=DTYPES, default="float32", help="the worker's --dtype (default float32)")
    model.add_argument("--salt", default="", help="the request's salt (never sent to the daemon)")
    model.add_argument("--adapter", default="", help="the worker's --adapter")
    model.add_argument("--block-tokens", type=int, default=16, help="the worker's --block-tokens (default 16)")


def has_prompt(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in ("prompt", "prompt_file", "tokens"))


@dataclass
class PromptKeys:
    """What a worker computes for a prompt: its namespace, tokens, full-block keys and, when the
    prompt does not end on a block boundary, the tail key of its last partial block."""

    namespace: Namespace
    tokens: list[int]
    keys: list[bytes]
    tail: bytes | None
    tokenizer: Any

    @property
    def block_tokens(self) -> int:
        return self.namespace.block_tokens

    def block_key(self, parent: bytes | None, start: int, length: int) -> bytes:
        """The key of tokens[start:start + length] chained after `parent` (None: the namespace)."""
        return chain_key(parent or self.namespace.digest(), self.tokens[start : start + length])


def _parse_tokens(text: str) -> list[int]:
    try:
        value = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except (ValueError, RecursionError):  # RecursionError: a list nested thousands deep
        raise InvalidArgument(f"--tokens {text[:40]!r}: expected integers like '1,2,3' or a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidArgument("--tokens must be a list of integers")
    return value


def _prompt_text(args: argparse.Namespace) -> str | None:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            if args.prompt_file == "-":  # bytes, decoded here: the same check as for a file
                stdin = getattr(sys.stdin, "buffer", None)
                return stdin.read().decode("utf-8") if stdin is not None else sys.stdin.read()
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise InvalidArgument(f"--prompt-file: {e}") from None
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"--prompt-file {args.prompt_file}: not UTF-8 text "
                                  f"(byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    return None


def prompt_keys(args: argparse.Namespace) -> PromptKeys:
    """Load the model's identity (and tokenizer), tokenize, compute keys. InvalidArgument for bad input."""
    if not has_prompt(args):
        raise InvalidArgument("give the prompt: --prompt TEXT, --prompt-file FILE or --tokens IDS")
    if args.block_tokens < 1:
        raise InvalidArgument(f"--block-tokens must be >= 1, got {args.block_tokens}")
    import torch  # only the prompt commands pay for torch and the model

    from tiercache.worker.model import load_model, namespace_for

    # The worker's own loader: the namespace (name, weights digest, geometry) then matches by construction.
    loaded = load_model(args.model, device="cpu", dtype=getattr(torch, args.dtype))
    ns = namespace_for(loaded, block_tokens=args.block_tokens, adapter=args.adapter, salt=args.salt)
    text = _prompt_text(args)
    tokens = loaded.tokenizer.encode(text) if text is not None else _parse_tokens(args.tokens)
    if not tokens:
        raise InvalidArgument("the prompt is empty")
    try:
        keys = block_keys(ns, tokens)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    size = ns.block_tokens
    rest = len(tokens) % size
    tail = chain_key(keys[-1] if keys else ns.digest(), tokens[len(tokens) - rest:]) if rest else None
    return PromptKeys(ns, tokens, keys, tail, loaded.tokenizer)
