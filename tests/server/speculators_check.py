"""Run by the speculators venv's Python (tests/server/test_speculators_oracle.py), not by pytest:
reads a directory with speculators 0.9.0's own offline-training code and prints what it found as
one JSON object on stdout. Imports nothing from kvtier.

    python speculators_check.py dataset DIR MODEL AUX   ArrowDataset, CollateFn and the data-generation
                                                        checks on DIR; the verifier MODEL (transformers)
                                                        as the oracle for the states it hands training,
                                                        AUX (JSON) the ids of the aux layers
    python speculators_check.py rows DIR                the rows of a prepared dataset (prepare-data's)
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch


def dataset(data_dir: Path, model_dir: Path) -> dict:
    from safetensors.torch import load_file
    from speculators.data_generation.offline import (
        check_hidden_states,
        find_corrupt_hidden_state_indices,
        get_existing_hidden_state_indices,
    )
    from speculators.train.data import ArrowDataset, CollateFn
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hidden = model.config.hidden_size
    ds = ArrowDataset(max_len=4096, datapath=data_dir, on_missing="raise", hidden_states_dtype=torch.float32)
    indices = get_existing_hidden_state_indices(data_dir / "hidden_states")
    out: dict = {"rows": len(ds), "indices": indices,
                 "corrupt": find_corrupt_hidden_state_indices(data_dir / "hidden_states", indices), "items": []}
    items = []
    for i in range(len(ds)):
        with warnings.catch_warnings(record=True) as caught:  # ArrowDataset warns, then drops, a mismatched row
            warnings.simplefilter("always")
            item = ds[i]
        if not isinstance(item, dict):
            out["items"].append({"unavailable": repr(item), "warnings": [str(w.message) for w in caught]})
            continue
        check_hidden_states(load_file(data_dir / "hidden_states" / f"hs_{i}.safetensors"),
                            ds.data[i]["input_ids"].tolist())  # generate-offline-data's --validate-outputs
        ids = item["input_ids"]
        with torch.no_grad():
            ref = model(input_ids=ids[None], output_hidden_states=True)
            # What training does with it (speculators/models/eagle3/core.py): the verifier's norm and head.
            targets = model.lm_head(model.model.norm(item["verifier_last_hidden_states"]))
        aux = item["hidden_states"].view(len(ids), -1, hidden)
        out["items"].append({
            "shapes": {k: list(v.shape) for k, v in item.items()},
            "dtypes": {k: str(v.dtype) for k, v in item.items()},
            "input_ids": ids.tolist(), "loss_mask": item["loss_mask"].tolist(),
            "num_aux": aux.shape[1],
            # per aux layer: (max |difference| to transformers' hidden_states[k], max |reference|)
            "aux_vs_transformers": {str(k): [(aux[:, j] - ref.hidden_states[k][0]).abs().max().item(),
                                             ref.hidden_states[k][0].abs().max().item()]
                                    for j, k in enumerate(json.loads(sys.argv[4]))},
            "final_vs_logits": [(targets - ref.logits[0]).abs().max().item(), ref.logits[0].abs().max().item()],
        })
        items.append(item)
    batch = CollateFn(max_len=256, hidden_size=hidden, num_target_layers=out["items"][0]["num_aux"],
                      dtype=torch.float32)(items)
    out["batch"] = {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return out


def rows(data_dir: Path) -> dict:
    from datasets import load_from_disk

    ds = load_from_disk(str(data_dir))
    return {"columns": ds.column_names, "rows": [{k: (v.tolist() if hasattr(v, "tolist") else v)
                                                  for k, v in row.items()} for row in ds]}


if __name__ == "__main__":
    what, path = sys.argv[1], Path(sys.argv[2])
    print(json.dumps(dataset(path, Path(sys.argv[3])) if what == "dataset" else rows(path)))
