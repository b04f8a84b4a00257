"""The Train tab's Sweep box and the Sweeps tab without a browser: the box's rows become the engine's search
space, a refusal is shown in the box with its key and queues nothing, a launch queues the sweep; the Sweeps
tab's leaderboard puts the best completed trial first, plots the objective over the trials and Optuna's
parameter importances, and cancel / promote go through the services the REST API calls."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import gradio as gr
import optuna
import pytest
from studio_helpers import DEMO_SFT, upload

from studio.services import runs as runs_svc
from studio.services import sweeps as sweeps_svc
from studio.sweep_storage import optuna_storage
from studio.ui.context import UIContext
from studio.ui.i18n import Texts, localize_frame, text
from studio.ui.sweep_box import (
    ROW_PARTS,
    ROWS,
    SETTING_KEYS,
    SweepHandlers,
    choice_value,
    estimate_markdown,
    space_of,
)
from studio.ui.sweeps_tab import SweepsHandlers, summary_markdown, sweep_choices, sweep_rows, trial_rows
from studio.ui.text_check import untranslated_words

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
EMPTY_ROW = (None, "log-uniform", None, None, "")
SETTINGS = {
    "n_trials": 3, "parallelism": 1, "objective": "eval_loss", "direction": "minimize", "sampler": "tpe",
    "pruner": "median", "max_wall_s": 0, "max_total_steps": 0,
}  # fmt: skip


def box_values(*rows: tuple, **settings) -> tuple:
    rows = (*rows, *[EMPTY_ROW] * (ROWS - len(rows)))
    assert all(len(r) == len(ROW_PARTS) for r in rows)
    return (*(v for r in rows for v in r), *({**SETTINGS, **settings}[k] for k in SETTING_KEYS))


@pytest.fixture
def spec(client) -> runs_svc.RunSpec:
    ds = upload(client, DEMO_SFT).json()["id"]
    return runs_svc.RunSpec(
        name="base", dataset_ids=[ds], eval_dataset_ids=[ds], hyperparameters={"max_steps": 4}
    )


@pytest.fixture
def ctx(settings) -> UIContext:
    return UIContext(settings=settings, texts=Texts(), demo=None)


def test_rows_become_the_engines_space():
    rows = [
        ("learning_rate", "log-uniform", 1e-5, 1e-3, ""),
        ("lora_rank", "int", 4, 16, ""),
        ("lr_scheduler_type", "choice", None, None, "cosine, linear"),
        ("weight_decay", "uniform", 0, 0.1, ""),
        (None, "int", 1, 2, ""),  # no key: not searched
    ]
    assert space_of(rows) == {
        "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
        "lora_rank": {"type": "int", "low": 4, "high": 16},
        "lr_scheduler_type": {"type": "categorical", "choices": ["cosine", "linear"]},
        "weight_decay": {"type": "float", "low": 0, "high": 0.1},
    }
    assert [choice_value(v) for v in (" true", "8", "1e-4", "cosine")] == [True, 8, 1e-4, "cosine"]


def test_refusals_name_the_key_and_queue_nothing(ctx, spec, session):
    h = SweepHandlers(ctx, lambda values: values[0], 1)
    cases = [
        (box_values(("learning_rate", "log-uniform", 1e-3, 1e-5, "")), "learning_rate: the range is empty"),
        (box_values(("learning_rat", "uniform", 0, 1, "")), "learning_rat: not a training key"),
        (box_values(("lr_scheduler_type", "choice", None, None, "cosyne")), "choice 'cosyne' is not"),
        (
            box_values(("learning_rate", "log-uniform", 1e-5, 1e-3, ""), objective="eval_accuracy"),
            "objective:",
        ),
        (box_values(), "give at least one key to search"),
        (box_values(("learning_rate", "log-uniform", 1e-5, 1e-3, ""), n_trials=0), "n_trials:"),
    ]
    for values, says in cases:
        shown, launched = h.launch(spec, *values)
        assert "was not queued" in shown and says in shown, (says, shown)
        assert launched == gr.skip()
        assert says in h.estimate(spec, *values)
    no_eval = spec.model_copy(update={"eval_dataset_ids": None})
    shown, _ = h.launch(no_eval, *box_values(("learning_rate", "log-uniform", 1e-5, 1e-3, "")))
    assert "eval_dataset_ids" in shown
    assert sweeps_svc.list_sweeps(session) == []


def test_a_launch_queues_the_sweep_with_its_estimate(ctx, spec, session):
    h = SweepHandlers(ctx, lambda values: values[0], 1)
    values = box_values(("learning_rate", "log-uniform", 1e-5, 1e-3, ""), ("lora_rank", "int", 4, 8, ""))
    assert "**3 trials**, 1 at a time: at most 12 steps (4 a trial)" in h.estimate(spec, *values)
    shown, sweep_id = h.launch(spec, *values)
    sweep = sweeps_svc.get_sweep(session, sweep_id)
    assert f"Sweep #{sweep_id} **base-sweep** queued: 3 trials" in shown
    assert sweep.parameters == {
        "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
        "lora_rank": {"type": "int", "low": 4, "high": 8},
    }
    assert sweep.spec["hyperparameters"] == {"max_steps": 4} and sweep.settings["n_trials"] == 3


def _finished_trials(settings, sweep, values: list[tuple[float, int, float]]) -> None:
    """Trials told to the sweep's own study in the studio's database, as its driver tells them."""
    study = optuna.load_study(study_name=sweep.study_name, storage=optuna_storage(settings))
    dists = {
        "learning_rate": optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True),
        "lora_rank": optuna.distributions.IntDistribution(4, 8),
    }
    for lr, rank, value in values:
        study.add_trial(
            optuna.trial.create_trial(
                params={"learning_rate": lr, "lora_rank": rank}, distributions=dists, value=value
            )
        )
    study.add_trial(
        optuna.trial.create_trial(
            params={"learning_rate": 1e-5, "lora_rank": 4},
            distributions=dists,
            state=optuna.trial.TrialState.PRUNED,
            intermediate_values={2: 9.0},
        )
    )


def test_the_sweeps_tab_shows_the_leaderboard_plots_and_acts(ctx, spec, session, settings):
    _, sweep_id = SweepHandlers(ctx, lambda values: values[0], 1).launch(
        spec, *box_values(("learning_rate", "log-uniform", 1e-5, 1e-3, ""), ("lora_rank", "int", 4, 8, ""))
    )
    sweep = sweeps_svc.get_sweep(session, sweep_id)
    h = SweepsHandlers(ctx)
    summary, board, points, importance, _, cancel, promote = h.view(sweep_id)
    assert board.empty and points.empty and importance.empty
    assert cancel["interactive"] is True and promote["interactive"] is False
    with pytest.raises(gr.Error, match="no completed trial yet"):
        h.promote(sweep_id)

    _finished_trials(settings, sweep, [(1e-4, 4, 2.5), (5e-4, 8, 1.5), (1e-3, 6, 2.0), (3e-4, 5, 1.8)])
    summary, board, points, importance, _, cancel, promote = h.view(sweep_id)
    assert list(board["trial"]) == [1, 3, 2, 0, 4]  # best first, the pruned one last
    assert list(board["objective"]) == ["1.5", "1.8", "2", "2.5", "9"]
    assert board["trial state"].iloc[-1].endswith("pruned")
    assert "Best: trial 1, 1.5 (learning_rate=0.0005, lora_rank=8)" in summary
    assert "4 complete, 1 pruned" in summary
    frame = points["value"]
    assert sorted(frame["trial"]) == [0, 1, 2, 3, 4] and set(frame["state"]) == {"complete", "pruned"}
    assert points["x_lim"] == [-0.5, 4.5] and points["y_lim"][0] < 1.5 and points["y_lim"][1] > 9
    assert set(importance["parameter"]) == {"learning_rate", "lora_rank"}
    assert importance["importance"].sum() == pytest.approx(1.0)
    assert promote["interactive"] is True
    # maximise: the same trials the other way round
    assert list(trial_rows(sweeps_svc.trials(session, settings, sweep), "maximize")["trial"])[:2] == [0, 2]

    # with nothing picked, the tab shows ?sweep=N, else the newest sweep; a pick is never overwritten
    newer = SweepHandlers(ctx, lambda values: values[0], 1).launch(
        spec, *box_values(("learning_rate", "log-uniform", 1e-5, 1e-3, ""))
    )[1]
    assert h.table(None, SimpleNamespace(query_params={"sweep": str(sweep_id)}))[2] == sweep_id
    assert h.table(None, SimpleNamespace(query_params={}))[0]["value"] == newer
    assert "value" not in h.table(sweep_id, SimpleNamespace(query_params={"sweep": str(newer)}))[0]

    assert "Cancelling sweep" in h.cancel(sweep_id)
    session.expire_all()
    assert sweeps_svc.get_sweep(session, sweep_id).status == "cancelled"
    summary, *_, cancel, _ = h.view(sweep_id)
    assert "cancelled" in summary and cancel["interactive"] is False


def test_the_sweep_texts_are_chinese_in_chinese():
    sweep = SimpleNamespace(
        id=3, name="lr-sweep", status="running", stop_reason="n_trials", error=None, created_at=NOW,
        settings={"objective": "eval_loss", "direction": "minimize", "n_trials": 4, "sampler": "tpe", "pruner": "median"},
    )  # fmt: skip
    trials = [
        {"number": n, "state": state, "params": {"learning_rate": 1e-4 * (n + 1)}, "value": value,
         "last_value": 2.0, "last_step": 4, "run_id": n + 1, "run_status": status}
        for n, (state, value, status) in enumerate(
            [("complete", 1.5, "succeeded"), ("pruned", None, "cancelled"), ("running", None, "running"),
             ("fail", None, "failed"), ("waiting", None, None)]
        )
    ]  # fmt: skip
    est = {
        "n_trials": 4,
        "parallelism": 2,
        "steps": 16,
        "total_s": 75.0,
        "run": {"steps": 4, "memory_gib": {"peak": 1.2}},
    }
    shown = {
        lang: [
            summary_markdown(sweep, trials, lang),
            localize_frame(trial_rows(trials, "minimize", lang), lang).to_csv(),
            localize_frame(sweep_rows([sweep], lang), lang).to_csv(),
            *(label for label, _ in sweep_choices([sweep], lang)),
            estimate_markdown(est, lang),
            text("sw.launched", lang, id=3, name="lr-sweep", trials=4),
            *(text(k, lang) for k in ("sw.refused", "swp.none", "swp.err.none", "sw.help")),
            text("swp.promoted", lang, trial=0, run=1, id=2),
        ]
        for lang in ("zh", "en")
    }
    data = ["lr-sweep", "eval_loss", "minimize", "tpe", "median", "n_trials"]
    for piece in shown["zh"]:
        assert untranslated_words(piece, data) == [], piece
    assert all(untranslated_words(piece, data) for piece in shown["en"][:1])  # the check is not vacuous


def test_the_sweep_box_adds_no_event_to_opening_the_train_tab(settings):
    """Opening the Train tab stays one event (each event costs the page a pass over every component any
    event touched): the box's choices are built with the page, and only its two buttons send its values."""
    from studio.ui import build_ui

    demo = build_ui(settings)
    train = next(b for b in demo.blocks.values() if isinstance(b, gr.Tab) and b.id == "train")
    box = {b._id for b in demo.blocks.values() if (getattr(b, "elem_id", None) or "").startswith("sw-")}
    assert len(box) > 20  # the rows, the settings, the buttons and the status
    opened = [fn for fn in demo.fns.values() if (train._id, "select") in fn.targets]
    # the form's one event (TrainHandlers.open_tab), and the page-wide record of the tab with its timers
    assert len(opened) == 2 and "opened" in [fn.name for fn in opened]
    for fn in demo.fns.values():
        if any(event in ("select", "load") for _, event in fn.targets):
            assert not {b._id for b in [*fn.inputs, *fn.outputs]} & box, fn.name
    clicks = [fn for fn in demo.fns.values() if {b._id for b in fn.inputs} & box]
    assert sorted(fn.name for fn in clicks) == ["estimate", "launch"]
