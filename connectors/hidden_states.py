"""HiddenStatesConnector: writes each finished request's exported hidden states to
`{shared_storage_path}/{request_id}.safetensors` (vLLM's ExampleHiddenStatesConnector format,
which the `speculators` training library reads):

    hidden_states  [num_tokens, num_layer_ids, hidden]  model dtype
    token_ids      [num_tokens]                          int64
    metadata       model, layer_ids (JSON list), format_version; lora_name and lora_id when the
                   request ran under a LoRA adapter (its states are the adapted model's)

The engine keeps hidden states in paged G1 blocks beside the KV (connectors/hidden_spec.py), so
tokens that came from the prefix cache or an offload tier have their states without being
recomputed. At `request_finished` this connector holds the request's blocks (an extra ref)
and, on the worker side at the next `get_finished`, gathers the states and hands them to
writer threads through a bounded queue: when the disk falls behind, `put` blocks the step
loop (backpressure) instead of growing memory. Files appear atomically (temp file + rename).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import re
import tempfile
import threading
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from connectors.base import ConnectorMeta, FinishedTransfers, KVConnector
from connectors.hidden_spec import FORMAT_VERSION, HiddenStatesSpec
from kvstore.threads import one_torch_thread
from kvstore.g1 import BlockId, BlockPool

log = logging.getLogger(__name__)


_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_STOP = object()


def file_name(request_id: str) -> str:
    """`{request_id}.safetensors`, or a digest of the id when it is not a safe file name."""
    if _SAFE_ID.fullmatch(request_id):
        return f"{request_id}.safetensors"
    return f"req-{sha256(request_id.encode()).hexdigest()[:32]}.safetensors"


def check_writable(path: Path) -> None:
    """Creates `path` (0700: the files hold what prompts computed) if needed and proves a file can
    be written there; ValueError otherwise."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvtier-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"hidden-state output directory {str(path)!r} is not writable: {e.strerror or e}") from None


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Writes a temp file, then links it to `path`: atomic, and FileExistsError instead of
    replacing a file that is already there (another request's, or another process's)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.link(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def free_name(directory: Path, request_id: str, taken: set[str]) -> str:
    """`file_name(request_id)`, or `{stem}-{k}.safetensors` with the first k free when that name
    is on disk or in `taken`: a client that reuses another's request_id gets a file of its own."""
    name = file_name(request_id)
    stem = name.removesuffix(".safetensors")
    k = 0
    while name in taken or (directory / name).exists():
        k += 1
        name = f"{stem}-{k}.safetensors"
    return name


@dataclass
class _Pending:
    request_id: str
    blocks: list[BlockId]
    token_ids: list[int]
    path: Path
    metadata: dict[str, str]


class HiddenStatesConnector(KVConnector):
    def __init__(self, path: Path, spec: HiddenStatesSpec, pool: BlockPool, block_size: int, model: str,
                 *, include_output_tokens: bool = False, writer_threads: int = 2, max_queued_files: int = 16) -> None:
        if writer_threads < 1 or max_queued_files < 1:
            raise ValueError("writer_threads and max_queued_files must be >= 1")
        check_writable(path)
        self.path, self.spec, self.pool, self.block_size = path, spec, pool, block_size
        self.include_output_tokens = include_output_tokens
        self.metadata = {"model": model, "layer_ids": json.dumps(list(spec.layer_ids)),
                         "format_version": FORMAT_VERSION}
        self.hidden_cache: torch.Tensor | None = None
        self._pending: list[_Pending] = []
        self._reserved: set[str] = set()  # file names handed out and not yet written (under _lock)
        self._queue: queue.Queue[Any] = queue.Queue(max_queued_files)
        self._lock = threading.Lock()
        self.files_written = 0
        self.write_errors = 0
        self.tokens_written = 0
        self._closed = False
        self._writers = [threading.Thread(target=self._writer, name=f"kvtier-hs-writer-{i}", daemon=True)
                         for i in range(writer_threads)]
        for t in self._writers:
            t.start()

    # ---- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduled) -> ConnectorMeta:
        return ConnectorMeta()

    def request_finished(self, request, block_ids):
        # Tokens whose states were computed: the prompt, and with include_output_tokens every
        # output token but the last (it was sampled, never fed through the model).
        if request.error is not None or request.num_computed_tokens < request.num_prompt_tokens:
            return None  # failed or aborted before its prompt was through: no partial files
        n = request.num_prompt_tokens
        if self.include_output_tokens:
            n = min(max(n, request.num_tokens - 1), request.num_computed_tokens)
        blocks = [BlockId(b) for b in block_ids[: -(-n // self.block_size)]]
        self.pool.acquire(blocks)  # the states must outlive the request's blocks until gathered
        with self._lock:  # until written: two requests finishing together get two names
            name = free_name(self.path, request.request_id, self._reserved)
            self._reserved.add(name)
        path = self.path / name
        meta = self.metadata
        if request.lora_tag is not None:  # kvstore.events.LoRATag: the id comes from the adapter's files
            meta = {**meta, "lora_name": request.lora_tag.name, "lora_id": str(request.lora_tag.id)}
        self._pending.append(_Pending(request.request_id, blocks, list(request.all_token_ids[:n]), path, meta))
        return {"hidden_states_path": str(path)}

    # ---- worker side -------------------------------------------------------------------
    def shard_over(self, peers) -> None:
        """Nothing to share out: rank 0's residual stream is whole after each layer's all-reduce,
        so rank 0 alone writes the files (docs/parallel.md)."""

    def register_hidden_cache(self, hidden_cache: torch.Tensor) -> None:
        self.hidden_cache = hidden_cache

    def get_finished(self) -> FinishedTransfers:
        self._gather_pending()
        return FinishedTransfers()

    def _gather_pending(self) -> None:
        if self.hidden_cache is None:
            if self._pending:
                raise RuntimeError("HiddenStatesConnector has no hidden cache: the engine was not started "
                                   "with speculative_config method extract_hidden_states")
            return
        pending, self._pending = self._pending, []
        for p in pending:
            idx = torch.tensor(p.blocks, dtype=torch.long, device=self.hidden_cache.device)
            states = self.hidden_cache.index_select(0, idx).flatten(0, 1)[: len(p.token_ids)].cpu()
            self.pool.release(reversed(p.blocks))
            tensors = {"hidden_states": states.contiguous(), "token_ids": torch.tensor(p.token_ids, dtype=torch.int64)}
            self._queue.put((p.path, tensors, p.metadata))  # blocks when full: backpressure

    def _writer(self) -> None:
        one_torch_thread()
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                path, tensors, metadata = item
                try:
                    write_atomically(path, tensors, metadata)
                    with self._lock:
                        self.files_written += 1
                        self.tokens_written += tensors["token_ids"].numel()
                except OSError as e:
                    log.error("writing %s failed: %s", path, e)
                    with self._lock:
                        self.write_errors += 1
                finally:
                    with self._lock:
                        self._reserved.discard(path.name)
            finally:
                self._queue.task_done()

    def busy(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Gathers what finished and waits until every queued file is on disk."""
        self._gather_pending()
        self._queue.join()

    def wait_for_outputs(self) -> None:
        self.flush()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"hidden_states": {"files_written": self.files_written, "tokens_written": self.tokens_written,
                                      "write_errors": self.write_errors, "queued_files": self._queue.qsize()}}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        for _ in self._writers:
            self._queue.put(_STOP)
        for t in self._writers:
            t.join()
