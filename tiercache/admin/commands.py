"""The admin commands that read or change what the daemon holds: stats, ls, flush, evict, pin, unpin, verify."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from tiercache.admin.output import (
    EXIT_DAMAGED,
    EXIT_DECLINED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    fmt_age,
    fmt_bytes,
    fmt_pct,
    fmt_pin,
    fmt_until,
    quoted,
    short,
    table,
    waiting,
)
from tiercache.admin.prompt import has_prompt, prompt_keys
from tiercache.admin.view import (
    Chain,
    NamespaceView,
    build,
    cached_prefix,
    descendants,
    find_blocks,
    find_chain,
    resolve_namespace,
)
from tiercache.client.types import ScrubUsage
from tiercache.errors import InvalidArgument, NotFound
from tiercache.tenancy import scope_keys

MAX_VERIFY_BATCHES = 50  # progress granularity: each batch is one Verify call


def _namespace_json(v: NamespaceView) -> dict[str, Any]:
    d = v.description
    out: dict[str, Any] = {"digest": v.digest.hex(), "model": v.model, "num_blocks": len(v.blocks), "bytes": v.nbytes,
                           "tokens": v.tokens, "described": d is not None}
    if d is not None:
        out.update({k: val for k, val in d.fields().items() if k != "salt_digest"}, salted=bool(d.salt_digest))
    return out


def _chain_json(v: NamespaceView, c: Chain) -> dict[str, Any]:
    return {"id": c.id, "head_store_key": c.head.store_key.hex(), "blocks": len(c.blocks), "tokens": c.tokens,
            "branches": c.branches, "tiers": c.tiers, "hits": c.head.hits, "last_access_unix_s": c.last_access,
            "pinned": c.pinned, "reachable": c.reachable, "preview": v.preview(c.head)}


def _scrub_line(c: ScrubUsage) -> str:
    """The disk scrub's progress and findings in one line."""
    where = (f"{c.pass_fraction:.0%} through a pass" if not c.next_pass_unix_s
             else f"between passes, the next {fmt_until(c.next_pass_unix_s)}")
    state = ", paused while calls are served" if c.paused else ""
    last = f"last full pass ended {fmt_age(c.last_pass_unix_s)}" if c.last_pass_unix_s else "no full pass yet"
    return (f"disk scrub at {fmt_bytes(c.bytes_per_s)}/s: {where}{state}; since start {c.blocks_scrubbed} blocks "
            f"({fmt_bytes(c.bytes_scrubbed)}) verified, {c.damaged_blocks} damaged dropped, {c.passes} passes "
            f"completed; {last}")


