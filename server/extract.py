"""`kvtier extract MODEL --input FILE.jsonl --output DIR`: hidden states for a JSONL of prompts.

Each input line is a JSON object with one of
    "prompt": "text"                 tokenized with the model's tokenizer (as LLM.generate does)
    "prompt_token_ids": [int, ...]   used as given
    "messages": [{"role", "content"}, ...]  the chat template applied (as LLM.chat does)
and an optional "id" (a non-empty string or an integer). A line without one is named
`line-NNNNNN`, its 1-based line number zero-padded to six digits (so `ls` sorts them); blank
lines are ignored. Ids must be unique: every later line with an id already seen fails.

Output, in DIR: one safetensors file per line, written by HiddenStatesConnector and named by
`connectors.hidden_states.file_name(id)` (`{id}.safetensors`, or a digest for ids that are not
safe file names), and `manifest.jsonl`, one JSON object per completed file:
    {"id": str, "path": file name relative to DIR, "num_tokens": int, "layer_ids": [int, ...]}
The manifest is the commit record: a line is appended (flushed and fsynced once per batch) only
after the batch's files are on disk, so a rerun with the same DIR resumes:
  * ids in the manifest are skipped (their files are checked cheaply first; one that is missing or
    unreadable is dropped from the manifest and recomputed);
  * a file present but not in the manifest (killed between the rename and the append) is checked
    (it opens, has the requested layers, holds this line's token ids) and then added without
    recomputing, or recomputed when the check fails;
  * leftover temp files (`.*.tmp-*`) of a killed run are deleted, and a torn or duplicated
    manifest line is dropped by rewriting the manifest atomically.
One job at a time per DIR (a lock file enforces it: temp-file cleanup would race otherwise);
--data-parallel-size N runs N engine processes under that job (server/extract_dp.py).

Layers: --eagle3 (the default) is speculators' choice, [2, N//2, N-3] and then N, the last layer's
output, last: speculators reads a file's last layer as the final state. --layout speculators also
writes, from the manifest at the end of each run, what speculators' offline training reads as it
is (hidden_states/hs_{i}.safetensors and the Arrow dataset: server/extract_layout.py).

Progress moves per file (as each request finishes); Ctrl-C during start-up exits 130 with one line
(server/cli.py's handler); during the job it stops the batch in flight (a rerun recovers its finished
files), prints the summary and exits 130.

extract builds the engine's `--speculative-config` and `--kv-transfer-config` itself, so passing
either is an error (exit 2) rather than a silent merge; the offload flags (--kv-offloading-size,
--kv-offload-disk) compose: the HiddenStatesConnector then runs inside a MultiConnector beside
TieredOffloadConnector. Bad lines (bad JSON, no or several prompt fields, wrong types, empty or
too long prompts, token ids outside the vocabulary, duplicate ids) are reported on stderr with
their line number and the job goes on; exit code 1 if any failed. Bad configuration exits 2
before any work.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.args import add_engine_args, llm_kwargs
from server.extract_manifest import Manifest, check_file

PROG = "kvtier extract"
LOCK = ".kvtier-extract.lock"
TEMP_GLOB = ".*.tmp-*"  # HiddenStatesConnector's `.NAME.tmp-PID-TID`, and our manifest rewrite's
PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


class ConfigError(Exception):
    """Bad configuration: reported in one line, exit 2, before any work."""


class LineError(Exception):
    """One bad input line: reported with its line number; the job goes on."""


@dataclass
class Item:
    lineno: int
    rid: str
    token_ids: list[int]
    request: Any  # the engine's Request, validated and built once (EngineCore.make_request)


@dataclass
class Totals:
    done: int = 0
    skipped: int = 0
    recovered: int = 0  # of skipped: files found complete but missing from the manifest
    failed: int = 0
    tokens: int = 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Export hidden states (EAGLE-3 training data, the vLLM/speculators safetensors format) "
                    "for every prompt of a JSONL file.",
        epilog=__doc__.split("\n", 2)[2])
    add_engine_args(p)
    for action in p._actions:  # shared engine flags that extract owns: say so in --help
        if action.dest in ("kv_transfer_config", "speculative_config"):
            action.help = "not accepted: extract builds it from --layers/--eagle3 and --output"
    x = p.add_argument_group("extraction")
    x.add_argument("--input", required=True, metavar="FILE.jsonl",
                   help='one JSON object a line: {"prompt": ...}, {"prompt_token_ids": [...]} or '
                        '{"messages": [...]}, each with an optional "id" (string or int)')
    x.add_argument("--output", required=True, metavar="DIR",
                   help="directory for the .safetensors files and manifest.jsonl; created if needed; "
                        "rerunning with the same DIR resumes")
    layers = x.add_mutually_exclusive_group()
    layers.add_argument("--layers", type=_layer_list, metavar="IDS",
                        help="comma-separated layer ids, in file order (0 = embeddings, k = output of "
                             "decoder layer k-1, N = the last layer's, before the final norm)")
    layers.add_argument("--eagle3", action="store_true",
                        help="EAGLE-3's default layers [2, N//2, N-3] for an N-layer model, then N (the default "
                             "when --layers is not given)")
    last = x.add_mutually_exclusive_group()
    last.add_argument("--include-last-layer", dest="include_last_layer", action="store_const", const=True,
                      default=None, help="with --eagle3: export layer N (the last layer's output, before the final "
                                         "norm) after the aux layers; the default, kept for speculators' flag name")
    last.add_argument("--no-include-last-layer", dest="include_last_layer", action="store_const", const=False,
                      help="with --eagle3: the aux layers only (speculators then reads the last aux layer as the "
                           "final state: only for files you pair with the final states yourself)")
    x.add_argument("--layout", choices=["kvtier", "speculators"], default="kvtier",
                   help="kvtier: {id}.safetensors files and manifest.jsonl; speculators: those plus what "
                        "speculators' offline training reads as is: hidden_states/hs_{i}.safetensors and the "
                        "Arrow dataset of input_ids/loss_mask/seq_len (needs pyarrow) (default: %(default)s)")
    x.add_argument("--max-tokens", type=int, default=0,
                   help="0: prompt tokens only; K > 0: generate up to K tokens greedily and include the "
                        "states of the generated tokens that went through the model (default: %(default)s)")
    x.add_argument("--batch-size", type=int, default=64,
                   help="prompts per engine call; the manifest is synced after each (default: %(default)s)")
    x.add_argument("--no-add-generation-prompt", dest="add_generation_prompt", action="store_false",
                   help='for "messages" lines: do not append the assistant header (use when the '
                        "conversation already ends with the assistant's reply)")
    x.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    x.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="engines working through the input side by side, each a process on its share of the CPUs "
                        "with its part of the lines (by id, so a duplicate id meets its first line); they append "
                        "to the one manifest, and a rerun resumes as with one (default: %(default)s)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="logging verbosity (default: %(default)s)")
    return p


def _layer_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 2,8,13; got {text!r}") from None


def num_model_layers(model_dir: Path) -> int:
    """num_hidden_layers from config.json, read before the (slow) model load."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {model_dir / 'config.json'}: {e}") from None
    n = cfg.get("num_hidden_layers", (cfg.get("text_config") or {}).get("num_hidden_layers"))
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"{model_dir / 'config.json'} has no valid num_hidden_layers")
    return n


