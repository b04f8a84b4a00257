"""The ERNIEKit VL reader (sft_vl records: text_info, image_info, video_info, order) and the media it names:
local and remote images (resolved inside the dataset folder), videos as frame folders or animated images,
probed for their size and frames."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from engine.data import remote
from engine.data.messages import MEDIA
from engine.data.record_types import (
    IMAGE_MARK,
    REMOTE_PREFIXES,
    VIDEO_MARK,
    Conversation,
    Media,
    Turn,
    VideoClip,
    _text_field,
    _type_name,
    _unknown_keys,
)
from engine.data.vl_processor import (
    DEFAULT_MAX_IMAGE_PIXELS,
    FRAME_SUFFIXES,
    MAX_FILE_FRAMES,
    ProcessorSettings,
    VisionInputError,
    image_grid,
    load_image,
    smart_resize,
)

# ERNIEKit's sft_vl records: text_info (mask = prompt, no_mask = answer), image_info and video_info (whose
# entries also name their file "image_url"), and "order" placing texts, images and videos when a record has
# both kinds (PaddleFormers' convert_mm_data requires it then).
VL_KEYS = {"image_info", "video_info", "text_info", "order", "system", "id"}
MEDIA_FIELDS = {"image": "image_info", "video": "video_info"}
MEDIA_MARKS = {"image": IMAGE_MARK, "video": VIDEO_MARK}
ORDER_TYPES = ("text", "image", "video")
# Containers this engine cannot decode: it depends on no video codec (frames or animated images work).
VIDEO_FILE_SUFFIXES = (
    ".mp4",
    ".m4v",
    ".mov",
    ".avi",
    ".mkv",
    ".webm",
    ".flv",
    ".wmv",
    ".mpg",
    ".mpeg",
    ".ts",
    ".3gp",
)


def _local_path(url: str, base_dir: Path | None, what: str) -> tuple[Path | None, str | None]:
    """The path a media reference names inside the dataset directory, or why it cannot be used."""
    if url.startswith(REMOTE_PREFIXES):
        return (
            None,
            f"{what} {url!r} is remote; training reads local files only: save it next to the data file",
        )
    if base_dir is None:  # a record seen without its file (preview): only the path's shape can be checked
        rel = Path(url)
        if rel.is_absolute() or ".." in rel.parts:
            return None, f"{what} path {url!r} escapes the dataset directory; keep {what}s inside it"
        return rel, None
    base = base_dir.resolve()
    p = (base / url).resolve()
    if p != base and base not in p.parents:
        return None, f"{what} path {url!r} escapes the dataset directory {base}; keep {what}s inside it"
    return p, None


def _fetched_image(url: str, base_dir: Path, fetch_urls: bool) -> tuple[Path | None, str | None]:
    """An image named by an http(s) URL: its copy in the dataset directory (``engine.data.remote``), fetched
    now only when ``fetch_urls`` (a training run or the fetch job, never a request or a preview)."""
    if not fetch_urls:
        return remote.cached(url, base_dir.resolve()), None
    try:
        return remote.fetch(url, base_dir.resolve()), None
    except remote.FetchError as e:
        return None, MEDIA("not_fetched", url=url, msg_why=e.message)


def resolve_image(
    url: str, base_dir: Path | None, *, fetch_urls: bool = False, decode: bool = False
) -> tuple[Path | None, str | None]:
    """The local file of an image reference relative to the dataset directory, or the reason it is unusable.

    An http(s) URL is fetched into the directory first when ``fetch_urls``; otherwise its kept copy is used,
    and a URL not fetched yet is passed unchecked (``Path(url)``: the fetch job or the run checks it). The
    header is always read; ``decode`` also decodes the pixels (a truncated file has a good header).
    """
    if url.startswith(("http://", "https://")):
        if base_dir is None:  # a record seen without its file (preview)
            return Path(url), None
        p, why = _fetched_image(url, base_dir, fetch_urls)
        if p is None and why is None:  # not fetched yet
            return Path(url), None
    else:
        p, why = _local_path(url, base_dir, "image")
    if p is None or base_dir is None:
        return p, why
    if not p.is_file():
        return None, f"image {url!r} not found (looked for {p})"
    try:
        image_grid(p)  # header, pixel limit and aspect ratio, as the processor will need them
        if decode:
            load_image(p)
    except VisionInputError as e:
        return None, e.relabelled(MEDIA("image_file", path=str(p)), MEDIA("image_named", url=url))
    return p, None


def resolve_video(url: str, base_dir: Path | None) -> tuple[VideoClip | None, str | None]:
    """The frames of a video reference (a directory of frames or an animated GIF/PNG/WebP inside the dataset
    directory) described from their headers, or the reason it is unusable."""
    p, why = _local_path(url, base_dir, "video")
    if p is None:
        return None, why
    if p.suffix.lower() in VIDEO_FILE_SUFFIXES:
        frames = Path(url).with_suffix("").as_posix()
        return None, (
            f"video {url!r} is a {p.suffix} file, and this engine decodes no video formats: extract its frames "
            f"into a directory (e.g. `ffmpeg -i {url} -vf fps=2 {frames}/%05d.png`) and name that directory "
            f"({frames!r}) in image_url, or convert the clip to an animated GIF/WebP"
        )
    if base_dir is None:
        return VideoClip(p, 0, 0, 0), None  # not inspected: the encoder probes it when it needs the size
    if not p.exists():
        return None, f"video {url!r} not found (looked for {p})"
    try:
        clip = probe_video(p)
    except VisionInputError as e:
        return None, f"video {url!r}: {e}"
    base = base_dir.resolve()
    outside = [f.name for f in video_frame_files(p) if base not in f.resolve().parents] if p.is_dir() else []
    if outside:
        return (
            None,
            f"video {url!r}: frame {outside[0]} links outside the dataset directory; keep frames inside it",
        )
    return clip, None


def video_frame_files(directory: Path) -> list[Path]:
    """The frame images of a frame directory in the order ``read_video_frames`` reads them."""
    return sorted(p for p in directory.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)


def _frame_size(path: Path) -> tuple[int, int]:
    """(width, height) of one frame as ``load_image`` will see it (EXIF rotation applied), from its header."""
    try:
        with Image.open(path) as im:
            width, height = im.size
            if im.getexif().get(0x0112) in (5, 6, 7, 8):  # orientations that turn the frame on its side
                width, height = height, width
    except UnidentifiedImageError:
        raise VisionInputError(f"frame {path.name} is not an image PIL can read") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise VisionInputError(f"frame {path.name} cannot be read ({e})") from None
    return width, height


def _check_canvas(width: int, height: int, max_image_pixels: int) -> None:
    if width * height > max_image_pixels:
        raise VisionInputError(
            f"{width}x{height} pixels ({width * height:,}) is more than "
            f"max_image_pixels={max_image_pixels:,}; downscale the frames first"
        )


def _gif_durations(path: Path) -> list[int]:
    """Each frame's duration in ms, as PIL reports it (``info["duration"]``, 0 without a graphic control
    block), read from a GIF's blocks without decoding a pixel."""
    with open(path, "rb") as f:

        def byte() -> int:
            b = f.read(1)
            if not b:
                raise EOFError("the file ends inside a block")
            return b[0]

        def skip_sub_blocks() -> None:
            while size := byte():
                f.seek(size, 1)

        head = f.read(13)
        if len(head) < 13:
            raise EOFError("the file ends inside the header")
        if head[10] & 0x80:
            f.seek(3 << ((head[10] & 7) + 1), 1)  # global colour table
        durations: list[int] = []
        delay = None
        while (kind := f.read(1)) not in (b"", b";"):
            if kind == b"!":
                label = byte()
                if label == 0xF9:
                    block = f.read(byte())
                    delay = struct.unpack("<H", block[1:3])[0] * 10
                skip_sub_blocks()
            elif kind == b",":
                descriptor = f.read(9)
                if len(descriptor) < 9:
                    raise EOFError("the file ends inside an image descriptor")
                flags = descriptor[8]
                if flags & 0x80:
                    f.seek(3 << ((flags & 7) + 1), 1)  # local colour table
                byte()  # LZW minimum code size
                skip_sub_blocks()
                durations.append(delay or 0)
                delay = None
            else:
                raise VisionInputError(MEDIA("truncated", detail=f"unknown GIF block 0x{kind[0]:02x}"))
    return durations


