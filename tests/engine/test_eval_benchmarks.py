"""Benchmarks by option log-likelihood against a hand computation, the text metrics, located errors for bad
eval files, ERNIEKit's run_eval.yaml, and an interrupted evaluation that continues without duplicates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine
from engine.eval import EvalDataError, eval_config_from_dict, load_eval_config, run_eval
from engine.eval.answers import final_number, reference_number
from engine.eval.items import detect_benchmark, read_eval_file
from engine.eval.text_metrics import bleu_stats, corpus_bleu, normalize, rouge_l

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "eval"

MC = [
    {"question": "Which is a fruit?", "choices": ["stone", "apple", "chair"], "answer": 1},
    {"question": "2 + 2 = ?", "choices": ["3", "4", "5", "22"], "answer": "B"},
    {"question": "The sky is", "choices": {"text": ["green", "blue"], "label": ["1", "2"]}, "answerKey": "1"},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def evaluate(model_dir: Path, out: Path, **values) -> dict:
    cfg = eval_config_from_dict({"model_name_or_path": str(model_dir), "output_dir": str(out), **values})
    run_eval(cfg)
    return json.loads((out / "eval_results.json").read_text())


def test_multiple_choice_accuracy_equals_a_hand_computation(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "mc.jsonl", MC)
    results = evaluate(tiny_model_dir, tmp_path / "out", eval_dataset_path=str(data),
                       eval_dataset_type="multiple_choice", choice_continuation="text", bootstrap_samples=0)  # fmt: skip
    model, tok = engine.load_model(str(tiny_model_dir)), engine.load_tokenizer(str(tiny_model_dir))
    answers = [1, 1, 0]
    correct, rows = (
        [],
        [json.loads(x) for x in (tmp_path / "out" / "eval_samples.jsonl").read_text().splitlines()],
    )
    for rec, answer, row in zip(MC, answers, rows, strict=True):
        choices = rec["choices"] if isinstance(rec["choices"], list) else rec["choices"]["text"]
        letters = "ABCD"
        prompt = (
            rec["question"] + "".join(f"\n{letters[i]}. {c}" for i, c in enumerate(choices)) + "\nAnswer:"
        )
        ctx = tok.encode(prompt)
        by_hand = []
        for c in choices:
            cont = tok.encode(" " + c)
            with paddle.no_grad():
                logits = model(paddle.to_tensor([ctx + cont])).logits[0].numpy().astype(np.float64)
            logp = (
                logits
                - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
                - logits.max(-1, keepdims=True)
            )
            by_hand.append(sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont)))
        assert row["option_logprobs"] == pytest.approx(by_hand, abs=1e-3)
        correct.append(float(int(np.argmax(by_hand)) == answer))
    assert results["metrics"]["mc/acc"] == pytest.approx(np.mean(correct))
    assert results["datasets"]["mc.jsonl"]["metrics"]["acc"]["n"] == 3


def test_benchmark_shapes_read_to_the_same_items(tmp_path):
    ceval = read_eval_file(str(EXAMPLES / "ceval_style.csv"), "multiple_choice").items
    assert [it.answer for it in ceval] == [1, 2, 0] and ceval[0].choices == ["上海", "北京", "广州", "深圳"]
    arc = read_eval_file(str(EXAMPLES / "arc_style.jsonl"), "multiple_choice").items
    assert [it.answer for it in arc] == [1, 1, 0]
    gsm = read_eval_file(str(EXAMPLES / "gsm8k_style.jsonl"), "gsm8k").items
    assert [it.answer for it in gsm] == ["7", "60", "1000"]
    # One detection for `eval_dataset_type: auto` and the studio's uploads: benchmarks by their keys, chat
    # and preference records (alpaca DPO has a `question` too) never.
    detected = {f.name: detect_benchmark(f) for f in sorted(EXAMPLES.iterdir()) if f.suffix != ".yaml"}
    assert detected == {
        "arc_style.jsonl": "multiple_choice", "ceval_style.csv": "multiple_choice", "gsm8k_style.jsonl": "gsm8k",
        "mmlu_style.jsonl": "multiple_choice", "qa_eval.jsonl": None,
    }  # fmt: skip
    dpo = write_jsonl(tmp_path / "dpo.jsonl", [{"question": "q", "chosen": "a", "rejected": "b"}])
    assert detect_benchmark(dpo) is None
    auto = read_eval_file(str(EXAMPLES / "ceval_style.csv"), "auto")
    assert auto.type == "multiple_choice" and [it.answer for it in auto.items] == [1, 2, 0]
    assert read_eval_file(str(EXAMPLES / "gsm8k_style.jsonl"), "auto").type == "gsm8k"


def test_text_metrics():
    assert normalize("  The Cat,  sat! ", ["lower", "punctuation", "whitespace", "articles"]) == "cat sat"
    assert normalize("北京。", ["punctuation", "whitespace"]) == "北京"
    assert rouge_l("今天天气很好", "今天天气不错") == pytest.approx(4 / 6)  # characters, not one "word"
    assert rouge_l("the cat sat", "the cat sat on") == pytest.approx(2 * 1 * 0.75 / 1.75)
    import sacrebleu

    preds, refs = (
        ["今天天气很好", "the cat sat on the mat", "a b c d"],
        ["今天天气不错", "the cat sat on a mat", "a b"],
    )
    want = sacrebleu.corpus_bleu(preds, [refs], tokenize="zh").score
    assert corpus_bleu([bleu_stats(p, r) for p, r in zip(preds, refs, strict=True)]) == pytest.approx(want)
    assert reference_number("so 3 + 4 = 7\n#### 1,000") == "1000"
    assert final_number("We get 12 then 14.0 dollars.") == "14"
    assert final_number("The answer is $5.50.") == "5.5"


def test_bad_eval_files_give_located_errors(tiny_model_dir, tmp_path):
    no_ref = write_jsonl(tmp_path / "noref.jsonl", [{"src": ["hi"], "tgt": ["hello"]}, {"src": ["q"]}])
    bad_mc = write_jsonl(
        tmp_path / "mc.jsonl", [MC[0], {"question": "?", "choices": ["a", "b"], "answer": "E"}]
    )
    out = tmp_path / "out"
    with pytest.raises(EvalDataError) as e:
        evaluate(
            tiny_model_dir,
            out,
            eval_dataset_path=f"{no_ref},{bad_mc}",
            eval_dataset_type="erniekit,multiple_choice",
        )
    assert f"{no_ref}:2: no reference answer: the last turn's answer (tgt) is missing" in str(e.value)
    assert f"{bad_mc}:2: answer 'E' is not among the choices (A, B" in str(e.value)
    assert len(e.value.problems) == 2  # every problem of every file at once
    assert json.loads((out / "eval_results.json").read_text())["status"] == "failed"
    assert not (out / "eval_samples.jsonl").exists()  # nothing scored, nothing half written


def test_erniekit_run_eval_yaml_is_accepted_as_is(tiny_model_dir, tmp_path):
    path = tmp_path / "run_eval.yaml"
    path.write_text(f"""\
