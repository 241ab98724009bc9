"""`tiercache admin export/import`: one namespace's blocks in one safetensors file, through the rpcs only.

File format (tiercache.export.v2), any safetensors reader can open it: one tensor per block, named by
its store key in hex, in the canonical layout [num_layers, 2, num_kv_heads, tokens, head_dim] and the
namespace's dtype, its bytes exactly as the daemon holds them. __metadata__ holds "format", "tenant",
"namespace" (digest hex), "description" (the namespace's description as JSON, or "") and "blocks": a
JSON list, parents before children, of {key, parent, num_tokens, checksum, preview, pinned}; each
checksum is the XXH3-64 of the block's bytes (layout.checksum). A tiercache.export.v1 file (written by
0.1: checksums sum64) is still imported: each block is verified with sum64 and stored with XXH3-64.

Store keys are bound to the tenant (see the proto), so an import stores the blocks for the tenant
they were exported from, under the same store keys: a worker of that tenant then hits them exactly
as before. Only tenant "local" (the operator) may import (anyone else could plant blocks under
another tenant's keys). Import overwrites nothing: a block already present is left as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from tiercache.admin.output import EXIT_DECLINED, EXIT_OK, Progress, fmt_bytes, short
from tiercache.admin.view import NamespaceView, build, resolve_namespace
from tiercache.block import Block, BlockMeta, PutResult
from tiercache.client.types import NamespaceDescription
from tiercache.codec import ST_DTYPES
from tiercache.errors import CorruptBlock, InvalidArgument, NotFound
from tiercache.keys import KEY_BYTES
from tiercache.layout import DTYPE_NAMES, checksum, legacy_sum64

FORMAT = "tiercache.export.v2"
LEGACY_FORMAT = "tiercache.export.v1"  # checksums sum64
FETCH_BATCH_BYTES = 32 << 20  # payload bytes per Fetch call


def _pick(views: list[NamespaceView], name: str | None) -> NamespaceView:
    if name is not None:
        return resolve_namespace(views, name)
    if not views:
        raise NotFound("nothing is cached: no namespace to export")
    if len(views) > 1:
        raise InvalidArgument(f"the cache holds {len(views)} namespaces ({', '.join(short(v.digest) for v in views)}); "
                              "name one with --namespace")
    return views[0]


def _write(path: str, header: dict[str, Any], spool: Any) -> None:
    """header + spooled payloads as a safetensors file, replacing `path` atomically."""
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # safetensors aligns the payloads to 8 bytes with trailing spaces
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(data)))
            f.write(data)
            spool.seek(0)
            shutil.copyfileobj(spool, f, 1 << 20)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cmd_export(ctx: Any) -> int:
    args, client, console = ctx.args, ctx.client, ctx.console
    path = os.path.abspath(args.output)
    if os.path.isdir(path):
        raise InvalidArgument(f"{args.output} is a directory; name the file to write")
    if not os.path.isdir(os.path.dirname(path)):
        raise InvalidArgument(f"cannot write {args.output}: directory {os.path.dirname(path)} does not exist")
    view = _pick(build(client.listing()), args.namespace)
    if os.path.exists(path) and not console.confirm(f"overwrite {args.output}?", args.yes):
        console.err.write("not exported\n")
        return EXIT_DECLINED
    ordered = [b for chain in view.chains for b in chain.blocks]  # parents before children
    tensors: dict[str, Any] = {}
    blocks: list[dict[str, Any]] = []
    progress = console.progress(len(ordered), "exporting")
    # Payloads are spooled next to the output, because the safetensors header (which must come
    # first) can only be written once we know which blocks were still there to fetch.
    with tempfile.TemporaryFile(dir=os.path.dirname(path)) as spool:
        try:
            start = 0
            while start < len(ordered):
                end, size = start, 0
                while end < len(ordered) and (end == start or size + ordered[end].nbytes <= FETCH_BATCH_BYTES):
                    size += ordered[end].nbytes
                    end += 1
                listed = {b.store_key: b for b in ordered[start:end]}
                for block in client.fetch_store_keys(list(listed)):  # absent ones are skipped
                    meta, offset = block.meta, spool.tell()
                    spool.write(block.payload.numpy())
                    tensors[meta.key.hex()] = {"dtype": ST_DTYPES[meta.dtype], "shape": list(meta.shape),
                                               "data_offsets": [offset, offset + meta.nbytes]}
                    blocks.append({"key": meta.key.hex(), "parent": meta.parent.hex(), "num_tokens": meta.num_tokens,
                                   "checksum": meta.checksum, "preview": "" if view.salted else meta.preview,
                                   "pinned": listed[meta.key].pinned})
                start = end
                progress.update(start)
        finally:
            progress.close()
        description = json.dumps(view.description.fields()) if view.description else ""
        metadata = {"format": FORMAT, "tenant": client.stats().tenant, "namespace": view.digest.hex(),
                    "description": description, "blocks": json.dumps(blocks)}
        _write(path, {"__metadata__": metadata, **tensors}, spool)
    nbytes = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in tensors.values())
    skipped = len(ordered) - len(blocks)  # evicted between List and Fetch
    if console.as_json:
        console.json({"file": path, "namespace": view.digest.hex(), "blocks": len(blocks), "bytes": nbytes,
                      "skipped": skipped})
    else:
        console.print(f"exported {len(blocks)} blocks ({fmt_bytes(nbytes)}) of namespace {short(view.digest)} "
                      f"(model {view.model}) to {args.output}"
                      + (f"; {skipped} were evicted meanwhile" if skipped else ""))
    return EXIT_OK


def _read_metadata(path: str) -> tuple[Any, dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(path, framework="pt")
    except (OSError, SafetensorError) as e:
        raise InvalidArgument(f"{path}: not a readable safetensors file ({e})") from None
    metadata = handle.metadata() or {}
    if metadata.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise InvalidArgument(f"{path}: not a tiercache export (format {metadata.get('format')!r}, expected {FORMAT})")
    return handle, metadata


# Each entry of the metadata's "blocks" list, as export writes it.
ITEM_FIELDS: dict[str, type] = {"key": str, "parent": str, "num_tokens": int, "checksum": int, "preview": str,
                                "pinned": bool}


def _item_problem(item: object, tensors: set[str]) -> str:
    """What is wrong with one "blocks" entry of an export, or "" if nothing."""
    if not isinstance(item, dict):
        return "is not an object"
    for name, kind in ITEM_FIELDS.items():
        value = item.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"has no {kind.__name__} {name!r}"
    for name in ("key", "parent"):
        try:
            size = len(bytes.fromhex(item[name]))
        except ValueError:
            size = -1
        if size != KEY_BYTES and not (name == "parent" and size == 0):
            return f"{name} {item[name][:16]!r} is not {2 * KEY_BYTES} hex digits"
    if item["key"] not in tensors:
        return f"names block {item['key'][:12]}, whose tensor the file does not hold"
    return ""


def _blocks(handle: Any, items: list[dict[str, Any]], digest: bytes, pinned: bool, progress: Progress,
            done: list[int], legacy: bool) -> Iterator[Block]:
    for item in items:
        if bool(item["pinned"]) != pinned:
            continue
        tensor = handle.get_tensor(item["key"])
        if tensor.dtype not in DTYPE_NAMES:
            raise InvalidArgument(f"block {item['key'][:12]} of the file is {tensor.dtype}, not a KV dtype")
        payload = tensor.contiguous().reshape(-1).view(torch.uint8)
        verified = legacy_sum64(payload.numpy()) if legacy else checksum(payload)
        if verified != item["checksum"]:
            raise CorruptBlock(f"block {item['key'][:12]} of the file fails its checksum; the import stopped there")
        yield Block(BlockMeta(key=bytes.fromhex(item["key"]), namespace=digest, num_tokens=item["num_tokens"],
                              dtype=DTYPE_NAMES[tensor.dtype], shape=tuple(tensor.shape), nbytes=payload.numel(),
                              checksum=checksum(payload) if legacy else verified, parent=bytes.fromhex(item["parent"]),
                              preview=item["preview"]), payload)
        done[0] += 1
        progress.update(done[0])


def cmd_import(ctx: Any) -> int:
    args, client, console = ctx.args, ctx.client, ctx.console
    handle, metadata = _read_metadata(args.file)
    try:
        items = json.loads(metadata["blocks"])
        digest = bytes.fromhex(metadata["namespace"])
        tenant = metadata["tenant"]
        fields = json.loads(metadata["description"]) if metadata.get("description") else None
        description = NamespaceDescription(digest=digest, **fields) if fields else None
        if not isinstance(items, list):
            raise TypeError("blocks is not a list")
    except (KeyError, ValueError, TypeError) as e:
        raise InvalidArgument(f"{args.file}: damaged tiercache metadata ({type(e).__name__}: {e})") from None
    tensors = set(handle.keys())
    for i, item in enumerate(items):
        problem = _item_problem(item, tensors)
        if problem:
            raise InvalidArgument(f"{args.file}: damaged tiercache metadata (blocks[{i}] {problem})")
    progress, done = console.progress(len(items), "importing"), [0]
    results: list[PutResult] = []
    try:
        for pinned in (False, True):
            results += client.put(_blocks(handle, items, digest, pinned, progress, done,
                                           metadata["format"] == LEGACY_FORMAT), pin=pinned,
                                  namespace=description, import_tenant=tenant)
    finally:
        progress.close()
    stored = results.count(PutResult.STORED)
    if console.as_json:
        console.json({"file": os.path.abspath(args.file), "namespace": digest.hex(), "tenant": tenant,
                      "stored": stored, "already_present": len(results) - stored})
    else:
        console.print(f"imported {stored} blocks into namespace {short(digest)} for tenant {tenant}"
                      f" ({len(results) - stored} were already present)")
    return EXIT_OK
