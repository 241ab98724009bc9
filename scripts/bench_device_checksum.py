"""The gpu tier's device_checksum against XXH3 (layout.checksum), per block size, in the same run.

    python3 scripts/bench_device_checksum.py [--repeat 15] [--threads 1] [--device auto|cpu|cuda]

On the CPU the baseline is XXH3 of the same host bytes; device_checksum is far slower there and is
used there only by tests. On CUDA the baseline is what checking a device block with XXH3 costs: the
copy to the host and XXH3 of it; device_checksum reads the block where it lies and copies 16 bytes.
Block sizes: 64 KiB (the embedded model), 1.1 MiB (GPT-2 small, 16 tokens, float32) and 2 MiB
(Llama-3-8B, 16 tokens, float16). Prints medians of interleaved runs and the ratios.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch

from tiercache.device_checksum import device_checksum
from tiercache.layout import checksum

SIZES = {"64 KiB (embedded model)": 64 * 1024, "1.1 MiB (GPT-2 small fp32)": 1_179_648,
         "2 MiB (Llama-3-8B fp16)": 2 * 1024 * 1024}


def median_ms(calls: Mapping[str, Callable[[], object]], repeat: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median wall time of each call, interleaved; `sync` waits for the device after each."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm-up: kernels, allocator, caches
        call()
    sync()
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15, help="timed runs of each, interleaved (default 15)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the daemon's calls are serialised by the store's lock)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the block lies (default: cuda when available)")
    args = parser.parse_args()
    if args.repeat < 1 or args.threads < 1:
        parser.error("--repeat and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_device_checksum: --device cuda but CUDA is not available")
    device = torch.device(name)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    baseline = "XXH3 on the host" if device.type == "cpu" else "copy to host + XXH3"
    print(f"bench_device_checksum on {device}: median of {args.repeat} interleaved runs; "
          f"torch threads={torch.get_num_threads()}")
    print()
    print(f"{'block':<28} {baseline + ' ms':>24} {'device_checksum ms':>19} {'GiB/s':>8} {'vs baseline':>12}")
    for label, nbytes in SIZES.items():
        block = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        # layout.checksum copies a device tensor to the host itself: on CUDA the baseline includes that copy.
        calls = {"base": partial(checksum, block), "mine": partial(device_checksum, block)}
        ms = median_ms(calls, args.repeat, sync)
        gib_s = nbytes / 2**30 / (ms["mine"] / 1e3)
        print(f"{label:<28} {ms['base']:>24.3f} {ms['mine']:>19.3f} {gib_s:>8.3f} {ms['base'] / ms['mine']:>11.3f}x")
    print()
    print("vs baseline > 1: device_checksum is faster. On a CPU it is expected well below 1 (it is meant for "
          "the device).")


if __name__ == "__main__":
    main()
