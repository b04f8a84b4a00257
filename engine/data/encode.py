"""Examples -> token ids and aligned labels with the ERNIE chat template; truncation; preview spans.

The token stream of a conversation is ``[cls] system\\n User: q1\\nAssistant: `` | ``a1<sep>`` |
``User: q2\\nAssistant: `` | ``a2<sep>`` ... where every piece between special tokens is tokenized as
the tokenizer would tokenize the whole rendered prompt, so a final turn sees exactly the ids it will
see at inference. Loss covers the answers and their closing ``<|end_of_sentence|>``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.formats import parse_record
from engine.data.formats_vl import probe_video
from engine.data.record_types import (
    IMAGE_MARK,
    VIDEO_MARK,
    Conversation,
    Example,
    Media,
    PlainText,
    Preference,
    RecordError,
    Turn,
    VideoClip,
)
from engine.data.vl_processor import ProcessorSettings, image_grid, smart_resize
from engine.data.vl_video import sample_frame_indices
from engine.models.config import VisionConfig
from engine.models.positions import grid_tokens
from engine.tokenizer import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    ErnieTokenizer,
    picture_text,
    think_text,
    video_text,
)

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
# Encoded datasets stay in memory for the whole run: int32 halves that; batches are int64.
TOKEN_DTYPE = np.int32
_MEDIA_MARKS = re.compile(f"([{IMAGE_MARK}{VIDEO_MARK}])")


@dataclass
class EncodedSample:
    """One training sequence: ids, aligned labels (-100 = no loss) and the images and videos its prompts
    refer to, in the order their placeholder runs appear."""

    input_ids: np.ndarray
    labels: np.ndarray
    media: list[Media] = field(default_factory=list)
    num_turns: int = 1
    dropped_turns: int = 0
    truncated: bool = False
    full_length: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class EncodedPair:
    """A DPO pair; both sequences start with the same prompt ids."""

    chosen: EncodedSample
    rejected: EncodedSample
    prompt_length: int

    def __len__(self) -> int:
        return max(len(self.chosen), len(self.rejected))


def aligned_labels(ids: list[int], trained: list[bool]) -> np.ndarray:
    """label[t] = ids[t+1] where token t+1 is trained, else -100 (the model does not shift)."""
    labels = np.full(len(ids), IGNORE_INDEX, dtype=TOKEN_DTYPE)
    if len(ids) > 1:
        nxt = np.asarray(ids[1:], dtype=TOKEN_DTYPE)
        mask = np.asarray(trained[1:], dtype=bool)
        labels[:-1] = np.where(mask, nxt, IGNORE_INDEX)
    return labels


def video_frame_rate(clip: VideoClip, settings: ProcessorSettings) -> float | None:
    """The frame rate a video is sampled at: an animated file's own; a frame directory counts as extracted at
    the processor's ``video_fps`` (as ``ffmpeg -vf fps=N`` writes them), so all its frames are kept."""
    return clip.fps or settings.video_fps


def video_grid(clip: VideoClip, settings: ProcessorSettings) -> tuple[int, int, int]:
    """The (t, h, w) patch grid ``preprocess_video`` gives a clip, from its frame count and frame size alone:
    the frames the processor samples, padded to whole temporal patches, resized within the video pixel bounds."""
    s = settings
    frames = len(sample_frame_indices(clip.num_frames, s, video_frame_rate(clip, s)))
    frames += -frames % s.video_temporal_patch_size
    height, width = smart_resize(clip.height, clip.width, s.factor, s.video_min_pixels, s.video_max_pixels)
    return frames, height // s.patch_size, width // s.patch_size


def media_token_count(item: Media, settings: ProcessorSettings) -> int:
    """Placeholder tokens of one image or video (a video merges pairs of frames into one token each)."""
    grid = video_grid(item, settings) if isinstance(item, VideoClip) else image_grid(item, settings)
    return grid_tokens(grid, settings.merge_size, settings.video_temporal_patch_size)


def media_counts(turn: Turn) -> tuple[int, int]:
    """(pictures, videos) of a turn's prompt."""
    videos = sum(isinstance(m, VideoClip) for m in turn.media)
    return len(turn.media) - videos, videos


