"""Builds an engine's parts from its config: the model and tokenizer, G1's size and KV layout,
the runner (compiled and warmed up), the connector, the proposer and the scheduler. The order
matters: on a GPU with no explicit G1 size the model loads first and a profiled forward says
what memory G1 gets; G1's block size covers the draft's KV beside the target's; the connector
wraps G1's pool; the scheduler gets the connector and the proposer's lookahead."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from connectors.base import KVConnector, NullConnector
from connectors.factory import supports_kv_groups
from engine.config import EngineConfig
from engine.run_mode import cpu_kv_cache_gib
from engine.core import gpu_memory
from engine.core.connector_setup import OffloadQuant, OffloadSettings, make_connector
from engine.core.request_factory import RequestFactory
from engine.core.scheduler import Scheduler
from engine.core.setup import (attention_backend, eos_ids, kv_layout, step_token_budget,
                               warn_unused_gpu_memory_utilization)
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.kv_events import ZmqEventPublisher, open_events
from engine.kv.kv_groups import KVLayout
from engine.lora.adapter import AdapterInfo, max_adapter_bytes
from engine.lora.registry import LoRARegistry
from engine.lora.slots import LoRASlots
from engine.model_config import ModelConfig, load_model_config, resolve_offload_dtype
from engine.parallel.ranks import Ranks
from engine.parallel.shard import TPShard
from engine.runner import cpu_runtime, cpu_threads, stack_chunks
from engine.runner.compiled import CompiledForward, compile_errors
from engine.runner import kv_quant
from engine.runner.loader import load_model, load_tokenizer, weight_files
from engine.runner.graphs import graph_mode_for
from engine.runner.model_runner import ModelRunner, kv_cache_bytes_per_block
from engine.sample.sampler import Sampler
from engine.sample.stop import detokenize
from engine.spec.decode import SpecDecoder
from engine.spec.proposers import DraftPlan
from kvstore.events import EventBuffer
from kvstore.g1 import BlockPool
from policies import make_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class EngineParts:
    """What `EngineCore` runs, built once."""
    model_config: ModelConfig
    tokenizer: object
    eos_token_ids: frozenset[int]
    requests: RequestFactory
    max_model_len: int
    max_num_batched_tokens: int
    pool: BlockPool
    kv: KVCacheManager
    runner: ModelRunner
    threads: cpu_threads.ThreadGovernor | cpu_threads.FixedThreads | None  # what keeps the thread count (CPU)
    events: EventBuffer | None
    publisher: ZmqEventPublisher | None
    connector: KVConnector
    sampler: Sampler
    spec: SpecDecoder | None
    scheduler: Scheduler
    loras: LoRARegistry | None  # enable_lora: the adapters and their slots


def _one_group_reason(config: EngineConfig) -> str | None:
    """Why every layer must keep its history in one KV group, if it must (setup.kv_layout)."""
    if config.hidden_states is not None:
        return "hidden-state export reads every layer's history"
    if (config.offload_enabled or config.kv_transfer_config) and not supports_kv_groups(config.kv_transfer_config):
        return "the KV connector copies every layer of a block"
    return "--disable-hybrid-kv-cache-manager" if config.disable_hybrid_kv_cache_manager else None


def _fit_max_len(config: EngineConfig, layout: KVLayout, num_blocks: int, max_len: int) -> int:
    """max_model_len such that one sequence fits in G1: an explicit one that does not is an error,
    the model's default is lowered (logged)."""
    bs = config.block_size
    need = layout.blocks_per_sequence(max_len, bs, step_token_budget(config, max_len))
    if need <= num_blocks:
        return max_len
    if config.max_model_len is not None:
        raise ValueError(f"max_model_len={max_len} needs {need} KV blocks but G1 has {num_blocks}; "
                         "raise num_gpu_blocks / kv_cache_memory_gib or lower max_model_len")
    while max_len > bs and layout.blocks_per_sequence(max_len, bs, step_token_budget(config, max_len)) > num_blocks:
        max_len -= bs  # a few hundred iterations at most: G1 is small here
    log.warning("max_model_len lowered to %d so one sequence fits in G1 (%d blocks)", max_len, num_blocks)
    return max_len


def _warm_up(runner: ModelRunner, threads: cpu_threads.ThreadGovernor | cpu_threads.FixedThreads | None) -> None:
    """Compiles now (logged), not in the first request's step; at each thread count the CPU may use."""
    try:
        if threads is not None:
            threads.warm_up(runner.warm_up)
        else:
            runner.warm_up()
    except compile_errors() as e:
        runner.use_eager()
        log.warning("torch.compile failed, the model runs eagerly (with torch ops, not the fused C++ "
                    "ones; -O0 or --enforce-eager avoid this): %s", str(e).strip().splitlines()[0][:300])


