"""The cache as an operator sees it: List's blocks grouped into namespaces and prefix chains."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from tiercache.admin.output import short
from tiercache.block import TIER_ORDER
from tiercache.client.types import ListedBlock, Listing, NamespaceDescription
from tiercache.errors import InvalidArgument, NotFound
from tiercache.tenancy import scope_keys

MIN_PREFIX_HEX = 4  # shortest key/namespace prefix accepted on the command line


@dataclass
class Chain:
    """A prefix tree: a head block and every cached block chained after it (parents before children).

    `tokens` is the longest cached path, `branches` how many distinct continuations (leaves) it has.
    A head whose parent is no longer cached is unreachable: Lookup stops before it.
    """

    head: ListedBlock
    blocks: list[ListedBlock]
    tokens: int
    branches: int

    @property
    def id(self) -> str:
        return short(self.head.store_key)

    @property
    def reachable(self) -> bool:
        return not self.head.parent_store_key

    @property
    def tiers(self) -> list[str]:
        present = {t for b in self.blocks for t in b.tiers}
        return [t for t in TIER_ORDER if t in present]

    @property
    def last_access(self) -> float:
        return max(b.last_access for b in self.blocks)

    @property
    def pinned(self) -> str:
        count = sum(b.pinned for b in self.blocks)
        return "yes" if count == len(self.blocks) else "part" if count else "no"


@dataclass
class NamespaceView:
    digest: bytes
    description: NamespaceDescription | None
    blocks: list[ListedBlock]
    chains: list[Chain]

    @property
    def model(self) -> str:
        return self.description.model if self.description else "(not described)"

    @property
    def salted(self) -> bool:
        """Described with a salt: one user's prompts. Workers store no preview for them; blocks
        written before they stopped may still carry one, which the admin CLI never shows."""
        return self.description is not None and bool(self.description.salt_digest)

    def preview(self, block: ListedBlock) -> str:
        """The block's preview as the admin CLI may show it: none for a salted namespace."""
        return "" if self.salted else block.preview

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @property
    def tokens(self) -> int:
        return sum(b.num_tokens for b in self.blocks)


def _chains(blocks: list[ListedBlock]) -> list[Chain]:
    present = {b.store_key for b in blocks}
    children: dict[bytes, list[ListedBlock]] = defaultdict(list)
    for b in blocks:
        children[b.parent_store_key].append(b)
    chains = []
    for head in (b for b in blocks if b.parent_store_key not in present):
        order, depth, leaves = [head], {head.store_key: head.num_tokens}, 0
        for block in order:  # grows while we walk: breadth first, parents before children
            kids = children.get(block.store_key, [])
            leaves += not kids
            for kid in kids:
                depth[kid.store_key] = depth[block.store_key] + kid.num_tokens
                order.append(kid)
        chains.append(Chain(head, order, max(depth.values()), leaves))
    chains.sort(key=lambda c: c.last_access, reverse=True)
    return chains


def build(listing: Listing) -> list[NamespaceView]:
    """Namespaces (most recently used first), each with its chains."""
    by_ns: dict[bytes, list[ListedBlock]] = defaultdict(list)
    for b in listing.entries:
        by_ns[b.namespace].append(b)
    described = {d.digest: d for d in listing.namespaces}
    views = [NamespaceView(ns, described.get(ns), blocks, _chains(blocks)) for ns, blocks in by_ns.items()]
    views.sort(key=lambda v: max(b.last_access for b in v.blocks), reverse=True)
    return views


def _hex_prefix(text: str, what: str) -> str:
    prefix = text.lower()
    if len(prefix) < MIN_PREFIX_HEX or any(c not in "0123456789abcdef" for c in prefix):
        raise InvalidArgument(f"{what} {text!r}: expected at least {MIN_PREFIX_HEX} hex digits")
    return prefix


def resolve_namespace(views: list[NamespaceView], text: str) -> NamespaceView:
    """The namespace named by a digest prefix or a model name; NotFound / InvalidArgument if none or several."""
    matches = [v for v in views if v.description and v.description.model == text]
    if not matches and all(c in "0123456789abcdefABCDEF" for c in text):
        prefix = _hex_prefix(text, "namespace")
        matches = [v for v in views if v.digest.hex().startswith(prefix)]
    if not matches:
        raise NotFound(f"no cached namespace matches {text!r} (see `tiercache admin ls`)")
    if len(matches) > 1:
        digests = ", ".join(short(v.digest) for v in matches)
        raise InvalidArgument(f"{text!r} matches {len(matches)} namespaces ({digests}); give a longer digest prefix")
    return matches[0]


def find_chain(views: list[NamespaceView], text: str) -> Chain:
    """The chain whose id (head store key) starts with `text`."""
    prefix = _hex_prefix(text, "chain")
    matches = [c for v in views for c in v.chains if c.head.store_key.hex().startswith(prefix)]
    if not matches:
        raise NotFound(f"no cached chain {text!r} (see `tiercache admin ls`)")
    if len(matches) > 1:
        raise InvalidArgument(f"chain {text!r} is ambiguous ({len(matches)} match); give more digits")
    return matches[0]


def find_blocks(listing: Listing, texts: list[str]) -> list[ListedBlock]:
    """The blocks whose store keys start with each of `texts` (one each, else an error)."""
    found = []
    for text in texts:
        prefix = _hex_prefix(text, "key")
        matches = [b for b in listing.entries if b.store_key.hex().startswith(prefix)]
        if not matches:
            raise NotFound(f"no cached block {text!r} (see `tiercache admin ls --blocks`)")
        if len(matches) > 1:
            raise InvalidArgument(f"key {text!r} is ambiguous ({len(matches)} match); give more digits")
        found.append(matches[0])
    return found


def descendants(listing: Listing, roots: list[bytes]) -> list[bytes]:
    """Store keys of `roots` and every cached block chained after them (useless once they go)."""
    children: dict[bytes, list[bytes]] = defaultdict(list)
    for b in listing.entries:
        children[b.parent_store_key].append(b.store_key)
    out, seen = list(roots), set(roots)
    for key in out:
        for kid in children.get(key, []):
            if kid not in seen:
                seen.add(kid)
                out.append(kid)
    return out


def cached_prefix(client: object, listing: Listing | None, tenant: str, keys: list[bytes]) -> list[str]:
    """Fastest tier of each block of the cached prefix of client `keys`, as Lookup would answer.

    Read from a listing, so that inspecting a prompt is not counted as a lookup in the daemon's hit
    rate; Lookup itself only when the listing was cut short by its limit.
    """
    if listing is None or not keys:
        return []
    if listing.num_total > len(listing.entries):
        return client.lookup(keys)  # type: ignore[attr-defined]
    by_key = {b.store_key: b for b in listing.entries}
    now = time.time()
    tiers = []
    for key in scope_keys(tenant, keys):
        block = by_key.get(key)
        if block is None or (block.expires_at and block.expires_at <= now and not block.pinned):
            break
        tiers.append(block.tiers[0])
    return tiers
