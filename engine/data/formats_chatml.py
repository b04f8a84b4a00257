"""The chatml (OpenAI messages) reader: messages with roles, tools and tool calls, reasoning, per-message loss
labels, checked into a `Conversation`."""

from __future__ import annotations

import json
from typing import Any

from engine.data.record_types import CHATML_ROLES, Conversation, Turn, _labels, _type_name, _unknown_keys
from engine.tokenizer import (
    split_reasoning,
    tool_calls_text,
    tool_definition,
    tool_list_text,
    tool_response_text,
)

CHATML_KEYS = {"messages", "tools", "label", "id", "source"}


def _tool_definitions(tools: Any, problems: list[str]) -> list[dict] | None:
    """The record's tool list, each an OpenAI-style function (``{"type": "function", "function": {...}}``)."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        problems.append(f"'tools' must be a list of tool definitions (objects), got {_type_name(tools)}")
        return None
    for i, tool in enumerate(tools):
        fn = tool_definition(tool)["function"]
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            problems.append(
                f"tools[{i}] has no function name ({{'type': 'function', 'function': {{'name': ...}}}})"
            )
    return tools or None


def _message_text(content: Any, role: str, where: str, problems: list[str]) -> str | None:
    """A message's text: a string, a list of text parts, or (a tool's result) any JSON value."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(isinstance(p, dict) and p.get("type") == "text" for p in content)
    ):
        texts = [p.get("text") for p in content]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    if role == "tool" and content is not None:
        return json.dumps(content, ensure_ascii=False)  # ERNIEKit's function-call data holds results as JSON
    problems.append(
        f"{where}.content must be a string or a list of text parts ({{'type': 'text', 'text': ...}}), "
        f"got {_type_name(content)}"
    )
    return None


def _tool_calls(calls: Any, where: str, problems: list[str]) -> list[tuple[str, Any]] | None:
    """(name, arguments) of an assistant's tool_calls; arguments written as a JSON string are read as JSON."""
    if not isinstance(calls, list) or not calls:
        problems.append(f"{where}.tool_calls must be a non-empty list of calls, got {_type_name(calls)}")
        return None
    out: list[tuple[str, Any]] = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            problems.append(
                f'{at} must be {{"type": "function", "function": {{"name": ..., "arguments": {{...}}}}}}'
            )
            continue
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                problems.append(f"{at}.function.arguments is a string that is not JSON ({e.msg})")
                continue
        if not isinstance(args, dict):
            problems.append(f"{at}.function.arguments must be an object, got {_type_name(args)}")
            continue
        out.append((fn["name"], args))
    return out if len(out) == len(calls) else None


def _assistant_parts(m: dict, text: str, where: str, problems: list[str]) -> tuple[str | None, str]:
    """(reasoning, answer with its tool calls) of an assistant message."""
    reasoning, answer = split_reasoning(text)
    given = m.get("reasoning_content")
    if given is not None:
        if not isinstance(given, str):
            problems.append(f"{where}.reasoning_content must be a string, got {_type_name(given)}")
        elif reasoning is not None:
            problems.append(f"{where} has both reasoning_content and a <think> block in content; keep one")
        else:
            reasoning = given.strip("\n")
    calls = m.get("tool_calls")
    if calls is not None:
        parsed = _tool_calls(calls, where, problems)
        if parsed:
            # ERNIE's function formatter always opens the calls with a newline ("\n<tool_call>...")
            answer = answer + "\n" + tool_calls_text(parsed)
    return reasoning, answer


def _chatml_labels(rec: dict, n_assistant: int, problems: list[str]) -> list[int] | None:
    """ERNIEKit's per-assistant-message 0/1 loss switches of a chatml record (``label``)."""
    labels = _labels(rec, problems)
    if labels is not None and len(labels) != n_assistant:
        problems.append(f"'label' has {len(labels)} values but there are {n_assistant} assistant messages")
        return None
    return labels


# (index, role, text, reasoning, trained) of one usable chatml message
CleanMessage = tuple[int, str, str, str | None, bool]


