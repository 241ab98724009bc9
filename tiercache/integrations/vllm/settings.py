"""The connector's settings: vLLM's kv_connector_extra_config, validated into a frozen dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

ENGINE = "vllm"


@dataclass(frozen=True)
class ConnectorSettings:
    """What `kv_connector_extra_config` may hold; unknown keys are errors.

    socket / address: the daemon, on its Unix socket (same host: shared-memory fetches) or at
    host:port over TCP (then `token` or `token_file` names the tenant). `salt` isolates users who must
    not share KV (DESIGN.md, block keys). `lookup_timeout_ms` bounds the scheduler's calls (vLLM's
    whole engine waits on them), `timeout_ms` the workers' fetches and writes; `retry_after_s` is how
    long a daemon that failed is left alone before it is tried again (vLLM recomputes meanwhile).
    `share_with_hf_worker` drops the engine from the namespace so the HF worker (same model, dtype
    and block size) and vLLM read each other's blocks: off by default, as their kernels round
    differently. `model_name` overrides the model's name in the namespace.
    `max_save_queue_blocks` bounds the blocks waiting to be written back (beyond it they are
    dropped and counted: a cache may forget, the forward pass must not wait).
    """

    socket: str = ""
    address: str = ""
    token: str = ""
    token_file: str = ""
    salt: str = ""
    lookup_timeout_ms: int = 250
    timeout_ms: int = 5000
    retry_after_s: float = 5.0
    share_with_hf_worker: bool = False
    model_name: str = ""
    max_save_queue_blocks: int = 256

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> ConnectorSettings:
        """Settings from vLLM's extra config; ValueError naming the key for an unknown key or bad value."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"tiercache connector: unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                             f"expected some of {', '.join(known)}")
        values: dict[str, object] = {}
        for name, value in extra.items():
            default = getattr(cls, name)
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"tiercache connector: {name} must be true or false, got {value!r}")
            elif isinstance(default, (int, float)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(f"tiercache connector: {name} must be a positive number, got {value!r}")
                if isinstance(default, int) and value != int(value):
                    raise ValueError(f"tiercache connector: {name} must be an integer, got {value!r}")
                value = type(default)(value)
            elif not isinstance(value, str):
                raise ValueError(f"tiercache connector: {name} must be a string, got {value!r}")
            values[name] = value
        settings = cls(**values)  # type: ignore[arg-type]  # each value checked above against its field's default
        if settings.socket and settings.address:
            raise ValueError("tiercache connector: give socket or address, not both")
        if not settings.socket and not settings.address:
            raise ValueError("tiercache connector: kv_connector_extra_config needs socket (the daemon's Unix "
                             "socket path) or address (host:port)")
        if settings.token and settings.token_file:
            raise ValueError("tiercache connector: give token or token_file, not both")
        return settings

    @property
    def target(self) -> str:
        """The gRPC target of the daemon."""
        return f"unix:{self.socket}" if self.socket else self.address

    def read_token(self) -> str | None:
        """The bearer token (from token_file when given, stripped), or None."""
        if self.token_file:
            with open(self.token_file, encoding="utf-8") as f:
                return f.read().strip() or None
        return self.token or None
