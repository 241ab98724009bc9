"""Copying whole blocks between vLLM's paged KV tensors and tiercache's canonical block layout.

vLLM hands each attention layer's cache as a [num_blocks, num_kv_heads, block_size, C] view
(RFC #42082), but what C holds depends on the attention backend, which is why the packing is chosen
by the backend's name and never guessed from shapes:

- CPU_ATTN: C = 2 * head_size, and each (block, head) slab is read as [2 * block_size, head_size]:
  the first block_size rows are K, the rest V. Viewed as [blocks, heads, 2, tokens, head_dim].
- FLASH_ATTN: C = 2 * head_size with K in the first head_size channels and V in the rest. Viewed
  as [blocks, heads, tokens, 2, head_dim]. (Read from vLLM's backend; no GPU here to run it.)

Canonical: one block is [num_layers, 2, num_kv_heads, block_size, head_dim] (tiercache/layout.py).
Only whole blocks are copied: tokens are never indexed inside a block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# backend name -> how a layer's cache is viewed; per view, the axes that turn one block to [2, H, T, D]
ROWS = "rows"  # [B, H, 2, T, D]
CHANNELS = "channels"  # [B, H, T, 2, D]
PACKINGS = {"CPU_ATTN": ROWS, "FLASH_ATTN": CHANNELS}
_TO_CANONICAL = {ROWS: (1, 0, 2, 3), CHANNELS: (2, 0, 1, 3)}


_SAME_SIZE_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bits (bfloat16 and other dtypes numpy lacks: as ints of their size)."""
    return tensor.view(_SAME_SIZE_INTS[tensor.dtype.itemsize]).numpy()


class UnsupportedLayout(ValueError):
    """vLLM's KV cache is laid out in a way this connector does not copy."""


class KVPacking:
    """The layers of one worker's paged KV cache, as whole-block copies to and from canonical blocks.

    gather() reads blocks out (a new contiguous tensor the caller owns); scatter() writes them in.
    Neither changes anything but the blocks named.
    """

    def __init__(self, backend: str, layers: Sequence[torch.Tensor], *, num_kv_heads: int, head_dim: int,
                 block_size: int) -> None:
        packing = PACKINGS.get(backend)
        if packing is None:
            raise UnsupportedLayout(f"tiercache connector: attention backend {backend!r} is not supported; "
                                    f"supported: {', '.join(PACKINGS)}")
        if not layers:
            raise UnsupportedLayout("tiercache connector: vLLM registered no KV cache layers")
        self.backend = backend
        self.packing = packing
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.views = [self._view(i, layer) for i, layer in enumerate(layers)]
        self.dtype = layers[0].dtype
        self.device = layers[0].device
        self._axes = _TO_CANONICAL[packing]
        self.block_bytes = self.dtype.itemsize * len(self.views) * 2 * num_kv_heads * block_size * head_dim
        # On the CPU, copies go through numpy: torch's copy of one block's layer (a few 32 KiB runs)
        # is split over its intra-op threads, which in a vLLM worker share the cores with the engine's
        # busy-polling loop: 31 blocks of 4 MiB took 252 ms with torch (2 threads), 19 ms with numpy.
        self._arrays = [_as_array(view) for view in self.views] if self.device.type == "cpu" else None

    def _view(self, index: int, layer: torch.Tensor) -> torch.Tensor:
        expected = (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        if layer.dim() != 4 or tuple(layer.shape[1:]) != expected:
            raise UnsupportedLayout(f"tiercache connector: KV layer {index} has shape {tuple(layer.shape)}, expected "
                                    f"[num_blocks, {', '.join(map(str, expected))}] for {self.backend}")
        blocks, heads, tokens, d = layer.shape[0], self.num_kv_heads, self.block_size, self.head_dim
        try:
            if self.packing == ROWS:
                return layer.view(blocks, heads, 2, tokens, d)
            return layer.view(blocks, heads, tokens, 2, d)
        except RuntimeError as e:  # strides that do not allow the view: the packing is not what we read
            raise UnsupportedLayout(f"tiercache connector: KV layer {index} ({tuple(layer.shape)}, strides "
                                    f"{layer.stride()}) cannot be viewed as {self.packing} packing: {e}") from None

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """The canonical shape of one block: [num_layers, 2, num_kv_heads, block_size, head_dim]."""
        return (len(self.views), 2, self.num_kv_heads, self.block_size, self.head_dim)

    def read(self, block_id: int, out: torch.Tensor) -> None:
        """Copy vLLM's block `block_id` into `out` ([num_layers, 2, H, T, D], contiguous, on any device)."""
        if self._arrays is not None and out.device.type == "cpu":
            target = _as_array(out)
            for layer, array in enumerate(self._arrays):
                np.copyto(target[layer], array[block_id].transpose(self._axes))
            return
        for layer, view in enumerate(self.views):
            out[layer].copy_(view[block_id].permute(self._axes))

    def write(self, block: torch.Tensor, block_id: int) -> None:
        """Copy `block` ([num_layers, 2, H, T, D], any device) into vLLM's block `block_id`."""
        if tuple(block.shape) != self.block_shape:
            raise ValueError(f"a block of shape {tuple(block.shape)} for vLLM blocks of {self.block_shape}")
        if self._arrays is not None and block.device.type == "cpu" and block.dtype == self.dtype:
            source = _as_array(block)
            for layer, array in enumerate(self._arrays):
                np.copyto(array[block_id].transpose(self._axes), source[layer])
            return
        for layer, view in enumerate(self.views):
            view[block_id].permute(self._axes).copy_(block[layer])

    def pieces(self, block_id: int) -> list[torch.Tensor] | list[np.ndarray]:
        """vLLM's block `block_id` as the canonical block's pieces, one per layer: [2, H, T, D] views
        into the layer's cache (strided; numpy arrays of its bits on the CPU), which take a canonical
        block's bytes in order (Client.fetch_into writes them straight from the daemon's slab)."""
        if self._arrays is not None:
            return [array[block_id].transpose(self._axes) for array in self._arrays]
        return [view[block_id].permute(self._axes) for view in self.views]

    def zero(self, block_id: int) -> None:
        """Zero vLLM's block `block_id` in every layer (what vLLM does to a block it allocates)."""
        for view in self.views:
            view[block_id].zero_()

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks `block_ids` as a new [n, num_layers, 2, H, T, D] tensor."""
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype, device=self.device)
        for i, block_id in enumerate(block_ids):
            self.read(block_id, out[i])
        return out

    def scatter(self, blocks: Sequence[torch.Tensor] | torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write blocks (each [num_layers, 2, H, T, D]) into vLLM's blocks `block_ids`, in order."""
        if len(blocks) != len(block_ids):
            raise ValueError(f"{len(blocks)} blocks for {len(block_ids)} vLLM blocks")
        for block, block_id in zip(blocks, block_ids):
            self.write(block, block_id)
