"""Building a worker's KV cache from fetched blocks (kvcache.blocks_to_cache), by where the blocks lie.

    python3 scripts/bench_cache_build.py [--tokens 2000] [--repeat 21]

Blocks of 16 tokens lying back to back in one buffer (as views of the daemon's slab do) are copied
into each layer's room a run at a time; blocks in separate tensors are concatenated. The baseline is
what blocks_to_cache did for both before runs ("cat"): a view per block and a concatenation per layer. Three
KV shapes (the embedded default model's, GPT-2 small's, and a Llama-3-8B-like 32 layers x 8 KV heads x
128 in float16) on tiny random models: only the cache's shape matters here. Prints the medians of
interleaved runs and the ratios; every build is checked to hold the same tokens.
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
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiercache.worker.geometry import kv_geometry  # noqa: E402
from tiercache.worker.kvcache import ReservedLayer, blocks_to_cache, new_cache  # noqa: E402

BLOCK_TOKENS = 16
SHAPES = {"default (4 x 2 x 64, float32)": (4, 2, 64, torch.float32),
          "GPT-2 small (12 x 12 x 64, float32)": (12, 12, 64, torch.float32),
          "Llama-3-8B-like (32 x 8 x 128, float16)": (32, 8, 128, torch.float16)}


def concatenated(blocks: list[torch.Tensor], model: torch.nn.Module, reserve_tokens: int) -> DynamicCache:
    """The baseline: the same rooms, each filled by one concatenation of a view per block."""
    g = kv_geometry(model.config)
    cache = new_cache(model, reserve_tokens)
    num_tokens = sum(block.shape[3] for block in blocks)
    for index, layer in enumerate(cache.layers):
        assert isinstance(layer, ReservedLayer)
        room = torch.empty((2, 1, g.num_kv_heads, num_tokens + reserve_tokens, g.head_dim), dtype=model.dtype)
        torch.cat([block[index] for block in blocks], dim=2, out=room[:, 0, :, :num_tokens])
        layer.adopt(room, num_tokens)
    return cache


def tiny_model(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=256, hidden_size=8 * kv_heads, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    return LlamaForCausalLM(config).to(dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000, help="prefix tokens, a multiple of 16 (default 2000)")
    parser.add_argument("--repeat", type=int, default=21, help="timed builds of each, interleaved (default 21)")
    args = parser.parse_args()
    if args.tokens <= 0 or args.tokens % BLOCK_TOKENS:
        parser.error(f"--tokens must be a positive multiple of {BLOCK_TOKENS}")
    torch.set_num_threads(1)  # as a worker on a small box runs (see bench_peers)
    count = args.tokens // BLOCK_TOKENS
    print(f"{args.tokens} tokens in {count} blocks of {BLOCK_TOKENS}, room for 512 more; medians of {args.repeat}, "
          "1 torch thread\n")
    print(f"{'':<40} {'one buffer (slab views)':^33} {'separate tensors':^33}")
    print(f"{'KV shape (layers x KV heads x dim)':<40} {'cat ms':>9} {'now ms':>9} {'ratio':>13} "
          f"{'cat ms':>9} {'now ms':>9} {'ratio':>13}")
    for name, (layers, kv_heads, head_dim, dtype) in SHAPES.items():
        model = tiny_model(layers, kv_heads, head_dim, dtype)
        shape = (layers, 2, kv_heads, BLOCK_TOKENS, head_dim)
        per_block = torch.Size(shape).numel()
        buffer = torch.randn(count * per_block, generator=torch.Generator().manual_seed(0)).to(dtype)
        in_buffer = [part.view(shape) for part in buffer.split(per_block)]  # back to back, like slab views
        separate = [block.clone() for block in in_buffer]
        builds = {"buffer cat": functools.partial(concatenated, in_buffer, model, 512),
                  "buffer now": functools.partial(blocks_to_cache, in_buffer, model, 512),
                  "separate cat": functools.partial(concatenated, separate, model, 512),
                  "separate now": functools.partial(blocks_to_cache, separate, model, 512)}
        reference = builds["buffer cat"]()
        for build in builds.values():
            for want, got in zip(reference.layers, build().layers, strict=True):
                assert torch.equal(want.keys, got.keys) and torch.equal(want.values, got.values), name
        times: dict[str, list[float]] = {key: [] for key in builds}
        for _ in range(args.repeat):
            for key, build in builds.items():
                start = time.perf_counter()
                build()
                times[key].append((time.perf_counter() - start) * 1e3)
        ms = {key: statistics.median(values) for key, values in times.items()}
        print(f"{name:<40}" + "".join(f" {ms[f'{where} cat']:>9.2f} {ms[f'{where} now']:>9.2f} "
                                      f"{ms[f'{where} cat'] / ms[f'{where} now']:>12.2f}x"
                                      for where in ("buffer", "separate")))


if __name__ == "__main__":
    main()
