"""TierCacheConnector: vLLM's KVConnectorBase_V1 over the tiercache daemon. This module only
translates vLLM's objects into plan.py (scheduler side) and transfer.py (worker side) calls.

Scheduler side: how much of each prompt, past vLLM's own prefix cache, the daemon holds (from the
shared index on the same host); which blocks each step loads and writes back. Worker side: copies
those blocks between the daemon and vLLM's paged KV (loads before the forward pass; write-backs
copied out after it and sent by a thread). A daemon that is down, slow or returns a damaged block
costs a recompute, never a wrong token: blocks that could not be loaded are reported to vLLM
(get_block_ids_with_load_errors), which recomputes them under kv_load_failure_policy "recompute";
the scheduler side hears of them (update_connector_output) and has them written back once recomputed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from tiercache.integrations.vllm.link import DaemonLink
from tiercache.integrations.vllm.naming import Namespaces, base_namespace
from tiercache.integrations.vllm.packing import KVPacking, UnsupportedLayout
from tiercache.integrations.vllm.plan import Planner, Transfer
from tiercache.integrations.vllm.settings import ConnectorSettings
from tiercache.integrations.vllm.transfer import KVTransfer
from tiercache.layout import DTYPE_NAMES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """vLLM configures handlers for its own loggers only: send tiercache's records (INFO and up)
    through them too, unless the application configured tiercache's logging itself."""
    ours = logging.getLogger("tiercache")
    if not ours.handlers:
        for handler in logging.getLogger("vllm").handlers:
            ours.addHandler(handler)
        if ours.level == logging.NOTSET:
            ours.setLevel(logging.INFO)
        ours.propagate = False


@dataclass
class TierCacheMetadata(KVConnectorMetadata):
    """What the scheduler side tells the workers for one step. `recomputing`: vLLM block ids whose failed
    load the scheduler learned of since the last step; vLLM recomputes them from this step on."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    recomputing: list[int] = field(default_factory=list)


def attention_spec(kv_cache_config: KVCacheConfig) -> Any:
    """The one full-attention KV cache group's spec; UnsupportedLayout for anything else."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise UnsupportedLayout(f"tiercache connector: needs one full-attention KV cache group, this model has "
                                f"[{kinds}] (sliding-window, hybrid and MLA models are not supported; for a hybrid "
                                "model also pass disable_hybrid_kv_cache_manager=True)")
    spec = groups[0].kv_cache_spec
    if spec.dtype not in DTYPE_NAMES:
        raise UnsupportedLayout(f"tiercache connector: KV cache dtype {spec.dtype} is not supported; "
                                f"use one of {', '.join(map(str, DTYPE_NAMES))}")
    return spec