def choose_layers(ns: argparse.Namespace, num_layers: int) -> list[int]:
    from connectors.hidden_spec import HiddenStatesSpec, eagle3_layer_ids

    if ns.layers is not None:
        if ns.include_last_layer is not None:
            flag = "--include-last-layer" if ns.include_last_layer else "--no-include-last-layer"
            raise ConfigError(f"{flag} goes with --eagle3; with --layers list the ids yourself (the last "
                              f"layer is {num_layers})")
        ids = ns.layers
    else:
        ids = eagle3_layer_ids(num_layers)
        if ns.include_last_layer is not False:
            # Last, as speculators' launch_vllm.py appends it: training reads the file's last layer as the
            # final state. A tiny model's aux ids can include N itself; it then moves to the end.
            ids = [i for i in ids if i != num_layers] + [num_layers]
    try:
        HiddenStatesSpec(tuple(ids)).check_model(num_layers)
        if ns.layout == "speculators":
            from server.extract_layout import check_layers

            check_layers(ids, num_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return ids


def line_id(obj: dict[str, Any], lineno: int) -> str:
    rid = obj.get("id", None)
    if rid is None:
        return f"line-{lineno:06d}"
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise LineError(f'"id" must be a non-empty string or an integer; got {rid!r}')
    return str(rid)


def chat_ids(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    """The conversation's ids through the chat template, exactly as LLM.chat makes them."""
    from engine.llm import as_token_ids

    try:
        return as_token_ids(tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    tokenize=True))
    except Exception as e:  # noqa: BLE001 - the template is user code (jinja): any failure is this line's
        raise LineError(f"the chat template failed on these messages: {e}") from None


def tokenize(obj: dict[str, Any], tok: Any, add_generation_prompt: bool) -> list[int]:
    keys = [k for k in PROMPT_KEYS if k in obj]
    if len(keys) != 1:
        raise LineError(f"needs exactly one of {', '.join(repr(k) for k in PROMPT_KEYS)}; got "
                        f"{', '.join(repr(k) for k in keys) or 'none'}")
    value = obj[keys[0]]
    if keys[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise LineError('"prompt" must be a non-empty string')
        return tok.encode(value)  # as LLM.generate tokenizes a text prompt
    if keys[0] == "prompt_token_ids":
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise LineError('"prompt_token_ids" must be a list of integers')
        return value
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) and "role" in m for m in value):
        raise LineError('"messages" must be a non-empty list of {"role": ..., "content": ...} objects')
    return chat_ids(tok, value, add_generation_prompt)


