"""Issue 45, acceptance 2, 3 and 5 through `kvtier serve` and the official `openai` client: images
as OpenAI `image_url` content parts; the same text with another image gets no cached tokens for
the image's blocks, the same image hits them (and, after a restart, from G3); every bad image
is a 400 naming the problem, and none reaches the engine core."""
from __future__ import annotations

import openai
import pytest
from serving import start_server

import checkpoints_mm as M

BLOCK = 16
TEXT_BEFORE = " ".join(["cat"] * 36)  # with the template's 3 leading tokens: the image starts in block 2


@pytest.fixture(scope="module")
def mm_ckpt(tmp_path_factory):
    return M.build_gemma3_mm(tmp_path_factory.mktemp("gemma3_mm_serve"))


def serve(ckpt, *flags):
    return start_server(str(ckpt), "--served-model-name", "mm", "--num-gpu-blocks", "128", *flags)


def ask(oa, url: str, text: str = "what is in the image") -> object:
    messages = [{"role": "user", "content": [{"type": "text", "text": TEXT_BEFORE},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": text}]}]
    return oa.chat.completions.create(model="mm", messages=messages, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def test_same_image_hits_other_image_does_not_also_after_a_restart(mm_ckpt, tmp_path):
    a, b = M.data_url(M.image(51)), M.data_url(M.image(52))
    flags = ("--kv-offload-disk", str(tmp_path / "g3"), "--kv-offload-block-size", str(BLOCK))
    srv = serve(mm_ckpt, *flags)
    try:
        oa = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)
        first = ask(oa, a)
        other = ask(oa, b)
        same = ask(oa, a)
        n = first.usage.prompt_tokens
        assert cached(first) == 0 and cached(other) == 32  # the text blocks before the image
        assert cached(same) == (n - 1) // BLOCK * BLOCK
        assert other.choices[0].message.content != first.choices[0].message.content
        assert same.choices[0].message.content == first.choices[0].message.content
        with srv.client() as c:  # two images encoded; the third request's prefix hit covered its image
            metrics = c.get("/metrics").text
        assert 'kvtier:mm_encoder_cache_misses_total{model_name="mm"} 2.0' in metrics
        assert 'kvtier:mm_encoder_cache_hits_total{model_name="mm"} 0.0' in metrics
    finally:
        assert srv.stop() == 0
    srv = serve(mm_ckpt, *flags)  # a restart: G1 and G2 empty, G3 kept
    try:
        oa = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)
        again = ask(oa, a)
        assert cached(again) == (n - 1) // BLOCK * BLOCK
        assert again.choices[0].message.content == first.choices[0].message.content
        assert "G3" in srv.log()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def strict(mm_ckpt, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    M.image(60).save(allowed / "ok.png")
    srv = serve(mm_ckpt, "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "2500",
                "--max-image-bytes", "16000", "--allowed-local-media-path", str(allowed),
                "--allowed-media-domains", "localhost")
    yield srv, allowed
    srv.stop()


def prompt_tokens_metric(srv) -> str:
    with srv.client() as c:
        return next(line for line in c.get("/metrics").text.splitlines() if line.startswith("kvtier:prompt_tokens_total"))


@pytest.mark.parametrize("url, content_type, message", [
    ("data:image/png;base64,not*base64", None, "not valid base64"),
    ("data:image/png,rawbytes", None, "malformed data URL"),
    ("data:image/svg+xml;base64,PHN2Zz4=", None, "unsupported image type 'image/svg+xml'"),
    ("PIXELS", None, "exceeds the limit of 2500 (--max-image-pixels)"),
    ("BYTES", None, "exceeds the limit of 16000 bytes (--max-image-bytes)"),
    ("THREE", None, "more than the 2 the server takes (--limit-mm-per-prompt)"),
    ("http://127.0.0.1:9/cat.png", None, "host '127.0.0.1' is not allowed (the server's --allowed-media-domains lists localhost)"),
    ("OUTSIDE", None, "outside --allowed-local-media-path"),
    ("data:image/png;base64," + "iVBORw0KGgo=", None, "not an image this server can read"),
    (None, "input_audio", "content part type 'input_audio' is not supported"),
    (None, "video_url", "content part type 'video_url' is not supported"),
], ids=["base64", "no-base64", "svg", "pixels", "bytes", "too-many", "http", "outside", "not-image", "audio", "video"])
def test_bad_images_get_a_400_naming_the_problem_and_never_reach_the_core(strict, tmp_path, url, content_type,
                                                                          message):
    srv, allowed = strict
    oa = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)
    ok = M.data_url(M.image(61))
    if url == "PIXELS":
        url = M.data_url(M.image(62, (60, 60)))
    elif url == "BYTES":
        url = M.data_url(M.image(63, (100, 100)))
    elif url == "OUTSIDE":
        M.image(64).save(tmp_path / "secret.png")
        url = (tmp_path / "secret.png").as_uri()
    parts = [{"type": "text", "text": "look"}]
    if content_type == "input_audio":
        parts.append({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
    elif content_type == "video_url":
        parts.append({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}})
    elif url == "THREE":
        parts += [{"type": "image_url", "image_url": {"url": ok}}] * 3
    else:
        parts.append({"type": "image_url", "image_url": {"url": url}})
    before = prompt_tokens_metric(srv)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="mm", messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert message in str(e.value), str(e.value)
    assert prompt_tokens_metric(srv) == before  # nothing reached the engine core
    # the allowed folder and a data URL still work
    r = oa.chat.completions.create(model="mm", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": (allowed / "ok.png").as_uri()}},
        {"type": "image_url", "image_url": {"url": ok}}, {"type": "text", "text": "two"}]}])
    assert r.usage.prompt_tokens > 2 * M.TOKENS_PER_IMAGE