def cmd_stats(ctx: Any) -> int:
    s = ctx.client.stats()
    listing = ctx.client.listing()
    views = build(listing)
    if ctx.console.as_json:
        ctx.console.json({**asdict(s), "hit_rate": s.lookups and (s.lookups - s.lookup_misses) / s.lookups,
                          "namespaces": [_namespace_json(v) for v in views], "num_listed": len(listing.entries),
                          "num_total": listing.num_total})
        return EXIT_OK
    p = ctx.console.print
    quota = f", quota {fmt_bytes(s.tenant_quota_bytes)}" if s.tenant_quota_bytes else ""
    p(f"daemon {s.version}, tenant {s.tenant}{quota}")
    # The remote tier is not listed (no capacity, no block counts): its own lines, below.
    local_tiers = [t for t in s.tiers if t.tier != "remote"]
    remote = next((t for t in s.tiers if t.tier == "remote"), None)
    if s.tenant != "local":  # the daemon sends other tenants no aggregates: no column of zeros
        p(table(["TIER", "CAPACITY", "YOURS"],
                [[t.tier, fmt_bytes(t.capacity_bytes), f"{t.tenant_blocks} ({fmt_bytes(t.tenant_bytes)})"]
                 for t in local_tiers]))
        if remote is not None:
            p("remote tier: on (a cluster shared with other daemons)")
        p("(aggregate counters are reported to tenant local only)")
        return EXIT_OK
    p(table(["TIER", "CAPACITY", "USED", "BLOCKS", "YOURS", "LOOKUP HITS", "FETCH HITS", "PROMOTIONS", "EVICTIONS",
             "VERIFY FAILS"],
            [[t.tier, fmt_bytes(t.capacity_bytes),
              f"{fmt_bytes(t.used_bytes)} ({fmt_pct(t.used_bytes, t.capacity_bytes)})",
              t.num_blocks, f"{t.tenant_blocks} ({fmt_bytes(t.tenant_bytes)})",
              f"{t.lookup_hits} ({fmt_pct(t.lookup_hits, s.lookups)})", t.hits, t.promotions, t.evictions,
              t.verification_failures] for t in local_tiers]))
    hits = s.lookups - s.lookup_misses
    p(f"lookups: {s.lookups} keys, {hits} hits ({fmt_pct(hits, s.lookups)}),"
      f" {s.lookup_misses} misses")
    p(f"tokens: {s.tokens_reused} reused, {s.tokens_computed} computed "
      f"({fmt_pct(s.tokens_reused, s.tokens_reused + s.tokens_computed)} reused) over {s.requests_reported} "
      f"reported requests")
    p(f"verification failures: {s.verification_failures}")
    if s.scrub is not None:
        p(_scrub_line(s.scrub))
    if remote is not None and s.remote is not None:
        r = s.remote
        p()
        p("remote tier (a cluster shared with other daemons; this daemon's reads and writes since start):")
        p(table(["HITS", "MISSES", "VERIFY FAILS", "PULLED", "READ", "PUTS", "WRITTEN", "WRITE ERRORS", "DROPPED",
                 "QUEUE", "ERRORS"],
                [[remote.hits, remote.misses, remote.verification_failures, r.blocks_pulled, fmt_bytes(r.bytes_read),
                  remote.puts, fmt_bytes(r.bytes_written), r.write_errors, r.writes_dropped, r.queue_blocks,
                  r.errors]]))
        failed = f"; {r.census_failed_primaries} primaries did not answer" if r.census_failed_primaries else ""
        p(f"in the cluster: about {r.cluster_blocks} blocks, {fmt_bytes(r.cluster_bytes)} (every daemon's, "
          f"estimated from {r.census_samples} random keys{failed})")
    if views:
        p()
        p(table(["NAMESPACE", "MODEL", "BLOCKS", "TOKENS", "BYTES"],
                [[short(v.digest), v.model, len(v.blocks), v.tokens, fmt_bytes(v.nbytes)] for v in views]))
    if s.tenants:
        p()
        p(table(["TENANT", "BLOCKS", "BYTES"], [[t.tenant, t.num_blocks, fmt_bytes(t.bytes)] for t in s.tenants]))
    return EXIT_OK


def cmd_ls(ctx: Any) -> int:
    listing = ctx.client.listing()
    views = build(listing)
    if ctx.args.namespace is not None:
        views = [resolve_namespace(views, ctx.args.namespace)]
    if ctx.console.as_json:
        out = []
        for v in views:
            item = {**_namespace_json(v), "chains": [_chain_json(v, c) for c in v.chains]}
            if ctx.args.blocks:
                item["blocks"] = [{**asdict(b), "store_key": b.store_key.hex(),
                                   "parent_store_key": b.parent_store_key.hex(),
                                   "namespace": b.namespace.hex(), "preview": v.preview(b)}
                                  for c in v.chains for b in c.blocks]
            out.append(item)
        ctx.console.json({"namespaces": out, "num_total": listing.num_total, "num_listed": len(listing.entries)})
        return EXIT_OK
    p = ctx.console.print
    if not views:
        p("no blocks cached")
    for i, v in enumerate(views):
        d = v.description
        extra = f"  {d.dtype}  {d.block_tokens} tokens/block  adapter {d.adapter or '-'}  " \
                f"salt {'set' if d.salt_digest else 'none'}" if d else ""
        p(("\n" if i else "") + f"namespace {short(v.digest)}  model {v.model}{extra}  "
          f"({len(v.blocks)} blocks, {v.tokens} tokens, {fmt_bytes(v.nbytes)})")
        p(table(["CHAIN", "BLOCKS", "TOKENS", "BRANCHES", "TIERS", "HITS", "LAST USE", "PINNED", "PREVIEW"],
                [[c.id, len(c.blocks), c.tokens, c.branches, ",".join(c.tiers), c.head.hits, fmt_age(c.last_access),
                  c.pinned, quoted(v.preview(c.head)) if c.reachable else "(unreachable: its parent was evicted)"]
                 for c in v.chains]))
        if ctx.args.blocks:
            p(table(["  KEY", "PARENT", "TOKENS", "TIERS", "HITS", "LAST USE", "PINNED", "EXPIRES"],
                    [["  " + short(b.store_key), short(b.parent_store_key) or "-", b.num_tokens, ",".join(b.tiers),
                      b.hits, fmt_age(b.last_access), fmt_pin(b.pinned, b.pin_expires_at),
                      fmt_until(b.expires_at)]
                     for c in v.chains for b in c.blocks]))
    if listing.num_total > len(listing.entries):
        p(f"(showing the {len(listing.entries)} most recently used of {listing.num_total} blocks)")
    return EXIT_OK