def _chatml(rec: dict, problems: list[str]) -> Conversation | None:
    _unknown_keys(rec, CHATML_KEYS, problems)
    msgs = rec.get("messages")
    tools = _tool_definitions(rec.get("tools"), problems)
    if not isinstance(msgs, list):
        problems.append(
            "missing field 'messages'"
            if msgs is None
            else f"'messages' must be a list, got {_type_name(msgs)}"
        )
        return None
    if not msgs:
        problems.append("'messages' is empty")
        return None
    clean = [c for i, m in enumerate(msgs) if (c := _chatml_message(i, m, problems)) is not None]
    labels = _chatml_labels(
        rec, sum(1 for m in msgs if isinstance(m, dict) and m.get("role") == "assistant"), problems
    )
    if problems:
        return None
    if labels is not None:
        answers = iter(labels)
        clean = [
            (i, r, t, rs, bool(next(answers)) and tr if r == "assistant" else tr) for i, r, t, rs, tr in clean
        ]
    system = None
    if clean[0][1] == "system":
        system = clean[0][2]
        clean = clean[1:]
    if tools:
        system = (system + "\n" if system else "") + tool_list_text(tools)
    turns, called = _chatml_turns(clean, problems)
    if problems:
        return None
    thinking = any(t.reasoning is not None for t in turns)
    if thinking:  # ERNIE's Thinking template gives answers without reasoning an empty think block
        for t in turns:
            t.reasoning = "" if t.reasoning is None else t.reasoning
    return Conversation(system, turns, per_turn=thinking or tools is not None or called)


def _chatml_message(i: int, m: Any, problems: list[str]) -> CleanMessage | None:
    """One chatml message checked and split into its parts; None (with the problem noted) if unusable."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        problems.append(f"{where} must be an object with 'role' and 'content', got {_type_name(m)}")
        return None
    role, content = m.get("role"), m.get("content")
    if role not in CHATML_ROLES:
        problems.append(f"{where}.role is {json.dumps(role)}; use one of {', '.join(CHATML_ROLES)}")
        return None
    if m.get("tool_calls") is not None and role != "assistant":
        problems.append(f"{where} is a {role} message with tool_calls; only assistant messages call tools")
        return None
    if content is None and (m.get("tool_calls") or m.get("reasoning_content")):
        content = ""
    text = _message_text(content, role, where, problems)
    if text is None:
        return None
    reasoning = None
    if role == "assistant":
        reasoning, text = _assistant_parts(m, text, where, problems)
    if not text.strip() and not reasoning:
        problems.append(f"{where} ({role}) has empty content")
        return None
    trained = m.get("loss", True)
    if not isinstance(trained, bool):
        problems.append(f"{where}.loss must be true or false, got {json.dumps(trained)}")
        trained = True
    return i, role, text, reasoning, trained


def _chatml_turns(clean: list[CleanMessage], problems: list[str]) -> tuple[list[Turn], bool]:
    """The (prompt, answer) turns of the messages after the system prompt, and whether an assistant
    message called a tool through tool_calls; the order's problems are noted."""
    turns: list[Turn] = []
    prompt: list[str] = []
    called = False
    for i, role, text, reasoning, trained in clean:
        if role == "system":
            problems.append(
                f"messages[{i}] is a system message; only the first message may be the system prompt"
            )
        elif role in ("user", "tool"):
            if role == "tool" and not turns:
                problems.append(f"messages[{i}] is a tool result before any assistant message called a tool")
            prompt.append(text if role == "user" else tool_response_text(text))
        elif not prompt:
            problems.append(
                f"messages[{i}] is an assistant message that does not follow a user message "
                "(roles must alternate user -> assistant)"
            )
        else:
            called = called or "<tool_call>" in text
            turns.append(Turn("\n".join(prompt), text, trained, reasoning=reasoning))
            prompt = []
    if prompt and not problems:
        problems.append(
            "the conversation ends with a user/tool message; the last message must be the assistant's"
        )
    if not turns and not problems:
        problems.append("no assistant message: nothing to learn")
    if turns and not any(t.trained for t in turns) and not problems:
        problems.append("every assistant message has loss false, so the sample has nothing to learn")
    return turns, called
