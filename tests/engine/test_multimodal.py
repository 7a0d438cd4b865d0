"""Issue 45: images in prompts (Gemma 3 with a SigLIP tower), token-identical to transformers,
with KV keyed by what was seen.

Oracle: transformers' `Gemma3ForConditionalGeneration.generate` with the checkpoint's own
processor, for prompts with 0, 1 and 3 images, with prefix caching on and off and with prompts
chunked around the images; and the engine itself for isolation (the same text with another
image must not hit the first image's blocks, in G1 or in G3 after a restart)."""
from __future__ import annotations

import pytest
import torch

import checkpoints as C
import checkpoints_mm as M
from engine.llm import LLM
from engine.mm.inputs import MMInputs, MMItem
from engine.runner.attention import PrefillSeq
from engine.sampling_params import SamplingParams
from kvstore.keys import chain_keys

BLOCK = 16
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


words = M.words


def prompt(parts: list[int], seed: int) -> str:
    """Text of `parts[0]` words, then an image marker and `parts[1]` words, and so on."""
    return f" {M.BOI} ".join(words(n, seed + i) for i, n in enumerate(parts))


# (text, images): 0, 1 and 3 images; images at block boundaries and inside blocks
CASES = [
    (prompt([40], 1), []),
    (prompt([21, 30], 2), [M.image(11)]),
    (prompt([3, 9, 14, 25], 3), [M.image(12), M.image(13), M.image(14)]),
]


@pytest.fixture(scope="module")
def mm_ckpt(tmp_path_factory):
    return M.build_gemma3_mm(tmp_path_factory.mktemp("gemma3_mm"))


@pytest.fixture(scope="module")
def oracle(mm_ckpt):
    model, proc = M.load_hf_mm(mm_ckpt)
    return [M.hf_greedy_mm(model, proc, text, images, MAX_TOKENS) for text, images in CASES]