eval_dataset_type: "erniekit"
eval_dataset_path: "{EXAMPLES / "qa_eval.jsonl"}"
eval_dataset_prob: "1.0"
max_seq_len: 8192
num_samples_each_epoch: 6000000
model_name_or_path: {tiny_model_dir}
fine_tuning: LoRA
lora_rank: 32
fuse_rope: True
seed: 23
do_train: False
do_eval: True
max_evaluate_steps: 2
distributed_dataloader: False
dataloader_num_workers: 1
batch_size: 1
logging_dir: ./vdl_log
output_dir: {tmp_path / "out"}
disable_tqdm: True
tensor_parallel_degree: 1
sharding: stage1
recompute: True
compute_type: bf16
""")
    cfg = load_eval_config(path)
    assert cfg.eval_dataset_path.endswith("qa_eval.jsonl") and cfg.max_seq_len == 8192 and cfg.seed == 23
    assert {n.key for n in cfg.notices} >= {
        "fine_tuning",
        "lora_rank",
        "fuse_rope",
        "do_train",
        "compute_type",
    }
    with pytest.raises(
        ValueError, match=r"run_eval.yaml:\d+: unknown key 'judge_urll'; did you mean 'judge_url'"
    ):
        load_eval_config(_with(path, "judge_urll: x\n"))


def _with(path: Path, extra: str) -> Path:
    path.write_text(path.read_text() + extra)
    return path


def test_an_interrupted_eval_continues_without_duplicates_or_losses(tiny_model_dir, tmp_path):
    rows = [{"src": [f"question {i}?"], "tgt": [f"answer {i}"]} for i in range(10)]
    data = write_jsonl(tmp_path / "qa.jsonl", rows)
    values = dict(eval_dataset_path=str(data), eval_dataset_type="erniekit", metrics="exact_match,rouge_l",
                  max_new_tokens=4, max_num_seqs=2, max_seq_len=64)  # fmt: skip
    full = evaluate(tiny_model_dir, tmp_path / "full", **values)
    out = tmp_path / "killed"
    first = evaluate(
        tiny_model_dir, out, **values
    )  # then cut the file as a kill in the middle of a write would
    samples = out / "eval_samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    samples.write_text("".join(lines[:6]) + lines[6][: len(lines[6]) // 2])
    again = evaluate(tiny_model_dir, out, **values)
    ids = [json.loads(x)["id"] for x in samples.read_text().splitlines()]
    assert sorted(ids) == sorted(f"qa.jsonl:{i}" for i in range(1, 11)) and len(ids) == len(set(ids))
    assert (
        again["metrics"] == first["metrics"] == full["metrics"]
    )  # greedy: the redone samples come out the same


def test_docs_key_table_is_the_schema():
    from engine.eval.config import EvalConfig
    from engine.train.config_docs import keys_table

    doc = (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8")
    assert f"<!-- keys:eval -->\n{keys_table(EvalConfig)}\n<!-- /keys:eval -->" in doc, (
        "docs/evaluation.md's key table differs from EvalConfig; run tools/make_config_docs.py"
    )