def _probe_animated(path: Path, max_image_pixels: int) -> VideoClip:
    """Frame count, size and frame rate of an animated image; frame timing as ``read_video_frames`` takes it.

    The canvas size is checked from the header before any frame is counted or seeked to: seeking composes
    each frame on the full canvas, so a tiny file declaring a huge canvas would otherwise allocate it.
    """
    try:
        with Image.open(path) as im:
            width, height = im.size
            _check_canvas(width, height, max_image_pixels)
            count = int(getattr(im, "n_frames", 1))
            if count > MAX_FILE_FRAMES:
                raise VisionInputError(f"more than {MAX_FILE_FRAMES} frames")
            if im.format == "GIF":  # from the blocks: seeking would compose every frame on the canvas
                durations = _gif_durations(path)
                if len(durations) != count:
                    raise VisionInputError(
                        MEDIA("truncated", detail=f"{count} frames but {len(durations)} images")
                    )
            else:
                durations = []
                for index in range(count):
                    im.seek(index)
                    durations.append(im.info.get("duration") or 0)
    except VisionInputError:
        raise
    except UnidentifiedImageError:
        raise VisionInputError(
            "not an image PIL can read; a video is a directory of frames or an animated GIF/PNG/WebP"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error) as e:
        raise VisionInputError(MEDIA("truncated", detail=str(e))) from None
    fps = 1000.0 / (sum(durations) / count) if all(durations) else None
    return VideoClip(path, count, width, height, fps)


