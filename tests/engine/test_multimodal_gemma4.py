"""Issue 45 for Gemma 4 (`Gemma4ForConditionalGeneration`): images of any aspect ratio (their
placeholder count follows it), token-identical to transformers, KV keyed by what was seen.

Oracle: transformers' `Gemma4ForConditionalGeneration.generate`, fed what its processor gives
(`checkpoints_mm.gemma4_inputs`: the checkpoint's image processor and `Gemma4Processor`'s own
placeholder expansion; the processor class itself needs torchvision, which this environment's
torch build cannot load). Gemma 4 differs from Gemma 3 in three ways each test below can catch:
variable-resolution items, the pad token's per-layer embeddings at image positions, and image
placeholders attending both ways in sliding-window layers only."""
from __future__ import annotations

import pytest

import checkpoints_mm as M
from engine.llm import LLM
from engine.mm.inputs import MMInputs, MMItem
from engine.runner.attention import PrefillSeq
from engine.sampling_params import SamplingParams

BLOCK = 16
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


words = M.words


def prompt(parts: list[int], seed: int) -> str:
    return f" {M.IMG} ".join(words(n, seed + i) for i, n in enumerate(parts))


# 0, 1 and 3 images; the three of different aspect ratios (63, 48 and 66 placeholders)
CASES = [
    (prompt([40], 1), []),
    (prompt([21, 30], 2), [M.image(11)]),
    (prompt([3, 9, 14, 25], 3), [M.image(12), M.image(13, (20, 60)), M.image(14, (64, 32))]),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return M.build_gemma4_mm(tmp_path_factory.mktemp("gemma4_mm"))


@pytest.fixture(scope="module")
def hf(ckpt):
    return M.load_hf_gemma4_mm(ckpt)


@pytest.fixture(scope="module")
def oracle(hf):
    return [M.hf_greedy_gemma4_mm(hf, text, images, MAX_TOKENS) for text, images in CASES]


def generate(llm: LLM, cases) -> list:
    return llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in cases], GREEDY,
                        use_tqdm=False)


@pytest.mark.parametrize("settings", [
    {},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 72},  # each image whole in a step, the text around it cut
    {"max_num_batched_tokens": 72, "async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
], ids=["default", "no-prefix-cache", "chunked", "chunked-async", "ngram"])
def test_greedy_tokens_equal_transformers_with_0_1_3_images(ckpt, oracle, settings):
    with LLM(str(ckpt), dtype="float32", **settings) as llm:
        outs = generate(llm, CASES)
        assert [o.outputs[0].token_ids for o in outs] == oracle
        # the placeholder expansion is transformers' (Gemma4Processor.replace_image_token)
        assert [o.prompt_token_ids for o in outs] == [M.gemma4_inputs(t, ims)["input_ids"][0].tolist()
                                                      for t, ims in CASES]
        again = [generate(llm, [case])[0] for case in CASES]
        assert [o.outputs[0].token_ids for o in again] == oracle
        if settings.get("enable_prefix_caching", True):
            assert all(o.num_cached_tokens > 0 for o in again[1:])
        llm.engine.runner.encoder.check_integrity()


def test_image_spans_attend_both_ways_in_sliding_layers_only(ckpt, hf, oracle):
    """The oracle depends on the image, and the engine matches it only with spans in sliding
    layers alone: causal everywhere, or both ways in every layer (Gemma 3's rule), differs."""
    text, images = CASES[1]
    assert M.hf_greedy_gemma4_mm(hf, text, [M.image(99)], MAX_TOKENS) != oracle[1]
    with LLM(str(ckpt), dtype="float32") as llm:
        real = PrefillSeq.spans_for
        try:
            PrefillSeq.spans_for = lambda self, window: ()
            causal = generate(llm, CASES[1:])
            PrefillSeq.spans_for = lambda self, window: self.bidir
            everywhere = generate(llm, CASES[1:])
        finally:
            PrefillSeq.spans_for = real
        llm.engine.pool.reset_prefix_cache()
        assert [o.outputs[0].token_ids for o in generate(llm, CASES[1:])] == oracle[1:]
    assert [o.outputs[0].token_ids for o in causal] != oracle[1:]
    assert [o.outputs[0].token_ids for o in everywhere] != oracle[1:]


