"""Deterministic test blocks: payload bytes derived from a seed, with a real key chain."""

from __future__ import annotations

from benchmarks.daemons import payload_for
from tiercache.block import Block, BlockMeta
from tiercache.keys import Namespace, block_keys
from tiercache.layout import BlockLayout, checksum

NS = Namespace(model="test", weights="w", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
               block_tokens=16)
LAYOUT = BlockLayout.of(NS)


def make_block(key: bytes, parent: bytes = b"", *, layout: BlockLayout = LAYOUT, num_tokens: int | None = None,
               namespace: bytes | None = None, tenant: str = "") -> Block:
    tokens = layout.block_tokens if num_tokens is None else num_tokens
    nbytes = layout.nbytes(tokens)
    payload = payload_for(key, nbytes)
    meta = BlockMeta(key=key, namespace=namespace or NS.digest(), num_tokens=tokens, dtype=layout.dtype,
                     shape=layout.shape(tokens), nbytes=nbytes, checksum=checksum(payload), parent=parent,
                     tenant=tenant)
    return Block(meta, payload)


def make_chain(tokens: list[int], ns: Namespace = NS, **kw: object) -> list[Block]:
    layout = BlockLayout.of(ns)
    keys = block_keys(ns, tokens)
    parents = [b""] + keys[:-1]
    return [make_block(k, p, layout=layout, namespace=ns.digest(), **kw) for k, p in zip(keys, parents)]