def test_image_flags_on_a_text_model_and_bad_values_exit_2(ckpt_dir):
    from serving import run_cli

    r = run_cli(str(ckpt_dir("llama")), "--limit-mm-per-prompt", '{"image": 2}')
    assert r.returncode == 2 and "--limit-mm-per-prompt: LlamaForCausalLM takes no images" in r.stderr
    r = run_cli(str(ckpt_dir("llama")), "--limit-mm-per-prompt", '{"audio": 2}')
    assert r.returncode == 2 and "images are the one modality served" in r.stderr


def test_a_text_model_refuses_image_parts_by_name(tiny_server):
    oa = openai.OpenAI(base_url=tiny_server.v1, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="'image_url' is not supported: this model takes text only"):
        oa.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": M.data_url(M.image(1))}}]}])


def test_http_images_only_from_allowed_hosts_and_never_through_a_redirect(strict, tmp_path):
    """A real HTTP server: localhost is allowed and served; its redirect to 127.0.0.1 (the same
    machine under a name that is not allowed) is refused, not followed."""
    import http.server
    import threading

    srv, _ = strict
    M.image(65).save(tmp_path / "ok.png")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(tmp_path), **k)

        def do_GET(self):  # noqa: N802
            if self.path == "/moved.png":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{web.server_address[1]}/ok.png")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *a):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        oa = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)

        def chat(url: str):
            return oa.chat.completions.create(model="mm", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what"}]}])

        port = web.server_address[1]
        assert chat(f"http://localhost:{port}/ok.png").usage.prompt_tokens > M.TOKENS_PER_IMAGE
        with pytest.raises(openai.BadRequestError, match="redirects are not followed"):
            chat(f"http://localhost:{port}/moved.png")
        with pytest.raises(openai.BadRequestError, match="host '127.0.0.1' is not allowed"):
            chat(f"http://127.0.0.1:{port}/ok.png")
    finally:
        web.shutdown()


def test_gemma4_images_of_two_aspect_ratios_through_the_openai_client(tmp_path):
    """Gemma 4's variable-resolution items (their patch grid crosses the API-to-core channel): the
    answer equals transformers', the same image again hits its blocks, another image does not."""
    from transformers import AutoTokenizer

    ckpt = M.build_gemma4_mm(tmp_path / "gemma4_mm")
    wide, tall = M.image(61, (30, 70)), M.image(62, (64, 32))
    tok = AutoTokenizer.from_pretrained(ckpt)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": TEXT_BEFORE}, {"type": "image"},
                                      {"type": "text", "text": "what is in the image"}]}],
        tokenize=False, add_generation_prompt=True)
    want = M.hf_greedy_gemma4_mm(M.load_hf_gemma4_mm(ckpt), rendered, [wide], 6)
    srv = serve(ckpt)
    try:
        oa = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)
        first, other, same = ask(oa, M.data_url(wide)), ask(oa, M.data_url(tall)), ask(oa, M.data_url(wide))
        got = first.choices[0].token_ids  # ask() does not ignore EOS: a prefix of transformers' run
        assert got and got == want[:len(got)]
        assert cached(other) == 32 and cached(same) == (first.usage.prompt_tokens - 1) // BLOCK * BLOCK
        assert first.usage.prompt_tokens != other.usage.prompt_tokens  # another aspect ratio, other count
        assert same.choices[0].message.content == first.choices[0].message.content
    finally:
        assert srv.stop() == 0
