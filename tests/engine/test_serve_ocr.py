"""`ernie-studio serve` on a PaddleOCR-VL model, driven by the official `openai` client: an image chat reads
the image through PaddleOCR-VL's processor and chat template, and answers what the OCR evaluation
(``engine.eval.ocr.read_set``) reads greedily; images the server cannot or will not read are 400s that
name the problem."""

from __future__ import annotations

import base64
import shutil
import struct
import zlib
from pathlib import Path

import httpx
import openai
import pytest
from serve_support import REPO, running_server

import engine

LINES = REPO / "examples" / "data" / "ocr_demo" / "lines_eval.jsonl"
MAX_TOKENS = 16


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` pixels and holds none: the pixel limit must refuse it from
    its header, before anything is decoded."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def ocr_chat(url: str, prompt: str = "OCR:") -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def server(tiny_ocr_model_dir):
    with running_server(tiny_ocr_model_dir, "--max-num-seqs", "2", "--max-model-len", "512") as (base, proc):
        yield base, proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0)


def test_an_image_chat_reads_what_the_ocr_evaluation_reads(client, tiny_ocr_model_dir):
    """Same prompt ids as the training / evaluation prompt form, same greedy text as ``read_set``."""
    from engine.data.ocr import OCRSampleEncoder
    from engine.data.paddleocr_vl_processor import OCRProcessorSettings
    from engine.eval.ocr import prompt_ids, read_ocr_set, read_set

    tok = engine.load_tokenizer(str(tiny_ocr_model_dir))
    settings = OCRProcessorSettings.from_model_dir(tiny_ocr_model_dir)
    items = read_ocr_set(LINES, tok, max_samples=2)
    model = engine.load_model(str(tiny_ocr_model_dir))
    expected = read_set(model, tok, settings, items, max_new_tokens=MAX_TOKENS)
    encoder = OCRSampleEncoder(tok, 1 << 20, settings)
    answers = []
    for item in items:
        assert item.conversation.turns[0].user.endswith("OCR:")
        r = client.chat.completions.create(
            model="default",
            messages=ocr_chat(data_url(item.images[0].read_bytes())),
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert r.usage.prompt_tokens == len(prompt_ids(encoder, item))
        answers.append(r.choices[0].message.content)
    assert answers == expected
    assert answers[0] and answers[0] != answers[1]  # each reading depends on its image


BAD_IMAGES = [
    ("data:image/png;base64,@@@not-base64@@@", "not a readable image"),
    (data_url(b"plain text, not a picture"), "not an image PIL can read"),
    ("data:image/png,rawbytes", "a data: URL must be base64"),
    ("http://127.0.0.1:9/line.png", "http: URLs are not fetched"),
    ("https://example.com/line.png", "https: URLs are not fetched"),
    (
        data_url(png_header(9000, 9000)),
        "9000x9000 pixels (81,000,000) is more than max_image_pixels=64,000,000",
    ),
    ("images/line_006.png", "reads files only from a --media-dir, which it was not given"),
    ("", "image_url.url is missing"),
]


@pytest.mark.parametrize(("url", "fragment"), BAD_IMAGES, ids=lambda v: str(v)[:30])
def test_images_the_server_does_not_read_are_400s_naming_the_problem(client, url, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ocr_chat(url), max_tokens=2)
    assert e.value.status_code == 400
    assert fragment in e.value.body["message"], e.value.body
    assert e.value.body["param"] == "messages.0.content.0"


def test_prompts_that_misplace_images_are_400s(server, client):
    png = data_url((REPO / "examples/data/ocr_demo/images/line_006.png").read_bytes())
    cases = [
        # image tokens written as text would claim pixels no part sent
        (
            ocr_chat(png, "OCR: <|IMAGE_PLACEHOLDER|>"),
            "may not contain the image token <|IMAGE_PLACEHOLDER|>",
        ),
        (
            [{"role": "user", "content": "<|IMAGE_START|>OCR:"}],
            "may not contain the image token <|IMAGE_START|>",
        ),
        # the template renders user turns' images only
        (
            [
                {"role": "system", "content": [{"type": "image_url", "image_url": {"url": png}}]},
                *ocr_chat(png),
            ],
            "PaddleOCR-VL reads images in user messages only",
        ),
    ]
    for messages, fragment in cases:
        with pytest.raises(openai.BadRequestError, match=None) as e:
            client.chat.completions.create(model="default", messages=messages, max_tokens=2)
        assert fragment in e.value.body["message"], e.value.body
    assert httpx.get(server[0].removesuffix("/v1") + "/health").status_code == 200


def test_a_directory_without_a_chat_template_reads_with_paddleocr_vls(tiny_ocr_model_dir, tmp_path):
    """Not ERNIE's built-in template: the prompt is PaddleOCR-VL's, as with its chat_template.jinja."""
    from engine.serve.generate import GenerationEngine
    from engine.serve.protocol import ChatCompletionRequest
    from engine.serve.state import ServingState

    bare = tmp_path / "bare"
    shutil.copytree(tiny_ocr_model_dir, bare)
    (bare / "chat_template.jinja").unlink()
    png = data_url((REPO / "examples/data/ocr_demo/images/line_006.png").read_bytes())
    req = ChatCompletionRequest(model="m", messages=ocr_chat(png))

    def prompt(directory: Path) -> list[int]:
        model, tok = engine.load_model(str(directory)), engine.load_tokenizer(str(directory))
        return ServingState(GenerationEngine(model, tok, max_num_seqs=1), "m", 1, directory).chat_prompt(req)[
            0
        ]

    assert prompt(bare) == prompt(tiny_ocr_model_dir)
