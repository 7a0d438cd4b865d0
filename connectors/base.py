"""The connector API: the contract between the engine and everything below G1.

It mirrors vLLM's V1 connector in shape, with a scheduler side (bookkeeping, no tensors) and
a worker side (moves bytes). Both sides live on one object here because kvtier runs them in
one process; a connector must still keep them apart: scheduler-side methods never touch
tensors, worker-side methods never change scheduling state.

A step, as the engine drives it:

    scheduler: get_num_new_matched_tokens -> (allocate) -> update_state_after_alloc
               build_connector_meta(step)                    # what to load/store this step
    worker:    start_load_kv(meta) ; forward ; wait_for_save()   # loads/stores run async
    engine:    get_finished() -> FinishedTransfers              # which loads completed
    scheduler: request_finished(request, block_ids) -> kv_transfer_params

A connector that must read a finished request's blocks after it ends takes its own refs on them
(`BlockPool.acquire`) and releases them when done: there is no delayed free.

Most plugin authors want `connectors.backend.StorageBackend` instead: the tiered offload
connector stacks backends as tiers.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from connectors.pd import PDRequest
    from kvstore.events import LoRATag
    from kvstore.keys import BlockKey


class RequestView(Protocol):
    """What a connector may read of the engine's request (`engine.core.request.Request` has these).
    `full_block_keys(block_size)` gives the keys of its full blocks (computed once, by the request
    itself); a connector never writes a request, it reports through return values."""

    request_id: str
    all_token_ids: list[int]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    cache_salt: str | None
    priority: int
    arrival_time: float  # time.monotonic() when the engine took it (tiers' eviction policies see it)
    session: str | None  # the client's conversation hint (prompt_cache_key or user), for eviction policies
    error: str | None  # set when the request failed
    pd: PDRequest | None  # prefill/decode disaggregation role (connectors/pd.py), from kv_transfer_params
    lora_tag: LoRATag | None  # the LoRA adapter its KV is computed under (in its block keys already), for events

    def full_block_keys(self, block_size: int) -> list[BlockKey]: ...




def tier_entries(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-tier entries of a connector's `stats()` (a tier's entry has `hit_tokens`), in the
    connector's order: G2, then its storage tiers."""
    return {k: v for k, v in stats.items() if isinstance(v, dict) and "hit_tokens" in v}


@dataclass(frozen=True)
class FinishedTransfers:
    """What `get_finished` reports: the requests whose asynchronous loads completed (all of their
    blocks, or up to a failed one: `get_block_ids_with_load_errors` says which)."""

    loaded: frozenset[str] = frozenset()


@dataclass
class ConnectorMeta:
    """What the scheduler side tells the worker side for one step (connector-specific)."""

    loads: list[Any] = field(default_factory=list)
    stores: list[Any] = field(default_factory=list)


class KVConnector(ABC):
    # Whether the connector takes G1 laid out in several KV groups (engine/kv/kv_groups.py: sliding
    # layers keep only their window). The engine gives any other connector one group of every layer.
    supports_kv_groups: ClassVar[bool] = False

    def set_kv_groups(self, windows: tuple[int, ...]) -> None:
        """Called once, before any request, when G1 has several KV groups or one sliding one
        (`windows`: each group's sliding window, 0 for full attention; group 0 is full attention
        when any is). From then on
        `block_ids` in `update_state_after_alloc` and `build_connector_meta` are one list per group,
        with -1 for blocks the request no longer holds (a sliding group's that left its window);
        a block of `register_kv_caches`' tensor holds one group's layers; and a request's prefix
        of N tokens is served by full groups' blocks before N and sliding groups' window before N."""
        raise NotImplementedError(f"{type(self).__name__} does not take several KV groups")

    def shard_over(self, peers: Any) -> None:
        """Called once on rank 0 of a tensor-parallel engine, before any request: `peers`
        (connectors/sharded.TransferPeers) runs this connector's plans on the other ranks. A
        connector that moves KV must move every rank's shard of it; the default refuses."""
        raise ValueError(f"{type(self).__name__} does not work with tensor parallelism")

    # ---- scheduler side ----------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` (G1 hits) this connector can supply, and whether
        the load is asynchronous (the request then waits in WAITING_FOR_REMOTE_KVS). Must not
        exceed `request.num_tokens - 1 - num_computed_tokens`: the last token is always computed."""

    @abstractmethod
    def update_state_after_alloc(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        """G1 blocks were allocated for the request; the external tokens go into
        `block_ids[num_computed // block_size : ...]`."""

    @abstractmethod
    def build_connector_meta(self, scheduled: list[tuple[RequestView, int, list[int]]]) -> ConnectorMeta:
        """Called once per step after scheduling with (request, num_new_tokens, block_ids)."""

    def take_load_split(self, req_id: str) -> dict[str, int]:
        """For the load just finished for `req_id`: the prompt tokens each tier was to supply,
        in lookup order (tier name -> tokens). The engine trims it to what landed and reports it
        per request (`cached_tokens_by_tier`). Called once per load; connectors without tiers
        return {}."""
        return {}

    def request_finished(self, request: RequestView, block_ids: list[int]) -> dict[str, Any] | None:
        """The request ended (its blocks are freed right after): returns its kv_transfer_params."""
        return None

    def check_pd(self, pd: PDRequest) -> None:
        """ValueError unless this connector can play `pd.role` for a request (called before the
        request is accepted, so a request it cannot honour is a 400, not a silent recompute)."""
        raise ValueError("kv_transfer_params (prefill/decode disaggregation) need a shared tier below G1 to "
                         "move KV through: start the server with --kv-offload-remote URL")

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The G1 tensor `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`."""

    def register_hidden_cache(self, hidden_cache: torch.Tensor) -> None:
        """The paged exported hidden states `[num_blocks, block_size, num_ids, hidden]`, indexed
        by the same block ids as the KV (only when hidden-state export is on)."""

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Begin this step's loads; must not block on I/O."""

    def wait_for_save(self, meta: ConnectorMeta) -> None:
        """Called after the forward: begin (not finish) this step's stores."""

    @abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """The transfers that completed since the last call. Called at the start of every step."""

    def busy(self) -> bool:
        """Transfers are in flight that hold engine resources (G1 blocks); the engine waits
        for them rather than declaring itself stuck."""
        return False

    def wait_for_progress(self, timeout: float) -> None:
        """Block until a transfer finishes or `timeout` seconds pass. The engine calls it when
        nothing can run but transfers, so that it sleeps instead of spinning on the cores the
        copies need. The default polls in short sleeps; a connector with a completion signal
        should wait on it."""
        time.sleep(min(timeout, 0.0005))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """G1 blocks whose async load failed since the last call (vLLM's name). The engine
        keeps what was loaded before a request's first failed block and recomputes the rest."""
        return set()

    def flush(self) -> None:
        """Block until queued transfers have finished (tests, benchmarks, shutdown)."""

    def wait_for_outputs(self) -> None:
        """Block until what finished requests were promised in `kv_transfer_params` exists
        (e.g. their files are written). The offline API calls it before returning outputs."""

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Flush pending writes and stop threads."""


class NullConnector(KVConnector):
    """No tiers below G1 and no plugins: the engine's connector when none is configured, so the
    engine never branches on whether there is one."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduled: list[tuple[RequestView, int, list[int]]]) -> ConnectorMeta:
        return ConnectorMeta()

    def get_finished(self) -> FinishedTransfers:
        return FinishedTransfers()