class Extractor:
    def __init__(self, ns: argparse.Namespace, llm: Any, out: Path, layer_ids: list[int], manifest: Manifest) -> None:
        from engine import SamplingParams

        self.ns, self.llm, self.out, self.layer_ids, self.manifest = ns, llm, out, layer_ids, manifest
        # The engine always samples at least one token; with --max-tokens 0 the file holds the prompt only.
        self.params = SamplingParams(temperature=0.0, max_tokens=max(ns.max_tokens, 1), ignore_eos=ns.max_tokens == 0)
        self.totals = Totals()
        self.seen: dict[str, int] = {}
        self.rows: dict[str, Any] = {}  # --layout speculators: each good line's row (extract_layout.Row)
        self.start = time.perf_counter()
        self.finished_tokens = 0

    def fail(self, lineno: int, why: str) -> None:
        print(f"{PROG}: line {lineno}: {why}", file=sys.stderr, flush=True)
        self.totals.failed += 1

    def prepare(self, lineno: int, raw: bytes) -> Item | None:
        """The line's work item; None when it is blank, failed, or already complete."""
        from connectors.hidden_states import file_name

        if not raw.strip():
            return None
        try:
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise LineError(f"not valid JSON: {e}") from None
            if not isinstance(obj, dict):
                raise LineError(f"expected a JSON object, got {type(obj).__name__}")
            rid = line_id(obj, lineno)
            if rid in self.seen:
                raise LineError(f"duplicate id {rid!r} (first on line {self.seen[rid]})")
            self.seen[rid] = lineno
            if rid in self.manifest.entries and self.ns.layout == "kvtier":
                self.totals.skipped += 1
                return None
            ids = tokenize(obj, self.llm.get_tokenizer(), self.ns.add_generation_prompt)
            if self.ns.layout == "speculators":  # every line, done ones too: the dataset is rebuilt each run
                self.rows[rid] = self._row(obj, ids)
                if rid in self.manifest.entries:
                    self.totals.skipped += 1
                    return None
            try:  # the engine's own checks (empty, max_model_len, vocabulary), without queueing anything
                request = self.llm.engine.make_request(rid, ids, self.params)
            except ValueError as e:
                raise LineError(str(e)) from None
        except LineError as e:
            self.fail(lineno, str(e))
            return None
        path = self.out / file_name(rid)
        n = check_file(path, self.layer_ids, prompt=ids, max_new=self.ns.max_tokens) if path.exists() else None
        if n is not None:  # complete but never recorded: the previous run died before the append
            self.manifest.append([self.entry(rid, n)])
            self.totals.skipped += 1
            self.totals.recovered += 1
            return None
        path.unlink(missing_ok=True)  # not this line's file: the writer never overwrites, so clear the name
        return Item(lineno, rid, ids, request)

    def _row(self, obj: dict[str, Any], ids: list[int]) -> Any:
        from server.extract_layout import LayoutError, line_row

        tok = self.llm.get_tokenizer()
        try:
            return line_row(obj, ids, lambda msgs, agp: chat_ids(tok, msgs, agp))
        except LayoutError as e:
            raise LineError(str(e)) from None

    def entry(self, rid: str, num_tokens: int) -> dict[str, Any]:
        from connectors.hidden_states import file_name

        return {"id": rid, "path": file_name(rid), "num_tokens": num_tokens, "layer_ids": self.layer_ids}

    def run_batch(self, batch: list[Item], bar: Any) -> None:
        """Runs the batch through the engine, then records its files in the manifest. The bar moves
        as each request finishes (its file then goes to the writer threads), not once per batch."""
        eng = self.llm.engine
        for it in batch:
            eng.add_request(it.request)
        pending = {it.request.request_id for it in batch}
        errors: dict[Any, str | None] = {}
        try:
            while pending:
                for req in eng.step():
                    if req.status.finished and req.request_id in pending:
                        pending.discard(req.request_id)
                        errors[req.request_id] = req.error
                        self.finished_tokens += len(req.prompt_token_ids)  # the bar's rate, before the commit
                        bar.update(1)
                        bar.set_postfix_str(f"{self.finished_tokens / (time.perf_counter() - self.start):,.0f} "
                                            "prompt tok/s", refresh=False)
        except BaseException:
            for rid in pending:  # a Ctrl-C: nothing half-done stays queued in the engine
                eng.abort_request(rid)
            raise
        eng.drain()  # async scheduling: the steps planned and run after the last token
        eng.connector.wait_for_outputs()  # the files exist once this returns
        self._commit(batch, errors)

    def _commit(self, batch: list[Item], errors: dict[Any, str | None]) -> None:
        from connectors.hidden_states import file_name

        entries = []
        for it in batch:
            error = errors.get(it.request.request_id)
            n = None if error else check_file(self.out / file_name(it.rid), self.layer_ids, prompt=it.token_ids,
                                              max_new=self.ns.max_tokens)
            if n is None:
                self.fail(it.lineno, f"id {it.rid!r}: {error or 'the hidden-state file was not written (see log)'}")
                self.rows.pop(it.rid, None)
                continue
            entries.append(self.entry(it.rid, n))
            self.totals.done += 1
            self.totals.tokens += n
        self.manifest.append(entries)  # only now: the files exist

    def write_layout(self) -> int:
        """--layout speculators: the dataset and hidden_states/ of every complete line, in input order."""
        from server.extract_layout import write

        order = sorted((lineno, rid) for rid, lineno in self.seen.items()
                       if rid in self.rows and rid in self.manifest.entries)
        entries = [(rid, self.out / self.manifest.entries[rid]["path"], self.rows[rid]) for _, rid in order]
        return write(self.out, entries, lambda rid, why: self.fail(self.seen[rid], f"id {rid!r}: {why}"))


