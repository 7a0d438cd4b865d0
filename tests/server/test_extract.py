"""`kvtier extract`: the JSONL -> hidden-state files job (server/extract.py).

Oracle for the tensors: the offline API (LLM.generate / LLM.chat with HiddenStatesConnector),
itself checked against transformers in tests/connectors/test_hidden_states.py. The rest is the
job's bookkeeping: per-line errors, configuration errors, and resume after a kill.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import LAYERS, random_prompt
from safetensors.torch import load_file

from connectors.hidden_spec import speculative_config
from engine import LLM, SamplingParams
from server import cli

REPO = Path(__file__).resolve().parents[2]
ENGINE = ["--dtype", "float32", "--num-gpu-blocks", "200", "--no-progress"]
KIND = "llama"


def run_cli(model: Path, src: Path, out: Path, *extra: str) -> int:
    """`kvtier extract` in-process; argparse's own errors (SystemExit) become their exit code."""
    try:
        return cli.main(["extract", str(model), "--input", str(src), "--output", str(out), *ENGINE, *extra])
    except SystemExit as e:
        return int(e.code or 0)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Rows are objects (dumped) or raw strings (written as they are: malformed lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def manifest(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def temp_files(out: Path) -> list[Path]:
    return list(out.glob(".*.tmp-*"))


def kill_after_first_commit(argv: list[str], env: dict[str, str], out: Path) -> None:
    """Runs the extract command and SIGKILLs it once its first batch is in the manifest: later files
    may then exist with their manifest lines unwritten."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "manifest.jsonl").exists() and (out / "manifest.jsonl").stat().st_size:
                break
            time.sleep(0.005)
        assert proc.poll() is None, f"finished before the kill: {proc.stdout.read().decode()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_mixed_inputs_match_the_offline_api(ckpt_dir, tmp_path):
    model, layer_ids = ckpt_dir(KIND), [0, LAYERS, 1]
    text, ids = "hello world what is the capital of france ?", random_prompt(40, 5100)
    messages = [{"role": "user", "content": "tell me a story please"}]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "text", "prompt": text}, {"prompt_token_ids": ids},
                                              {"id": 7, "messages": messages}])
    out = tmp_path / "out"
    assert run_cli(model, src, out, "--layers", "0,2,1") == 0

    entries = manifest(out)
    assert [e["id"] for e in entries] == ["text", "line-000002", "7"]  # line number names an id-less line
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == \
        ["7.safetensors", "line-000002.safetensors", "manifest.jsonl", "text.safetensors"]
    assert not temp_files(out)

    ref_dir = tmp_path / "ref"
    llm = LLM(str(model), dtype="float32", num_gpu_blocks=200, speculative_config=speculative_config(layer_ids),
              kv_transfer_config={"kv_connector": "HiddenStatesConnector",
                                  "kv_connector_extra_config": {"shared_storage_path": str(ref_dir)}})
    try:
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        refs = llm.generate([text, {"prompt_token_ids": ids}], sp, use_tqdm=False, request_ids=["r-text", "r-ids"])
        refs += llm.chat([messages], sp, use_tqdm=False)
    finally:
        llm.close()
    # With the offload flags the connector runs inside a MultiConnector beside the offload tiers.
    offloaded = tmp_path / "offloaded"
    assert run_cli(model, src, offloaded, "--layers", "0,2,1", "--kv-offloading-size", "0.05",
                   "--kv-offload-disk", str(tmp_path / "g3")) == 0
    for e, ref in zip(entries, refs):
        got, want = load_file(out / e["path"]), load_file(ref.kv_transfer_params["hidden_states_path"])
        assert e["layer_ids"] == layer_ids and e["num_tokens"] == len(ref.prompt_token_ids)
        assert got["token_ids"].tolist() == ref.prompt_token_ids
        assert got["hidden_states"].shape == (e["num_tokens"], 3, want["hidden_states"].shape[-1])
        assert torch.equal(got["hidden_states"], want["hidden_states"]), e["id"]
        assert torch.equal(load_file(offloaded / e["path"])["hidden_states"], got["hidden_states"]), e["id"]
    assert manifest(offloaded) == entries


def test_max_tokens_exports_the_generated_tokens_too(ckpt_dir, tmp_path):
    model, prompt = ckpt_dir(KIND), random_prompt(30, 5150)
    src, out = write_jsonl(tmp_path / "in.jsonl", [{"id": "g", "prompt_token_ids": prompt}]), tmp_path / "out"
    assert run_cli(model, src, out, "--layers", "1", "--max-tokens", "4") == 0
    ref_dir = tmp_path / "ref"
    llm = LLM(str(model), dtype="float32", num_gpu_blocks=200, speculative_config=speculative_config([1]),
              kv_transfer_config={"kv_connector": "HiddenStatesConnector", "kv_connector_extra_config": {
                  "shared_storage_path": str(ref_dir), "include_output_tokens": True}})
    try:
        (ref,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4),
                              use_tqdm=False, request_ids=["g"])
    finally:
        llm.close()
    got, want = load_file(out / "g.safetensors"), load_file(ref_dir / "g.safetensors")
    assert got["token_ids"].tolist() == prompt + ref.outputs[0].token_ids[:-1]  # the last one never went through
    assert torch.equal(got["hidden_states"], want["hidden_states"])
    assert manifest(out)[0]["num_tokens"] == len(got["token_ids"])
    assert run_cli(model, src, out, "--layers", "1", "--max-tokens", "4") == 0  # complete: skipped, not redone


def test_help_explains_every_flag():
    from server.extract import build_parser

    parser = build_parser()
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]
    text = parser.format_help()
    for flag in ("--input", "--output", "--layers", "--eagle3", "--include-last-layer", "--max-tokens",
                 "--batch-size", "--kv-offloading-size", "manifest.jsonl", "line-NNNNNN"):
        assert flag in text, flag


def test_bad_lines_are_reported_and_the_rest_completes(ckpt_dir, tmp_path, capsys):
    rows = [
        {"id": "ok1", "prompt": "hello world"},                              # 1
        "{not json",                                                         # 2
        {"id": "noprompt"},                                                  # 3
        {"id": "wrongtype", "prompt": 5},                                    # 4
        {"id": "empty", "prompt": ""},                                       # 5
        {"id": "long", "prompt_token_ids": random_prompt(100, 5200)},        # 6: > --max-model-len
        {"id": "ok1", "prompt": "again"},                                    # 7: duplicate id
        {"id": "vocab", "prompt_token_ids": [7, 99999]},                     # 8
        {"id": True, "prompt": "a bool is no id"},                           # 9
        "",                                                                  # 10: blank, ignored
        {"prompt_token_ids": random_prompt(10, 5201)},                       # 11
        "[1, 2]",                                                            # 12
        {"prompt": "two prompt fields", "messages": [{"role": "user", "content": "hi"}]},  # 13
    ]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out"
    assert run_cli(ckpt_dir(KIND), src, out, "--layers", "1", "--max-model-len", "64", "--batch-size", "4") == 1
    captured = capsys.readouterr()
    bad = {2, 3, 4, 5, 6, 7, 8, 9, 12, 13}
    reported = {int(line.split("line ")[1].split(":")[0]) for line in captured.err.splitlines()
                if line.startswith("kvtier extract: line ")}
    assert reported == bad, captured.err
    assert "duplicate id 'ok1' (first on line 1)" in captured.err
    assert [e["id"] for e in manifest(out)] == ["ok1", "line-000011"]
    assert "2 done, 0 skipped" in captured.out and "10 failed" in captured.out


@pytest.mark.parametrize("args, match", [
    (["--layers", str(LAYERS + 1)], "exceed the model"),
    (["--layers", "1,1"], "duplicates"),
    (["--layers=-1"], "integers >= 0"),
    (["--layers", "1", "--include-last-layer"], "--include-last-layer goes with --eagle3"),
    (["--kv-transfer-config", "{}"], "built by extract"),
    (["-sc", "{}"], "built by extract"),
    (["--batch-size", "0"], "--batch-size"),
])
def test_bad_configuration_exits_2_before_any_work(ckpt_dir, tmp_path, capsys, args, match):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    out = tmp_path / "out"
    assert run_cli(ckpt_dir(KIND), src, out, *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier extract: error:") and match in err and "\n" not in err, err
    assert not out.exists()


def test_unwritable_output_or_missing_input_exits_2(ckpt_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert run_cli(ckpt_dir(KIND), src, blocker / "out") == 2
    assert "not writable" in capsys.readouterr().err
    assert run_cli(ckpt_dir(KIND), tmp_path / "missing.jsonl", tmp_path / "out") == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert run_cli(ckpt_dir(KIND), src, tmp_path / "out", "--layers", "x") == 2  # argparse's message
    assert "comma-separated integers" in capsys.readouterr().err


def test_rerun_resumes_without_recomputing_complete_files(ckpt_dir, tmp_path, capsys):
    model, ids = ckpt_dir(KIND), [f"p{i}" for i in range(6)]
    src = write_jsonl(tmp_path / "in.jsonl",
                      [{"id": i, "prompt_token_ids": random_prompt(20 + 9 * k, 5300 + k)} for k, i in enumerate(ids)])
    out = tmp_path / "out"
    assert run_cli(model, src, out, "--batch-size", "4") == 0
    # Copies: load_file's tensors may map the file, and some files are truncated below (SIGBUS).
    first = {i: {k: v.clone() for k, v in load_file(out / f"{i}.safetensors").items()} for i in ids}
    path = {i: out / f"{i}.safetensors" for i in ids}

    keep = [e for e in manifest(out) if e["id"] not in ("p1", "p3")]
    (out / "manifest.jsonl").write_text("".join(json.dumps(e) + "\n" for e in keep)
                                        + '{"id": "p0", "pa')  # torn by a kill mid-append
    path["p2"].unlink()                                                  # listed, file gone
    path["p3"].write_bytes(path["p3"].read_bytes()[:100])                # unlisted and torn
    path["p4"].write_bytes(path["p4"].read_bytes()[:-8])                 # listed but truncated
    (out / ".p5.safetensors.tmp-999-1").write_bytes(b"half a file")      # leftover temp file
    stamp = {i: (path[i].stat().st_ino, path[i].stat().st_mtime_ns) for i in ("p0", "p1", "p5")}
    capsys.readouterr()

    assert run_cli(model, src, out, "--batch-size", "4") == 0
    summary = capsys.readouterr().out
    assert "3 done, 3 skipped (already complete; 1 recovered from files), 0 failed" in summary, summary
    entries = manifest(out)
    assert sorted(e["id"] for e in entries) == ids  # each exactly once, the torn line gone
    assert not temp_files(out)
    for i in ("p0", "p1", "p5"):  # untouched: same inode and mtime, p1 recovered without recompute
        assert (path[i].stat().st_ino, path[i].stat().st_mtime_ns) == stamp[i]
    for i in ids:
        data = load_file(path[i])
        assert torch.equal(data["hidden_states"], first[i]["hidden_states"]), i
        assert torch.equal(data["token_ids"], first[i]["token_ids"]), i

    before = (out / "manifest.jsonl").read_bytes()
    assert run_cli(model, src, out) == 0
    assert "0 done, 6 skipped" in capsys.readouterr().out
    assert (out / "manifest.jsonl").read_bytes() == before
    assert run_cli(model, src, out, "--layers", "1") == 2  # other layers into the same directory
    assert "use another --output" in capsys.readouterr().err


def test_sigkill_then_rerun_completes_every_line_once(ckpt_dir, tmp_path):
    prompts = {f"q{k:03d}": random_prompt(100 + k % 100, 5400 + k) for k in range(200)}
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt_token_ids": p} for i, p in prompts.items()])
    out = tmp_path / "out"
    # A 32-token step budget stretches the job (~2 s of compute here) so the kill lands mid-job.
    argv = [sys.executable, "-m", "server.cli", "extract", str(ckpt_dir(KIND)), "--input", str(src),
            "--output", str(out), *ENGINE, "--batch-size", "8", "--layers", "1,2", "--max-num-batched-tokens", "32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    kill_after_first_commit(argv, env, out)
    assert len(manifest(out)) < len(prompts)  # killed mid-job

    done = subprocess.run(argv, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    skipped = re.search(r"(\d+) skipped", done.stdout)
    assert ", 0 failed" in done.stdout and skipped and int(skipped[1]) > 0, done.stdout  # resumed
    entries = manifest(out)
    assert sorted(e["id"] for e in entries) == sorted(prompts)
    assert not temp_files(out)
    for e in entries:
        data = load_file(out / e["path"])
        assert data["token_ids"].tolist() == prompts[e["id"]] and e["num_tokens"] == len(prompts[e["id"]])
        assert data["hidden_states"].shape[:2] == (len(prompts[e["id"]]), 2)


def test_progress_advances_per_file(ckpt_dir, tmp_path, monkeypatch):
    import tqdm

    updates: list[int] = []

    class Bar:  # records what the job reports; tqdm itself throttles what it draws
        def __init__(self, *args: Any, **kw: Any) -> None:
            pass

        def update(self, n: int = 1) -> None:
            updates.append(n)

        def set_postfix_str(self, *args: Any, **kw: Any) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": random_prompt(10 + k, 5500 + k)} for k in range(6)])
    assert run_cli(ckpt_dir(KIND), src, tmp_path / "out", "--layers", "1", "--batch-size", "6") == 0
    assert updates == [1] * 6  # one step per file as its request finishes, not one jump of 6 per batch


@pytest.mark.parametrize("when", ["imports", "configuration", "model load"])
def test_ctrl_c_during_start_up_exits_130_with_one_line(ckpt_dir, tmp_path, when):
    """A real `kvtier extract` process gets SIGINT where start-up waits on the test, so it lands
    there however fast or loaded this machine is: in configuration, on config.json made a FIFO
    (its read blocks until a writer comes); in the model load, on the CPU kernels' build, run by a
    stand-in compiler (CXX) that never finishes, in an empty cache."""
    model = tmp_path / "model"
    model.mkdir()
    for f in ckpt_dir(KIND).iterdir():
        (model / f.name).symlink_to(f)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello world"}])
    out, building = tmp_path / "out", tmp_path / "building"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo stand-in 1.0 && exit 0\ntouch {building}\nexec sleep 600\n')
    cxx.chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CXX": str(cxx),
           "KVTIER_CACHE_DIR": str(tmp_path / "cache"), "KVTIER_CPU_KERNELS": "1"}
    if when == "configuration":
        (model / "config.json").unlink()
        os.mkfifo(model / "config.json")
    argv = [sys.executable, "-m", "server.cli", "extract", str(model), "--input", str(src), "--output", str(out),
            *ENGINE]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fd = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if when == "imports":  # Python is up, the handler too, and importing torch, which takes seconds
                time.sleep(0.5)
                break
            if when == "model load" and building.exists():
                break
            if when == "configuration":
                with contextlib.suppress(OSError):  # ENXIO until the job opens it to read
                    fd = os.open(model / "config.json", os.O_WRONLY | os.O_NONBLOCK)
                    break  # held open, unwritten: the job's read blocks
            time.sleep(0.005)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if fd is not None:
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = (stdout + stderr).strip().splitlines()
    assert proc.returncode == 130 and lines == ["kvtier extract: interrupted during start-up"], (proc.returncode, lines)
    assert (out / ".kvtier-extract.lock").exists() == (when == "model load")  # the lock: model load began
    assert not (out / "manifest.jsonl").exists()
