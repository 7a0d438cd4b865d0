"""Issue 17, "flags users reach for": vLLM's serve flags, through real `kvtier serve` processes.

Two servers on one checkpoint whose generation_config.json sets temperature 0 and 5 new tokens:
`configured` takes nearly everything from a --config YAML (TLS, a root path, CORS for one origin,
request logging, uvicorn at warning, a chat template file, the generation config read by
default) with --max-model-len overriding the file's; `plain` takes --model, --generation-config
vllm, --no-enable-prefix-caching, --kv-cache-dtype bfloat16 over float32 weights and an inline
chat template. Oracles: the same server's answer to a request that sets the defaulted fields
explicitly, transformers' rendering of the chat template, the servers' own logs and /v1/kv/stats,
and the float32-KV server's greedy tokens for the bfloat16-KV one. Bad values are checked
in-process (a start would fail the test rather than serve).
"""
from __future__ import annotations

import json
import shutil
import ssl
import subprocess

import httpx
import pytest
import yaml
from serving import start_server

from checkpoints import random_prompt

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def model_dir(ckpt_dir, tmp_path_factory):
    """The tiny Llama, its generation_config.json asking for greedy decoding and 5 new tokens
    (and top_k 50, transformers' own default: not a default vLLM applies)."""
    d = tmp_path_factory.mktemp("genconf") / "llama"
    shutil.copytree(ckpt_dir("llama"), d)
    gc = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gc, "temperature": 0.0, "top_k": 50, "max_new_tokens": 5}))
    return d


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1, made now."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"), "-out",
                    str(d / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def configured(model_dir, tls, tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    (d / "template.jinja").write_text(TEMPLATE)
    cfg = {"model": str(model_dir), "served-model-name": ["cfg"], "num_gpu_blocks": 64, "max-model-len": 256,
           "api_key": KEY, "root-path": "/api", "allowed-origins": [ORIGIN], "allow_credentials": True,
           "ssl-certfile": str(tls[0]), "ssl_keyfile": str(tls[1]), "enable-log-requests": True, "log-prompts": True,
           "uvicorn-log-level": "warning", "chat-template": str(d / "template.jinja"), "enable-prefix-caching": True}
    (d / "serve.yaml").write_text(yaml.safe_dump(cfg))
    srv = start_server("--config", str(d / "serve.yaml"), "--max-model-len", "512")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(model_dir):
    srv = start_server("--model", str(model_dir), "--generation-config", "vllm", "--no-enable-prefix-caching",
                       "--dtype", "float32", "--kv-cache-dtype", "bfloat16", "--chat-template", TEMPLATE,
                       "--num-gpu-blocks", "64", "--max-model-len", "512")
    yield srv
    srv.stop()


def https(srv, tls) -> httpx.Client:
    return httpx.Client(base_url=srv.url, verify=ssl.create_default_context(cafile=str(tls[0])), timeout=120)


def chat(client: httpx.Client, model: str, **kw) -> dict:
    r = client.post("/v1/chat/completions", headers=AUTH, json={"model": model, "messages": MESSAGES,
                                                                 "ignore_eos": True, "return_token_ids": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_config_file_https_root_path_and_cors(configured, tls):
    # The file's values, the command line's --max-model-len over the file's 256.
    assert configured.url.startswith("https://127.0.0.1:") and configured.model == "cfg"
    assert "max_model_len=512" in configured.log()
    with https(configured, tls) as c:
        assert c.get("/health").status_code == 200  # open without the key behind the root path too
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "cfg"
        assert c.get("/openapi.json", headers=AUTH).json()["servers"] == [{"url": "/api"}]
        pre = c.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                         "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200, pre.text  # answered before the key check
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert pre.headers["access-control-allow-credentials"] == "true"
        bad = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                         "Access-Control-Request-Method": "POST"})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        # A refused request still carries the headers a browser needs to read the error.
        denied = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    with pytest.raises(httpx.HTTPError):  # TLS only: a plain HTTP request gets no answer
        httpx.get(configured.url.replace("https://", "http://") + "/health", timeout=10)


def test_default_cors_is_vllms_any_origin(plain):
    with plain.client() as c:
        pre = c.options("/v1/completions", headers={"Origin": "https://anywhere.example",
                                                    "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in pre.headers


def test_generation_config_defaults_apply_to_unset_fields_only(configured, plain, tls):
    with https(configured, tls) as c:
        defaulted = chat(c, "cfg")
        explicit = chat(c, "cfg", temperature=0, max_tokens=5)
        assert defaulted["usage"]["completion_tokens"] == 5  # max_new_tokens: 5, with EOS ignored
        assert defaulted["choices"][0]["token_ids"] == explicit["choices"][0]["token_ids"]
        # Fields the request sets win: a longer limit, and sampling at temperature 1.
        assert chat(c, "cfg", max_tokens=8)["usage"]["completion_tokens"] == 8
        sampled = chat(c, "cfg", temperature=1.0, seed=11, max_tokens=5)["choices"][0]["token_ids"]
        assert sampled != explicit["choices"][0]["token_ids"]
        # Completions keep their own default of 16 tokens (vLLM's field default), not the file's.
        r = c.post("/v1/completions", headers=AUTH, json={"model": "cfg", "prompt": "hello there", "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 16
    line = next(x for x in configured.lines if "Default sampling parameters have been overridden" in x)
    assert "temperature=0.0" in line and "max_tokens=5" in line and "top_k" not in line
    # --generation-config vllm: OpenAI's defaults (temperature 1, the rest of the context).
    assert not any("Default sampling parameters" in x for x in plain.lines)
    with plain.client() as c:
        seeded = chat(c, plain.model, seed=11, max_tokens=5)["choices"][0]["token_ids"]
        assert seeded == chat(c, plain.model, seed=11, max_tokens=5, temperature=1.0)["choices"][0]["token_ids"]
        whole = chat(c, plain.model)
        assert whole["usage"]["completion_tokens"] == 512 - whole["usage"]["prompt_tokens"]


def test_chat_template_from_a_file_and_inline(configured, plain, tls, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    want = list(tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))
    assert want != list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
    with https(configured, tls) as c:
        assert c.post("/tokenize", headers=AUTH, json={"messages": MESSAGES}).json()["tokens"] == want
        assert chat(c, "cfg", max_tokens=1)["choices"][0]["prompt_token_ids"] == want
    with plain.client() as c:
        assert c.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == want


def test_request_logging_and_uvicorn_log_level(configured, plain, tls):
    prompt = random_prompt(12, 9101)
    for srv, client in ((configured, https(configured, tls)), (plain, plain.client())):
        with client as c:
            r = c.post("/v1/completions", headers=AUTH, json={"model": srv.model, "prompt": prompt, "max_tokens": 2,
                                                              "request_id": "logged-1"})
            assert r.status_code == 200, r.text
    line = next(x for x in configured.lines if "Received request logged-1" in x)
    assert f"prompt_token_ids: {prompt}" in line and "'max_tokens': 2" in line
    assert not any("Received request" in x for x in plain.lines)  # off by default
    done = next(x for x in configured.lines if "Finished request logged-1" in x)
    assert "prompt_tokens=12 " in done and "output_tokens=2 " in done and "finish_reason=length" in done
    assert not any("Finished request" in x for x in plain.lines)
    # uvicorn at warning while kvtier logs at info; by default uvicorn follows --log-level.
    assert not any("Application startup complete" in x for x in configured.lines)
    assert any("Application startup complete" in x for x in plain.lines)
    assert any("starting the engine core" in x for x in configured.lines)


def test_prefix_caching_flags_and_bfloat16_kv(configured, plain, tls):
    prompt = random_prompt(64, 9102)

    def twice(client: httpx.Client, model: str) -> tuple[list[int], int, int]:
        for _ in range(2):
            r = client.post("/v1/completions", headers=AUTH, json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
        g1 = client.get("/v1/kv/stats", headers=AUTH).json()["tiers"]["G1"]
        return r.json()["choices"][0]["token_ids"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], \
            g1["prefix_cache_hits"]

    with https(configured, tls) as c:
        f32_tokens, cached, hits = twice(c, "cfg")
    assert cached >= 48 and hits > 0  # enable-prefix-caching: true (the file), the default
    with plain.client() as c:
        bf16_tokens, cached, hits = twice(c, plain.model)
    assert cached == 0 and hits == 0  # --no-enable-prefix-caching
    # bfloat16 KV under float32 weights (tests/engine/test_kv_cache_dtype.py has the exact oracle):
    # the server runs, and greedy decoding starts as with float32 KV.
    assert bf16_tokens[:3] == f32_tokens[:3], (bf16_tokens, f32_tokens)


@pytest.fixture
def serve_main(monkeypatch):
    """`kvtier serve ARGV` in this process, refusing to start serving: returns (exit code, stderr)."""
    import server.serve as serve

    async def no_serve(*args, **kwargs):
        raise AssertionError("the flags were accepted: the server would have started")

    monkeypatch.setattr(serve, "_serve", no_serve)

    def run(*argv: str) -> int:
        try:
            return serve.main(list(argv))
        except SystemExit as e:
            return int(e.code)
        except AssertionError as e:
            raise AssertionError(f"{argv}: {e}") from None
    return run


def test_bad_values_exit_2_naming_the_flag(serve_main, capsys, model_dir, tls, tmp_path):
    m = str(model_dir)
    (tmp_path / "gc").mkdir()
    (tmp_path / "gc" / "generation_config.json").write_text('{"temperature": "hot"}')
    (tmp_path / "unknown.yaml").write_text("max-modle-len: 512\n")
    (tmp_path / "badvalue.yaml").write_text("max_model_len: lots\n")
    (tmp_path / "list.yaml").write_text("- max-model-len\n")
    cases = [
        ([m, "--kv-cache-dtype", "int8"], "--kv-cache-dtype: 'int8' is not supported"),
        ([m, "--allowed-origins", "https://a.example"], "--allowed-origins"),
        ([m, "--allowed-methods", '{"GET": 1}'], "--allowed-methods"),
        ([m, "--ssl-certfile", str(tmp_path / "missing.pem")], "--ssl-certfile"),
        ([m, "--ssl-keyfile", str(tls[1])], "--ssl-keyfile needs --ssl-certfile"),
        ([m, "--ssl-certfile", str(tls[0]), "--ssl-cert-reqs", "2"], "--ssl-ca-certs"),
        ([m, "--root-path", "api"], "--root-path"),
        ([m, "--uvicorn-log-level", "loud"], "--uvicorn-log-level"),
        ([m, "--chat-template", str(tmp_path / "missing.jinja")], "--chat-template"),
        ([m, "--chat-template", "{% for m in messages %}"], "--chat-template"),
        ([m, "--generation-config", str(tmp_path / "nowhere")], "--generation-config"),
        ([m, "--generation-config", str(tmp_path / "gc")], "temperature must be a number"),
        ([m, "--max-log-len", "-1"], "--max-log-len"),
        ([m, "--log-prompts"], "--log-prompts needs --enable-log-requests"),
        ([m, "--enable-log-requests", "--max-log-len", "8"], "--max-log-len needs --log-prompts"),
        ([m, "--disable-log-stats", "--log-stats-interval", "5"], "--log-stats-interval has no effect"),
        ([m, "--log-stats-interval", "0"], "--log-stats-interval"),
        ([m, "--model", str(tmp_path)], "the positional MODEL and --model differ"),
        (["--config", str(tmp_path / "missing.yaml")], "--config"),
        (["--config", str(tmp_path / "unknown.yaml"), m], "max-modle-len"),
        (["--config", str(tmp_path / "badvalue.yaml"), m], "--max-model-len"),
        (["--config", str(tmp_path / "list.yaml"), m], "mapping"),
    ]
    for argv, needle in cases:
        rc = serve_main(*argv)
        assert rc == 2, argv
        err = capsys.readouterr().err.strip()
        last = err.splitlines()[-1]  # argparse's usage lines come first
        assert last.startswith("kvtier serve: error:") and needle in last and "Traceback" not in err, (argv, err)


def test_every_flag_has_help():
    from server.serve import build_parser

    text = build_parser().format_help()
    for flag in ("--config", "--model", "--chat-template", "--generation-config", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--kv-cache-dtype", "--root-path", "--allowed-origins",
                 "--allowed-methods", "--allowed-headers", "--allow-credentials", "--ssl-keyfile", "--ssl-certfile",
                 "--ssl-ca-certs", "--ssl-cert-reqs", "--uvicorn-log-level", "--enable-log-requests",
                 "--disable-log-requests", "--max-log-len", "--log-prompts", "--log-format", "--disable-log-stats",
                 "--log-stats-interval", "--log-level"):
        assert flag in text, flag
    for action in build_parser()._actions:
        assert action.help, action.option_strings


def test_engine_flags_reach_generate(model_dir, capsys):
    """--kv-cache-dtype and --model are engine flags: `kvtier generate` takes them too."""
    from server.cli import main

    assert main(["generate", "--model", str(model_dir), "--dtype", "float32", "--kv-cache-dtype", "bfloat16",
                 "--num-gpu-blocks", "32", "--prompt", "hello there", "--max-tokens", "3"]) == 0
    assert "tokens, finish_reason=" in capsys.readouterr().out


def test_generation_config_directory_semantics(tmp_path):
    """vLLM's rules, without a server: values equal to transformers' defaults and do_sample are
    ignored; a request's own (non-null) fields win; from a directory, max_new_tokens also caps."""
    from server.defaults import SamplingDefaults
    from server.protocol import ChatCompletionRequest, CompletionRequest

    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0, "min_p": 0.05,
        "max_new_tokens": 7, "do_sample": False, "eos_token_id": 2}))
    folder = SamplingDefaults.load(str(tmp_path), tmp_path / "unused")
    auto = SamplingDefaults.load("auto", tmp_path)
    assert dict(folder.values) == {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05} == dict(auto.values)
    assert (folder.max_tokens, folder.cap, auto.cap) == (7, True, False)
    assert not SamplingDefaults.load("vllm", tmp_path)

    def params(defaults, cls=ChatCompletionRequest, **fields):
        body = {"prompt": "x"} if cls is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
        req = cls.model_validate({**body, **fields})
        return defaults.apply(req, req.sampling_params(100))

    p = params(auto, top_p=0.5, temperature=None)  # a null field is unset
    assert (p.temperature, p.top_p, p.min_p, p.top_k, p.max_tokens) == (0.6, 0.5, 0.05, 0, 7)
    assert params(auto, max_tokens=20).max_tokens == 20 and params(folder, max_tokens=20).max_tokens == 7
    assert params(auto, cls=CompletionRequest).max_tokens == 16 and params(folder, cls=CompletionRequest).max_tokens == 7
    assert params(auto, max_completion_tokens=3, min_p=0.0).min_p == 0.0  # set explicitly: wins


def test_config_file_values_become_flags(tmp_path):
    from server import config_file
    from server.serve import build_parser

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model": "from-file", "no-enable-prefix-caching": True, "enforce_eager": True,
        "trust-request-chat-template": False, "kv-transfer-config": {"kv_connector": "TieredOffloadConnector"},
        "served_model_name": ["a", "b"], "allowed-origins": ["https://x.example"], "port": 9, "seed": None}))
    p = build_parser()
    ns = p.parse_args(config_file.expand(p, ["--config", str(tmp_path / "c.yaml"), "--port", "10"]))
    assert (ns.model, ns.enable_prefix_caching, ns.enforce_eager, ns.trust_request_chat_template) == \
        ("from-file", False, True, False)
    assert json.loads(ns.kv_transfer_config) == {"kv_connector": "TieredOffloadConnector"}
    assert (ns.served_model_name, ns.allowed_origins, ns.port, ns.seed) == (["a", "b"], ("https://x.example",), 10, 0)
    # MODEL on the command line wins over the file's, as any flag does.
    assert p.parse_args(config_file.expand(p, ["cli-model", "--config", str(tmp_path / "c.yaml")])).model == "cli-model"