class TierCacheConnector(KVConnectorBase_V1):
    """tiercache as vLLM's KV connector (kv_role "kv_both"); settings in kv_connector_extra_config."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        self.settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise UnsupportedLayout("tiercache connector: pipeline parallelism is not supported "
                                    f"(pipeline_parallel_size={parallel.pipeline_parallel_size})")
        self.spec = attention_spec(kv_cache_config)
        self.layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        scheduler = role == KVConnectorRole.SCHEDULER
        self.link = DaemonLink(self.settings, timeout_ms=self.settings.lookup_timeout_ms if scheduler else None)
        if scheduler:
            self._recompute_on_load_failure()
            model = vllm_config.model_config
            base = base_namespace(self.settings, model=model.model, revision=model.revision,
                                  model_type=model.hf_config.model_type, dtype=DTYPE_NAMES[self.spec.dtype],
                                  num_layers=len(self.layer_names), num_kv_heads=self.spec.num_kv_heads,
                                  head_dim=self.spec.head_size, block_tokens=self.spec.block_size)
            self.namespaces = Namespaces(self.settings, base, parallel.tensor_parallel_size)
            self.planner = Planner(self.spec.block_size, self.link.lookup)
            self._recomputing: set[int] = set()
            logger.info("tiercache connector: daemon %s, namespace model=%s weights=%s block_tokens=%d adapter=%s",
                        self.settings.target, base.model, base.weights[:16], base.block_tokens,
                        self.namespaces.of()[0].adapter)
        else:
            self.transfer: KVTransfer | None = None
            self._failed_block_ids: set[int] = set()

    def _recompute_on_load_failure(self) -> None:
        """A cache miss must cost a recompute, not a failed request: vLLM's default policy for a block
        that could not be loaded is "fail", so it is set to "recompute" (with a warning)."""
        config = self._kv_transfer_config
        if config.kv_load_failure_policy != "recompute":
            logger.warning("tiercache connector: setting kv_load_failure_policy to 'recompute' (was %r): a block "
                           "the daemon cannot supply is recomputed, never a failed request",
                           config.kv_load_failure_policy)
            config.kv_load_failure_policy = "recompute"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped write-back is a later miss

    # ---- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.mm_features or request.prompt_token_ids is None:
            return 0, False  # placeholder tokens do not name an image's KV: such prompts are not cached
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        namespaces = self.namespaces.of(lora, request.cache_salt)
        matched = self.planner.matched(request.request_id, request.prompt_token_ids, namespaces, num_computed_tokens)
        return matched, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.planner.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled: list[tuple[str, int, int, list[int] | None, bool]] = []
        num_tokens = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            scheduled.append((new.req_id, new.num_computed_tokens, num_tokens[new.req_id], new.block_ids[0], True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            scheduled.append((req_id, cached.num_computed_tokens[i], num_tokens[req_id],
                              ids[0] if ids is not None else None, req_id in cached.resumed_req_ids))
        loads, saves = self.planner.step(scheduled)
        self._skip_zeroing(scheduler_output, loads)
        recomputing, self._recomputing = sorted(self._recomputing), set()
        return TierCacheMetadata(loads, saves, recomputing)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        failed = connector_output.invalid_block_ids
        if failed:  # vLLM recomputes them: written back once recomputed, as blocks never cached
            self.planner.load_failed(failed)
            self._recomputing.update(failed)

    @staticmethod
    def _skip_zeroing(scheduler_output: SchedulerOutput, loads: list[Transfer]) -> None:
        """vLLM zeroes newly allocated blocks before the step; the blocks this step loads are
        overwritten whole (and zeroed by the worker when their load fails), so that pass is skipped,
        as vLLM allows a synchronous loading connector to."""
        to_zero = getattr(scheduler_output, "new_block_ids_to_zero", None)
        if not to_zero or not loads:
            return
        loaded = {block_id for load in loads for block_id in load.block_ids}
        scheduler_output.new_block_ids_to_zero = [b for b in to_zero if b not in loaded] or None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request.request_id)
        return False, None  # write-backs were copied out in the step that computed them

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        context = self._vllm_config.compilation_config.static_forward_context
        backend = context[self.layer_names[0]].attn_backend.get_name()
        packing = KVPacking(backend, [kv_caches[name] for name in self.layer_names],
                            num_kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_size,
                            block_size=self.spec.block_size)
        self.transfer = KVTransfer(self.link, packing, get_tensor_model_parallel_rank(),
                                   self.settings.max_save_queue_blocks)
        logger.info("tiercache connector: %d layers, backend %s, %d-token blocks of %s", len(self.layer_names),
                    backend, self.spec.block_size, packing.block_shape)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, TierCacheMetadata) or self.transfer is None:
            return
        self.transfer.recomputing(meta.recomputing)
        for load in meta.loads:
            failed = self.transfer.load(load)
            for block_id in failed:  # vLLM skipped zeroing them (_skip_zeroing) and recomputes them
                self.transfer.packing.zero(block_id)
            self._failed_block_ids.update(failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are copied out in wait_for_save, all layers at once

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, TierCacheMetadata) or self.transfer is None:
            return
        for save in meta.saves:
            self.transfer.save(save)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        transfer = getattr(self, "transfer", None)
        if transfer is not None:
            transfer.close()
            logger.info("tiercache connector: loaded %d blocks (%d failed, %d copied again) in %.0f ms, stored %d "
                        "(%d dropped, %d left until recomputed) after %.0f ms of copies", transfer.num_loaded,
                        transfer.num_load_failed, transfer.num_refetched, transfer.load_s * 1000,
                        transfer.num_saved, transfer.num_save_dropped, transfer.num_save_unfilled,
                        transfer.save_s * 1000)
        else:
            self.link.close()