class SampleEncoder:
    """Encodes parsed examples for one stage at one ``max_seq_len``."""

    def __init__(
        self,
        tokenizer: ErnieTokenizer,
        max_seq_len: int,
        vision_config: VisionConfig | None = None,
        max_prompt_len: int | None = None,
        vision: ProcessorSettings | None = None,
    ):
        if max_seq_len < 8:
            raise ValueError(f"max_seq_len must be at least 8, got {max_seq_len}")
        self.tok = tokenizer
        self.max_seq_len = max_seq_len
        self.max_prompt_len = max_prompt_len
        self.vision_config = vision_config
        self.vision = vision or ProcessorSettings.from_vision_config(vision_config)
        self.cls_id = tokenizer.convert_tokens_to_ids(tokenizer.cls_token)
        self.sep_id = tokenizer.sep_token_id
        # Baidu's own tokenizers have no video placeholder: their models read video patches at the image
        # placeholder's id (config.video_token_id == im_patch_id).
        self.video_placeholder = (
            VIDEO_PLACEHOLDER if VIDEO_PLACEHOLDER in tokenizer.added_tokens else IMAGE_PLACEHOLDER
        )
        self._probed: dict[VideoClip, VideoClip] = {}
        self._media_tokens: dict[Media, int] = {}

    # ---- text pieces ------------------------------------------------------------------------------
    def probed(self, item: Media) -> Media:
        """A video read from its headers when its record was parsed without its directory (else as it is)."""
        if not isinstance(item, VideoClip) or item.num_frames:
            return item
        if item not in self._probed:
            self._probed[item] = probe_video(item.path, self.vision.max_image_pixels)
        return self._probed[item]

    def media_tokens(self, item: Media) -> int:
        """Decoder tokens of one image or video, from headers (the pixels are read when a batch is built)."""
        if item not in self._media_tokens:
            self._media_tokens[item] = media_token_count(self.probed(item), self.vision)
        return self._media_tokens[item]

    def expand_media(
        self, text: str, media: list[Media], first_picture: int = 1, first_video: int = 1
    ) -> str:
        """Each image mark becomes ``Picture N:<|IMAGE_START|>`` + one placeholder per image token +
        ``<|IMAGE_END|>``, each video mark ``Video N:<|VIDEO_START|>`` + its placeholders + ``<|VIDEO_END|>``;
        pictures and videos are numbered apart, from ``first_*``, as the official chat template numbers them."""
        if not media:  # text of a record without media keeps any private-use characters it has
            return text
        pieces = _MEDIA_MARKS.split(text)
        out = [pieces[0]]
        numbers = {IMAGE_MARK: first_picture, VIDEO_MARK: first_video}
        for mark, item, rest in zip(pieces[1::2], media, pieces[2::2], strict=True):
            n, numbers[mark] = numbers[mark], numbers[mark] + 1
            if mark == IMAGE_MARK:
                run = picture_text(n, IMAGE_PLACEHOLDER * self.media_tokens(item))
            else:
                run = video_text(n, self.video_placeholder * self.media_tokens(item))
            out.append(run + rest)
        return "".join(out)

    def head_text(self, system: str | None) -> str:
        return self.tok.cls_token + (system + "\n" if system else "")

    def prompt_text(self, turn: Turn, first_picture: int = 1, first_video: int = 1) -> str:
        return (
            "User: " + self.expand_media(turn.user, turn.media, first_picture, first_video) + "\nAssistant: "
        )

    def answer_text(self, answer: str) -> str:
        return answer + self.tok.sep_token

    def reply_text(self, turn: Turn) -> str:
        """An assistant turn: its reasoning block (when it has one), the answer and ``<|end_of_sentence|>``."""
        return reply_text(turn, self.tok.sep_token)

    def reply_ids(self, turn: Turn) -> list[int]:
        return self.tok.encode(self.reply_text(turn))

    # ---- conversations ----------------------------------------------------------------------------
    def _turn_ids(self, system: str | None, turns: list[Turn], first: int) -> list[tuple[list[int], bool]]:
        pieces: list[tuple[list[int], bool]] = []
        for i, turn in enumerate(turns[first:]):
            head = self.head_text(system) if i == 0 else ""
            pieces.append((self.tok.encode(head + self.prompt_text(turn)), False))
            pieces.append((self.tok.encode(self.answer_text(turn.assistant)), turn.trained))
        return pieces

    def encode_conversation(self, conv: Conversation) -> EncodedSample | None:
        """Ids and labels; overlong conversations lose their oldest turns first, then get cut at the end."""
        n = len(conv.turns)
        # Pictures and videos are numbered through the conversation, as the official template numbers them.
        counts = np.asarray([(1, 1)] + [media_counts(t) for t in conv.turns])
        numbers = np.cumsum(counts, axis=0).tolist()
        prompts = [self.tok.encode(self.prompt_text(t, *numbers[i])) for i, t in enumerate(conv.turns)]
        answers = [self.reply_ids(t) for t in conv.turns]
        sizes = [len(p) + len(a) for p, a in zip(prompts, answers, strict=True)]

        def lead(first: int) -> list[int]:
            # The head shares its piece of text with the first kept prompt (no special token between them),
            # so the two are tokenized together: apart, they may take a token more or less.
            return self.tok.encode(
                self.head_text(conv.system) + self.prompt_text(conv.turns[first], *numbers[first])
            )

        def kept_length(first: int) -> int:
            return len(lead(first)) + len(answers[first]) + sum(sizes[first + 1 :])

        full = kept_length(0)
        first = 0
        # Keep dropping while too long and a later turn that trains is left.
        while first < n - 1 and kept_length(first) > self.max_seq_len:
            if not any(t.trained for t in conv.turns[first + 1 :]):
                break
            first += 1
        ids: list[int] = lead(first)
        trained: list[bool] = [False] * len(ids)
        for i in range(first, n):
            if i > first:
                ids.extend(prompts[i])
                trained.extend([False] * len(prompts[i]))
            ids.extend(answers[i])
            trained.extend([conv.turns[i].trained] * len(answers[i]))
        media = [self.probed(m) for turn in conv.turns[first:] for m in turn.media]
        truncated = len(ids) > self.max_seq_len
        if truncated:
            if media:
                return None  # cutting through placeholders would break the image / token pairing
            ids, trained = ids[: self.max_seq_len], trained[: self.max_seq_len]
        labels = aligned_labels(ids, trained)
        if not (labels != IGNORE_INDEX).any():
            return None
        return EncodedSample(
            input_ids=np.asarray(ids, dtype=TOKEN_DTYPE),
            labels=labels,
            media=media,
            num_turns=n - first,
            dropped_turns=first,
            truncated=truncated,
            full_length=full,
        )

    def encode_preference(self, pref: Preference) -> EncodedPair | None:
        """Chosen and rejected sequences sharing one prompt; history turns are dropped oldest first."""
        last = Turn(pref.prompt, "")
        chosen = self.tok.encode(self.answer_text(pref.chosen))
        rejected = self.tok.encode(self.answer_text(pref.rejected))
        longest = max(len(chosen), len(rejected))
        history = list(pref.history)
        full = 0
        while True:
            pieces = self._turn_ids(pref.system, [*history, last], 0)[:-1]  # all but the empty last answer
            prompt = [i for piece, _ in pieces for i in piece]
            full = full or len(prompt) + longest
            if len(prompt) + longest <= self.max_seq_len or not history:
                break
            history.pop(0)
        dropped = len(pref.history) - len(history)
        # The prompt keeps what the longest answer leaves, but at most max_prompt_len and never so much that
        # an answer gets less than half the window.
        budget = self.max_seq_len - min(longest, self.max_seq_len // 2)
        if self.max_prompt_len:
            budget = min(budget, self.max_prompt_len)
        truncated = len(prompt) + longest > self.max_seq_len
        if truncated and len(prompt) > budget:
            prompt = [prompt[0], *prompt[len(prompt) - budget + 1 :]]  # keep cls, cut the oldest prompt text
        room = self.max_seq_len - len(prompt)
        if room < 2:
            return None
        pair = []
        for resp in (chosen, rejected):
            resp = resp[:room]
            ids = prompt + resp
            labels = aligned_labels(ids, [False] * len(prompt) + [True] * len(resp))
            pair.append(
                EncodedSample(
                    np.asarray(ids, dtype=TOKEN_DTYPE),
                    labels,
                    num_turns=len(history) + 1,
                    dropped_turns=dropped,
                    truncated=truncated,
                    full_length=full,
                )
            )
        return EncodedPair(pair[0], pair[1], len(prompt))

    def encode_text(self, text: PlainText) -> list[EncodedSample]:
        """Pretraining text: loss on every token; long documents become several max_seq_len windows."""
        ids = [self.cls_id, *self.tok.encode(text.text), self.sep_id]
        out = []
        step = self.max_seq_len
        for start in range(0, len(ids), step):
            chunk = ids[start : start + step]
            if len(chunk) < 2:
                break
            out.append(
                EncodedSample(
                    np.asarray(chunk, dtype=TOKEN_DTYPE),
                    aligned_labels(chunk, [True] * len(chunk)),
                    truncated=len(ids) > step,
                    full_length=len(ids),
                )
            )
        return out

    def encode(self, example: Example) -> list[EncodedSample | EncodedPair]:
        """Zero or more training items of one example (zero when nothing trainable fits)."""
        if isinstance(example, PlainText):
            return list(self.encode_text(example))
        if isinstance(example, Preference):
            pair = self.encode_preference(example)
            return [pair] if pair is not None else []
        samples = [self.encode_conversation(c) for c in turn_samples(example)]
        return [s for s in samples if s is not None]


def reply_text(turn: Turn, sep_token: str) -> str:
    """An assistant turn as the template writes it: reasoning block, answer (with its tool calls), separator."""
    head = think_text(turn.reasoning) if turn.reasoning is not None else ""
    return head + turn.assistant + sep_token


def turn_samples(conv: Conversation) -> list[Conversation]:
    """The conversations a record trains as: itself, or (``per_turn``) one per trained assistant turn, each
    ending at that turn with the earlier turns untrained and without their reasoning, as ERNIEKit's
    function-call reader and its ``split_multi_turn`` thinking data do."""
    if not conv.per_turn:
        return [conv]
    out = []
    for k, turn in enumerate(conv.turns):
        if turn.trained:
            history = [replace(t, trained=False, reasoning=None) for t in conv.turns[:k]]
            out.append(Conversation(conv.system, [*history, turn]))
    return out


# ---- preview -----------------------------------------------------------------------------------------
def media_preview(item: Media, number: int) -> str:
    """How a preview shows one image or video: the template's numbered run with a note in place of the
    placeholders (processed size and token count under the default processor settings)."""
    s = ProcessorSettings()
    video = isinstance(item, VideoClip)
    kind, name = ("video", item.path.name) if isinstance(item, VideoClip) else ("image", item.name)
    try:
        if isinstance(item, VideoClip):
            item = item if item.num_frames else probe_video(item.path)
            _, h, w = video_grid(item, s)
            size = f"{item.num_frames} frames, {w * s.patch_size}x{h * s.patch_size}"
        else:
            _, h, w = image_grid(item, s)
            size = f"{w * s.patch_size}x{h * s.patch_size}"
        note = f"[{kind} {name}: {size}, {media_token_count(item, s)} tokens]"
    except (OSError, ValueError):
        note = f"[{kind} {name}]"
    return video_text(number, note) if video else picture_text(number, note)


def render_record(
    record: dict[str, Any],
    format: str,
    kind: str,
    tokenizer: ErnieTokenizer | None = None,
    base_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """The chat-template text of a raw record as spans ``{"text", "trained"}`` (DPO answers add ``"label"``).

    A record that cannot be used becomes one span ``{"text", "trained": False, "error": True}`` that lists
    its problems, so a preview page can show it in place.
    """
    if isinstance(record, dict) and "__error__" in record:
        return [{"text": str(record["__error__"]), "trained": False, "error": True}]
    try:
        ex = parse_record(record, format, kind, Path(base_dir) if base_dir else None)
    except RecordError as e:
        return [{"text": "; ".join(e.problems), "trained": False, "error": True}]
    cls_token = tokenizer.cls_token if tokenizer is not None else "<|begin_of_sentence|>"
    sep_token = tokenizer.sep_token if tokenizer is not None else "<|end_of_sentence|>"
    spans: list[dict[str, Any]] = []

    def add(text: str, trained: bool, **extra: Any) -> None:
        if spans and spans[-1]["trained"] == trained and not extra and len(spans[-1]) == 2:
            spans[-1]["text"] += text
        else:
            spans.append({"text": text, "trained": trained, **extra})

    numbers = {IMAGE_MARK: iter(range(1, 10**6)), VIDEO_MARK: iter(range(1, 10**6))}

    def user(turn: Turn) -> str:
        text = turn.user
        for item in turn.media:
            mark = VIDEO_MARK if isinstance(item, VideoClip) else IMAGE_MARK
            text = text.replace(mark, media_preview(item, next(numbers[mark])), 1)
        return "User: " + text + "\nAssistant: "

    if isinstance(ex, PlainText):
        return [{"text": cls_token + ex.text + sep_token, "trained": True}]
    head = cls_token + (ex.system + "\n" if ex.system else "")
    add(head, False)
    if isinstance(ex, Preference):
        for turn in ex.history:
            add(user(turn) + turn.assistant + sep_token, False)
        add(user(Turn(ex.prompt, "")), False)
        add(ex.chosen + sep_token, True, label="chosen")
        add(ex.rejected + sep_token, True, label="rejected")
        return spans
    # A per-turn conversation shows every turn with its reasoning: each trains so, in its own sample.
    for turn in ex.turns:
        add(user(turn), False)
        add(reply_text(turn, sep_token), turn.trained)
    return spans
