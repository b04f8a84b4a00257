"""How the page's events cost the browser: what an event shows its progress on, and what a timer re-sends.

Gradio's page keeps a loading status for every component any event has targeted and looks each one up in
the page's tree (walking a container's whole subtree) at every status change of every event; it redoes its
state for every value it receives. An idle Runs tab cost the renderer 90% of a core before these rules
(docs/benchmarks.md, "The studio page in the browser").
"""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pandas as pd
from gradio.blocks import BlockContext

from studio.ui import build_ui
from studio.ui.context import SentValues


def test_no_event_shows_progress_on_a_container(settings):
    demo = build_ui(settings)
    for fn in demo.fns.values():
        shown = fn.show_progress_on if fn.show_progress_on is not None else fn.outputs
        assert not [b for b in shown if isinstance(b, BlockContext) and b.children], (fn.name, shown)
    # the page load that opens the remembered tab updates the tabs and shows its progress elsewhere
    tabs = [fn for fn in demo.fns.values() if any(isinstance(o, gr.Tabs) for o in fn.outputs)]
    assert tabs and all(fn.show_progress_on for fn in tabs)


def test_the_language_switch_shows_no_progress_and_the_form_loaders_keep_theirs(settings):
    """The language switch relabels ~250 components; shown on them, its statuses stayed in every later status
    change's walk of the page (see the module's docstring), so it points at the one hidden sink. The recipe,
    template, YAML and clone loaders write the form's values and keep the fields as targets: a value typed
    while one lands is not overwritten (an e2e run caught the clone's learning rate overwriting the typed
    one when they pointed at the sink)."""
    demo = build_ui(settings)
    by_name = {fn.name: fn for fn in demo.fns.values()}
    assert [b.elem_id for b in by_name["set_language"].show_progress_on] == ["studio-progress"]
    for name in ("load_recipe", "load_template", "clone_into_form", "import_file", "import_text"):
        shown = by_name[name].show_progress_on or by_name[name].outputs
        assert len(shown) > 20 and "studio-progress" not in {b.elem_id for b in shown}, name
    union = set()
    for fn in demo.fns.values():
        union |= {b._id for b in (fn.show_progress_on if fn.show_progress_on is not None else fn.outputs)}
    assert len(union) <= 220, len(union)  # measured 202 of the 502 blocks (287 before)


def _request(session: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=session)


def test_a_tick_sends_only_what_changed_for_each_session():
    sent = SentValues()
    frame = pd.DataFrame([[1, "a"], [2, "b"]], columns=["id", "name"])
    first = ("run 1", frame, gr.update(value=3, visible=True))
    assert sent.changed(_request("s1"), first) == first  # a session's first tick sends everything
    again = sent.changed(_request("s1"), ("run 1", frame.copy(), gr.update(visible=True, value=3)))
    assert all(v == gr.skip() for v in again)
    # one cell of the table changed: the table alone is sent
    changed = frame.copy()
    changed.loc[1, "name"] = "c"
    out = sent.changed(_request("s1"), ("run 1", changed, gr.update(value=3, visible=True)))
    assert out[0] == gr.skip() and out[1] is changed and out[2] == gr.skip()
    # another browser session has its own record
    assert sent.changed(_request("s2"), first) == first
    # a value the handler skips itself keeps the page's, and the record of it
    assert sent.changed(_request("s1"), (gr.skip(), changed, gr.skip()))[1] == gr.skip()
    assert sent.changed(_request("s1"), ("run 1", changed, gr.update(value=3, visible=True)))[0] == gr.skip()
    # an event other than the tick wrote these outputs: everything is sent again
    sent.forget(_request("s1"))
    assert sent.changed(_request("s1"), ("run 1", changed, 3)) == ("run 1", changed, 3)
    # without a session (a call from Python) nothing is skipped
    assert sent.changed(None, ("run 1",)) == ("run 1",)


def test_the_record_keeps_a_bounded_number_of_sessions():
    sent = SentValues(sessions=2)
    for s in ("a", "b", "c"):
        sent.changed(_request(s), ("x",))
    assert sent.changed(_request("a"), ("x",)) == ("x",)  # the oldest was dropped: sent again
    assert sent.changed(_request("c"), ("x",)) == (gr.skip(),)


def test_the_page_carries_no_api_description_and_its_events_stay_callable(tmp_path):
    """Gradio wrote the schema of every public event into each page it served (`window.gradio_api_info`):
    1.38 MB of a 1.89 MB page. The page now holds no endpoint description and weighs about 0.5 MB (what a
    remote browser downloads at each load; Chromium's CPU per load did not change measurably:
    tools/page_load_cost.py, docs/benchmarks.md); the upload event is still called by its name
    (tests/studio/test_security.py calls it so)."""
    import json
    import re

    from fastapi.testclient import TestClient

    from studio.app import create_app
    from studio.config import Settings
    from studio.migrate import upgrade

    settings = Settings(home=tmp_path / "home")
    upgrade(settings)
    with TestClient(create_app(settings, with_ui=True), base_url="http://127.0.0.1") as client:
        page = client.get("/")
        assert page.status_code == 200
        info = json.loads(re.search(r"window\.gradio_api_info = (.*?);</script>", page.text).group(1))
        assert info["named_endpoints"] == {} == info["unnamed_endpoints"], list(info["named_endpoints"])
        assert len(page.content) < 700_000, len(page.content)  # measured: 513 KB (1.89 MB before)
        posted = client.post("/gradio_api/call/upload_dataset", json={"data": [None, "x", "auto"]})
        assert posted.status_code == 200, posted.text


def test_every_event_that_writes_the_forms_review_waits_in_one_queue(settings):
    """The YAML, the problems and Launch's state are written by the review after an edit, after a clone,
    recipe, template or import, on the tab's opening, on the page's load and after a language switch. Apart,
    a clone's review could finish after the review of an edit typed right after it and leave the YAML of the
    values before the edit (a fresh clone's test_studio flow showed `learning_rate: 0.001` for 30 s after
    0.0001 was typed; with the clone's review slowed by 3 s it does every time, and with this queue never).
    In one queue (limit 1) they finish in the order they were sent, each with the values of its moment."""
    demo = build_ui(settings)
    writers = [fn for fn in demo.fns.values() if any(o.elem_id == "tr-yaml" for o in fn.outputs)]
    # the language switch itself only relabels the page (its follower re-runs the review, in the queue)
    reviews = [fn for fn in writers if fn.name != "set_language"]
    assert len(reviews) >= 10, [fn.name for fn in writers]
    assert {(fn.concurrency_id, fn.concurrency_limit) for fn in reviews} == {("train-review", 1)}, [
        (fn.name, fn.concurrency_id) for fn in reviews
    ]
