"""Evaluation: ``run_eval(EvalConfig)`` scores a model on eval files (``ernie-studio eval``)."""

from typing import TYPE_CHECKING, Any

from engine.eval.config import EvalConfig, eval_config_from_dict, load_eval_config
from engine.eval.items import EvalDataError
from engine.eval.judge import JudgeError

if TYPE_CHECKING:
    from engine.eval.runner import EvalSummary, run_eval

__all__ = [
    "EvalConfig",
    "EvalDataError",
    "EvalSummary",
    "JudgeError",
    "eval_config_from_dict",
    "load_eval_config",
    "run_eval",
]


def __getattr__(name: str) -> Any:
    # The runner (and with it Paddle, ~3 s of CPU) loads on first use: the studio's services read the
    # config's choices through this package and need no Paddle for that.
    if name in ("EvalSummary", "run_eval"):
        from engine.eval import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