def _setup(ns: argparse.Namespace) -> tuple[Path, Path, list[int]]:
    """Every configuration check that needs no model load; the output directory is touched last."""
    from connectors.hidden_states import check_writable

    if ns.kv_transfer_config is not None or ns.speculative_config is not None:
        raise ConfigError("--kv-transfer-config and --speculative-config are built by extract (from --layers/"
                          "--eagle3 and --output); drop them (the offload flags still work)")
    if ns.max_tokens < 0 or ns.batch_size < 1 or ns.data_parallel_size < 1:
        raise ConfigError("--max-tokens must be >= 0, --batch-size and --data-parallel-size >= 1")
    if ns.data_parallel_size > 1 and ns.layout == "speculators":
        raise ConfigError("--layout speculators with --data-parallel-size > 1 is not supported yet (the dataset "
                          "is written from every line's row in one process)")
    if ns.layout == "speculators":
        from server.extract_layout import check_pyarrow

        try:
            check_pyarrow()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    src = Path(ns.input)
    if not src.is_file() or not os.access(src, os.R_OK):
        raise ConfigError(f"input file {str(src)!r} does not exist or is not readable")
    if ns.model is None:
        from engine.demo.demo_model import ensure_demo_model

        try:
            ns.model = str(ensure_demo_model())
        except (OSError, ImportError, ValueError) as e:
            raise ConfigError(f"the demo model is not available: {e}") from None
    layer_ids = choose_layers(ns, num_model_layers(Path(ns.model)))
    out = Path(ns.output)
    try:
        check_writable(out)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return src, out, layer_ids


