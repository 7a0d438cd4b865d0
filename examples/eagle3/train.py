#!/usr/bin/env python3
"""Train an EAGLE-3 draft on CPU from `kvtier extract` output with speculators' model classes, and
save it in speculators' format (config.json + model.safetensors) for `kvtier serve -sc` or vLLM.

Runs in a venv with `speculators` (see README.md); it imports nothing from kvtier. The data
directory holds `manifest.jsonl` and one `{id}.safetensors` per prompt with `token_ids` [T] and
`hidden_states` [T, layers, hidden] in the manifest's `layer_ids` order: the aux layers, then the
target's last layer (id N, before the final norm), whose logits are the training targets. That is
the layout speculators' own data pipeline reads, so its `shift_batch` and `CollateFn` pair row t
as (g_t, token t+1) -> target logits at t+1 (token t+2), exactly what serving feeds the draft.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.eagle3.data import shift_batch
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.data import CollateFn
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from transformers import AutoTokenizer, LlamaConfig

Sample = dict[str, torch.Tensor]


def generation_header(target: Path) -> list[int]:
    """The tokens the chat template appends to open the assistant's turn: what follows their last
    occurrence in a sample is the model's own answer."""
    tok = AutoTokenizer.from_pretrained(target)
    msgs = [{"role": "user", "content": "x"}]
    with_header = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    without = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=True, return_dict=False)
    if with_header[:len(without)] != without or len(with_header) == len(without):
        raise SystemExit("cannot find the chat template's generation header; use --loss-on all")
    return with_header[len(without):]


def answer_start(ids: list[int], header: list[int]) -> int:
    for i in range(len(ids) - len(header), -1, -1):
        if ids[i:i + len(header)] == header:
            return i + len(header)
    return len(ids)  # no answer: nothing to learn from this sample


def load_samples(data: Path, num_layers: int, header: list[int] | None) -> tuple[list[Sample], list[int]]:
    """Samples in the dict layout of speculators' datasets (before shift_batch), and the aux ids."""
    rows = [json.loads(line) for line in (data / "manifest.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{data}/manifest.jsonl lists no files")
    layer_ids = rows[0]["layer_ids"]
    if layer_ids[-1] != num_layers or any(r["layer_ids"] != layer_ids for r in rows):
        raise SystemExit(f"every file must hold the same layers ending with {num_layers} (the last layer's "
                         f"output, for the targets): got {layer_ids}; extract with --layers ...,{num_layers}")
    samples = []
    for r in rows:
        t = load_file(data / r["path"])
        ids, hs = t["token_ids"].long(), t["hidden_states"].float()
        mask = torch.ones(len(ids), dtype=torch.bool)
        if header is not None:
            mask[:answer_start(ids.tolist(), header)] = False
        samples.append({"hidden_states": hs[:, :-1].flatten(1), "input_ids": ids,
                        "verifier_last_hidden_states": hs[:, -1], "loss_mask": mask,
                        "lengths": torch.tensor([len(ids)]), "position_ids": torch.arange(len(ids))})
    return samples, layer_ids[:-1]


def target_weights(target: Path) -> dict[str, torch.Tensor]:
    """embed_tokens, lm_head (the embedding when tied) and the final norm of the target."""
    want = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    out = {}
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k).float() for k in st.keys() if k in want})
    out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def build_model(tcfg: dict, aux_ids: list[int], samples: list[Sample], args: argparse.Namespace) -> Eagle3DraftModel:
    # One Llama decoder layer with the target's sizes; vocab_size is the target's (embed_tokens).
    layer = LlamaConfig(
        vocab_size=tcfg["vocab_size"], hidden_size=tcfg["hidden_size"], intermediate_size=tcfg["intermediate_size"],
        num_hidden_layers=1, num_attention_heads=tcfg["num_attention_heads"],
        num_key_value_heads=tcfg.get("num_key_value_heads", tcfg["num_attention_heads"]),
        head_dim=tcfg.get("head_dim"), rms_norm_eps=tcfg["rms_norm_eps"], hidden_act=tcfg.get("hidden_act", "silu"),
        max_position_embeddings=tcfg["max_position_embeddings"],
        rope_theta=tcfg.get("rope_theta", (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        tie_word_embeddings=False)
    # Flex attention (speculators' default) wants a GPU; eager takes the same dense mask on CPU.
    layer._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=args.draft_vocab, eagle_aux_hidden_state_layer_ids=aux_ids,
        # Written explicitly: vLLM takes a missing key as true, speculators' config class as false.
        norm_before_residual=args.norm_before_residual,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=args.ttt_steps)],
            verifier=VerifierConfig(name_or_path=args.verifier_name or str(args.target),
                                    architectures=tcfg.get("architectures", ["LlamaForCausalLM"]))))
    model = Eagle3DraftModel(cfg)
    # Draft vocabulary: the most frequent target tokens where the loss applies (as speculators'
    # vocab_mapping does); d2t holds offsets, target id = draft id + d2t[draft id].
    freq = Counter()
    for s in samples:
        freq.update(s["input_ids"][s["loss_mask"]].tolist())
    w = target_weights(args.target)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(w["model.embed_tokens.weight"])
        lm_head = w["lm_head.weight"]
        if model.use_draft_vocab:
            d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), args.draft_vocab, tcfg["vocab_size"])
            model.load_vocab_mappings(t2d, d2t)
            lm_head = lm_head[t2d]
            covered = sum(freq[i] for i in t2d.nonzero().flatten().tolist()) / max(1, freq.total())
            print(f"draft vocabulary: {args.draft_vocab} tokens ({len(freq)} seen) cover {covered:.2%} of the loss tokens")
        # lm_head starts as (and, in speculators 0.9.0, stays) the target's rows: frozen.
        model.lm_head.weight.copy_(lm_head)
        model.verifier_lm_head.weight.copy_(lm_head)
        model.verifier_norm.weight.copy_(w["model.norm.weight"])
    return model


