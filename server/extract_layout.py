"""`kvtier extract --layout speculators`: a directory `speculators`' offline training reads as it is.

What speculators 0.9.0 reads (speculators/train/data.py `ArrowDataset`, hs_connectors' `FileTransfer`,
speculators/data_generation/offline.py), and so what this module writes beside kvtier's own files:

    DIR/data-00000-of-00001.arrow, dataset_info.json, state.json
        `datasets.load_from_disk(DIR)`: the HF dataset `speculators prepare-data` saves. One row per
        completed input line, in input order: `input_ids` list<int32> (prepare-data's dtype: datasets
        narrows that column), `loss_mask` list<int64> (1 = a token the draft learns to predict),
        `seq_len` int64; saved in the "torch" format.
    DIR/hidden_states/hs_{i}.safetensors
        Row i's states: kvtier's file for that line (a hard link, no copy): `hidden_states`
        [seq_len, L, hidden] in the model dtype and `token_ids` [seq_len] int64, equal to the row's
        `input_ids` (ArrowDataset drops a row whose ids differ).

ArrowDataset splits `hidden_states` by position: [:, :-1] (flattened) are the aux layers the draft
reads, [:, -1] is `verifier_last_hidden_states`, to which training applies the verifier's final norm
and lm_head. So the file's last layer must be N, the last decoder layer's output before the norm
(kvtier's id N, speculators' `--include-last-layer`); `check_layers` refuses anything else.

Loss masks follow prepare-data: for a "messages" line, the tokens of each assistant message after the
first message (found, as prepare-data does, where rendering the conversation through that message
extends rendering the messages before it with the generation prompt); for "prompt" and
"prompt_token_ids" lines, every token (or the line's own "loss_mask" next to "prompt_token_ids");
tokens generated with --max-tokens are always 1. Rows are rebuilt from the manifest at the end of
every run that was not interrupted, so the indices always run 0..n-1 without gaps.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HIDDEN_STATES = "hidden_states"
DATA_FILE = "data-00000-of-00001.arrow"
ROWS_PER_BATCH = 1000  # Arrow record batches: bounded memory however many rows (datasets writes 1000 too)
# The features `speculators prepare-data` saves (datasets 5.1 through save_to_disk), in datasets' JSON.
FEATURES: dict[str, Any] = {
    "input_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int64", "_type": "Value"},
}

Render = Callable[[list[dict[str, Any]], bool], list[int]]  # (messages, add_generation_prompt) -> ids


class LayoutError(ValueError):
    """A line speculators' layout cannot hold (reported with its line number; the job goes on)."""


def check_layers(layer_ids: list[int], num_layers: int) -> None:
    """speculators reads the file's last layer as the verifier's final state: it must be N."""
    if layer_ids[-1] != num_layers:
        raise ValueError(f"--layout speculators reads the last layer of each file as the final hidden state: the "
                         f"layer ids must end with {num_layers} (this model's last layer); got {layer_ids}")
    if len(layer_ids) < 2:
        raise ValueError(f"--layout speculators needs at least one aux layer before the last one; got {layer_ids}")


def check_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ValueError("--layout speculators writes an Arrow dataset and needs pyarrow: pip install pyarrow "
                         "(or kvtier[speculators])") from None


@dataclass(frozen=True)
class Row:
    """What a line contributes to its row, kept small (ids are re-read from its file at the end)."""
    prompt_len: int
    prompt_digest: bytes  # the prompt's ids: its file must start with them
    spans: tuple[tuple[int, int], ...]  # supervised [start, end) ranges of the prompt


def _digest(ids: list[int]) -> bytes:
    return hashlib.blake2b(json.dumps(ids).encode(), digest_size=16).digest()


def _spans(mask: list[int]) -> tuple[tuple[int, int], ...]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return tuple(out)


def line_row(obj: dict[str, Any], ids: list[int], render: Render) -> Row:
    """The row of a line whose prompt tokenized to `ids`; LayoutError when it cannot have one."""
    if "messages" in obj:
        mask = messages_mask(obj["messages"], ids, render)
    elif "loss_mask" in obj:
        mask = obj["loss_mask"]
        if "prompt_token_ids" not in obj:
            raise LayoutError('"loss_mask" goes with "prompt_token_ids" (a text prompt\'s token count is the '
                              "tokenizer's)")
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) or isinstance(m, bool)
                                                                       for m in mask):
            raise LayoutError(f'"loss_mask" must be a list of {len(ids)} zeros and ones, one per token')
    else:
        mask = [1] * len(ids)
    return Row(len(ids), _digest(ids), _spans(mask))


