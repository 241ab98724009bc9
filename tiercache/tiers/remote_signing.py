"""The remote tier's signed values: TCR2 (AES-256-GMAC under a key per value) written, TCR1 (HMAC-SHA256) read."""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

# value = MAGIC + signature + record, signature = key id (8) + salt (16) + AES-GMAC tag (16); see Signer
MAGIC = b"TCR2"
KEY_ID_BYTES, SALT_BYTES, TAG_BYTES = 8, 16, 16
MAC_BYTES = KEY_ID_BYTES + SALT_BYTES + TAG_BYTES  # the signature's length
LEGACY_MAGIC = b"TCR1"  # value = LEGACY_MAGIC + HMAC-SHA256(secret, redis key + record) + record: read, never written
LEGACY_MAC_BYTES = 32
_NONCE = bytes(12)  # fixed: every value key authenticates one value (Signer)
_KEY_ID_AT, _SALT_AT, _TAG_AT, _RECORD_AT = 4, 4 + KEY_ID_BYTES, 4 + KEY_ID_BYTES + SALT_BYTES, 4 + MAC_BYTES


class Unverified(Exception):
    """A value this daemon cannot verify; the message says why."""


class Signer:
    """Signs values with the first of a daemon's secrets; verifies values signed with any of them.

    A value's signature is key id | salt | tag (MAGIC before it, the record after it):
      key id    = HMAC-SHA256(secret, "tiercache-remote-key-id")[:8], names the secret that signed
      salt      = 16 random bytes, fresh for every value written
      value key = HMAC-SHA256(HMAC-SHA256(secret, "tiercache-remote-v2 key"), salt + redis key)
      tag       = AES-256-GMAC(value key, nonce 0^96, record): AES-GCM, empty plaintext, the record as
                  associated data
    Each value key authenticates exactly one value, so the fixed nonce never repeats under a key:
    two values share a value key only when they share salt and redis key, a 128-bit salt collision
    that has odds of at most n^2 / 2^129 over the n values a secret signs (2^-49 after 2^40), where
    a random 96-bit nonce per value under one key would be safe for only about 2^32 values. The
    redis key (which names the tenant) is bound through the value key: a value copied under another
    key fails. Under the secret itself only two fixed labels are hashed; neither holds a ":", and
    the input of a TCR1 HMAC (a redis key, then the record) always does: no TCR1 tag is ever a key
    id or master key here.

    TCR1 values (the format before) verify by their HMAC under any listed secret, tried in order.
    Thread-safe: no state changes after construction.
    """

    def __init__(self, secrets: Sequence[bytes]) -> None:
        assert secrets, "a signer needs at least one secret"
        self._secrets = list(dict.fromkeys(secrets))  # for TCR1, which names no secret
        self._masters: dict[bytes, bytes] = {}  # key id -> the secret's master key of this scheme
        for secret in self._secrets:
            key_id = hmac.digest(secret, b"tiercache-remote-key-id", "sha256")[:KEY_ID_BYTES]
            self._masters.setdefault(key_id, hmac.digest(secret, b"tiercache-remote-v2 key", "sha256"))
        self._key_id = next(iter(self._masters))

    @property
    def key_ids(self) -> list[str]:
        """The listed secrets' key ids in hex, the signing one first: safe to log, equal for equal secrets."""
        return [key_id.hex() for key_id in self._masters]

    def sign(self, rkey: bytes, record: bytes | memoryview) -> bytes:
        """The signature of `record` under its Redis key `rkey`, with the first secret (a fresh salt each call)."""
        salt = os.urandom(SALT_BYTES)
        key = hmac.digest(self._masters[self._key_id], salt + rkey, "sha256")
        return self._key_id + salt + AESGCM(key).encrypt(_NONCE, b"", record)

    def record(self, rkey: bytes, value: bytes) -> tuple[memoryview, bool]:
        """The record that `value`, read under `rkey`, carries (a view of it) and whether it is a TCR1
        value; raises Unverified when it is no signed value, its secret is not listed or its tag fails."""
        view = memoryview(value)
        magic = view[: len(MAGIC)]
        if magic == MAGIC and len(view) >= _RECORD_AT:
            master = self._masters.get(bytes(view[_KEY_ID_AT:_SALT_AT]))
            if master is None:
                raise Unverified("signed with a secret this daemon does not list (dropped in a rotation, or never "
                                 "shared)")
            key = hmac.digest(master, bytes(view[_SALT_AT:_TAG_AT]) + rkey, "sha256")
            record = view[_RECORD_AT:]
            try:
                AESGCM(key).decrypt(_NONCE, view[_TAG_AT:_RECORD_AT], record)
            except InvalidTag:
                raise Unverified("fails its MAC (damaged, or copied from another key)") from None
            return record, False
        if magic == LEGACY_MAGIC and len(view) >= len(LEGACY_MAGIC) + LEGACY_MAC_BYTES:
            signature, record = view[4 : 4 + LEGACY_MAC_BYTES], view[4 + LEGACY_MAC_BYTES :]
            for secret in self._secrets:
                mac = hmac.new(secret, rkey, "sha256")
                mac.update(record)
                if hmac.compare_digest(signature, mac.digest()):
                    return record, True
            raise Unverified("a TCR1 value that fails its HMAC under every listed secret")
        raise Unverified("not a signed value")
