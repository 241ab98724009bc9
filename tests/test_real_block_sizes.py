"""The same-host fast paths at the block sizes of real models, with the default 64 KiB host pages:
a put in place, lookup, fetch, fetch_views and fetch_into of GPT-2-small (1.1 MiB) and Llama-3-8B
(2 MiB) blocks all run without a payload over gRPC and without a call where the shared index can
answer (every block published, whatever its page count), and every byte comes back verified."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.daemons import chain, cleanup, running_server, short_dir, small_config, tokens
from tiercache.client import Client
from tiercache.config import HostConfig, StoreConfig
from tiercache.errors import InvalidArgument
from tiercache.keys import Namespace
from tiercache.store import PutResult

LAYOUTS = {
    "gpt2-small fp32": Namespace(model="gpt2", weights="w", dtype="float32", num_layers=12, num_kv_heads=12,
                                 head_dim=64, block_tokens=16),
    "llama-3-8b fp16": Namespace(model="llama3-8b", weights="w", dtype="float16", num_layers=32, num_kv_heads=8,
                                 head_dim=128, block_tokens=16),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_real_sized_blocks_take_every_same_host_fast_path(name: str) -> None:
    ns = LAYOUTS[name]
    base = short_dir()
    try:
        config = small_config(base, disk_bytes=128 << 20)
        config = dataclasses.replace(config, host=HostConfig(capacity_bytes=64 << 20, shm_dir=config.host.shm_dir),
                                     store=StoreConfig(max_block_bytes=8 << 20))
        assert config.host.page_bytes == 64 << 10  # the default page
        with running_server(config) as (store, address), Client(address) as client:
            blocks = chain(tokens(len(name), 8), ns=ns)
            keys = [b.meta.key for b in blocks]
            assert blocks[0].meta.nbytes > 16 * config.host.page_bytes  # more pages than a slot once listed
            assert client.put(blocks) == [PutResult.STORED] * 8
            assert (client.num_in_place_puts, client.num_staged_puts, client.num_put_fallbacks) == (8, 0, 0)
            assert store.host._index.num_unpublished == 0
            calls = client._stub.Lookup
            client._stub.Lookup = None  # answered from the shared index: no call at all
            assert client.lookup(keys) == ["host"] * 8
            client._stub.Lookup = calls
            local = client.num_local
            views = client.fetch_views(keys)
            assert [torch.equal(v.payload, b.payload) for v, b in zip(views, blocks, strict=True)] == [True] * 8
            assert views.still_valid()
            copies = client.fetch(keys)
            assert [torch.equal(c.payload, b.payload) for c, b in zip(copies, blocks, strict=True)] == [True] * 8
            pool = torch.zeros(10, blocks[0].meta.nbytes // 4, dtype=torch.float32)  # a caller's paged pool
            metas = client.fetch_into(keys, [pool[i] for i in (3, 1, 4, 9, 5, 2, 6, 8)])
            assert metas == [b.meta for b in blocks]
            got = [pool[i].view(torch.uint8) for i in (3, 1, 4, 9, 5, 2, 6, 8)]
            assert [torch.equal(g, b.payload) for g, b in zip(got, blocks)] == [True] * 8
            assert pool[0].count_nonzero() == 0 and pool[7].count_nonzero() == 0  # untouched
            assert client.num_local == local + 3, "a fetch went to the daemon though the index holds the chain"
            with pytest.raises(InvalidArgument, match="outs\\[0\\] has 12 bytes"):
                client.fetch_into(keys[:1], [torch.empty(3)])
            with pytest.raises(InvalidArgument, match="outs\\[0\\] must be a contiguous CPU tensor"):
                client.fetch_into(keys[:1], [pool.t()])
            store.check_integrity()
    finally:
        cleanup(base)
