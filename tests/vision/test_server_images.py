"""Images through the server (issue 20, acceptance 4): a data-URL image part via the official `openai` client
gives the same tokens as `dsv41 generate --chat --image`; remote URLs, malformed and oversize images are 4xx
with OpenAI-style bodies, and the server keeps serving."""

from __future__ import annotations

import argparse
import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from tests.server.conftest import LiveServer

from dsv41.cli import main as dsv41_main
from dsv41.engine.cli import load_model_and_tokenizer
from dsv41.image_processor import ImageLimits, decode_image
from dsv41.server.cli import build_server

MODEL = "dsv41-tiny-vl"
QUESTION = "What is in this image?"
VL_ARGS = argparse.Namespace(preset="tiny-vl", random_init=True, checkpoint=None, tokenizer=None, device="cpu")


def png(h: int, w: int, seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vl_server():
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(VL_ARGS)  # the weights `dsv41 generate --preset tiny-vl --random-init` builds
    app, scheduler = build_server(model, tok, model_name=MODEL, max_batch=2, kv_budget_bytes=2**28,
                                  image_limits=ImageLimits(max_pixels=40 * 40))
    server = LiveServer(app, scheduler)
    yield server, model, tok
    server.close()


@pytest.fixture(scope="module")
def client(vl_server):
    return openai.OpenAI(base_url=vl_server[0].base_url, api_key="none", max_retries=0, timeout=60)


def chat(client, parts: list[dict], n: int = 6, role: str = "user"):
    return client.chat.completions.create(model=MODEL, messages=[{"role": role, "content": parts}],
                                          max_tokens=n, temperature=0)


def test_a_data_url_image_gives_the_tokens_of_dsv41_generate(vl_server, client, tmp_path, capsys):
    _, model, tok = vl_server
    image = png(28, 36, 1)
    (tmp_path / "a.png").write_bytes(image)
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": QUESTION}]
    resp = chat(client, parts)
    assert dsv41_main(["generate", "--preset", "tiny-vl", "--random-init", "--device", "cpu", "--chat", "--image",
                       str(tmp_path / "a.png"), "--prompt", QUESTION, "--max-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    assert resp.choices[0].message.content == printed[:-1]
    # the prompt holds the image's whole span: the text-only chat plus h·(w + 1) + 2 positions
    span = decode_image(image, model.config).n_positions
    text_only = tok.encode_chat([{"role": "user", "content": QUESTION}])
    assert resp.usage.prompt_tokens == len(text_only) + span


@pytest.mark.parametrize("url, status, code", [
    ("https://example.com/cat.png", 400, "remote_image_url"),
    ("http://127.0.0.1:1/x.png", 400, "remote_image_url"),
    ("data:image/png;base64,not*base64", 400, "invalid_image"),
    (data_url(b"\x89PNG\r\n\x1a\n this is no png"), 400, "invalid_image"),
    ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), 400, "invalid_image"),
    (data_url(png(60, 60, 2)), 413, "image_too_large"),  # over the server's 40 x 40 pixel limit
])
def test_bad_images_are_4xx_and_the_server_keeps_serving(vl_server, client, url, status, code):
    with pytest.raises(openai.APIStatusError) as e:
        chat(client, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}])
    assert e.value.status_code == status, e.value.response.text
    body = e.value.response.json()["error"]
    assert body["code"] == code and body["message"], body
    ok = chat(client, [{"type": "text", "text": QUESTION}], n=2)  # the next request is served
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_an_image_outside_a_user_message_is_refused(client):
    with pytest.raises(openai.BadRequestError):
        chat(client, [{"type": "image_url", "image_url": {"url": data_url(png(20, 20, 3))}}], role="assistant")
