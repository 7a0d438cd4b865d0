#!/usr/bin/env python3
"""A repeated image with a changing question (issue 45, point 4): time to first token when the
image is new (cold: encode + prefill), when only its encoder output is kept (the text before it
changed, so no KV matches: prefill only), when its KV is in G1 (the question after it changed),
and when its KV comes from G3 (G1 emptied); transformers' own first token on the cold prompt
beside them.

The model is a random-weight Gemma 3 with a SigLIP tower (no multimodal checkpoint can be
downloaded here), sized to run on a CPU: a 12-layer SigLIP-base-like tower over 448x448 images
(1,024 patches pooled to 256 tokens) and an 18-layer language model of Gemma 3 270M's shape. Each
run uses a new image, so its cold prompt is cold; the modes run in order within a run.

    .venv/bin/python benchmarks/multimodal.py --runs 5 --out benchmarks/results/multimodal.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE.parent / "tests"))  # checkpoints_mm.build_gemma3_mm
sys.path.append(str(_HERE))

from _common import log, machine_info, median, print_table, set_torch_threads, write_json  # noqa: E402
from engine.mm.inputs import MMItem  # noqa: E402

TEXT = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
            layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)])
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              image_size=448, patch_size=14)
MODES = ("cold", "encoder cache", "G1 prefix hit", "G3 hit")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="images, each through every mode (default %(default)s)")
    ap.add_argument("--words", type=int, default=200, help="words of text before the image (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    set_torch_threads(args.threads)
    import checkpoints_mm as M
    import numpy as np
    import torch

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    work = Path(tempfile.mkdtemp(prefix="kvtier-mm-bench-"))
    log("building the checkpoint")
    ckpt = M.build_gemma3_mm(work / "ckpt", text=TEXT, vision=VISION, tokens_per_image=256, randomize=False)
    vocab = [w for w in M.build_tokenizer().get_vocab() if w.isalpha()]
    rng = np.random.default_rng(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(vocab, n))

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm = LLM(str(ckpt), dtype="float32", kv_offload_disk=str(work / "g3"))
    from transformers import Gemma3ForConditionalGeneration

    hf, proc = Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval(), M.load_hf_mm(ckpt)[1]

    def ttft(text: str, image) -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt": text, "multi_modal_data": {"image": [image]}}], one, use_tqdm=False)
        return time.perf_counter() - t0

    def hf_ttft(text: str, image) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            inputs = proc(text=text, images=[image], return_tensors="pt")
            hf(**inputs, logits_to_keep=1)
        return time.perf_counter() - t0

    ttft(f"{words(20)} {M.BOI} warm up", M.image(10_000, (448, 448)))  # first-call costs out of the figures
    hf_ttft(f"{words(20)} {M.BOI} warm up", M.image(10_000, (448, 448)))
    times: dict[str, list[float]] = {m: [] for m in (*MODES, "transformers (cold)")}
    encode: list[float] = []
    for r in range(args.runs):
        image = M.image(r, (448, 448))
        before, q = words(args.words), [words(12) for _ in range(4)]
        times["transformers (cold)"].append(hf_ttft(f"{before} {M.BOI} {q[0]}", image))
        times["cold"].append(ttft(f"{before} {M.BOI} {q[0]}", image))
        times["encoder cache"].append(ttft(f"{words(args.words)} {M.BOI} {q[1]}", image))
        times["G1 prefix hit"].append(ttft(f"{before} {M.BOI} {q[2]}", image))
        llm.engine.connector.flush()
        llm.engine.pool.reset_prefix_cache()
        times["G3 hit"].append(ttft(f"{before} {M.BOI} {q[3]}", image))
        pixels = proc.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        t0 = time.perf_counter()
        llm.engine.runner.model.encode_images([MMItem(0, 1, b"\0" * 16, pixels)])
        encode.append(time.perf_counter() - t0)
        log(f"run {r + 1}/{args.runs}: " + ", ".join(f"{m} {v[-1]:.3f}s" for m, v in times.items()))
    llm.close()
    cold = median(times["cold"])
    rows = [[m, f"{median(v):.3f}", f"{cold / median(v):.1f}x"] for m, v in times.items()]
    prompt_tokens = len(proc(text=f"{words(args.words)} {M.BOI} {words(12)}", images=[M.image(0, (448, 448))])
                        ["input_ids"][0])
    print(f"TTFT, {prompt_tokens}-token prompt with one 256-token image; median of {args.runs}; "
          f"the image's encode alone: {median(encode):.3f}s; {machine_info()['cpu_model']} ({machine_info()['cpu_isa']})")
    print_table(["mode", "TTFT s", "cold / this"], rows)
    if args.out is not None:
        write_json(args.out, {"benchmark": "multimodal", "runs": args.runs, "prompt_tokens": prompt_tokens,
                              "text_config": TEXT, "vision_config": VISION, "encode_s": encode, "ttft_s": times})
    return 0


if __name__ == "__main__":
    sys.exit(main())
