"""Issue 17 (endpoints): vLLM's /ping, /v1/models/{id} and the OpenAPI docs. Oracle: the served
model names and OpenAI's error format."""
from __future__ import annotations

from test_serve_errors import assert_openai_error


def test_ping_model_card_and_docs(tiny_server):
    with tiny_server.client(timeout=30) as c:
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
        card = c.get("/v1/models/tiny").json()
        assert card["id"] == "tiny" and card["object"] == "model" and card["max_model_len"] > 0
        assert card == c.get("/v1/models").json()["data"][0]
        assert_openai_error(c.get("/v1/models/other"), 404, "model")
        assert "swagger" in c.get("/docs").text.lower()
        paths = c.get("/openapi.json").json()["paths"]
        assert {"/v1/chat/completions", "/v1/completions", "/ping"} <= set(paths)