def packs(samples: list[Sample], max_len: int, rng: random.Random) -> list[list[Sample]]:
    """Shuffled samples packed greedily into batches of at most max_len tokens (after the shift)."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    out, cur, used = [], [], 0
    for i in order:
        n = len(samples[i]["input_ids"]) - 1
        if cur and used + n > max_len:
            out.append(cur)
            cur, used = [], 0
        cur.append(samples[i])
        used += n
    return out + ([cur] if cur else [])


def step_stats(metrics: dict[str, torch.Tensor], steps: int) -> tuple[list[float], float]:
    """Per-step accuracy (step k counts only when steps 0..k were all right) and the acceptance
    length it implies: 1 + the expected number of leading correct drafts."""
    acc = [float(metrics[f"full_acc_{k}_sum"] / metrics[f"full_acc_{k}_total"].clamp(min=1)) for k in range(steps)]
    return acc, 1 + sum(acc)


def evaluate(model: Eagle3DraftModel, batches: list[dict], kw: dict) -> tuple[float, list[float], float]:
    model.eval()
    sums: Counter = Counter()
    with torch.no_grad():
        for b in batches:
            _, loss, m = model(**b, **kw)
            sums["loss"] += float(loss)
            for k, v in m.items():
                sums[k] += float(v)
    model.train()
    acc, al = step_stats({k: torch.tensor(v) for k, v in sums.items()}, kw["ttt_steps"])
    return sums["loss"] / max(1, len(batches)), acc, al


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="kvtier extract output directory")
    p.add_argument("--target", type=Path, required=True, help="the target's HF checkpoint directory")
    p.add_argument("--out", type=Path, required=True, help="directory for the draft (speculators format)")
    p.add_argument("--verifier-name", default=None,
                   help="verifier.name_or_path written in config.json (default: --target)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size")
    p.add_argument("--norm-before-residual", action=argparse.BooleanOptionalAction, default=True,
                   help="residual = hidden_norm(h) (speculators' trainer default) instead of h")
    p.add_argument("--loss-on", choices=["answer", "all"], default="answer",
                   help="train on the model's answers only (as speculators does) or on every token")
    p.add_argument("--epochs", type=int, default=8, help="passes over the data (on 2 cores the time box ends first)")
    p.add_argument("--max-minutes", type=float, default=15.0, help="stop (and save) after this long")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-len", type=int, default=1024, help="tokens per packed batch")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps trained (and speculative_tokens written)")
    p.add_argument("--val-frac", type=float, default=0.05, help="share of samples held out for validation")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="saved dtype")
    p.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.monotonic()

    tcfg = json.loads((args.target / "config.json").read_text())
    header = generation_header(args.target) if args.loss_on == "answer" else None
    samples, aux_ids = load_samples(args.data, tcfg["num_hidden_layers"], header)
    rng = random.Random(args.seed)
    rng.shuffle(samples)
    n_val = int(len(samples) * args.val_frac)
    val, train = samples[:n_val], samples[n_val:]
    print(f"{len(train)} train / {len(val)} val samples, aux layers {aux_ids}, "
          f"{sum(int(s['loss_mask'].sum()) for s in train)} training tokens ({time.monotonic() - start:.0f} s)")

    model = build_model(tcfg, aux_ids, train, args)
    collate = CollateFn(args.max_len, tcfg["hidden_size"], len(aux_ids), dtype=torch.float32, preprocess=shift_batch)

    def batch(group: list[Sample]) -> dict:
        b = collate(group)
        return {k: b[k] for k in ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
                                  "verifier_last_hidden_states")}

    # The eager loss: speculators' default is a fused Triton kernel, which needs a GPU.
    kw = {"ttt_steps": args.ttt_steps, "loss_config": resolve_loss_config("kl_div", "eager")}
    val_batches = [batch(g) for g in packs(val, args.max_len, rng)]
    params = [q for q in model.parameters() if q.requires_grad]
    print(f"trainable parameters: {sum(q.numel() for q in params) / 1e6:.1f} M")
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(packs(train, args.max_len, random.Random(0)))
    total, warmup = args.epochs * steps_per_epoch, max(1, args.epochs * steps_per_epoch // 50)
    deadline = start + 60 * args.max_minutes
    step, stop = 0, False
    for epoch in range(args.epochs):
        for group in packs(train, args.max_len, rng):
            now = time.monotonic()
            # Linear decay over steps or over the time box, whichever runs out first, so that a
            # time-boxed run still ends at a low learning rate.
            done = max(step / total, (now - start) / (deadline - start))
            for g in opt.param_groups:
                g["lr"] = args.lr * min((step + 1) / warmup, max(0.0, 1 - done))
            _, loss, m = model(**batch(group), **kw)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % args.log_every == 0 or step == 1:
                acc, al = step_stats(m, args.ttt_steps)
                print(f"epoch {epoch} step {step}/~{total} loss {loss.item():.3f} acc "
                      f"{' '.join(f'{a:.3f}' for a in acc)} (accept len ~{al:.2f}) lr {opt.param_groups[0]['lr']:.2e} "
                      f"{time.monotonic() - start:.0f} s", flush=True)
            if time.monotonic() > deadline:
                print(f"--max-minutes {args.max_minutes} reached")
                stop = True
                break
        if val_batches:
            vl, acc, al = evaluate(model, val_batches, kw)
            print(f"epoch {epoch} val loss {vl:.3f} acc {' '.join(f'{a:.3f}' for a in acc)} "
                  f"(accept len ~{al:.2f})", flush=True)
        if stop:
            break

    model = model.to(getattr(torch, args.dtype))
    # embed_tokens is a frozen copy of the target's: vLLM and kvtier share the target's when it is
    # absent, and speculators reloads it from the verifier, so leave out its vocab x hidden floats.
    state = {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    model.save_pretrained(args.out, state_dict=state)
    print(f"saved {args.out} ({step} steps, {(time.monotonic() - start) / 60:.1f} min)")


if __name__ == "__main__":
    main()
