"""The client Protocol the worker calls: Client and every benchmark baseline take its calls as it makes them."""

from __future__ import annotations

import inspect

import pytest

from benchmarks.backends import (
    FileBackend,
    InProcessBackend,
    Meter,
    RedisBackend,
    TierCacheBackend,
    Timed,
    make_backend,
)
from benchmarks.daemons import assert_intact, chain, cleanup, running_server, short_dir, small_config, tokens
from tiercache.client import CacheClient, Client, Copies
from tiercache.layout import BlockLayout

IMPLEMENTATIONS = [Client, InProcessBackend, FileBackend, RedisBackend, TierCacheBackend, Timed]


def _protocol_methods() -> list[str]:
    return [name for name, value in vars(CacheClient).items() if inspect.isfunction(value) and not name.startswith("_")]


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_implementation_takes_every_call_as_the_protocol_makes_it(cls) -> None:
    """What mypy checks statically (tiercache/client/protocol.py, benchmarks/backends.py), at run time:
    every parameter of the Protocol's methods is taken, by the same name and kind, and whatever
    else the implementation takes has a default."""
    assert set(_protocol_methods()) == {"lookup", "fetch", "fetch_views", "put", "pin", "report", "close"}
    for name in _protocol_methods():
        wanted = inspect.signature(getattr(CacheClient, name)).parameters
        given = inspect.signature(getattr(cls, name)).parameters
        for param in wanted.values():
            assert param.name in given, f"{cls.__name__}.{name} lacks {param.name}"
            assert given[param.name].kind == param.kind, \
                f"{cls.__name__}.{name}({param.name}) is {given[param.name].kind}"
        extra = [p for p in given.values() if p.name not in wanted and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert all(p.default is not p.empty for p in extra), f"{cls.__name__}.{name} needs {extra}"


def test_a_client_is_a_cache_client() -> None:
    with Client("unix:/tmp/tc-no-such-daemon.sock") as client:  # a channel connects on its first call
        assert isinstance(client, CacheClient)
    layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16, dtype="float16")
    inproc = InProcessBackend(layout, b"\0" * 32)
    assert isinstance(inproc, CacheClient) and isinstance(Timed(inproc, Meter()), CacheClient)


def test_copies_are_always_valid() -> None:
    copies = Copies()
    assert copies.still_valid() and copies == []


def test_the_copy_rows_views_are_copies_and_only_the_views_row_views_the_slab() -> None:
    """The benchmark's copy row must end with bytes of its own, intact when the daemon recycles the
    slab pages they came from; its fetch_views (which the Worker calls) copies like its fetch. The
    views row hands out slab views, which go stale."""
    base = short_dir()
    try:
        with running_server(small_config(base)) as (_, address):
            spec = {"kind": "tiercache", "address": address, "shared_memory": True}
            copy = Timed(make_backend(spec, None, None), Meter())
            views = Timed(make_backend({**spec, "views": True}, None, None), Meter())
            try:
                blocks = chain(tokens(1, 4))
                keys = [b.meta.key for b in blocks]
                copy.put(blocks)
                copied, viewed = copy.fetch_views(keys), views.fetch_views(keys)
                assert len(copied) == len(viewed) == len(keys) and viewed.still_valid()
                views.inner.flush("host")
                for seed in range(2, 14):  # the freed pages, and more, taken by other blocks
                    copy.put(chain(tokens(seed, 4)))
                assert not viewed.still_valid(), "the slab pages were not recycled: the test proves nothing"
                assert copied.still_valid()
                assert_intact(list(copied))
                assert copy.meter.fetches == views.meter.fetches == 1
            finally:
                copy.close()
                views.close()
    finally:
        cleanup(base)