def cmd_flush(ctx: Any) -> int:
    args, client = ctx.args, ctx.client
    namespace = None
    stats = client.stats()
    enabled = [t.tier for t in stats.tiers]
    if args.tier is not None and args.tier not in enabled:
        raise NotFound(f"tier {args.tier!r} is not enabled (enabled: {', '.join(enabled)})")
    if args.tier == "remote":
        return _flush_remote(ctx)
    if args.tenant:
        usage = {t.tenant: t for t in stats.tenants}
        if args.tenant not in usage:
            raise NotFound(f"tenant {args.tenant!r} holds no blocks (or you are not tenant local)")
        count, nbytes = usage[args.tenant].num_blocks, usage[args.tenant].bytes
        if args.namespace is not None:
            namespace = _full_digest(args.namespace)
    else:
        views = build(client.listing())
        if args.namespace is not None:
            views = [resolve_namespace(views, args.namespace)]
            namespace = views[0].digest
        blocks = [b for v in views for b in v.blocks if args.tier is None or args.tier in b.tiers]
        count, nbytes = len(blocks), sum(b.nbytes for b in blocks)
    scope = (f"tenant {args.tenant}" if args.tenant else "your blocks") + \
        (f", tier {args.tier}" if args.tier else ", every tier" + (" but remote" if "remote" in enabled else "")) + \
        (f", namespace {short(namespace)}" if namespace else "")
    if not count:
        raise NotFound(f"nothing to flush ({scope})")
    # Another tenant's blocks cannot be listed, only counted: with a tier or namespace, the count is
    # that tenant's whole holding, of which the flush takes the matching part.
    amount = f"up to {count} blocks (of {fmt_bytes(nbytes)} that tenant {args.tenant} holds" \
        if args.tenant and (args.tier or namespace) else f"{count} blocks ({fmt_bytes(nbytes)}"
    if not ctx.console.confirm(f"flush {amount}; {scope})?", args.yes):
        ctx.console.err.write("not flushed\n")
        return EXIT_DECLINED
    with waiting(ctx.console.err, f"flushing {count} blocks", ctx.console.live):
        removed = client.flush(tier=args.tier, namespace=namespace, tenant=args.tenant or "")
    if ctx.console.as_json:
        ctx.console.json({"removed": removed, "tier": args.tier, "namespace": namespace.hex() if namespace else None,
                          "tenant": args.tenant})
    else:
        ctx.console.print(f"flushed {removed} blocks ({scope})")
    return EXIT_OK


def _flush_remote(ctx: Any) -> int:
    """flush --tier remote: the tenant's keys in the shared cluster. They cannot be counted before
    (only a scan of the cluster would tell), so the question names what goes, and the answer counts."""
    args = ctx.args
    if args.namespace is not None:
        raise InvalidArgument("--namespace cannot be combined with --tier remote: the remote tier's keys name the "
                              "tenant, not the namespace; flush the whole remote tier (of a tenant), or another tier")
    scope = (f"tenant {args.tenant}" if args.tenant else "your blocks") + ", tier remote"
    if not ctx.console.confirm(f"flush every block of {'tenant ' + args.tenant if args.tenant else 'yours'} in the "
                               "remote tier (the cluster shared with other daemons, which lose these hits too)?",
                               args.yes):
        ctx.console.err.write("not flushed\n")
        return EXIT_DECLINED
    removed = ctx.client.flush(tier="remote", tenant=args.tenant or "")
    if ctx.console.as_json:
        ctx.console.json({"removed": removed, "tier": "remote", "namespace": None, "tenant": args.tenant})
    else:
        ctx.console.print(f"flushed {removed} blocks ({scope})")
    return EXIT_OK if removed else EXIT_NOT_FOUND


def _full_digest(text: str) -> bytes:
    """A namespace named by its whole digest (another tenant's namespaces cannot be listed to match a prefix)."""
    digest = bytes.fromhex(text) if len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text) else None
    if digest is None:
        raise InvalidArgument(f"--namespace {text!r}: with --tenant, give the full 64-hex-digit digest")
    return digest


