"""Streaming multipart parsing for dataset uploads: the file goes to disk under home as it arrives and the
size limit is enforced on the way, so a 1 GB upload never sits in memory or in /tmp."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header

from studio.config import Settings
from studio.services.datasets import incoming_dir, safe_dataset_upload_name
from studio.services.errors import InvalidInput, PayloadTooLarge
from studio.services.messages import SERVICES

MAX_FIELD_BYTES = 4096
TEXT_FIELDS = ("name", "format", "data_file")
# Headers and the small text fields may come on top of the file itself.
MULTIPART_OVERHEAD = 1024 * 1024


@dataclass
class UploadedForm:
    staged: Path | None = None
    filename: str | None = None
    fields: dict[str, str] = field(default_factory=dict)


async def receive_dataset_upload(request: Request, settings: Settings) -> UploadedForm:
    """Parse `multipart/form-data` with a `file` part and optional `name` / `format` / `data_file` parts."""
    boundary = _boundary(request, settings)
    receiver = FormReceiver(settings)
    parser = MultipartParser(boundary, receiver.callbacks())
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except Exception as e:
        receiver.discard()
        if isinstance(e, InvalidInput | PayloadTooLarge):
            raise
        raise InvalidInput(f"the multipart body could not be parsed: {e}") from None
    if receiver.form.staged is None:
        raise InvalidInput("file: missing; send the dataset in the multipart field `file`")
    return receiver.form


def _boundary(request: Request, settings: Settings) -> bytes:
    """The multipart boundary, after refusing other content types and a declared length over the limit."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise InvalidInput("send the dataset as multipart/form-data with the file in the field `file`")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > settings.max_upload_bytes + MULTIPART_OVERHEAD:
        raise PayloadTooLarge(
            f"file: the upload is {int(declared) / 2**20:.0f} MB, over the limit of {settings.max_upload_mb} MB; "
            "split it or raise ERNIE_STUDIO_MAX_UPLOAD_MB"
        )
    return params[b"boundary"]


class FormReceiver:
    """The parser's callbacks: the `file` part is written to a staged file under home as it arrives (size
    checked on the way), the small text parts are collected, anything else is ignored."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.form = UploadedForm()
        self.written = 0
        self._start_part()

    def _start_part(self) -> None:
        self.headers: dict[str, bytes] = {}
        self.header_name = b""
        self.name: str | None = None
        self.value = b""
        self.out: BinaryIO | None = None

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._start_part,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
        }

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        key = self.header_name.decode("latin-1").lower()
        self.headers[key] = self.headers.get(key, b"") + data[start:end]

    def on_header_end(self) -> None:
        self.header_name = b""

    def on_headers_finished(self) -> None:
        _, disp = parse_options_header(self.headers.get("content-disposition", b""))
        self.name = disp.get(b"name", b"").decode("utf-8", "replace")
        if self.name != "file":
            return
        if self.form.staged is not None:
            raise InvalidInput("file: send exactly one file per upload")
        raw = disp.get(b"filename")
        safe = safe_dataset_upload_name(raw.decode("utf-8", "replace") if raw is not None else None)
        self.form.filename = safe
        self.form.staged = incoming_dir(self.settings) / f"{uuid.uuid4().hex}-{safe}"
        self.out = open(self.form.staged, "wb")  # noqa: SIM115 - closed in on_part_end / discard

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.out is not None:
            self.written += end - start
            if self.written > self.settings.max_upload_bytes:
                raise PayloadTooLarge(
                    SERVICES("upload_too_large", name=self.form.filename, mb=self.settings.max_upload_mb)
                )
            self.out.write(data[start:end])
        elif self.name in TEXT_FIELDS:
            self.value += data[start:end]
            if len(self.value) > MAX_FIELD_BYTES:
                raise InvalidInput(f"{self.name}: longer than {MAX_FIELD_BYTES} bytes")

    def on_part_end(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None
        elif self.name in TEXT_FIELDS:
            try:
                self.form.fields[self.name] = self.value.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInput(f"{self.name}: not valid UTF-8") from None

    def discard(self) -> None:
        """Close and delete a half-received file (the upload failed)."""
        if self.out is not None:
            self.out.close()
        if self.form.staged is not None:
            self.form.staged.unlink(missing_ok=True)