def messages_mask(messages: list[dict[str, Any]], ids: list[int], render: Render) -> list[int]:
    """1 on the tokens of every assistant message but a leading one, as prepare-data derives them."""
    mask = [0] * len(ids)
    for j, msg in enumerate(messages):
        if msg.get("role") != "assistant" or j == 0:  # a leading reply has no context to predict from
            continue
        before, through = render(messages[:j], True), render(messages[: j + 1], False)
        start = len(before)
        if through[:start] != before:
            # A generation prompt the reply does not extend (a pre-filled <think> scaffold): the reply
            # starts where the two renders part, valid only if the history itself renders the same.
            start = next((i for i, (a, b) in enumerate(zip(before, through)) if a != b), len(through))
            history = render(messages[:j], False)
            if through[: len(history)] != history or start < len(history):
                raise LayoutError(f"the chat template renders the history differently at assistant message {j}: "
                                  "cannot tell its tokens from the context (prepare-data skips such conversations)")
        if ids[: len(through)] != through:
            raise LayoutError(f"the chat template is not prefix-stable: the conversation through assistant message "
                              f"{j} is not a prefix of the whole conversation's tokens")
        mask[start: len(through)] = [1] * (len(through) - start)
    if not any(mask):
        raise LayoutError('"messages" has no assistant reply after the first message: speculators trains on '
                          "assistant tokens, and this line has none")
    return mask


def _token_ids(path: Path) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_tensor("token_ids").tolist()


def write(out: Path, entries: list[tuple[str, Path, Row]], fail: Callable[[str, str], None]) -> int:
    """Writes the dataset and hidden_states/ for `entries` (id, its file, its row; input order).
    A file that no longer matches its line is reported through `fail(id, why)` and left out.
    Returns the number of rows."""
    for old in out.glob(f".{HIDDEN_STATES}.*"):  # a run killed mid-swap: its staging or old directory
        shutil.rmtree(old, ignore_errors=True)
    staging = out / f".{HIDDEN_STATES}.staging-{os.getpid()}"
    staging.mkdir()
    count = 0

    def kept() -> Iterator[tuple[list[int], list[int]]]:
        nonlocal count
        for rid, path, row in entries:
            ids = _token_ids(path)
            if len(ids) < row.prompt_len or _digest(ids[: row.prompt_len]) != row.prompt_digest:
                fail(rid, f"{path.name} holds other tokens than this line's prompt: delete it to recompute")
                continue
            mask = [0] * row.prompt_len + [1] * (len(ids) - row.prompt_len)  # generated tokens: learned
            for a, b in row.spans:
                mask[a:b] = [1] * (b - a)
            _link(path, staging / f"hs_{count}.safetensors")
            count += 1
            yield ids, mask

    fingerprint = _write_arrow(out, kept())
    old = out / f".{HIDDEN_STATES}.old-{os.getpid()}"
    if (out / HIDDEN_STATES).exists():
        os.replace(out / HIDDEN_STATES, old)
    os.replace(staging, out / HIDDEN_STATES)
    shutil.rmtree(old, ignore_errors=True)
    _write_json(out / "state.json", {
        "_data_files": [{"filename": DATA_FILE}], "_fingerprint": fingerprint, "_format_columns": None,
        "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False, "_split": None})
    _write_json(out / "dataset_info.json", {"citation": "", "description": "", "features": FEATURES,
                                            "homepage": "", "license": ""})
    return count


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # no copy: the row's file is kvtier's file
    except OSError:  # a filesystem without hard links
        shutil.copyfile(src, dst)


def _write_arrow(out: Path, rows: Iterator[tuple[list[int], list[int]]]) -> str:
    """The Arrow IPC stream datasets' save_to_disk writes; returns a fingerprint of its rows."""
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int64())),
                        ("seq_len", pa.int64())],
                       metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})})
    digest = hashlib.sha256()
    tmp = out / f".{DATA_FILE}.tmp-{os.getpid()}"
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        batch: list[tuple[list[int], list[int]]] = []
        for row in itertools.chain(rows, [None]):  # None: flush the last batch
            if row is not None:
                batch.append(row)
                digest.update(json.dumps(row).encode())
            if batch and (row is None or len(batch) == ROWS_PER_BATCH):
                writer.write_batch(pa.record_batch(
                    [pa.array([r[0] for r in batch], pa.list_(pa.int32())),
                     pa.array([r[1] for r in batch], pa.list_(pa.int64())),
                     pa.array([len(r[0]) for r in batch], pa.int64())], schema=schema))
                batch = []
    os.replace(tmp, out / DATA_FILE)
    return digest.hexdigest()[:16]


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
