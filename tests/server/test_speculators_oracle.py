"""Issue 17, acceptance 4, with the real package: speculators 0.9.0's own offline pipeline reads
`kvtier extract --layout speculators` output as it is, and `speculators prepare-data
--render-endpoint` works against `kvtier serve`.

speculators pins its own transformers/datasets, so it lives in a separate venv, built by
scripts/speculators-venv.sh (`make speculators-venv`; about 2.5 minutes and 1.5 GB once, then
cached). Found at $KVTIER_SPECULATORS_VENV or .venv-speculators; without it these tests skip.
The checks that run inside it are tests/server/speculators_check.py.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from checkpoints import build_checkpoint, random_prompt
from serving import start_server
from test_extract import run_cli, write_jsonl
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.9.0"
VENV = Path(os.environ.get("KVTIER_SPECULATORS_VENV", REPO / ".venv-speculators"))
pytestmark = pytest.mark.skipif(
    not (VENV / f".speculators-{VERSION}").exists(),
    reason=f"no speculators {VERSION} venv at {VENV}: run scripts/speculators-venv.sh (or set KVTIER_SPECULATORS_VENV)")

NUM_LAYERS = 8  # EAGLE-3's aux layers [2, 4, 5], then 8
AUX = [2, 4, 5]
STORY = [{"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": "the capital of france"},
         {"role": "user", "content": "and what"}, {"role": "assistant", "content": "hello world"}]


@pytest.fixture(scope="module")
def deep_ckpt(tmp_path_factory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("deep") / "llama", num_hidden_layers=NUM_LAYERS)


def in_venv(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # nothing of kvtier's: speculators reads the files alone
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, env=env)


def speculators_reads(data_dir: Path, model: Path) -> dict:
    done = in_venv(str(VENV / "bin" / "python"), str(Path(__file__).with_name("speculators_check.py")),
                   "dataset", str(data_dir), str(model), json.dumps(AUX))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_arrow_dataset_reads_the_layout_with_the_final_state_last(deep_ckpt, tmp_path):
    rows = [{"prompt": "hello world what is the capital of france ?"}, {"messages": STORY},
            {"prompt_token_ids": random_prompt(40, 7300), "loss_mask": [0] * 15 + [1] * 25}]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out"
    assert run_cli(deep_ckpt, src, out, "--layout", "speculators", "--no-add-generation-prompt") == 0
    got = speculators_reads(out, deep_ckpt)

    assert got["rows"] == 3 and got["indices"] == [0, 1, 2] and got["corrupt"] == {}
    tok = AutoTokenizer.from_pretrained(deep_ckpt)
    want_ids = [tok.encode(rows[0]["prompt"]),
                tok.apply_chat_template(STORY, add_generation_prompt=False, tokenize=True, return_dict=False),
                rows[2]["prompt_token_ids"]]
    for item, ids in zip(got["items"], want_ids):
        assert "unavailable" not in item, item
        n = len(ids)
        assert item["input_ids"] == ids
        assert item["shapes"]["hidden_states"] == [n, 3 * 64] and item["shapes"]["verifier_last_hidden_states"] == [n, 64]
        assert item["dtypes"]["hidden_states"] == "torch.float32" and item["dtypes"]["input_ids"] == "torch.int64"
        # The aux layers are transformers' hidden_states[2, 4, 5]; the final state, through the verifier's
        # norm and head as training applies them, gives transformers' logits. (float32 in another order:
        # bounds relative to the scale; a wrong layer is off by the scale itself.)
        for layer, (diff, scale) in item["aux_vs_transformers"].items():
            assert diff <= 1e-5 * scale, (layer, diff, scale)
        diff, scale = item["final_vs_logits"]
        assert diff <= 1e-5 * scale, (diff, scale)
    assert got["items"][0]["loss_mask"] == [1] * len(want_ids[0])
    assert got["items"][2]["loss_mask"] == rows[2]["loss_mask"]
    assert got["batch"]["hidden_states"] == [1, 256, 192] and got["batch"]["verifier_last_hidden_states"] == [1, 256, 64]


def test_prepare_data_renders_through_kvtier_serve_and_extract_completes_it(deep_ckpt, tmp_path):
    convs = tmp_path / "convs.jsonl"
    write_jsonl(convs, [{"conversations": STORY},
                        {"conversations": [{"role": "system", "content": "you are a helpful assistant"},
                                           {"role": "user", "content": "what is the capital of france ?"},
                                           {"role": "assistant", "content": "the capital of france"}]}])
    prepared = tmp_path / "prepared"
    server = start_server(str(deep_ckpt), "--served-model-name", "tiny", "--num-gpu-blocks", "256")
    try:
        done = in_venv(str(VENV / "bin" / "speculators"), "prepare-data", "--model", str(deep_ckpt),
                       "--data", str(convs), "--output", str(prepared), "--render-endpoint", server.url,
                       "--seq-length", "64", "--num-preprocessing-workers", "1")
    finally:
        server.stop()
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    read = in_venv(str(VENV / "bin" / "python"), str(Path(__file__).with_name("speculators_check.py")),
                   "rows", str(prepared))
    assert read.returncode == 0, read.stderr[-3000:]
    got = json.loads(read.stdout)["rows"]

    # prepare-data: one row per assistant turn after the first message, the turn's tokens learned.
    tok = AutoTokenizer.from_pretrained(deep_ckpt)

    def render(msgs: list[dict], gen: bool) -> list[int]:
        return tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=False)

    system_conv = [{"role": "system", "content": "you are a helpful assistant"},
                   {"role": "user", "content": "what is the capital of france ?"},
                   {"role": "assistant", "content": "the capital of france"}]
    want = []
    for conv, turn in [(STORY, 1), (STORY, 3), (system_conv, 2)]:
        ids, start = render(conv[: turn + 1], False), len(render(conv[:turn], True))
        want.append({"input_ids": ids, "loss_mask": [0] * start + [1] * (len(ids) - start), "seq_len": len(ids)})
    key = lambda r: r["input_ids"]
    assert sorted(got, key=key) == sorted(want, key=key)

    # Its rows as speculator-format lines: kvtier extract completes the training directory.
    src = write_jsonl(tmp_path / "rows.jsonl", [{"prompt_token_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
                                                for r in got])
    out = tmp_path / "out"
    assert run_cli(deep_ckpt, src, out, "--layout", "speculators") == 0
    items = speculators_reads(out, deep_ckpt)["items"]
    assert [(i["input_ids"], i["loss_mask"]) for i in items] == [(r["input_ids"], r["loss_mask"]) for r in got]
