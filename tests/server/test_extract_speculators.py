"""`kvtier extract --layout speculators` and the EAGLE-3 layer choice (server/extract_layout.py).

What the layout must be was read from speculators 0.9.0 (see the module's docstring); this file
checks it without speculators installed: the files, keys, dtypes and shapes, the hidden states
against transformers (aux layers against `output_hidden_states`, the last layer through the
model's final norm and lm_head against its logits: what speculators' training does with it), the
Arrow dataset's rows and loss masks, and resuming. tests/server/test_speculators_oracle.py runs
speculators itself on the same output when its venv exists.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa  # kvtier[test] has it: --layout speculators writes Arrow
import pytest
import torch
from checkpoints import build_checkpoint, load_hf, random_prompt
from safetensors.torch import load_file
from test_extract import manifest, run_cli, write_jsonl
from transformers import AutoTokenizer

from server.extract import build_parser, choose_layers

NUM_LAYERS = 8  # EAGLE-3's defaults [2, 4, 5] are distinct, and then 8
STORY = [{"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": "the capital of france"},
         {"role": "user", "content": "and what"}, {"role": "assistant", "content": "hello world"}]
ROWS = [
    {"id": "text", "prompt": "hello world what is the capital of france ?"},
    {"id": "chat", "messages": STORY},
    {"id": "no-reply", "messages": STORY[:1]},  # nothing to learn: refused, like prepare-data drops it
    {"id": "ids", "prompt_token_ids": random_prompt(30, 7100), "loss_mask": [0] * 10 + [1] * 20},
]


@pytest.fixture(scope="module")
def deep_ckpt(tmp_path_factory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("deep") / "llama", num_hidden_layers=NUM_LAYERS)


def layers_for(num_layers: int, *flags: str) -> list[int]:
    ns = build_parser().parse_args(["--input", "x", "--output", "y", *flags])
    return choose_layers(ns, num_layers)


@pytest.mark.parametrize("num_layers, flags, want", [
    (32, [], [2, 16, 29, 32]),                           # speculators' launch_vllm.py default
    (32, ["--eagle3", "--include-last-layer"], [2, 16, 29, 32]),
    (32, ["--no-include-last-layer"], [2, 16, 29]),
    (8, [], [2, 4, 5, 8]),
    (2, [], [1, 2]),                                     # aux ids [2, 1]: 2 is the last layer, so it goes last
    (8, ["--layout", "speculators"], [2, 4, 5, 8]),
])
def test_eagle3_layers_end_with_the_last_layer(num_layers, flags, want):
    assert layers_for(num_layers, *flags) == want


def test_speculators_layout_matches_transformers(deep_ckpt, tmp_path, capsys):
    src, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out"
    assert run_cli(deep_ckpt, src, out, "--layout", "speculators", "--no-add-generation-prompt") == 1
    captured = capsys.readouterr()
    assert "line 3: \"messages\" has no assistant reply" in captured.err, captured.err
    assert "(3 speculators rows)" in captured.out, captured.out
    assert [e["layer_ids"] for e in manifest(out)] == [[2, 4, 5, NUM_LAYERS]] * 3

    # The files speculators opens, and nothing else it would mistake for a row.
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == [f"hs_{i}.safetensors" for i in range(3)]
    state = json.loads((out / "state.json").read_text())
    assert state["_data_files"] == [{"filename": "data-00000-of-00001.arrow"}] and state["_format_type"] == "torch"
    want_features = {"input_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"},
                     "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
                     "seq_len": {"dtype": "int64", "_type": "Value"}}
    assert json.loads((out / "dataset_info.json").read_text())["features"] == want_features
    with pa.ipc.open_stream(str(out / "data-00000-of-00001.arrow")) as reader:  # what datasets maps
        assert json.loads(reader.schema.metadata[b"huggingface"])["info"]["features"] == want_features
        table = reader.read_all()
    assert [str(t) for t in table.schema.types] == ["list<item: int32>", "list<item: int64>", "int64"]
    rows = table.to_pylist()

    model = load_hf(deep_ckpt)
    tok = AutoTokenizer.from_pretrained(deep_ckpt)
    for i, rid in enumerate(["text", "chat", "ids"]):  # input order, the failed line left out
        hs_file = out / "hidden_states" / f"hs_{i}.safetensors"
        assert os.path.samefile(hs_file, out / f"{rid}.safetensors")  # a link to kvtier's file, not a copy
        data = load_file(hs_file)
        assert set(data) == {"hidden_states", "token_ids"}
        ids = data["token_ids"]
        assert ids.dtype == torch.int64 and rows[i]["input_ids"] == ids.tolist() and rows[i]["seq_len"] == len(ids)
        hs = data["hidden_states"]
        assert hs.dtype == torch.float32 and hs.shape == (len(ids), 4, model.config.hidden_size)
        with torch.no_grad():
            ref = model(input_ids=ids[None], output_hidden_states=True)
            # speculators' training: verifier_lm_head(verifier_norm(hidden_states[:, -1])) are the targets
            logits = model.lm_head(model.model.norm(hs[:, -1]))
        # float32 summed in another order than transformers' SDPA: bounds relative to the scale of
        # the residual stream (as tests/connectors/test_hidden_states.py argues), far below a defect.
        for j, layer in enumerate([2, 4, 5]):  # output_hidden_states[k]: after decoder layer k-1
            want = ref.hidden_states[layer][0]
            assert (hs[:, j] - want).abs().max() <= 2e-6 * want.abs().max(), (rid, layer)
        # The final norm rescales the residual (to logits of std 4 here), its rounding error with it.
        assert (logits - ref.logits[0]).abs().max() <= 1e-5 * ref.logits[0].abs().max(), rid
        with torch.no_grad():  # what a file without the last layer makes training use: another model
            wrong = model.lm_head(model.model.norm(hs[:, -2]))
        assert (wrong - ref.logits[0]).abs().max() > 1, rid

    assert rows[0]["loss_mask"] == [1] * rows[0]["seq_len"]  # a text prompt: every token
    chat_ids = torch.tensor(rows[1]["input_ids"])
    learned = tok.decode(chat_ids[torch.tensor(rows[1]["loss_mask"]).bool()])
    assert learned == "the capital of france <|im_end|> hello world <|im_end|>"  # the assistant turns only
    assert rows[2]["loss_mask"] == ROWS[3]["loss_mask"]  # the line's own

    # A rerun recomputes nothing; a new line in the middle renumbers the rows in input order.
    before = (out / "data-00000-of-00001.arrow").read_bytes()
    assert run_cli(deep_ckpt, src, out, "--layout", "speculators", "--no-add-generation-prompt") == 1
    assert "0 done, 3 skipped" in capsys.readouterr().out
    assert (out / "data-00000-of-00001.arrow").read_bytes() == before
    write_jsonl(src, [ROWS[0], {"id": "new", "prompt": "the capital of france"}, ROWS[1], ROWS[3]])
    assert run_cli(deep_ckpt, src, out, "--layout", "speculators", "--no-add-generation-prompt") == 0
    assert "1 done, 3 skipped" in capsys.readouterr().out
    assert [os.path.samefile(out / "hidden_states" / f"hs_{i}.safetensors", out / f"{rid}.safetensors")
            for i, rid in enumerate(["text", "new", "chat", "ids"])] == [True] * 4
    assert not list(out.glob(".hidden_states.*")) and not list(out.glob(".*.tmp-*"))


def test_generated_tokens_are_learned_too(deep_ckpt, tmp_path):
    prompt = random_prompt(12, 7200)
    src, out = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": prompt, "loss_mask": [0] * 12}]), \
        tmp_path / "out"
    assert run_cli(deep_ckpt, src, out, "--layout", "speculators", "--max-tokens", "5") == 0
    data = load_file(out / "hidden_states" / "hs_0.safetensors")
    with pa.ipc.open_stream(str(out / "data-00000-of-00001.arrow")) as reader:
        (row,) = reader.read_all().to_pylist()
    n = len(data["token_ids"])
    assert n > len(prompt) and row["input_ids"] == data["token_ids"].tolist()
    assert row["loss_mask"] == [0] * len(prompt) + [1] * (n - len(prompt))  # the model's own reply


@pytest.mark.parametrize("flags, match", [
    (["--no-include-last-layer"], "must end with 8"),
    (["--layers", "2,4,5"], "must end with 8"),
    (["--layers", "8"], "at least one aux layer"),
])
def test_speculators_layout_refuses_files_without_the_final_state(deep_ckpt, tmp_path, capsys, flags, match):
    src, out = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}]), tmp_path / "out"
    assert run_cli(deep_ckpt, src, out, "--layout", "speculators", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier extract: error:") and match in err and "\n" not in err, err
    assert not out.exists()


def test_line_errors_of_the_layout(deep_ckpt, tmp_path, capsys):
    rows = [{"prompt": "hello", "loss_mask": [1]},                                      # 1: mask needs ids
            {"prompt_token_ids": [7, 8, 9], "loss_mask": [1, 0]},                       # 2: wrong length
            {"prompt_token_ids": [7, 8, 9], "loss_mask": [1, 2, 0]},                    # 3: not 0/1
            {"messages": [{"role": "assistant", "content": "hi"}]},                     # 4: leading reply only
            {"prompt_token_ids": [7, 8, 9], "loss_mask": [0, 1, 1]}]                    # 5: fine
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out"
    assert run_cli(deep_ckpt, src, out, "--layout", "speculators") == 1
    err = capsys.readouterr().err
    assert '"loss_mask" goes with "prompt_token_ids"' in err and "a list of 3 zeros and ones" in err
    assert {int(line.split("line ")[1].split(":")[0]) for line in err.splitlines()
            if line.startswith("kvtier extract: line ")} == {1, 2, 3, 4}
    assert len(list((out / "hidden_states").iterdir())) == 1