def _transfer_config(ns: argparse.Namespace, out: Path) -> dict[str, Any]:
    hs: dict[str, Any] = {"kv_connector": "HiddenStatesConnector",
                          "kv_connector_extra_config": {"shared_storage_path": str(out),
                                                        "include_output_tokens": ns.max_tokens > 0}}
    if ns.kv_offloading_size or ns.kv_offload_disk is not None:
        return {"kv_connector": "MultiConnector",
                "kv_connector_extra_config": {"connectors": [{"kv_connector": "TieredOffloadConnector"}, hs]}}
    return hs


def run(ns: argparse.Namespace) -> int:
    src, out, layer_ids = _setup(ns)
    with open(out / LOCK, "w") as lock:  # held until the job ends; the kernel drops it even on SIGKILL
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another {PROG} is writing to {out}") from None
        return _run_locked(ns, src, out, layer_ids)


def _run_locked(ns: argparse.Namespace, src: Path, out: Path, layer_ids: list[int]) -> int:
    for tmp in out.glob(TEMP_GLOB):  # a killed run's half-written files (we hold the lock: none are live)
        tmp.unlink(missing_ok=True)
    from server.extract_dp import run_data_parallel  # here: it imports this module
    if ns.data_parallel_size == 1:
        return run_shard(ns, src, out, layer_ids, 0, 1)
    return run_data_parallel(ns, src, out, layer_ids)


def run_shard(ns: argparse.Namespace, src: Path, out: Path, layer_ids: list[int], shard: int, shards: int) -> int:
    """The job over this shard's lines (all of them with one shard)."""
    from tqdm import tqdm

    from connectors.hidden_spec import speculative_config
    from engine import LLM
    from server.extract_dp import shard_of

    manifest = Manifest(out, layer_ids)
    try:
        manifest.load(repair=shards == 1)
        llm = LLM(**{**llm_kwargs(ns), "speculative_config": speculative_config(layer_ids),
                     "kv_transfer_config": _transfer_config(ns, out)})
    except (ValueError, OSError) as e:  # LayerMismatch included
        raise ConfigError(str(e)) from None
    _start_up_done()
    job = Extractor(ns, llm, out, layer_ids, manifest)
    fh = open(src, "rb")  # noqa: SIM115 - closed in the finally below, with the engine
    total_lines = sum(1 for lineno, raw in enumerate(fh, 1) if shard_of(lineno, raw, shards) == shard)
    fh.seek(0)
    bar = tqdm(total=total_lines, unit="line", desc="extract" if shards == 1 else f"extract dp{shard}",
               disable=ns.no_progress, dynamic_ncols=True, file=sys.stderr, position=shard)
    interrupted, rows = False, None
    try:
        batch: list[Item] = []
        for lineno, raw in enumerate(fh, 1):  # bytes: a line that is not UTF-8 fails alone
            if shard_of(lineno, raw, shards) != shard:
                continue
            item = job.prepare(lineno, raw)
            if item is not None:
                batch.append(item)
            else:
                bar.update(1)
            if len(batch) >= ns.batch_size:
                job.run_batch(batch, bar)
                batch = []
        if batch:
            job.run_batch(batch, bar)
        bar.close()
        if ns.layout == "speculators":
            rows = job.write_layout()
    except KeyboardInterrupt:
        interrupted = True  # what the manifest holds is complete; a rerun resumes
    finally:
        fh.close()
        bar.close()
        manifest.close()
        llm.close()
    t, secs = job.totals, time.perf_counter() - job.start
    print(f"{PROG}{'' if shards == 1 else f' (data-parallel shard {shard} of {shards})'}: {t.done} done, {t.skipped} skipped (already complete; {t.recovered} recovered from files), "
          f"{t.failed} failed; {t.tokens:,} tokens in {secs:.1f} s ({t.tokens / max(secs, 1e-9):,.0f} tokens/s) "
          f"-> {out}" + (f" ({rows} speculators rows)" if rows is not None else "")
          + (" [interrupted]" if interrupted else ""), flush=True)
    if interrupted:
        return 130
    return 1 if t.failed else 0


def _start_up_done() -> None:
    """From here Ctrl-C raises KeyboardInterrupt again, which the job loop winds down with (the
    summary, exit 130), instead of the `kvtier` entry point's exit during start-up (server/cli.py)."""
    handler = signal.getsignal(signal.SIGINT)
    if getattr(handler, "start_up_only", False) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(ns)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # during start-up (model load): the job loop reports its own interruption
        print(f"{PROG}: interrupted during start-up; nothing was extracted", file=sys.stderr, flush=True)
        return 130