def probe_video(path: Path, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> VideoClip:
    """A video's frame count, frame size and frame rate from headers only (no frame is decoded); raises
    ``VisionInputError`` for no frames, frames of different sizes or a size the processor refuses."""
    if path.is_dir():
        files = video_frame_files(path)
        if not files:
            raise VisionInputError(
                f"has no frames: the directory holds no image files ({', '.join(FRAME_SUFFIXES)})"
            )
        width, height = _frame_size(files[0])
        for frame in files[1:]:
            w, h = _frame_size(frame)
            if (w, h) != (width, height):
                raise VisionInputError(
                    f"frame {frame.name} is {w}x{h} pixels but {files[0].name} is {width}x{height}; "
                    "all frames of a video need one size"
                )
        clip = VideoClip(path, len(files), width, height)
    else:
        clip = _probe_animated(path, max_image_pixels)
    _check_canvas(clip.width, clip.height, max_image_pixels)
    s = ProcessorSettings()
    smart_resize(clip.height, clip.width, s.factor, s.video_min_pixels, s.video_max_pixels)  # aspect ratio
    return clip


def _vl_texts(rec: dict, problems: list[str]) -> list[tuple[str, str]] | None:
    """(text, tag) of every text_info entry."""
    texts = rec.get("text_info")
    if not isinstance(texts, list) or not texts:
        problems.append(
            "missing field 'text_info'" if texts is None else "'text_info' must be a non-empty list"
        )
        return None
    parts: list[tuple[str, str]] = []
    for i, t in enumerate(texts):
        if not isinstance(t, dict):
            problems.append(f"text_info[{i}] must be an object with 'text' and 'tag'")
            parts.append(("", "mask"))
            continue
        text, tag = t.get("text"), t.get("tag")
        if not isinstance(text, str):
            problems.append(f"text_info[{i}].text must be a string, got {_type_name(text)}")
        elif not text.strip():
            problems.append(f"text_info[{i}].text is empty")
        elif IMAGE_MARK in text or VIDEO_MARK in text:
            problems.append(
                f"text_info[{i}].text holds U+E000 or U+E001, private-use characters that mark where images "
                "and videos go; remove them"
            )
        if tag not in ("mask", "no_mask"):
            problems.append(
                f"text_info[{i}].tag is {json.dumps(tag)}; use 'mask' (prompt) or 'no_mask' (answer)"
            )
        parts.append((text if isinstance(text, str) else "", tag))
    return parts


def _is_index(value: Any, size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size


def _vl_media(
    rec: dict,
    kind: str,
    parts: list[tuple[str, str]],
    matched: bool,
    base_dir: Path | None,
    problems: list[str],
    fetch_urls: bool = False,
    decode: bool = False,
) -> list[tuple[int, Media] | None]:
    """(matched_text_index, file) of every image_info or video_info entry (None where the entry is unusable);
    ``matched``: the entries are placed by matched_text_index (no ``order``), so it is checked; ``decode``:
    images are decoded, not only their headers read."""
    key = MEDIA_FIELDS[kind]
    infos = rec.get(key)
    if infos is None:
        return []
    if not isinstance(infos, list):
        problems.append(f"'{key}' must be a list, got {_type_name(infos)}")
        return []
    out: list[tuple[int, Media] | None] = []
    for i, info in enumerate(infos):
        out.append(None)
        if not isinstance(info, dict):
            problems.append(f"{key}[{i}] must be an object with 'image_url' and 'matched_text_index'")
            continue
        url, idx = info.get("image_url"), info.get("matched_text_index", 0)
        if not isinstance(url, str) or not url.strip():
            also = " (ERNIEKit names a video's path image_url too)" if kind == "video" else ""
            problems.append(f"{key}[{i}].image_url is missing or empty{also}")
            continue
        if matched and not _is_index(idx, len(parts)):
            problems.append(
                f"{key}[{i}].matched_text_index {json.dumps(idx)} is not an index into text_info (0..{len(parts) - 1})"
            )
            continue
        if kind == "video":
            found, why = resolve_video(url, base_dir)
        else:
            found, why = resolve_image(url, base_dir, fetch_urls=fetch_urls, decode=decode)
        if why:
            problems.append(MEDIA("located", field=f"{key}[{i}]", msg=why))
        else:
            out[-1] = (idx if matched else -1, found)
    return out


def _matched_sequence(media: dict[str, list], n_texts: int) -> list[tuple[str, int]]:
    """ERNIEKit's placement without ``order``: each entry goes right before text_info[matched_text_index]."""
    before: dict[int, list[tuple[str, int]]] = {}
    for kind in ("image", "video"):
        for i, entry in enumerate(media[kind]):
            before.setdefault(entry[0], []).append((kind, i))
    return [item for t in range(n_texts) for item in [*before.get(t, []), ("text", t)]]


def _order_sequence(order: Any, counts: dict[str, int], problems: list[str]) -> list[tuple[str, int]] | None:
    """The (kind, index) sequence an ``order`` object gives, checked to list every entry exactly once."""
    if not (
        isinstance(order, dict)
        and isinstance(order.get("type"), list)
        and isinstance(order.get("index"), list)
    ):
        problems.append(
            '\'order\' must be an object {"type": [...], "index": [...]} listing every text, image and '
            f"video entry in prompt order, got {_type_name(order)}"
        )
        return None
    types, indices = order["type"], order["index"]
    if len(types) != len(indices):
        problems.append(
            f"'order.type' has {len(types)} entries but 'order.index' has {len(indices)}; they pair up one to one"
        )
        return None
    seq: list[tuple[str, int]] = []
    seen: dict[tuple[str, int], int] = {}
    start = len(problems)
    for k, (kind, idx) in enumerate(zip(types, indices, strict=True)):
        if kind not in ORDER_TYPES:
            problems.append(f"order.type[{k}] is {json.dumps(kind)}; use 'text', 'image' or 'video'")
        elif not _is_index(idx, counts[kind]):
            size = f"0..{counts[kind] - 1}" if counts[kind] else "it is empty"
            problems.append(f"order.index[{k}] is {json.dumps(idx)}, not an index into {kind}_info ({size})")
        elif (kind, idx) in seen:
            problems.append(
                f"order lists {kind}_info[{idx}] twice (order positions {seen[(kind, idx)]} and {k})"
            )
        else:
            seen[(kind, idx)] = k
            seq.append((kind, idx))
    missing = [
        f"{kind}_info[{i}]" for kind in ORDER_TYPES for i in range(counts[kind]) if (kind, i) not in seen
    ]
    if missing:
        problems.append(
            f"order leaves out {', '.join(missing)}; it must list every text, image and video once"
        )
    texts = [i for kind, i in seq if kind == "text"]
    if texts != sorted(texts):
        problems.append(
            "order lists the text_info entries out of their order; texts keep their text_info order"
        )
    return None if len(problems) > start else seq


def _vl_sequence(
    rec: dict, media: dict[str, list], n_texts: int, problems: list[str]
) -> list[tuple[str, int]] | None:
    """Texts, images and videos in prompt order: by ``order`` when given, else by matched_text_index."""
    counts = {"text": n_texts, "image": len(media["image"]), "video": len(media["video"])}
    both = counts["image"] > 0 and counts["video"] > 0
    if rec.get("order") is None:
        if both:
            problems.append(
                "missing field 'order': a record with both image_info and video_info needs "
                'order {"type": [...], "index": [...]} listing its texts, images and videos in prompt order'
            )
            return None
        return _matched_sequence(media, n_texts)
    seq = _order_sequence(rec["order"], counts, problems)
    if seq is not None and not both and seq != _matched_sequence(media, n_texts):
        problems.append(
            "'order' places the media differently from their matched_text_index, which ERNIEKit follows when "
            "a record holds only images or only videos; make them agree or drop 'order'"
        )
        return None
    return seq


def _vl_turns(
    parts: list[tuple[str, str]], media: dict[str, list], sequence: list[tuple[str, int]], problems: list[str]
) -> list[Turn]:
    """Turns from the sequence; media ahead of a prompt's text lead it, media after it (before the answer)
    close the prompt, as ERNIEKit concatenates them."""
    turns: list[Turn] = []
    prompt: list[str] = []
    answer: list[str] = []
    fields: list[str] = []
    files: list[Media] = []
    marks, last_media = "", ""
    for kind, i in sequence:
        text, tag = parts[i] if kind == "text" else ("", "mask")
        if answer and tag == "mask":
            turns.append(
                Turn("\n".join(prompt), "\n".join(answer), True, files, answer_field=", ".join(fields))
            )
            prompt, answer, fields, files = [], [], [], []
        if kind != "text":
            marks += MEDIA_MARKS[kind]
            files.append(media[kind][i][1])
            last_media = f"{MEDIA_FIELDS[kind]}[{i}]"
        elif tag == "mask":
            prompt.append(marks + text)
            marks = ""
        else:
            if marks and prompt:
                prompt[-1] += marks
            elif marks:
                prompt.append(marks)
            marks = ""
            answer.append(text)
            fields.append(f"text_info[{i}].text")
    if marks:
        problems.append(f"{last_media} comes after the last answer; images and videos belong to a prompt")
    turns.append(Turn("\n".join(prompt), "\n".join(answer), True, files, answer_field=", ".join(fields)))
    return turns


def _erniekit_vl(
    rec: dict, problems: list[str], base_dir: Path | None, fetch_urls: bool = False, decode: bool = False
) -> Conversation | None:
    _unknown_keys(rec, VL_KEYS, problems)
    system = _text_field(rec, "system", problems, required=False) or None
    parts = _vl_texts(rec, problems)
    if parts is None:
        return None
    lists = [rec.get(MEDIA_FIELDS[k]) for k in ("image", "video")]
    # Without order, or with one kind only (ERNIEKit then ignores order), matched_text_index places them.
    matched = rec.get("order") is None or not all(isinstance(v, list) and v for v in lists)
    media = {
        kind: _vl_media(rec, kind, parts, matched, base_dir, problems, fetch_urls, decode)
        for kind in ("image", "video")
    }
    if problems:
        return None
    if parts[0][1] != "mask":
        problems.append("text_info[0] must be a prompt (tag 'mask'); an answer cannot come first")
    if parts[-1][1] != "no_mask":
        problems.append(
            f"text_info[{len(parts) - 1}] is a prompt with no answer after it (the last tag must be 'no_mask')"
        )
    sequence = None if problems else _vl_sequence(rec, media, len(parts), problems)
    if sequence is None:
        return None
    turns = _vl_turns(parts, media, sequence, problems)
    return None if problems else Conversation(system, turns)
