"""Greedy generation after a cached prefix: the worker's cache (kvcache.blocks_to_cache, room set aside
for the suffix and the new tokens) against transformers' DynamicCache filled from the same blocks.

    python3 scripts/bench_decode.py [--lengths 2000,6000] [--new-tokens 32] [--repeat 5]

Both runs start from the same prefix blocks, prefill the same 16-token suffix and generate the same
tokens (checked); DynamicCache copies each layer's whole K and V on every update, so its cost per
token grows with the prefix. Prints the median milliseconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from tiercache.layout import BlockLayout  # noqa: E402
from tiercache.worker.kvcache import blocks_to_cache, cache_to_blocks, greedy_generate, prefill  # noqa: E402
from tiercache.worker.model import load_default_model, namespace_for  # noqa: E402

SUFFIX = 16


def dynamic_cache(blocks: list[torch.Tensor], model: torch.nn.Module) -> DynamicCache:
    """transformers' own cache holding the blocks, filled as kvcache did before ReservedLayer: each
    layer takes one concatenation of its K and V (a single copy of the prefix)."""
    cache = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        both = torch.cat([block[index] for block in blocks], dim=2).unsqueeze(1)  # [2, 1, heads, tokens, dim]
        layer.lazy_initialization(both[0], both[1])
        layer.keys, layer.values = both[0], both[1]
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2000,6000", help="prefix lengths in tokens, multiples of 16")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per run (default 32)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each, interleaved (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a worker on a small box runs (see bench_peers)
    loaded = load_default_model()
    model, layout = loaded.model, BlockLayout.of(namespace_for(loaded, block_tokens=16))
    print(f"model: embedded default ({loaded.num_layers} layers, {loaded.num_kv_heads} KV heads x "
          f"{loaded.head_dim}, {loaded.dtype}), suffix {SUFFIX} tokens, {args.new_tokens} new tokens, "
          f"1 torch thread\n")
    print(f"{'prefix':>6} {'DynamicCache ms':>16} {'worker cache ms':>16} {'ratio':>6}")
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = torch.randint(3, 250, (length + SUFFIX,), generator=torch.Generator().manual_seed(length)).tolist()
        _, full = prefill(model, tokens[:length], None)
        blocks = cache_to_blocks(full, layout, 0, length)
        builds = {"DynamicCache": functools.partial(dynamic_cache, blocks, model),
                  "worker": functools.partial(blocks_to_cache, blocks, model, SUFFIX + args.new_tokens)}
        times: dict[str, list[float]] = {name: [] for name in builds}
        outputs: dict[str, list[int]] = {}
        for _ in range(args.repeat + 1):  # the first round warms up and is not counted
            for name, build in builds.items():
                start = time.perf_counter()
                logits, cache = prefill(model, tokens[length:], build())
                outputs[name] = greedy_generate(model, cache, logits, args.new_tokens)
                times[name].append(time.perf_counter() - start)
        if outputs["DynamicCache"] != outputs["worker"]:
            raise SystemExit(f"the two caches generated different tokens at {length}: {outputs}")
        old, new = (1e3 * statistics.median(times[name][1:]) for name in builds)
        print(f"{length:>6} {old:>16.1f} {new:>16.1f} {old / new:>5.2f}x")


if __name__ == "__main__":
    main()