def inputs(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def generate(llm: LLM, cases) -> list:
    return llm.generate([inputs(t, ims) for t, ims in cases], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("settings", [
    {},  # default: prefix caching on, whole prompts in one step
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 12},  # chunks cut before an image, or stretched to finish one
    {"max_num_batched_tokens": 12, "long_prefill_token_threshold": 5},
    {"max_num_batched_tokens": 12, "async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
], ids=["default", "no-prefix-cache", "chunked", "chunked-small", "chunked-async", "ngram"])
def test_greedy_tokens_equal_transformers_with_0_1_3_images(mm_ckpt, oracle, settings):
    with LLM(str(mm_ckpt), dtype="float32", **settings) as llm:
        assert [o.outputs[0].token_ids for o in generate(llm, CASES)] == oracle
        # Again, one at a time: with prefix caching the prompts now hit their own blocks
        again = [generate(llm, [case])[0] for case in CASES]
        assert [o.outputs[0].token_ids for o in again] == oracle
        if settings.get("enable_prefix_caching", True):
            assert all(o.num_cached_tokens > 0 for o in again[1:])
        llm.engine.runner.encoder.check_integrity()


def test_the_images_change_the_output_and_attend_both_ways(mm_ckpt, oracle):
    """The oracle itself depends on the image, and on the image placeholders seeing each other
    both ways (a causal-only engine differs): so the parity test above can fail."""
    model, proc = M.load_hf_mm(mm_ckpt)
    text, images = CASES[1]
    assert M.hf_greedy_mm(model, proc, text, [M.image(99)], MAX_TOKENS) != oracle[1]
    with LLM(str(mm_ckpt), dtype="float32") as llm:
        real = PrefillSeq.spans_for
        try:  # the engine with its image spans ignored
            PrefillSeq.spans_for = lambda self, window: ()
            causal = generate(llm, [CASES[1], CASES[2]])
        finally:
            PrefillSeq.spans_for = real
    assert [o.outputs[0].token_ids for o in causal] != oracle[1:]


def test_same_text_other_image_gets_no_image_blocks_and_same_image_hits(mm_ckpt):
    text = prompt([37, 40], 5)  # the image's placeholders from token 38 on: blocks 0-1 are text only
    a, b = M.image(21), M.image(22)
    with LLM(str(mm_ckpt), dtype="float32") as llm:
        first = generate(llm, [(text, [a])])[0]
        other = generate(llm, [(text, [b])])[0]
        same = generate(llm, [(text, [a])])[0]
        ids = first.prompt_token_ids
        image_at = ids.index(M.build_tokenizer().image_token_id)
        assert other.num_cached_tokens == image_at // BLOCK * BLOCK == 32
        assert same.num_cached_tokens == (len(ids) - 1) // BLOCK * BLOCK
        assert other.outputs[0].token_ids != first.outputs[0].token_ids
        assert same.outputs[0].token_ids == first.outputs[0].token_ids
        # a fresh engine's output for the other image: its text blocks' hit changed nothing
        with LLM(str(mm_ckpt), dtype="float32", enable_prefix_caching=False) as ref:
            assert generate(ref, [(text, [b])])[0].outputs[0].token_ids == other.outputs[0].token_ids


def test_image_blocks_from_g3_after_a_restart_only_for_the_same_image(mm_ckpt, tmp_path):
    text = prompt([37, 40], 6)
    a, b = M.image(31), M.image(32)
    settings = dict(dtype="float32", kv_offload_disk=str(tmp_path / "g3"), kv_offload_block_size=BLOCK)
    with LLM(str(mm_ckpt), **settings) as llm:
        first = generate(llm, [(text, [a])])[0]
        llm.engine.connector.flush()
    with LLM(str(mm_ckpt), **settings) as llm:  # a restart: G1 and G2 are empty
        other = generate(llm, [(text, [b])])[0]
        llm.engine.pool.reset_prefix_cache()
        same = generate(llm, [(text, [a])])[0]
    full = (len(first.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert dict(other.cached_tokens_by_tier) == {"G3": 32}  # the text blocks before the image only
    assert dict(same.cached_tokens_by_tier) == {"G3": full}
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


def test_media_digests_enter_the_keys_of_the_blocks_holding_placeholders():
    ids = list(range(100, 164))  # 4 blocks
    def item(digest: bytes) -> MMItem:  # placeholders in block 1 only
        return MMItem(20, 8, digest, None)
    mm_a, mm_b = MMInputs((item(b"a" * 16),)), MMInputs((item(b"b" * 16),))
    plain = chain_keys(ids, BLOCK)
    ka = chain_keys(ids, BLOCK, media=lambda i: mm_a.block_extra(i, BLOCK))
    kb = chain_keys(ids, BLOCK, media=lambda i: mm_b.block_extra(i, BLOCK))
    assert ka[0] == kb[0] == plain[0]  # text before the image: shared
    assert len({ka[1], kb[1], plain[1]}) == 3 and ka[3] != kb[3]  # the image's block and every later one
    assert chain_keys(ids, BLOCK, "salt", media=lambda i: mm_a.block_extra(i, BLOCK))[1] != ka[1]


def test_a_step_never_ends_inside_an_image_and_holds_at_most_the_images_it_may():
    mm = MMInputs((MMItem(10, 6, b"x" * 16, None), MMItem(20, 4, b"y" * 16, None)))
    assert mm.cut(0, 12, 100, 2) == 10  # stops before the image
    assert mm.cut(10, 3, 100, 2) == 6  # finishes the image it starts
    assert mm.cut(12, 2, 100, 2) == 4  # resumed inside one (a prefix hit ended there): finishes it
    assert mm.cut(12, 2, 3, 2) == 0  # and waits when the step has no room for that
    assert mm.cut(0, 16, 100, 2) == 16 and mm.cut(16, 8, 100, 2) == 8  # ends where an image does: as asked
    assert mm.cut(16, 6, 100, 2) == 4
    assert mm.cut(0, 30, 100, 2) == 30
    assert mm.cut(0, 30, 100, 1) == 20  # one image per step: stops before the second
    assert mm.cut(0, 30, 100, 0) == 10 and mm.cut(12, 10, 100, 0) == 0  # none: before the first, or wait
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        mm.check_fits(5)


def test_one_step_encodes_at_most_one_image(mm_ckpt):
    """A prompt's images are spread over steps (the encoder runs inside a step, which every other
    request's next token waits for), with transformers' tokens all the same."""
    text, images = CASES[2]
    with LLM(str(mm_ckpt), dtype="float32", enable_prefix_caching=False) as llm:
        enc = llm.engine.runner.encoder
        batches, real = [], enc._encode
        enc._encode = lambda items: (batches.append(len(items)), real(items))[1]
        out = generate(llm, [(text, images), CASES[1]])
    assert batches and max(batches) == 1 and len(batches) == 4
    model, proc = M.load_hf_mm(mm_ckpt)
    assert out[0].outputs[0].token_ids == M.hf_greedy_mm(model, proc, text, images, MAX_TOKENS)


def test_bad_image_requests_are_refused_by_name(mm_ckpt, ckpt_dir):
    with LLM(str(mm_ckpt), dtype="float32") as llm:
        with pytest.raises(ValueError, match="1 image marker.*2 image"):
            llm.generate([inputs(prompt([3, 3], 1), [M.image(1), M.image(2)])], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="PIL image"):
            llm.generate([inputs(prompt([3, 3], 1), ["not an image"])], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="'image' entry"):
            llm.generate([{"prompt": "hi", "multi_modal_data": {"audio": []}}], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="unknown prompt field"):
            llm.generate([{"prompt": "hi", "images": []}], GREEDY, use_tqdm=False)
        assert not llm.engine.scheduler.has_unfinished()
    with LLM(str(mm_ckpt), dtype="float32", max_num_batched_tokens=3) as llm:
        with pytest.raises(ValueError, match="an image takes 4 tokens"):
            llm.generate([inputs(prompt([3, 3], 1), [M.image(1)])], GREEDY, use_tqdm=False)
    with LLM(str(ckpt_dir("llama")), dtype="float32") as llm:
        with pytest.raises(ValueError, match="takes no images"):
            llm.generate([inputs("hello", [M.image(1)])], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="runs on one rank"):
        LLM(str(mm_ckpt), dtype="float32", tensor_parallel_size=2)


def test_encoder_cache_encodes_a_repeated_image_once(mm_ckpt):
    text = prompt([5, 5], 8)
    with LLM(str(mm_ckpt), dtype="float32", enable_prefix_caching=False) as llm:
        enc = llm.engine.runner.encoder
        outs = [generate(llm, [(text, [M.image(41)])])[0] for _ in range(3)]
        assert (enc.misses, enc.hits) == (1, 2)
        assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
        enc.check_integrity()
        assert torch.equal(enc.features([MMItem(0, 4, next(iter(enc._entries)), None)])[0],
                           next(iter(enc._entries.values())))


def test_chat_with_image_parts_equals_transformers(mm_ckpt):
    """LLM.chat takes OpenAI's image_url (a data: URL) and vLLM's image_pil parts; the oracle is
    transformers on the same chat template's text and the same image."""
    img = M.image(71)
    first = words(20, 9)
    parts = lambda image_part: [{"type": "text", "text": first}, image_part, {"type": "text", "text": "tell me"}]  # noqa: E731
    model, proc = M.load_hf_mm(mm_ckpt)
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": parts({"type": "image"})}],
                                              tokenize=False, add_generation_prompt=True)
    want = M.hf_greedy_mm(model, proc, text, [img], MAX_TOKENS)
    with LLM(str(mm_ckpt), dtype="float32") as llm:
        pil = llm.chat([{"role": "user", "content": parts({"type": "image_pil", "image_pil": img})}], GREEDY,
                       use_tqdm=False)[0]
        url = llm.chat([{"role": "user", "content": parts({"type": "image_url", "image_url": {"url": M.data_url(img)}})}],
                       GREEDY, use_tqdm=False)[0]
        assert pil.outputs[0].token_ids == url.outputs[0].token_ids == want
        with pytest.raises(ValueError, match="'input_audio' is not supported"):
            llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], GREEDY)
        with pytest.raises(ValueError, match="offline chat takes data: image URLs"):
            llm.chat([{"role": "user", "content": parts({"type": "image_url", "image_url": {"url": "http://x/y.png"}})}],
                     GREEDY)


@torch.no_grad()
def test_exported_hidden_states_with_images_equal_transformers(mm_ckpt, tmp_path):
    """Hidden-state export (the format speculators reads) on prompts with images: layer 0 holds the
    images' embeddings at their placeholders, as in transformers' `output_hidden_states`."""
    from safetensors.torch import load_file

    from connectors.hidden_spec import speculative_config

    text, images = CASES[2]
    layer_ids = [C.LAYERS, 0, 1]
    with LLM(str(mm_ckpt), dtype="float32", speculative_config=speculative_config(layer_ids),
             max_num_batched_tokens=12, kv_transfer_config={
                 "kv_connector": "HiddenStatesConnector",
                 "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "hs")}}) as llm:
        out = llm.generate([inputs(text, images)], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                           use_tqdm=False, request_ids=["img"])[0]
    data = load_file(out.kv_transfer_params["hidden_states_path"])
    model, proc = M.load_hf_mm(mm_ckpt)
    batch = proc(text=text, images=images, return_tensors="pt")
    assert data["token_ids"].tolist() == batch["input_ids"][0].tolist()
    last = {}
    hook = model.model.language_model.layers[-1].register_forward_hook(
        lambda mod, args, o: last.setdefault("h", o[0] if isinstance(o, tuple) else o))
    try:
        hs = model(**batch, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    ref = [h[0] for h in hs[:-1]] + [last["h"][0]]
    for j, lid in enumerate(layer_ids):
        scale = ref[lid].abs().max().item()
        torch.testing.assert_close(data["hidden_states"][:, j], ref[lid], rtol=1e-5, atol=1e-5 * scale,
                                   msg=f"layer id {lid}")


def test_a_prefix_hit_that_ends_inside_an_image_resumes_it(mm_ckpt, oracle):
    """The image's placeholders at 30-33 straddle the block boundary at 32: a second prompt with the
    same text and image but another question hits blocks 0-1 and resumes inside the image (its
    last two placeholders see the first two from the cache, and these saw them when computed)."""
    model, proc = M.load_hf_mm(mm_ckpt)
    before, img = words(29, 81), M.image(81)
    first, second = f"{before} {M.BOI} {words(30, 82)}", f"{before} {M.BOI} {words(25, 83)}"
    ids = list(proc(text=first, images=[img])["input_ids"][0])
    image_token = proc.tokenizer.image_token_id
    assert [i for i, t in enumerate(ids) if t == image_token] == [30, 31, 32, 33]
    want = M.hf_greedy_mm(model, proc, second, [img], MAX_TOKENS)
    with LLM(str(mm_ckpt), dtype="float32") as llm:
        generate(llm, [(first, [img])])
        out = generate(llm, [(second, [img])])[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == want


def test_items_built_elsewhere_are_checked_before_they_reach_the_encoder(mm_ckpt):
    """What the server's channel carries is checked by the core: an item off the placeholders or
    with pixels of another size is refused, and the engine serves the next request."""
    text, images = CASES[1]
    with LLM(str(mm_ckpt), dtype="float32") as llm:
        ids, mm = llm._images.process(text, images)
        item = mm.items[0]
        bad = [MMInputs((MMItem(item.offset - 1, item.length, item.digest, item.pixels),)),
               MMInputs((MMItem(item.offset, item.length, item.digest, item.pixels[:, :, :16]),))]
        for m, match in zip(bad, ("does not sit on image placeholder", "pixels are")):
            with pytest.raises(ValueError, match=match):
                llm.engine.make_request("bad", ids, GREEDY, mm=m)
        assert generate(llm, [(text, images)])[0].outputs[0].token_ids


def test_kvtier_generate_takes_image_files(mm_ckpt, tmp_path, capsys):
    from server.cli import main

    M.image(91).save(tmp_path / "cat.png")
    (tmp_path / "not.png").write_text("not an image")
    base = ["generate", str(mm_ckpt), "--dtype", "float32", "--max-tokens", "3", "--chat", "what is it"]
    assert main([*base, "--image", str(tmp_path / "cat.png")]) == 0
    assert "[3 tokens" in capsys.readouterr().out
    assert main([*base, "--image", str(tmp_path / "not.png")]) == 2
    assert "kvtier generate: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", str(mm_ckpt), "--prompt", "hi", "--image", str(tmp_path / "cat.png")])
    assert e.value.code == 2
