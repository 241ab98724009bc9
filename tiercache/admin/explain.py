"""`tiercache admin explain`: which blocks of a prompt are cached where, and why the rest missed.

The daemon never sees tokens, so a miss is explained from keys, which the admin computes exactly as
the worker does, and from what List shows (read from List rather than asked with Lookup, so that
inspecting a prompt does not move the daemon's hit rate):
- The first block whose key is absent is the first block that differs (or the cache ends there:
  when no cached block continues from the previous key, nothing longer was ever cached).
- The exact token where it diverges is named when a cached chain of the same namespace carries a
  preview (the worker records the prompt's first 64 characters on the chain's first block) that
  covers that token: the preview is tokenized, and when its own block keys are found in the cache
  the position is confirmed, not guessed. A cached breakpoint tail inside the block gives a lower
  bound. Otherwise the block's token range is reported: the exact token cannot be known.
- When nothing is cached in the prompt's namespace, the namespaces the workers described are
  compared field by field (model, weights, dtype, geometry, block_tokens, adapter, salt digest).
"""

from __future__ import annotations

from typing import Any

from tiercache.admin.output import EXIT_NOT_FOUND, EXIT_OK, short, table
from tiercache.admin.prompt import PromptKeys, prompt_keys
from tiercache.admin.view import cached_prefix
from tiercache.client.types import Listing, NamespaceDescription
from tiercache.errors import NotFound
from tiercache.keys import block_keys
from tiercache.tenancy import scope_key

CONTEXT_TOKENS = 10  # tokens of text shown on each side of a divergence
COMPARED = ("model", "weights", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_tokens", "adapter",
            "salt_digest")


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _from_previews(pk: PromptKeys, previews: list[str], present: set[bytes], tenant: str,
                   start: int, end: int) -> dict[str, Any] | None:
    """The divergent token inside [start, end) as a cached chain's preview shows it, or None."""
    best: dict[str, Any] | None = None
    size = pk.block_tokens
    for preview in dict.fromkeys(p for p in previews if p):
        theirs = list(pk.tokenizer.encode(preview))
        at = _first_difference(pk.tokens, theirs)
        confirmed = 0  # leading blocks of the preview's tokens that are cached as such
        for key in block_keys(pk.namespace, theirs):
            if scope_key(tenant, key) not in present:
                break
            confirmed += 1
        verified = at < confirmed * size
        # A preview is cut at a character count; its last token may be a fragment, never evidence.
        if not start <= at < end or not (verified or at < len(theirs) - 1):
            continue
        if best is None or (verified, at) > (best["verified"], best["token"]):
            lo, hi = max(0, at - CONTEXT_TOKENS), at + CONTEXT_TOKENS
            best = {"token": at, "verified": verified, "cached_text": pk.tokenizer.decode(theirs[lo:hi]),
                    "your_text": pk.tokenizer.decode(pk.tokens[lo:hi])}
    return best


def _namespace_mismatch(pk: PromptKeys, everything: Listing) -> dict[str, Any]:
    ours = NamespaceDescription.of(pk.namespace)
    known = everything.namespaces
    out: dict[str, Any] = {"reason": "namespace", "cached_namespaces": len({e.namespace for e in everything.entries})}
    if not known:
        out["detail"] = ("nothing is cached in this prompt's namespace, and no worker described the cached "
                         "namespaces, so the differing field cannot be named" if everything.entries
                         else "the cache is empty")
        return out
    same = [d for d in known if d.model == ours.model]
    pool = same or known
    diffs = {d.digest: [f for f in COMPARED if getattr(d, f) != getattr(ours, f)] for d in pool}
    closest = min(pool, key=lambda d: len(diffs[d.digest]))
    fields = diffs[closest.digest]
    out.update(closest=closest.digest.hex(), fields=fields, model=closest.model)
    words = []
    for f in fields:
        if f == "salt_digest":
            words.append("salt differs")  # the salt is a secret: never shown, not even its digest
        elif f == "weights":
            words.append(f"weights differ (cache {closest.weights[:12]}…, yours {ours.weights[:12]}…)")
        else:
            words.append(f"{f} differs (cache {getattr(closest, f)!r}, yours {getattr(ours, f)!r})")
    out["detail"] = (f"nothing is cached in this prompt's namespace; the closest cached namespace "
                     f"{short(closest.digest)} (model {closest.model}) has: {'; '.join(words)}")
    if not same:
        models = sorted({d.model for d in known})
        out["detail"] = (f"nothing is cached for model {ours.model}; the cache holds {', '.join(models)} "
                         f"(closest {short(closest.digest)}: {'; '.join(words)})")
    return out


