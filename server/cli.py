"""The `kvtier` command line.

Subcommands:
  serve       the OpenAI-compatible HTTP server (the embedded demo model when no MODEL is given)
  generate    answer prompts or chat messages offline with the engine
  extract     export hidden states (EAGLE-3 training data) for a JSONL of prompts
  demo-model  convert the embedded demo model into a Hugging Face checkpoint
  kv          inspect, verify or clear a G3 directory or G4 Redis (safe on a live server's tier), or
              watch replicas' KV events (which blocks each holds, per tier)

Bad input exits with code 2 and a one-line message, never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from server.process_exit import exit_now


def _generate(argv: list[str]) -> int:
    # Here, not at the top: server.args imports torch, which must come after entry()'s Ctrl-C handling.
    from server.args import add_engine_args, llm_kwargs

    p = argparse.ArgumentParser(prog="kvtier generate", description="Generate text offline with the kvtier engine.")
    add_engine_args(p)
    s = p.add_argument_group("request")
    s.add_argument("--prompt", action="append", default=[], help="raw prompt text (repeatable)")
    s.add_argument("--chat", action="append", default=[],
                   help="a user message, sent through the model's chat template (repeatable; one conversation each)")
    s.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image file sent with the --chat message, before its text (repeatable, in order; one "
                        "--chat; a model that takes images)")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per request (default: %(default)s)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables (default: 0)")
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="logging verbosity (default: %(default)s)")
    ns = p.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not ns.prompt and not ns.chat:
        p.error("give at least one --prompt or --chat")
    if ns.image and (ns.prompt or len(ns.chat) != 1):
        p.error("--image goes with exactly one --chat (and no --prompt)")
    from engine import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                                top_k=ns.top_k, seed=ns.sampling_seed)
        with LLM(**llm_kwargs(ns)) as llm:  # closing flushes the offload tiers' writes
            outs = llm.generate(ns.prompt, params, use_tqdm=False) if ns.prompt else []
            if ns.chat:
                outs += llm.chat([[{"role": "user", "content": _with_images(llm, m, ns.image)}] for m in ns.chat],
                                 params, use_tqdm=False)
    except (ValueError, OSError) as e:  # OSError: an image file that cannot be read
        print(f"kvtier generate: error: {e}", file=sys.stderr)
        return 2
    for q, o in zip(ns.prompt + ns.chat, outs):
        print(f"> {q}\n{o.outputs[0].text}\n[{len(o.outputs[0].token_ids)} tokens, finish_reason={o.outputs[0].finish_reason}]")
    return 0


def _with_images(llm: Any, text: str, files: list[str]) -> Any:
    """A --chat message's content: the text, or the images (vLLM's image_pil parts) then the text."""
    if not files:
        return text
    if not llm.engine.model_config.multimodal:
        raise ValueError(f"--image: {llm.engine.model_config.architecture} takes no images")
    from PIL import Image

    images = []
    for f in files:
        with Image.open(f) as im:
            images.append({"type": "image_pil", "image_pil": im.convert("RGB")})
    return [*images, {"type": "text", "text": text}]


def _serve(argv: list[str]) -> int:
    from server.serve import main

    return main(argv)


def _extract(argv: list[str]) -> int:
    from server.extract import main

    return main(argv)


def _kv(argv: list[str]) -> int:
    from kvtools.cli import main

    return main(argv)


def _demo_model(argv: list[str]) -> int:
    from engine.demo.demo_model import main

    return main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "serve": (_serve, "serve a model over an OpenAI-compatible HTTP API"),
    "generate": (_generate, "answer prompts or chat messages offline"),
    "extract": (_extract, "export hidden states (EAGLE-3 training data) for a JSONL of prompts"),
    "demo-model": (_demo_model, "convert the embedded demo model (SmolLM2-135M-Instruct) into an HF checkpoint"),
    "kv": (_kv, ("inspect, verify or clear a G3 dir or G4 Redis, or watch replicas' KV events: "
                 "kvtier kv {inspect,verify,clear} DIR|URL, kvtier kv events ENDPOINT...")),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: kvtier {" + ",".join(COMMANDS) + "} [-h] ...\n\ncommands:\n" + "".join(
        f"  {name:<11} {help_}\n" for name, (_, help_) in COMMANDS.items()
    ) + "\nRun 'kvtier COMMAND --help' for a command's flags."
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"kvtier: unknown command {argv[0]!r}\n{usage}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]][0](argv[1:])


def entry() -> None:
    """The `kvtier` executable. Unlike `main` (which tests and embedders call in-process), it may
    re-execute the process under tcmalloc first (engine/runner/cpu_runtime.py)."""
    argv = sys.argv[1:]
    if argv[:1] and argv[0] in _IN_PROCESS_COMMANDS:
        signal.signal(signal.SIGINT, _start_up_interrupt(argv[0]))
    if argv[:1] and argv[0] in _ENGINE_COMMANDS and argv[1:2] not in (["-h"], ["--help"]):
        _reexec_with_allocator()
    exit_now(main(argv))  # main returns once everything is flushed and closed


_ENGINE_COMMANDS = ("serve", "generate", "extract")
# Commands whose start-up Ctrl-C ends at once (the engine in this process, no other started; the
# command puts the default handler back when its work begins).
_IN_PROCESS_COMMANDS = ("extract",)


def _start_up_interrupt(command: str) -> Callable[[int, Any], None]:
    """The SIGINT handler while `command` starts (imports and the model load take seconds; nothing
    is written yet): one line and exit 130. Not a KeyboardInterrupt: raised inside an import or the
    model load, a library's bare `except:` can swallow it, or pybind11 turns it into an abort. A
    command that starts work it must wind down (extract's job loop) puts the default back first."""
    def handler(signum: int, frame: Any) -> None:
        print(f"kvtier {command}: interrupted during start-up", file=sys.stderr, flush=True)
        os._exit(130)
    handler.start_up_only = True  # type: ignore[attr-defined]
    return handler


def _reexec_with_allocator() -> None:
    """Runs the command again under tcmalloc when the system has it (engine/runner/cpu_runtime.py)."""
    from engine.runner.cpu_runtime import reexec_env

    try:
        env = reexec_env(dict(os.environ))
    except ValueError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        sys.exit(2)
    if env is not None and getattr(sys, "orig_argv", None):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


if __name__ == "__main__":
    entry()
