"""Reading llama-perplexity's output (a stand-in tool on ERNIE_STUDIO_LLAMACPP_BIN prints what the real one
prints): the final estimate when it is there; when the output ends early with exit 0, as llama-perplexity's
has in the suite, the running estimates it printed, and an export's files compared over common chunks."""

from __future__ import annotations

import stat

import pytest

from engine.train.gguf_export import perplexity_series

HEAD = "perplexity: calculating perplexity over 4 chunks, n_ctx=48, batch_size=48, n_seq=1"


def stand_in(tmp_path, body: str) -> None:
    tool = tmp_path / "bin" / "llama-perplexity"
    tool.parent.mkdir(exist_ok=True)
    tool.write_text(f"#!/bin/sh\necho '{HEAD}' >&2\n{body}\nexit 0\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def llamacpp_bin(tmp_path, monkeypatch):
    monkeypatch.setenv("ERNIE_STUDIO_LLAMACPP_BIN", str(tmp_path / "bin"))
    return tmp_path


def test_the_final_estimate_is_the_last_figure(llamacpp_bin):
    stand_in(
        llamacpp_bin,
        "printf '[1]10.5,[2]11.0,[3]12.0,[4]12.5,\\n'\necho 'Final estimate: PPL = 12.4871 +/- 0.5' >&2",
    )
    assert perplexity_series("m.gguf", "t.txt", 48) == ([10.5, 11.0, 12.0, 12.4871], 4)


def test_output_that_ends_early_keeps_the_estimates_it_printed(llamacpp_bin):
    stand_in(llamacpp_bin, "printf '[1]10.5,[2]11.0,[3]12.0,'")
    assert perplexity_series("m.gguf", "t.txt", 48) == ([10.5, 11.0, 12.0], 4)


def test_a_failed_run_names_its_exit_code(llamacpp_bin):
    stand_in(llamacpp_bin, "echo 'error: failed to load model' >&2; exit 3")
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\)(.|\n)*failed to load model"):
        perplexity_series("m.gguf", "t.txt", 48)