def _block_miss(pk: PromptKeys, n: int, listing: Listing, tenant: str) -> dict[str, Any]:
    size = pk.block_tokens
    start, end = n * size, min((n + 1) * size, len(pk.tokens))
    present = {e.store_key for e in listing.entries}
    parent = scope_key(tenant, pk.keys[n - 1]) if n else b""
    continuations = [e for e in listing.entries if e.parent_store_key == parent]
    out: dict[str, Any] = {"block": n, "start": start, "end": end, "continuations": len(continuations)}
    if not continuations:
        out.update(reason="cache_ends", detail=f"no cached prompt of this namespace continues past token {start}: "
                                               "the cache holds nothing longer")
        return out
    out["reason"] = "differs"
    lower = start  # a cached breakpoint tail that matches the first tokens of the block
    for length in range(size - 1, 0, -1):
        if start + length <= len(pk.tokens):
            if scope_key(tenant, pk.block_key(pk.keys[n - 1] if n else None, start, length)) in present:
                lower = start + length
                break
    # A salted namespace's previews are one user's prompt text: never read back, never shown.
    heads = [] if pk.namespace.salt else [e for e in listing.entries if not e.parent_store_key]
    if n:  # our own chain's head: the one whose first blocks we share
        head = scope_key(tenant, pk.keys[0])
        heads = [e for e in heads if e.store_key == head]
    found = _from_previews(pk, [e.preview for e in heads], present, tenant, lower, end)
    if found:
        out.update(divergent_token=found["token"], verified=found["verified"], cached_text=found["cached_text"],
                   your_text=found["your_text"])
        how = "confirmed by the cached blocks of its recorded preview" if found["verified"] else \
            "from the recorded preview text; its block is not cached to confirm it"
        out["detail"] = (f"block {n} (tokens {start}-{end - 1}) differs from the {len(continuations)} cached "
                         f"continuation(s); first divergent token: {found['token']} ({how})")
    else:
        out.update(divergent_token=None, verified=False)
        out["detail"] = (f"block {n} (tokens {start}-{end - 1}) differs from the {len(continuations)} cached "
                         f"continuation(s); it diverges within tokens {lower}-{end - 1} (the exact token is "
                         "unknown: the daemon keeps no token ids and no recorded preview reaches it)")
    out["lower_bound"] = lower
    return out


def explain(ctx: Any) -> dict[str, Any]:
    """The whole explanation as plain data (what --json prints)."""
    pk = prompt_keys(ctx.args)
    client = ctx.client
    tenant = client.stats().tenant
    size, digest = pk.block_tokens, pk.namespace.digest()
    try:
        listing: Listing | None = client.listing(namespace=digest)
    except NotFound:
        listing = None  # nothing at all in this namespace
    tiers = cached_prefix(client, listing, tenant, pk.keys)
    n = len(tiers)
    tail_tier = None
    if pk.tail is not None and n == len(pk.keys):
        tail_tier = next(iter(cached_prefix(client, listing, tenant, [pk.tail])), None)
    report: dict[str, Any] = {
        "namespace": digest.hex(), "model": pk.namespace.model, "dtype": pk.namespace.dtype, "block_tokens": size,
        "prompt_tokens": len(pk.tokens), "cached_blocks": n,
        "cached_tokens": n * size + (len(pk.tokens) % size if tail_tier else 0),
        # store_key: the key the daemon (and a remote tier, as <key_prefix>:<tenant>:<store_key>) keeps it under
        "blocks": [{"index": i, "start": i * size, "end": (i + 1) * size, "key": k.hex(),
                    "store_key": scope_key(tenant, k).hex(), "tier": tiers[i] if i < n else None}
                   for i, k in enumerate(pk.keys)],
        "tail": None, "miss": None}
    if pk.tail is not None:
        report["tail"] = {"start": len(pk.keys) * size, "end": len(pk.tokens), "key": pk.tail.hex(), "tier": tail_tier}
    if n < len(pk.keys):
        if listing is None:
            report["miss"] = _namespace_mismatch(pk, client.listing())
        else:
            report["miss"] = _block_miss(pk, n, listing, tenant)
    elif pk.tail is not None and tail_tier is None:
        start = len(pk.keys) * size
        report["miss"] = {"reason": "partial_tail", "start": start, "end": len(pk.tokens),
                          "detail": f"tokens {start}-{len(pk.tokens) - 1} are a partial block: only full blocks "
                                    f"are cached unless a request sets a breakpoint at token {len(pk.tokens)}"}
    return report


def print_explain(console: Any, r: dict[str, Any]) -> None:
    size = r["block_tokens"]
    console.print(f"namespace {r['namespace'][:12]}  model {r['model']}  {r['dtype']}  {size} tokens/block")
    tail = r["tail"]
    shape = f"{len(r['blocks'])} full blocks" + (f" + {tail['end'] - tail['start']}-token tail" if tail else "")
    console.print(f"prompt: {r['prompt_tokens']} tokens = {shape}")
    rows = [[b["index"], f"{b['start']}-{b['end'] - 1}", b["tier"] or "-", b["key"][:12]] for b in r["blocks"]]
    if tail:
        rows.append(["tail", f"{tail['start']}-{tail['end'] - 1}", tail["tier"] or "-", tail["key"][:12]])
    if rows:
        console.print(table(["BLOCK", "TOKENS", "TIER", "KEY"], rows))
    console.print(f"cached: {r['cached_blocks']} of {len(r['blocks'])} blocks, "
                  f"{r['cached_tokens']} of {r['prompt_tokens']} tokens")
    miss = r["miss"]
    if miss:
        console.print(f"miss: {miss['detail']}")
        if miss.get("divergent_token") is not None:
            console.print(f"  cached: {miss['cached_text']!r}")
            console.print(f"  yours:  {miss['your_text']!r}")


def cmd_explain(ctx: Any) -> int:
    report = explain(ctx)
    if ctx.console.as_json:
        ctx.console.json(report)
    else:
        print_explain(ctx.console, report)
    nothing = not report["cached_tokens"] and (report["blocks"] or report["tail"])
    return EXIT_NOT_FOUND if nothing else EXIT_OK
