"""Issue 19: the `kvtier kv` command line: bad input exits 2 with one line on stderr (never a
traceback), every flag has help, the real executable's exit codes, and a real engine's G3 tier
records which model its namespace is."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.disk import DiskBackend
from server.cli import main

REPO = Path(__file__).resolve().parents[2]
NS = bytes.fromhex("ab" * 16)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["kv", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, message", [
    (["inspect", "{missing}"], "does not exist"),
    (["verify", "{file}"], "is not a directory"),
    (["clear", "mysql://host/db"], "scheme must be one of"),
    (["inspect", "redis://127.0.0.1:{closed}"], "cannot reach"),
    (["inspect", "{dir}", "--bogus"], "unrecognized arguments: --bogus"),
    (["clear", "{dir}", "--namespace", "xyz"], "a namespace is 32 hex digits"),
    (["inspect", "{dir}", "--prefix", "team1"], "--prefix applies to a Redis URL"),
    (["verify", "{dir}", "--timeout-s", "2"], "--timeout-s applies to a Redis URL"),
    (["verify", "{dir}", "--kv-offload-secret-file", "{missing}"], "kv offload secret file"),
    (["frobnicate", "{dir}"], "invalid choice"),
    ([], "required"),
])
def test_bad_input_exits_2_with_a_message(args, message, tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    (tmp_path / "file").write_text("x")
    fill = {"missing": tmp_path / "missing", "file": tmp_path / "file", "dir": tmp_path, "closed": closed}
    code, out, err = run_cli(capsys, *(a.format(**fill) for a in args))
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command, flags", [
    ("inspect", ["--namespace", "--json", "--prefix", "--timeout-s"]),
    ("verify", ["--remove", "--kv-offload-secret-file", "--namespace", "--json", "--prefix", "--timeout-s"]),
    ("clear", ["--namespace", "--json", "--prefix", "--timeout-s"]),
])
def test_every_flag_has_help(command, flags, capsys):
    import argparse

    from kvtools.cli import _parser

    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0 and "DIR|URL" in out and all(flag in out for flag in flags)
    [subs] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    actions = subs.choices[command]._actions
    assert {o for a in actions for o in a.option_strings if o.startswith("--")} == {"--help", *flags}
    assert all(a.help and len(a.help) > 15 for a in actions), [a.dest for a in actions if not a.help]


def test_kvtier_lists_the_kv_command(capsys):
    assert main(["--help"]) == 0
    assert "kv " in capsys.readouterr().out


def test_the_real_command_line_exit_codes(tmp_path, capsys):
    """One subprocess (`python -m server.cli`, through `entry()`): exit 1 with a bad entry; then in
    process, `--remove` (1: it found one) and a clean directory (0)."""
    tier = DiskBackend(tmp_path, 1 << 20, NS, file_bytes=1)
    k = bytes(range(16))
    tier.put([k], [b"x" * 500])
    tier.close()
    entry = tmp_path / NS.hex() / k.hex()[:2] / f"{k.hex()}.kvb"
    entry.write_bytes(entry.read_bytes()[:-1] + b"y")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "server.cli", "kv", "verify", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert f"BAD {entry}: payload checksum mismatch" in proc.stdout and "Traceback" not in proc.stderr
    assert run_cli(capsys, "verify", str(tmp_path), "--remove")[0] == 1
    assert run_cli(capsys, "verify", str(tmp_path))[0] == 0 and not entry.exists()


def test_an_engine_records_its_namespace_model(ckpt_dir, tmp_path, capsys):
    """A real engine's G3 writes the namespace record: inspect names the model and its dtype."""
    from engine import LLM, SamplingParams

    model = ckpt_dir("qwen3")
    disk = tmp_path / "g3"
    with LLM(str(model), dtype="float32", num_gpu_blocks=64, kv_offload_disk=str(disk)) as llm:
        llm.generate([{"prompt_token_ids": list(range(1, 50))}], SamplingParams(temperature=0.0, max_tokens=2),
                     use_tqdm=False)
        llm.engine.flush_offload()
    code, out, _ = run_cli(capsys, "inspect", str(disk), "--json")
    assert code == 0
    [ns] = json.loads(out)["namespaces"]
    assert ns["model"] == f"{model} (torch.float32)" and ns["entries"] >= 1
    record = ns["record"]
    assert record["namespace"] == ns["namespace"] and record["fingerprint"]["block_size"] == 16
    assert record["fingerprint"]["architecture"] and "weights" in record["fingerprint"]
    code, out, _ = run_cli(capsys, "verify", str(disk))
    assert code == 0, out
