"""The Evaluate tab's parts without a browser: the results table, the per-sample view with its diff, the
Train tab's evaluate-after-training fields, and both languages of its texts and table headers."""

from __future__ import annotations

import pandas as pd

from studio.ui.evaluate_tab import (
    EVAL_COLUMNS,
    SAMPLE_COLUMNS,
    diff_html,
    evaluate_after_spec,
    results_frame,
    sample_html,
    sample_rows,
    summary_markdown,
)
from studio.ui.i18n import STRINGS, header, localize_frame
from studio.ui.train_tab import run_spec

COMPARE = {
    "evals": [{"id": 2, "name": "r · result"}, {"id": 1, "name": "r · base"}],
    "metrics": {"held/exact_match": {"2": 0.8125, "1": 0.0}, "held/rouge_l": {"2": 0.9, "1": None}},
    "intervals": {"held/exact_match": {"2": [0.62, 0.94]}},
    "pairwise": {"2": {"baseline": "x", "wins": 3, "ties": 1, "losses": 0, "unparsed": 0, "win_rate": 0.875}},
    "differ": {"evals": [2, 1], "samples": 13, "of": 16},
}


def test_results_side_by_side_with_intervals_and_win_rate():
    frame = results_frame(COMPARE)
    assert list(frame.columns) == ["metric", "#2 r · result", "#1 r · base"]
    assert frame.values.tolist() == [
        ["held/exact_match", "0.8125 (0.62–0.94)", "0"],
        ["held/rouge_l", "0.9", "—"],
    ]
    text = summary_markdown(COMPARE)
    assert "**13** of 16" in text and "win rate **87.5%** (3 wins, 1 ties, 0 losses" in text
    assert localize_frame(frame, "zh").columns[0] == "指标"


def test_sample_browser_shows_reference_both_predictions_and_their_diff():
    item = {
        "sample_id": "held.jsonl:3", "dataset": "held.jsonl", "line": 3, "prompt": "<b>what does the cat say?",
        "reference": "meow", "prediction": "meow", "scores": {"exact_match": 1.0},
        "other": {"prediction": "moo moo", "scores": {"exact_match": 0.0}}, "differ": True,
    }  # fmt: skip
    page = {"compare_to": 1, "items": [item]}
    rows = sample_rows(page)
    assert list(rows.columns) == SAMPLE_COLUMNS
    assert rows.values.tolist() == [["held.jsonl:3", "meow", "meow", "moo moo", "≠"]]
    shown = sample_html(item, "A: #2", "B: #1")
    assert "the predictions differ" in shown and "&lt;b&gt;what does" in shown  # escaped, not markup
    assert "(exact_match 1)" in shown and "(exact_match 0)" in shown
    assert diff_html("meow", "moo moo") == (
        "m<del style='background:#fecaca'>e</del>o<del style='background:#fecaca'>w</del>"
        "<ins style='background:#bbf7d0'>o moo</ins>"
    )
    assert sample_rows({"compare_to": None, "items": [dict(item, other=None, differ=None)]}).values[0][
        3:
    ].tolist() == ["—", ""]


def test_train_form_evaluate_after_fields_become_the_run_spec_part():
    assert evaluate_after_spec(False, 8, [3], 16) is None
    spec = evaluate_after_spec(True, 8, ["3"], 16)
    assert spec.holdout == 8 and spec.dataset_ids == [3] and spec.options == {"max_new_tokens": 16}
    assert evaluate_after_spec(True, 8, [], 128).options == {}  # the engine's default is not written
    form = {
        "base_model": "tiny", "dataset_ids": ["1"], "stage": "SFT", "fine_tuning": "LoRA", "max_steps": 3,
        "eval_after": True, "eval_holdout": 8, "eval_datasets": [], "eval_max_new_tokens": 16,
    }  # fmt: skip
    run = run_spec(form)
    assert run.evaluate.holdout == 8 and "eval_holdout" not in run.hyperparameters
    assert run.hyperparameters == {"max_steps": 3}


def test_evaluate_texts_have_both_languages():
    keys = [k for k in STRINGS if k.startswith(("ev.", "tab.evaluate"))]
    assert len(keys) > 15
    for column in [*EVAL_COLUMNS, *SAMPLE_COLUMNS]:
        zh = header(column, "zh")
        assert zh != column and not zh.isascii(), column
        assert header(zh, "en") == column
    assert isinstance(localize_frame(pd.DataFrame(columns=SAMPLE_COLUMNS), "zh"), pd.DataFrame)