def _adapter_bytes(mc: ModelConfig, max_rank: int) -> int:
    """The largest adapter weights file this model can take (`max_adapter_bytes`), from the whole
    model's shapes (a tensor-parallel rank's are a share of them)."""
    h, q, kv, inter = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    return max_adapter_bytes(mc.num_layers, max_rank, {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv),
                                                       "o_proj": (q, h), "gate_proj": (h, inter),
                                                       "up_proj": (h, inter), "down_proj": (inter, h)})


def _load_lora(slots: LoRASlots, ranks: Ranks | None, slot: int, info: AdapterInfo) -> None:
    """Rank 0 reads and checks the adapter into `slot` first (a ValueError leaves it as it was);
    then every other tensor-parallel rank loads its shard of the same files."""
    slots.load(slot, info)
    if ranks is not None:
        ranks.load_lora(slot, info.name, str(info.path), info.digest)


def build(config: EngineConfig) -> EngineParts:
    stack_chunks.install()  # before the first step: the step loop's depth is its caller's
    model_dir = Path(config.model)
    full = load_model_config(model_dir, config.dtype, config.device, config.kv_cache_dtype)
    shard = TPShard(0, config.tensor_parallel_size)
    if not shard.trivial and config.device != "cpu":
        raise ValueError(f"tensor_parallel_size={shard.size}: tensor parallelism runs on CPU ranks (gloo) for now")
    if full.multimodal and not shard.trivial:
        raise ValueError(f"tensor_parallel_size={shard.size}: a model that takes images runs on one rank for now")
    mc = shard.config(full)  # this rank's heads and MLP columns
    tokenizer = load_tokenizer(model_dir)
    eos = eos_ids(model_dir, tokenizer)
    bs = config.block_size
    hidden = config.hidden_states
    if hidden is not None:
        hidden.check_model(mc.num_layers)
    plan = DraftPlan.make(config.speculative, config, mc) if config.speculative is not None else None
    if config.enable_lora and mc.multimodal:
        raise ValueError("enable_lora with a model that takes images is not supported yet")
    if config.enable_lora and plan is not None and (plan.draft or plan.eagle3):
        # vLLM's behaviour too: the draft cannot know the adapter, so it proposes what the base
        # model (or EAGLE-3 head, from the adapted target's hidden states) would; verification
        # under the adapter keeps the output exact, only the acceptance rate can drop.
        log.info("enable_lora with speculative decoding: the draft runs without the adapters")
    if plan is not None and (plan.draft or plan.eagle3) and mc.multimodal:
        raise ValueError("speculative decoding with a draft model or EAGLE-3 on a model that takes images is not "
                         "supported yet (ngram is)")
    one_group = _one_group_reason(config)
    if plan is not None and (plan.draft or plan.eagle3) and kv_layout(mc, one_group).groups[0].window:
        # A draft's KV (full attention) follows group 0's table, which then must keep its history.
        one_group = "a draft's full-attention KV follows a sliding group's table"
    layout = kv_layout(mc, one_group)  # the other tensor-parallel ranks get the same reason, so the same layout
    # G1 blocks carry the draft's KV beside the target's: both index the same block ids.
    per_block = kv_cache_bytes_per_block(mc, bs, len(hidden.layer_ids) if hidden else 0, layout.slots) + (
        plan.kv_bytes_per_block(bs) if plan is not None else 0)
    max_len = config.max_model_len or mc.max_position_embeddings
    if max_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={mc.max_position_embeddings}")
    torch.manual_seed(config.seed)
    backend = attention_backend(config.device)
    # On a GPU with no explicit size, G1 is what gpu_memory_utilization leaves after the weights
    # and a profiled forward, so the model loads first (its rope tables at the longest length).
    profiled = config.device != "cpu" and config.num_gpu_blocks is None and config.kv_cache_memory_gib is None
    compiled = config.optimization_level > 0  # resolved: 0 under enforce_eager
    model = load_model(model_dir, mc, backend, max_len, config.device, compiled=compiled) if profiled else None
    if profiled:
        num_blocks = gpu_memory.profiled_num_blocks(
            model, mc, config.device, config.gpu_memory_utilization, per_block,
            step_token_budget(config, max_len), config.max_num_seqs, bs, max_len,
            graph_tokens=config.max_cudagraph_capture_size if config.cudagraph_mode.captures else 0)
    else:
        num_blocks = config.num_gpu_blocks or int((config.kv_cache_memory_gib or cpu_kv_cache_gib()) * 2**30 // per_block)
        warn_unused_gpu_memory_utilization(config)
    max_len = _fit_max_len(config, layout, num_blocks, max_len)
    budget = step_token_budget(config, max_len)
    ranks = Ranks(config, num_blocks, max_len, one_group, mc.dtype) if not shard.trivial else None
    try:
        if model is None:
            model = load_model(model_dir, mc, backend, max_len, config.device, compiled=compiled, shard=shard,
                               full_config=full)
        slots = LoRASlots(model, mc.num_layers, config.max_loras, config.max_lora_rank, config.lora_targets, mc.dtype,
                          config.device, shard, full) if config.enable_lora else None  # before the hooks: see LoRASlots
        if ranks is not None:
            ranks.connect()
            shard.attach(model, ranks.all_reduce)
        if resolve_offload_dtype(config.kv_offload_dtype, mc.kv_dtype) is not None and not OffloadSettings.of(config).tiered:
            # e.g. only a HiddenStatesConnector: nothing would narrow
            raise ValueError(f"kv_offload_dtype {config.kv_offload_dtype}: kv_transfer_config builds no offload tiers")
        reduce_max = ranks.all_max if ranks is not None else None
        # Under tensor parallelism the workers calibrate with rank 0 here (engine/parallel/worker.start).
        offload = OffloadQuant.make(config.kv_offload_dtype, mc, model, model_dir, tokenizer, bs, config.device,
                                    max_len, reduce_max)
        mc = kv_quant.prepare(model, mc, model_dir, weight_files(model_dir), tokenizer, bs, config.device, max_len,
                              reduce_max=reduce_max)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    events, publisher = open_events(config.kv_events_config)
    pool = BlockPool(num_blocks, make_policy(config.kv_eviction_policy, num_blocks), config.enable_prefix_caching, events)
    kv = KVCacheManager(pool, bs, layout)
    graph_mode = graph_mode_for(config.cudagraph_mode, model)
    runner = ModelRunner(model, mc, num_blocks, bs, config.device, hidden, group_decodes=backend.pads_decodes,
                         one_token_prefills=backend.one_token_prefills,
                         max_rows=config.max_num_seqs, max_model_len=max_len,
                         forward=CompiledForward(model, backend) if compiled else None,
                         aux_layer_ids=plan.aux_layer_ids if plan is not None else (), layout=layout, peers=ranks,
                         graph_mode=graph_mode, capture_sizes=config.cudagraph_capture_sizes or (), lora=slots,
                         backend=backend)
    if config.device != "cpu":
        threads = None
    elif ranks is not None:  # rank 0 runs on its share of the CPUs; the governor does not move ranks
        threads = cpu_threads.start(config.cpu_threads or len(ranks.cpus[0]), False, cpu_runtime.describe())
    else:
        threads = cpu_threads.start(config.cpu_threads, config.adaptive_cpu_threads, cpu_runtime.describe())
    if compiled:
        _warm_up(runner, threads)
    runner.capture_graphs()
    connector = make_connector(OffloadSettings.of(config), mc, model_dir, hidden, pool, events, runner,
                               tp_size=shard.size, peers=ranks, offload=offload) or NullConnector()
    sampler = Sampler(config.seed)
    spec = None
    if plan is not None:
        proposer = plan.build(config, backend, num_blocks, max_len, model, kv, sampler.generator)
        spec = SpecDecoder(plan.spec, proposer, sampler.generator)
        log.info("speculative decoding: %s, %d tokens per step", plan.spec.method.value, plan.spec.num_speculative_tokens)
    lookahead = spec.k if spec is not None and spec.proposer.needs_lookahead else 0
    scheduler = Scheduler(kv, config, budget, connector, num_lookahead_tokens=lookahead,
                          num_spec_placeholders=spec.k if spec and config.async_scheduling else 0,
                          eos_token_ids=eos, detokenize=partial(detokenize, tokenizer))
    log.info("G1: %d blocks of %d tokens (%.2f GiB), max_model_len=%d, max_num_batched_tokens=%d",
             num_blocks, bs, num_blocks * per_block / 2**30, max_len, budget)
    return EngineParts(mc, tokenizer, eos, RequestFactory(tokenizer, mc.vocab_size, eos, config.reasoning), max_len,
                       budget, pool, kv, runner, threads, events, publisher, connector, sampler, spec, scheduler,
                       LoRARegistry(config.max_loras, config.max_lora_rank, config.lora_targets,
                                    partial(_load_lora, slots, ranks), _adapter_bytes(full, config.max_lora_rank))
                       if slots is not None else None)
