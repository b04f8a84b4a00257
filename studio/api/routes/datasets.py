"""/api/v1/datasets: upload (multipart `file`, optional `name`, `format`, `data_file`), list, get, preview,
stats, a dataset's files (VL images), delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from studio.api.deps import ID, SessionDep, SettingsDep
from studio.api.served_files import served_file_response
from studio.api.uploads import receive_dataset_upload
from studio.db import session_factory
from studio.schemas import DatasetOut, ErrorOut, PreviewOut
from studio.services import datasets as svc

router = APIRouter(prefix="/datasets", tags=["datasets"])

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": ".jsonl or .json dataset, or a .zip of one such file and the "
                            "images its records name (paths relative to the data file); benchmark files "
                            "(multiple_choice, gsm8k) may also be .csv / .tsv",
                        },
                        "name": {"type": "string", "maxLength": 200},
                        "data_file": {
                            "type": "string",
                            "maxLength": 1024,
                            "description": "zip only: the data file's path inside the archive when it holds "
                            "more than one .jsonl/.json",
                        },
                        "format": {"type": "string", "enum": list(svc.DATASET_FORMATS)},
                    },
                }
            }
        },
    }
}
ERRORS = {
    400: {"model": ErrorOut},
    404: {"model": ErrorOut},
    413: {"model": ErrorOut},
    422: {"model": ErrorOut},
}


@router.post("", status_code=201, response_model=DatasetOut, openapi_extra=UPLOAD_BODY, responses=ERRORS)
async def upload_dataset(request: Request, settings: SettingsDep) -> DatasetOut:
    """Stream the file to disk, detect its format, validate every record and store the dataset."""
    form = await receive_dataset_upload(request, settings)

    def create() -> DatasetOut:
        with session_factory(settings)() as session:
            ds = svc.create_dataset(
                session,
                settings,
                form.staged,
                form.filename,
                name=form.fields.get("name") or None,
                format=form.fields.get("format") or None,
                data_file=form.fields.get("data_file") or None,
            )
            return DatasetOut.model_validate(ds)

    return await run_in_threadpool(create)


@router.get("", response_model=list[DatasetOut])
def list_datasets(session: SessionDep) -> list[DatasetOut]:
    return [DatasetOut.model_validate(d) for d in svc.list_datasets(session)]


@router.get("/{dataset_id}", response_model=DatasetOut, responses=ERRORS)
def get_dataset(dataset_id: ID, session: SessionDep) -> DatasetOut:
    return DatasetOut.model_validate(svc.get_dataset(session, dataset_id))


@router.get("/{dataset_id}/preview", response_model=PreviewOut, responses=ERRORS)
def preview_dataset(
    dataset_id: ID,
    session: SessionDep,
    settings: SettingsDep,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 20,
    render_with: Annotated[
        str | None, Query(max_length=1024, description="model whose chat template renders")
    ] = None,
) -> PreviewOut:
    """A page of raw records read without loading the file; `render_with` adds chat-template spans."""
    return PreviewOut(
        **svc.preview_dataset(session, settings, dataset_id, offset, limit, render_with=render_with)
    )


@router.get("/{dataset_id}/stats", responses=ERRORS)
def dataset_stats(
    dataset_id: ID,
    session: SessionDep,
    settings: SettingsDep,
    model: Annotated[str, Query(max_length=1024)] = "tiny",
    max_seq_len: Annotated[int, Query(ge=16, le=1_048_576)] = 2048,
) -> dict:
    """Token-length histogram and summary with `model`'s tokenizer."""
    return svc.dataset_stats(session, settings, dataset_id, model=model, max_seq_len=max_seq_len)


@router.get(
    "/{dataset_id}/files/{path:path}",
    response_class=FileResponse,
    responses={**ERRORS, 200: {"description": "the file's bytes", "content": {"image/png": {}}}},
)
def dataset_file(
    dataset_id: ID,
    path: Annotated[str, Path(max_length=1024, description="relative to the data file, as in image_url")],
    session: SessionDep,
    settings: SettingsDep,
) -> FileResponse:
    """A file of the dataset, e.g. an image a VL record names; confined to the data file's folder. Only
    previewable images and videos are served inline; anything else is an attachment (served_files.py)."""
    return served_file_response(svc.dataset_file(session, settings, dataset_id, path))


@router.delete("/{dataset_id}", status_code=204, responses=ERRORS)
def delete_dataset(dataset_id: ID, session: SessionDep, settings: SettingsDep) -> Response:
    svc.delete_dataset(session, settings, dataset_id)
    return Response(status_code=204)
