"""Block keys of one prompt: tiercache.keys against the spec written out plainly, in the same run.

    python3 scripts/bench_keys.py [--tokens 2000] [--repeat 2001] [--block-tokens 16]

The reference is DESIGN.md's "Block keys" formula as anyone would first write it: the namespace
digest from its canonical JSON, then one hashlib.blake2b per block over the tag, the parent, the
length and struct-packed ids, after the same per-token check the spec's ids need (ints in
[0, 2**32)). Both run interleaved on the same random ids (spread over the whole u32 range); the
script prints each median, the ratio and issue 32's target (block_keys of 2000 tokens <= 0.2 ms),
and checks that both give the same keys.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import random
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from tiercache.keys import Namespace, block_keys, tail_keys

TARGET_MS = 0.2  # issue 32: block_keys of 2000 tokens, median


def reference_block_keys(namespace: Namespace, tokens: Sequence[int]) -> list[bytes]:
    """The spec, plainly: check every id, then one hash per full block."""
    for position, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**32:
            raise ValueError(f"token at position {position} is invalid: {token!r}")
    canonical = json.dumps(namespace.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    parent = hashlib.blake2b(b"tiercache.ns.v1\0" + canonical, digest_size=32).digest()
    size = namespace.block_tokens
    keys = []
    for start in range(0, len(tokens) - size + 1, size):
        run = tokens[start : start + size]
        parent = hashlib.blake2b(b"tiercache.block.v1\0" + parent + struct.pack(f"<I{size}I", size, *run),
                                 digest_size=32).digest()
        keys.append(parent)
    return keys


def medians_ms(calls: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median wall time of each call, the calls interleaved so that load from elsewhere hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000, help="prompt tokens (default 2000)")
    parser.add_argument("--repeat", type=int, default=2001, help="timed calls of each, interleaved (default 2001)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    args = parser.parse_args()
    if args.tokens < 1 or args.repeat < 1 or args.block_tokens < 1:
        parser.error("--tokens, --repeat and --block-tokens must be >= 1")
    namespace = Namespace(model="bench", weights="bench", dtype="float16", num_layers=32, num_kv_heads=8,
                          head_dim=128, block_tokens=args.block_tokens)
    rng = random.Random(32)
    tokens = [rng.randrange(2**32) for _ in range(args.tokens)]
    if block_keys(namespace, tokens) != reference_block_keys(namespace, tokens):
        sys.exit("bench_keys: tiercache.keys and the reference disagree")
    breakpoint = args.tokens - 1 if args.tokens % args.block_tokens == 0 else args.tokens
    medians = medians_ms({
        "reference": lambda: reference_block_keys(namespace, tokens),
        "block_keys": lambda: block_keys(namespace, tokens),
        "block_keys + tail_keys": lambda: tail_keys(namespace, tokens, [breakpoint], block_keys(namespace, tokens)),
    }, args.repeat)
    reference = medians["reference"]
    print(f"bench_keys: {args.tokens} tokens, {args.tokens // args.block_tokens} blocks of {args.block_tokens}; "
          f"median of {args.repeat} interleaved calls")
    print()
    print(f"{'implementation':<44} {'median ms':>10} {'vs reference':>13}")
    print(f"{'reference (spec written plainly, before)':<44} {reference:>10.4f} {1.0:>12.2f}x")
    for name in ("block_keys", "block_keys + tail_keys"):
        print(f"{'tiercache.keys ' + name + ' (after)':<44} {medians[name]:>10.4f} {reference / medians[name]:>12.2f}x")
    print()
    verdict = "met" if medians["block_keys"] <= TARGET_MS else "missed"
    print(f"target: block_keys of {args.tokens} tokens <= {TARGET_MS} ms (issue 32, at 2000 tokens): "
          f"{medians['block_keys']:.4f} ms, {verdict}")


if __name__ == "__main__":
    main()