def _targets(ctx: Any, with_descendants: bool) -> tuple[list[bytes], str]:
    """Store keys named by --chain / --key / a prompt, and how to describe them."""
    args, client = ctx.args, ctx.client
    named = [name for name, given in (("--chain", args.chain is not None), ("--key", bool(args.key)),
                                      ("a prompt", has_prompt(args))) if given]
    if len(named) > 1:
        raise InvalidArgument(f"name the blocks one way, not with {' and '.join(named)}")
    listing = client.listing()
    if args.chain:
        chain = find_chain(build(listing), args.chain)
        return [b.store_key for b in chain.blocks], f"chain {chain.id}"
    if args.key:
        roots = [b.store_key for b in find_blocks(listing, args.key)]
        what = f"{len(roots)} named by --key"
    elif has_prompt(args):
        pk = prompt_keys(args)
        tenant = client.stats().tenant
        keys = pk.keys[: len(cached_prefix(client, listing, tenant, pk.keys))]
        if pk.tail is not None and len(keys) == len(pk.keys) and cached_prefix(client, listing, tenant, [pk.tail]):
            keys.append(pk.tail)
        if not keys:
            raise NotFound("nothing of this prompt is cached")
        roots = scope_keys(tenant, keys)
        what = "the prompt's cached prefix"
    else:
        raise InvalidArgument("name the blocks: --chain ID, --key KEY (repeatable) or a prompt (--prompt ...)")
    keys = descendants(listing, roots) if with_descendants else roots
    more = f" and the {len(keys) - len(roots)} blocks chained after them" if len(keys) > len(roots) else ""
    return keys, what + more


def cmd_evict(ctx: Any) -> int:
    keys, what = _targets(ctx, with_descendants=True)  # a block is useless without its parents
    if not ctx.console.confirm(f"evict {len(keys)} blocks ({what}) from every tier, pins notwithstanding?",
                               ctx.args.yes):
        ctx.console.err.write("not evicted\n")
        return EXIT_DECLINED
    evicted = ctx.client.evict(store_keys=keys)
    if ctx.console.as_json:
        ctx.console.json({"evicted": evicted})
    else:
        ctx.console.print(f"evicted {evicted} blocks")
    return EXIT_OK if evicted else EXIT_NOT_FOUND


def cmd_pin(ctx: Any) -> int:
    keys, what = _targets(ctx, with_descendants=False)
    if ctx.args.command_name == "pin":
        count = ctx.client.pin(store_keys=keys, ttl_s=ctx.args.ttl)
        until = f" for {ctx.args.ttl:g} s" if ctx.args.ttl else " until unpinned"
    else:  # only blocks that were pinned count
        count = ctx.client.unpin(store_keys=keys)
        until = f"; {len(keys) - count} of them were not pinned" if count < len(keys) else ""
    verb = ctx.args.command_name + "ned"
    if ctx.console.as_json:
        ctx.console.json({verb: count, "ttl_s": getattr(ctx.args, "ttl", None)})
    else:
        ctx.console.print(f"{verb} {count} blocks ({what}){until}")
    return EXIT_OK if count else EXIT_NOT_FOUND


def cmd_verify(ctx: Any) -> int:
    keys = [b.store_key for b in ctx.client.listing().entries]
    batch = max(1, -(-len(keys) // MAX_VERIFY_BATCHES))
    progress = ctx.console.progress(len(keys), "verifying")
    checked = failed = 0
    dropped: list[bytes] = []
    integrity_ok, integrity_error = True, ""
    try:
        for start in range(0, max(len(keys), 1), batch):
            result = ctx.client.verify(keys[start : start + batch] or ())
            checked += result.num_checked
            failed += result.num_failed
            dropped += result.dropped_store_keys
            integrity_ok, integrity_error = result.integrity_ok, result.integrity_error
            progress.update(min(start + batch, len(keys)))
            if not keys:
                break
    finally:
        progress.close()
    if ctx.console.as_json:
        ctx.console.json({"blocks": len(keys), "copies_checked": checked, "failed": failed,
                          "dropped_store_keys": [k.hex() for k in dropped], "integrity_ok": integrity_ok,
                          "integrity_error": integrity_error})
    else:
        ctx.console.print(f"verified {len(keys)} blocks ({checked} copies): {failed} damaged"
                          + (f" and dropped: {', '.join(short(k) for k in dropped)}" if failed else "")
                          + f"; store integrity {'ok' if integrity_ok else 'BROKEN: ' + integrity_error}")
    return EXIT_OK if not failed and integrity_ok else EXIT_DAMAGED
