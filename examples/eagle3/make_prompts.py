#!/usr/bin/env python3
"""Write a JSONL of chat prompts for EAGLE-3 training data: templates x topics, offline and
deterministic (a fixed seed picks which pairs are kept and their order).

Each line is {"id": "p0000", "messages": [{"role": "user", "content": ...}]}, the input that
`kvtier extract` takes. The templates cover the kinds of requests a chat model answers (stories,
explanations, lists, poems, advice, comparisons); benchmarks/spec_decode.py's chat prompts are
the evaluation set, so none of them is produced here.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

TEMPLATES = [
    "Write a short story about {t}.",
    "Explain {t} in simple words.",
    "What are the most important facts about {t}?",
    "Give me five tips related to {t}.",
    "Write a short poem about {t}.",
    "Describe {t} to someone who has never heard of it.",
    "What are the advantages and disadvantages of {t}?",
    "Explain {t} to a child.",
    "Write a paragraph about the history of {t}.",
    "What questions do people often ask about {t}? Answer two of them.",
    "List three common mistakes people make with {t} and how to avoid them.",
    "Why do people care about {t}?",
    "Write a friendly email to a colleague about {t}.",
    "Summarize what a beginner should know about {t}.",
    "Compare {t} with something similar and explain the differences.",
    "Give a step-by-step plan for getting started with {t}.",
    "Write a short dialogue between two friends talking about {t}.",
    "What is a fun fact about {t}? Explain why it is true.",
    "How has {t} changed over the last hundred years?",
    "Write a product description for something related to {t}.",
]

TOPICS = [
    "gardening", "the moon", "volcanoes", "coffee", "honeybees", "the internet", "chess",
    "rainforests", "public libraries", "electric cars", "the human heart", "photography",
    "baking cookies", "the Roman Empire", "recycling", "mountain climbing", "jazz music",
    "the water cycle", "friendship", "saving money", "airplanes", "penguins", "the printing press",
    "solar energy", "sleep", "museums", "trains", "learning to swim", "deserts", "cats", "dogs",
    "the Olympic Games", "robots", "earthquakes", "writing a diary", "the solar system",
    "vaccines", "board games", "rivers", "cooking pasta", "bridges", "the piano", "rain",
    "a small village", "time management", "dinosaurs", "the ocean floor", "video games",
    "running a marathon", "birds migrating", "a city at night", "painting with watercolors",
    "the weather", "computers", "tea", "forests in autumn", "space travel", "a lost key",
    "a birthday party", "a rainy Monday",
]


def make_prompts(n: int, seed: int) -> list[str]:
    pairs = list(itertools.product(TEMPLATES, TOPICS))
    random.Random(seed).shuffle(pairs)  # a spread of templates and topics at any n
    return [tpl.format(t=topic) for tpl, topic in pairs[:n]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    p.add_argument("-n", "--num", type=int, default=600,
                   help=f"number of prompts, at most {len(TEMPLATES) * len(TOPICS)} (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default: %(default)s)")
    args = p.parse_args()
    if not 0 < args.num <= len(TEMPLATES) * len(TOPICS):
        p.error(f"--num must be in 1..{len(TEMPLATES) * len(TOPICS)}")
    prompts = make_prompts(args.num, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for i, text in enumerate(prompts):
            f.write(json.dumps({"id": f"p{i:04d}", "messages": [{"role": "user", "content": text}]}) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
