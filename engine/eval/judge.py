"""LLM as judge through any OpenAI-compatible endpoint (``ernie-studio serve``, a studio deployment, or an
external API) with the official ``openai`` client.

``score``: the judge rates an answer 1-10 against the question and the reference (MT-Bench's single-answer
grading, reply ends in ``Rating: [[N]]``). ``pairwise``: the judge compares two answers and replies ``[[A]]``,
``[[B]]`` or ``[[C]]`` (tie); each pair is asked twice with the answers swapped, and only a verdict both
orders agree on counts (otherwise a tie), which cancels the judge's preference for a position.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

SCORE_PROMPT = """\
Please act as an impartial judge and evaluate the quality of the response provided by an AI assistant to the \
user question displayed below. A reference answer is given; judge how correct and helpful the response is \
compared with it. Be as objective as possible. Begin with a short explanation, then rate the response on a \
scale of 1 to 10 by strictly following this format: "Rating: [[5]]".

[Question]
{question}

[Reference Answer]
{reference}

[The Assistant's Answer]
{answer}"""

PAIRWISE_PROMPT = """\
Please act as an impartial judge and evaluate the responses provided by two AI assistants to the user \
question displayed below. A reference answer is given. Choose the assistant that answers the question \
better. Do not let the order of the responses, their length or the assistants' names influence you. Begin \
with a short explanation, then output your final verdict by strictly following this format: "[[A]]" if \
assistant A is better, "[[B]]" if assistant B is better, and "[[C]]" for a tie.

[Question]
{question}

[Reference Answer]
{reference}

[The Start of Assistant A's Answer]
{answer_a}
[The End of Assistant A's Answer]

[The Start of Assistant B's Answer]
{answer_b}
[The End of Assistant B's Answer]"""

_RATING = re.compile(r"\[\[\s*(\d+(?:\.\d+)?)\s*\]\]")
_VERDICT = re.compile(r"\[\[\s*([ABC])\s*\]\]")
THREADS = 8


class JudgeError(RuntimeError):
    """The judge endpoint cannot be used; the message names the config key (and its line) to fix."""


@dataclass
class JudgeSettings:
    url: str
    model: str
    api_key: str
    timeout: float
    max_tokens: int = 512
    where: str = "judge_url"  # the config key's "file:line"
    key_note: str = ""  # why no key was sent, told when the judge refuses


# The operator's keys (the worker's environment) and the judge endpoints they may be sent to. The eval's own
# key (judge_api_key, or the studio's ERNIE_STUDIO_EVAL_JUDGE_API_KEY for one eval) goes to its judge_url.
OPERATOR_KEY_VARS = ("ERNIE_STUDIO_JUDGE_API_KEY", "OPENAI_API_KEY")
OPERATOR_URLS_VAR = "ERNIE_STUDIO_JUDGE_URLS"
EVAL_KEY_VAR = "ERNIE_STUDIO_EVAL_JUDGE_API_KEY"
NO_KEY = "none"  # what the openai client sends when there is no key (ernie-studio serve needs none)


def endpoint_id(url: str) -> tuple[str, str, int | None, str]:
    """An endpoint as compared with the operator's list: scheme, host, port (default filled in), path."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = None
    scheme = parts.scheme.lower()
    port = port if port is not None else {"http": 80, "https": 443}.get(scheme)
    return scheme, (parts.hostname or "").lower().rstrip("."), port, parts.path.rstrip("/")


def operator_urls() -> list[str]:
    """``ERNIE_STUDIO_JUDGE_URLS``: the comma-separated judge endpoints the operator's key may go to."""
    return [u.strip() for u in os.environ.get(OPERATOR_URLS_VAR, "").split(",") if u.strip()]


def api_key(configured: str, url: str) -> tuple[str, str]:
    """The key to send to the judge at ``url``, and (when one is withheld) why.

    The eval's own key goes to its judge_url. The operator's key (ERNIE_STUDIO_JUDGE_API_KEY, else
    OPENAI_API_KEY) goes only to an endpoint listed in ERNIE_STUDIO_JUDGE_URLS: a judge_url comes with the
    eval request, and the worker's key must not follow it to a server the requester chose.
    """
    own = configured or os.environ.get(EVAL_KEY_VAR, "")
    if own:
        return own, ""
    operator = next((os.environ[v] for v in OPERATOR_KEY_VARS if os.environ.get(v)), "")
    if not operator:
        return NO_KEY, ""
    if endpoint_id(url) in {endpoint_id(u) for u in operator_urls()}:
        return operator, ""
    var = next(v for v in OPERATOR_KEY_VARS if os.environ.get(v))
    return NO_KEY, (
        f"the worker's {var} was not sent: it goes only to the judge endpoints the operator lists in "
        f"{OPERATOR_URLS_VAR}, and {url} is not one of them; give judge_api_key with this judge_url"
    )


def parse_rating(text: str) -> float | None:
    m = _RATING.findall(text)
    if not m:
        return None
    value = float(m[-1])
    return value if 1 <= value <= 10 else None


def parse_verdict(text: str) -> str | None:
    m = _VERDICT.findall(text)
    return m[-1] if m else None


def combine(first: str | None, second: str | None) -> float | None:
    """Win (1), tie (0.5) or loss (0) of the prediction from the verdicts of (prediction as A, as B).

    ``second`` was asked with the answers swapped, so its B means the prediction. A verdict missing in either
    order gives None (not counted); orders that disagree give a tie."""
    if first is None or second is None:
        return None
    mine = {"A": 1.0, "B": 0.0, "C": 0.5}[first], {"B": 1.0, "A": 0.0, "C": 0.5}[second]
    if mine[0] == mine[1]:
        return mine[0]
    if 0.5 in mine:  # one order prefers an answer, the other calls it a tie: lean half way
        return sum(mine) / 2
    return 0.5  # each order preferred the answer in its first (or second) place: position bias, a tie


class Judge:
    def __init__(self, settings: JudgeSettings):
        from openai import OpenAI

        self.settings = settings
        self.client = OpenAI(
            base_url=settings.url, api_key=settings.api_key, timeout=settings.timeout, max_retries=2
        )

    def check(self) -> None:
        """Fail before any model time is spent when the endpoint does not answer."""
        import openai

        try:
            self.client.with_options(timeout=min(self.settings.timeout, 10.0), max_retries=0).models.list()
        except openai.APIConnectionError as e:
            raise JudgeError(
                f"{self.settings.where}: the judge at {self.settings.url} does not answer ({_cause(e)}); start it "
                "(ernie-studio serve --model DIR) or fix judge_url"
            ) from e
        except openai.APIStatusError as e:
            raise JudgeError(
                f"{self.settings.where}: the judge at {self.settings.url} refused GET /models with HTTP "
                f"{e.status_code}: {_short(e.message)}; "
                + (self.settings.key_note or "check judge_url and judge_api_key")
            ) from e

    def ask(self, prompt: str) -> str:
        import openai

        try:
            reply = self.client.chat.completions.create(
                model=self.settings.model,
                messages=[{"role": "user", "content": prompt}],
                temperature=0.0,
                max_tokens=self.settings.max_tokens,
            )
        except openai.APIConnectionError as e:
            raise JudgeError(
                f"{self.settings.where}: the judge at {self.settings.url} stopped answering ({_cause(e)}); "
                "samples scored so far are kept, run the same command again to continue"
            ) from e
        except openai.APIStatusError as e:
            raise JudgeError(
                f"{self.settings.where}: the judge refused a request with HTTP {e.status_code}: {_short(e.message)}"
            ) from e
        return reply.choices[0].message.content or ""

    def score_all(self, cases: list[dict[str, str]]) -> list[dict[str, Any]]:
        """cases: {question, reference, answer} -> {judge, judge_raw}."""
        prompts = [SCORE_PROMPT.format(**c) for c in cases]
        replies = self._ask_all(prompts)
        return [{"judge": parse_rating(r), "judge_raw": r} for r in replies]

    def compare_all(self, cases: list[dict[str, str]]) -> list[dict[str, Any]]:
        """cases: {question, reference, answer, baseline} -> {judge (win rate share), verdicts, orders, raw}."""
        prompts = []
        for c in cases:
            common = {"question": c["question"], "reference": c["reference"]}
            prompts.append(PAIRWISE_PROMPT.format(**common, answer_a=c["answer"], answer_b=c["baseline"]))
            prompts.append(PAIRWISE_PROMPT.format(**common, answer_a=c["baseline"], answer_b=c["answer"]))
        replies = self._ask_all(prompts)
        out = []
        for i in range(len(cases)):
            first, second = replies[2 * i], replies[2 * i + 1]
            verdicts = [parse_verdict(first), parse_verdict(second)]
            out.append(
                {
                    "judge": combine(*verdicts),
                    "judge_orders": [["prediction", "baseline"], ["baseline", "prediction"]],
                    "judge_verdicts": verdicts,
                    "judge_raw": [first, second],
                }
            )
        return out

    def _ask_all(self, prompts: list[str]) -> list[str]:
        with ThreadPoolExecutor(max_workers=THREADS) as pool:
            return list(pool.map(self.ask, prompts))


def _cause(e: Exception) -> str:
    inner = e.__cause__ or e.__context__
    return _short(str(inner or e))


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 200 else text[:200] + "..."
