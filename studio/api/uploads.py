"""Streaming multipart parsing for dataset uploads: the file goes to disk under home as it arrives and the
size limit is enforced on the way, so a 1 GB upload never sits in memory or in /tmp."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header

from studio.config import Settings
from studio.services.datasets import incoming_dir, safe_dataset_upload_name
from studio.services.errors import InvalidInput, PayloadTooLarge

MAX_FIELD_BYTES = 4096
TEXT_FIELDS = ("name", "format", "data_file")


@dataclass
class UploadedForm:
    staged: Path | None = None
    filename: str | None = None
    fields: dict[str, str] = field(default_factory=dict)


async def receive_dataset_upload(request: Request, settings: Settings) -> UploadedForm:
    """Parse `multipart/form-data` with a `file` part and optional `name` / `format` / `data_file` parts."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise InvalidInput("send the dataset as multipart/form-data with the file in the field `file`")
    limit = settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + 1024 * 1024:
        raise PayloadTooLarge(
            f"file: the upload is {int(declared) / 2**20:.0f} MB, over the limit of {settings.max_upload_mb} MB; "
            "split it or raise ERNIE_STUDIO_MAX_UPLOAD_MB"
        )

    form = UploadedForm()
    state: dict = {"headers": {}, "name": None, "field": b"", "out": None, "written": 0, "hname": b""}

    def on_part_begin() -> None:
        state.update(headers={}, name=None, field=b"", out=None, hname=b"")

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["hname"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        key = state["hname"].decode("latin-1").lower()
        state["headers"][key] = state["headers"].get(key, b"") + data[start:end]

    def on_header_end() -> None:
        state["hname"] = b""

    def on_headers_finished() -> None:
        _, disp = parse_options_header(state["headers"].get("content-disposition", b""))
        name = disp.get(b"name", b"").decode("utf-8", "replace")
        state["name"] = name
        if name == "file":
            if form.staged is not None:
                raise InvalidInput("file: send exactly one file per upload")
            raw = disp.get(b"filename")
            filename = raw.decode("utf-8", "replace") if raw is not None else None
            safe = safe_dataset_upload_name(filename)
            form.filename = safe
            form.staged = incoming_dir(settings) / f"{uuid.uuid4().hex}-{safe}"
            state["out"] = open(form.staged, "wb")  # noqa: SIM115 - closed in on_part_end / cleanup

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["out"] is not None:
            state["written"] += end - start
            if state["written"] > limit:
                raise PayloadTooLarge(
                    f"file: {form.filename} is larger than the upload limit of {settings.max_upload_mb} MB; "
                    "split it or raise ERNIE_STUDIO_MAX_UPLOAD_MB"
                )
            state["out"].write(data[start:end])
        elif state["name"] in TEXT_FIELDS:
            state["field"] += data[start:end]
            if len(state["field"]) > MAX_FIELD_BYTES:
                raise InvalidInput(f"{state['name']}: longer than {MAX_FIELD_BYTES} bytes")

    def on_part_end() -> None:
        if state["out"] is not None:
            state["out"].close()
            state["out"] = None
        elif state["name"] in TEXT_FIELDS:
            try:
                form.fields[state["name"]] = state["field"].decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInput(f"{state['name']}: not valid UTF-8") from None

    parser = MultipartParser(
        params[b"boundary"],
        {
            "on_part_begin": on_part_begin,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
        },
    )
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except Exception as e:
        if state["out"] is not None:
            state["out"].close()
        if form.staged is not None:
            form.staged.unlink(missing_ok=True)
        if isinstance(e, InvalidInput | PayloadTooLarge):
            raise
        raise InvalidInput(f"the multipart body could not be parsed: {e}") from None
    if form.staged is None:
        raise InvalidInput("file: missing; send the dataset in the multipart field `file`")
    return form
