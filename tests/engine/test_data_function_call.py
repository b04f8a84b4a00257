"""ERNIEKit's own data as ERNIEKit reads it: function-call chatml, thinking conversations, PT ``{"tgt": [...]}``.

Sources (read, not copied):
- PaddlePaddle/ERNIE examples/data/function-call-eval.jsonl @ 484dddd18af75c156ee3aaa8aa891b3c7a28e5de (the record
  shape: ``tool_calls`` with an arguments object, a ``tool`` message whose content is a JSON list, ``<think>`` in
  the assistant content), examples/data/pt-eval.jsonl @ 5712651e95b315ef6f071bda2714ccfb429887f8 (``{"tgt": [...]}``
  read by stage PT, examples/configs/ERNIE-4.5-0.3B/pt/run_pt_8k.yaml, type "erniekit").
- PaddlePaddle/ERNIE ernie/dataset/finetuning.py @ 009cd6452bf89ebac9d549a4f05c92d94ff709dd (``process_fc``: one
  sample per assistant message with label 1, trained on that message only).
- PaddlePaddle/PaddleFormers paddleformers/datasets/template/template.py @ 01cc3cf536aa5058d38026ed9c809f607ba0a9a1
  (the "ernie" template, ``ErnieThinkingTemplate``, ``ReasoningTemplate``: earlier turns' reasoning removed, an
  answer without reasoning gets ``<think></think>``), template/tool_utils.py @ 036842c7f16c2fd17c9a90bf5144644d6df3b0d4
  (``ERNIEToolUtils``: ``<tool_list>``, ``<tool_call>``), template/formatter.py @ 533a57faac14a4c4b31609c517b3cd9c135d81f1
  (``ThinkingFormatter``, ``FunctionFormatter``: "\\n" before the calls).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine import load_tokenizer
from engine.data import IGNORE_INDEX, SampleEncoder, parse_record, render_record, validate_file
from engine.data.formats import detect_format
from engine.data.loader import load_items
from engine.train import run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_news",
            "description": "Get the latest news",
            "parameters": {
                "type": "object",
                "properties": {"category": {"type": "string", "description": "The category of news"}},
                "required": ["category"],
            },
        },
    }
]
# A shortened record of ERNIEKit's function-call demo data, in its exact shape.
FC_RECORD = {
    "messages": [
        {"role": "user", "content": "Can you get me the latest news in sports?"},
        {
            "role": "assistant",
            "content": "<think>The user wants sports news; get_news fits.\n</think>",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_news", "arguments": {"category": "sports"}}}
            ],
        },
        {"role": "tool", "content": [{"news": [{"title": "NBA: Lakers sign new player"}]}]},
        {"role": "assistant", "content": "Here are the latest sports news: NBA: Lakers sign new player."},
    ],
    "tools": TOOLS,
}
TOOL_LIST = (
    '<tool_list>\n[{"type": "function", "function": {"name": "get_news", "description": "Get the latest news", '
    '"parameters": {"type": "object", "properties": {"category": {"type": "string", "description": '
    '"The category of news"}}, "required": ["category"]}}}]\n</tool_list>'
)
CALL = '<tool_call>{"name": "get_news", "arguments": {"category": "sports"}}\n</tool_call>'
# The golden: ERNIE's tool parts (PaddleFormers "ernie" template) inside the ERNIE 4.5 instruct frame
# ("User: ...\nAssistant: ...<|end_of_sentence|>", REFERENCE.md) the encoder uses for every text model.
GOLDEN = [
    (
        "<|begin_of_sentence|>"
        + TOOL_LIST
        + "\nUser: Can you get me the latest news in sports?\nAssistant: ",
        False,
    ),
    (
        "<think>\nThe user wants sports news; get_news fits.\n</think>\n\n" + CALL + "<|end_of_sentence|>",
        True,
    ),
    (
        'User: <tool_response>\n[{"news": [{"title": "NBA: Lakers sign new player"}]}]\n</tool_response>\nAssistant: ',
        False,
    ),
    ("<think></think>Here are the latest sports news: NBA: Lakers sign new player.<|end_of_sentence|>", True),
]
THINK_RECORD = {
    "messages": [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Three and three."},
    ]
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def texts(tok, sample) -> tuple[str, str]:
    """(whole sequence, the tokens that get loss) decoded with special tokens."""
    whole = tok.decode(sample.input_ids.tolist(), skip_special_tokens=False)
    trained = tok.decode([int(x) for x in sample.labels if x != IGNORE_INDEX], skip_special_tokens=False)
    return whole, trained


def ids_of(tok, pieces: list[str]) -> list[int]:
    """The ids the encoder builds: every piece between turns tokenized on its own."""
    return [i for piece in pieces for i in tok.encode(piece)]


def test_function_call_record_renders_as_the_ernie_template(tok):
    spans = render_record(FC_RECORD, "chatml", "sft", tok)
    assert [(s["text"], s["trained"]) for s in spans] == GOLDEN


def test_function_call_trains_one_sample_per_assistant_turn_not_the_tool_result(tok):
    samples = SampleEncoder(tok, 1024).encode(parse_record(FC_RECORD, "chatml", "sft"))
    assert len(samples) == 2  # ERNIEKit's process_fc: one example per trained assistant message
    first, second = (texts(tok, s) for s in samples)
    assert samples[0].input_ids.tolist() == ids_of(tok, [GOLDEN[0][0], GOLDEN[1][0]])
    assert first[1] == GOLDEN[1][0]
    # The second sample's history holds the tool call without its reasoning; only the answer trains.
    history = ["\n" + CALL + "<|end_of_sentence|>", GOLDEN[2][0], GOLDEN[3][0]]
    assert samples[1].input_ids.tolist() == ids_of(tok, [GOLDEN[0][0], *history])
    assert second[1] == GOLDEN[3][0]
    assert "tool_response" not in first[1] + second[1]


def test_thinking_history_drops_its_reasoning_and_reasoning_content_reads_like_think(tok):
    samples = SampleEncoder(tok, 1024).encode(parse_record(THINK_RECORD, "chatml", "sft"))
    (_, t1), (_, t2) = (texts(tok, s) for s in samples)
    assert t1 == "<think>\nTwo and two.\n</think>\n4<|end_of_sentence|>"
    pieces = [
        "<|begin_of_sentence|>Solve it.\nUser: 2+2?\nAssistant: ",
        "4<|end_of_sentence|>",
        "User: 3+3?\nAssistant: ",
    ]
    assert samples[1].input_ids.tolist() == ids_of(tok, [*pieces, t2])
    assert t2 == "<think>\nThree and three.\n</think>\n6<|end_of_sentence|>"


def test_plain_chatml_stays_one_sample_without_think_blocks(tok):
    rec = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2}
    (sample,) = SampleEncoder(tok, 256).encode(parse_record(rec, "chatml", "sft"))
    assert texts(tok, sample)[1] == "b<|end_of_sentence|>b<|end_of_sentence|>"


def test_label_switches_assistant_turns_off(tok):
    rec = dict(FC_RECORD, label=[0, 1])
    samples = SampleEncoder(tok, 1024).encode(parse_record(rec, "chatml", "sft"))
    assert [texts(tok, s)[1] for s in samples] == [GOLDEN[3][0]]


BAD = {
    "args_not_json": (
        {"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
        "messages[1].tool_calls[0].function.arguments is a string that is not JSON",
    ),
    "no_name": (
        {"tool_calls": [{"type": "function", "function": {"arguments": {}}}]},
        "messages[1].tool_calls[0] must be",
    ),
    "args_list": (
        {"tool_calls": [{"function": {"name": "f", "arguments": [1]}}]},
        "messages[1].tool_calls[0].function.arguments must be an object, got a list",
    ),
    "calls_not_list": ({"tool_calls": {"name": "f"}}, "messages[1].tool_calls must be a non-empty list"),
    "both_reasonings": (
        {"content": "<think>a</think>b", "reasoning_content": "c"},
        "messages[1] has both reasoning_content and a <think> block",
    ),
}


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_function_call_records_are_located(tmp_path, name):
    change, fragment = BAD[name]
    bad = json.loads(json.dumps(FC_RECORD))
    bad["messages"][1].update(change)
    path = write(tmp_path / "fc.jsonl", [FC_RECORD, bad])
    report = validate_file(path, "chatml", "sft")
    assert [(p.line, fragment in p.message) for p in report.problems] == [(2, True)], report.problems
    assert f"{path}:2: " in str(report.problems[0])


def test_malformed_messages_are_located(tmp_path):
    records = [
        {
            "messages": [
                {"role": "user", "content": "q", "tool_calls": [{"function": {"name": "f"}}]},
                {"role": "assistant", "content": "a"},
            ]
        },
        {"messages": [{"role": "user", "content": {"x": 1}}, {"role": "assistant", "content": "a"}]},
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "label": [1, 0],
        },
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "tools": [{"x": 1}],
        },
    ]
    report = validate_file(write(tmp_path / "m.jsonl", records), "chatml", "sft")
    got = {p.line: p.message for p in report.problems}
    assert "messages[0] is a user message with tool_calls" in got[1]
    assert "messages[0].content must be a string or a list of text parts" in got[2]
    assert "'label' has 2 values but there are 1 assistant messages" in got[3]
    assert "tools[0] has no function name" in got[4]


def test_text_parts_and_tool_calls_without_content(tok):
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "news"}, {"type": "text", "text": "?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "get_news", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "none"},
            {"role": "assistant", "content": "No news."},
        ]
    }
    spans = render_record(rec, "chatml", "sft", tok)
    assert spans[0]["text"].endswith("User: news?\nAssistant: ")
    assert (
        spans[1]["text"]
        == '\n<tool_call>{"name": "get_news", "arguments": {}}\n</tool_call><|end_of_sentence|>'
    )


def test_erniekit_pt_records_are_pt_data(tmp_path, tok):
    path = write(tmp_path / "pt.jsonl", [{"tgt": ["真。"]}, {"tgt": ["巴西、哥伦比亚和阿根廷。", "second"]}])
    assert detect_format(path) == ("erniekit", "pt")
    assert validate_file(path).ok
    items, dropped = load_items(path, "erniekit", "pt", SampleEncoder(tok, 64), tok)
    assert dropped == 0 and len(items) == 2
    whole = tok.decode(items[1].input_ids.tolist(), skip_special_tokens=False)
    assert whole == "<|begin_of_sentence|>巴西、哥伦比亚和阿根廷。\nsecond<|end_of_sentence|>"
    assert (items[1].labels[:-1] == items[1].input_ids[1:]).all()
    with pytest.raises(ValueError, match=r"pretraining text .* train it with stage PT"):
        load_items(path, "erniekit", "sft", SampleEncoder(tok, 64), tok)
    report = validate_file(path, "erniekit", "sft")
    assert report.problems[0].line == 1 and "missing field 'src'" in report.problems[0].message
    bad = validate_file(
        write(tmp_path / "bad.jsonl", [{"tgt": []}, {"tgt": ["ok"], "src": ["q"]}]), "erniekit", "pt"
    )
    assert {p.line for p in bad.problems} == {1, 2}


def _train(tmp_path: Path, model: Path, data: Path, fmt: str, stage: str) -> list[float]:
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(model),
            output_dir=str(tmp_path / "out"),
            stage=stage,
            fine_tuning="Full",
            train_dataset_type=fmt,
            train_dataset_path=str(data),
            max_seq_len=256,
            batch_size=2,
            max_steps=24,
            learning_rate=2e-3,
            logging_steps=1,
            save_steps=1000,
            disable_tqdm=True,
            seed=3,
        ),
    )
    run_training(cfg)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("case", ["function_call", "thinking", "pt"])
def test_erniekit_records_train(tmp_path, tiny_model_dir, case):
    if case == "pt":
        data = write(
            tmp_path / "d.jsonl",
            [{"tgt": [f"Document {i}: the sky is blue and grass is green."]} for i in range(6)],
        )
        losses = _train(tmp_path, tiny_model_dir, data, "erniekit", "PT")
    else:
        rec = FC_RECORD if case == "function_call" else THINK_RECORD
        data = write(tmp_path / "d.jsonl", [rec] * 6)
        losses = _train(tmp_path, tiny_model_dir, data, "messages" if case == "thinking" else "chatml", "SFT")
    assert np.isfinite(losses).all()
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4]), losses