def test_without_bidirectional_attention_images_attend_causally(tmp_path):
    """A Gemma 4 checkpoint with use_bidirectional_attention None (transformers masks causally)."""
    path = M.build_gemma4_mm(tmp_path / "causal", bidirectional=None)
    want = [M.hf_greedy_gemma4_mm(M.load_hf_gemma4_mm(path), t, ims, MAX_TOKENS) for t, ims in CASES[1:]]
    with LLM(str(path), dtype="float32", max_num_batched_tokens=72) as llm:
        assert [o.outputs[0].token_ids for o in generate(llm, CASES[1:])] == want


def test_same_text_other_image_gets_no_image_blocks_and_same_image_hits(ckpt):
    text = prompt([37, 40], 5)  # the image's placeholders start after token 38: blocks 0-1 are text only
    a, b = M.image(21), M.image(22, (30, 70))
    with LLM(str(ckpt), dtype="float32") as llm:
        first = generate(llm, [(text, [a])])[0]
        other = generate(llm, [(text, [b])])[0]
        same = generate(llm, [(text, [a])])[0]
    ids = first.prompt_token_ids
    assert ids.index(M.build_tokenizer().image_token_id) // BLOCK * BLOCK == 32
    assert other.num_cached_tokens == 32
    assert same.num_cached_tokens == (len(ids) - 1) // BLOCK * BLOCK
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


def test_items_with_a_wrong_grid_or_pixels_are_refused_before_the_encoder(ckpt):
    text, images = CASES[1]
    with LLM(str(ckpt), dtype="float32") as llm:
        ids, mm = llm._images.process(text, images)
        it = mm.items[0]
        assert it.grid == (14, 18) and it.length == 63
        bad = {"placeholder tokens; its pixels make": MMItem(it.offset, it.length, it.digest, it.pixels, (14, 16)),
               "with a grid": MMItem(it.offset, it.length, it.digest, it.pixels),
               "expected \\[1, patches": MMItem(it.offset, it.length, it.digest, it.pixels[:, :, :16], it.grid),
               "does not sit on image placeholder": MMItem(it.offset - 1, it.length, it.digest, it.pixels, it.grid)}
        for match, item in bad.items():
            with pytest.raises(ValueError, match=match):
                llm.engine.make_request("bad", ids, GREEDY, mm=MMInputs((item,)))
        assert generate(llm, [(text, images)])[0].outputs[0].token_ids


def test_items_cross_the_server_channel_with_their_grid(ckpt):
    from server.media_wire import from_wire, to_wire

    text, images = CASES[2]
    with LLM(str(ckpt), dtype="float32") as llm:
        _, mm = llm._images.process(text, images)
    back = from_wire(to_wire(mm))
    assert [(i.offset, i.length, i.digest, i.grid) for i in back.items] == \
        [(i.offset, i.length, i.digest, i.grid) for i in mm.items]
    assert all((a.pixels == b.pixels).all() for a, b in zip(back.items, mm.items))


def test_chat_with_an_image_part_equals_transformers(ckpt, hf):
    img = M.image(71, (50, 30))
    parts = [{"type": "text", "text": words(20, 9)}, {"type": "image"}, {"type": "text", "text": "tell me"}]
    text = M.build_tokenizer()
    text.chat_template = M.GEMMA4_CHAT_TEMPLATE
    rendered = text.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                        add_generation_prompt=True)
    want = M.hf_greedy_gemma4_mm(hf, rendered, [img], MAX_TOKENS)
    parts[1] = {"type": "image_url", "image_url": {"url": M.data_url(img)}}
    with LLM(str(ckpt), dtype="float32") as llm:
        out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want


def test_image_blocks_from_g3_after_a_restart_only_for_the_same_image(ckpt, tmp_path):
    text = prompt([37, 40], 6)
    a, b = M.image(31), M.image(32)
    settings = dict(dtype="float32", kv_offload_disk=str(tmp_path / "g3"), kv_offload_block_size=BLOCK)
    with LLM(str(ckpt), **settings) as llm:
        first = generate(llm, [(text, [a])])[0]
        llm.engine.connector.flush()
    with LLM(str(ckpt), **settings) as llm:  # a restart: G1 and G2 are empty
        other = generate(llm, [(text, [b])])[0]
        llm.engine.pool.reset_prefix_cache()
        same = generate(llm, [(text, [a])])[0]
    assert dict(other.cached_tokens_by_tier) == {"G3": 32}  # the text blocks before the image only
    assert dict(same.cached_tokens_by_tier) == {"G3": (len(first.prompt_token_ids) - 1) // BLOCK * BLOCK}
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
