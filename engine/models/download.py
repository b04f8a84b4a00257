"""``ernie-studio download``: an official ERNIE 4.5 checkpoint (or any hub model repo) into a model directory.

Files come through the hub's own client, ``huggingface_hub``: ``HF_ENDPOINT`` names a mirror, ``HF_TOKEN`` a
token, a dropped connection is taken up again with a Range request, and Xet-stored files go through
``hf_xet``. They land in a staging directory, ``<parent of out>/.downloading/<name>``, and move to ``out``
only once every file has the size and checksum the hub lists for it (sha256 for LFS files, the git blob id
for the others) and the directory reads as an ERNIE 4.5 model. A failed or interrupted download never leaves
a directory that looks like a model, and running the command again keeps the files already verified.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from engine.models.presets import HUB_IDS, TINY_PRESETS

if TYPE_CHECKING:
    from huggingface_hub import HfApi

log = logging.getLogger(__name__)

SOURCES = ("huggingface", "aistudio")
STAGING_DIR = ".downloading"
# What huggingface_hub keeps inside a local_dir to skip finished files on a rerun; not part of the model.
HUB_BOOKKEEPING = Path(".cache") / "huggingface"
ERNIE_MODEL_TYPE_PREFIX = "ernie4_5"


class DownloadError(RuntimeError):
    """A download that failed or did not verify; the message says what, where and what to do next."""


@dataclass(frozen=True)
class HubFile:
    """One file of a hub repo at a commit, as the hub lists it."""

    path: str
    size: int | None
    sha256: str | None  # LFS files: sha256 of the content
    blob_id: str | None  # git blob id: the git sha1 of the content for files kept in git itself


@dataclass(frozen=True)
class Downloaded:
    path: Path
    repo_id: str
    commit: str
    files: list[HubFile]


# A hub repo id's owner and name (huggingface_hub's validate_repo_id); the name becomes a directory name.
HUB_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")


def resolve_name(name: str) -> tuple[str, str]:
    """(hub repo id, directory name) for an official preset (``ernie-4.5-0.3b``) or a hub repo id."""
    key = name.strip().lower()
    if key in HUB_IDS:
        return HUB_IDS[key], key
    for preset, repo_id in HUB_IDS.items():
        if key == repo_id.lower():
            return repo_id, preset
    if key in TINY_PRESETS:
        raise ValueError(
            f"{name} is a small random model built on this machine, not downloaded: "
            f"ernie-studio init-model --preset {key} --out DIR"
        )
    owner, _, repo = name.strip().partition("/")
    if owner and repo and "/" not in repo:
        for part in (owner, repo):
            if not HUB_NAME.fullmatch(part) or ".." in part or "--" in part:
                raise ValueError(
                    f"{name!r} is not a hub repo id: {part!r} must be 1-96 letters, digits, '-', '_' or '.', "
                    "not starting or ending with '-' or '.' and without '--' or '..' (the hub's rule)"
                )
        return name.strip(), repo  # the repo part names the directory under models/: checked above
    raise ValueError(
        f"unknown model {name!r}: name an official preset ({', '.join(HUB_IDS)}) "
        "or a hub repo id such as baidu/ERNIE-4.5-0.3B-PT"
    )


def default_out_dir(dir_name: str) -> Path:
    """``$ERNIE_STUDIO_HOME/models/<name>`` (where the studio looks for models) when set, else
    ``./models/<name>``."""
    home = os.environ.get("ERNIE_STUDIO_HOME", "").strip()
    return (Path(home).expanduser() / "models" if home else Path("models")) / dir_name


def download_model(
    name: str,
    out: str | Path | None = None,
    source: str = "huggingface",
    revision: str = "main",
    endpoint: str | None = None,
) -> Downloaded:
    """Download, verify and check a model repo into ``out``; ``endpoint`` defaults to ``HF_ENDPOINT``."""
    if source == "aistudio":
        raise ValueError(
            "--source aistudio is not supported yet: AI Studio is not a Hugging Face compatible hub, and its "
            "own client (aistudio-sdk) is not a dependency of ERNIE Studio. Use --source huggingface (set "
            "HF_ENDPOINT to use a mirror), or download from AI Studio yourself and point at that directory"
        )
    if source != "huggingface":
        raise ValueError(f"unknown --source {source!r}; choose one of: {', '.join(SOURCES)}")
    repo_id, dir_name = resolve_name(name)
    out = Path(out or default_out_dir(dir_name)).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: already exists and is not empty; remove it or choose another --out")
    staging = out.parent / STAGING_DIR / out.name

    from huggingface_hub import HfApi, constants

    import engine

    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, library_name="ernie-studio", library_version=engine.__version__)
    with _hub_errors(endpoint, repo_id, revision, out, staging):
        commit, files = list_hub_files(api, repo_id, revision)
    log.info(
        "%s at %s: %d files, %s", repo_id, commit, len(files), _readable_size(sum(f.size or 0 for f in files))
    )
    staging.mkdir(parents=True, exist_ok=True)
    total = sum(f.size or 0 for f in files)
    status = progress_file(out)
    status.write_text(
        json.dumps({"repo_id": repo_id, "commit": commit, "bytes_total": total}), encoding="utf-8"
    )
    with _hub_errors(endpoint, repo_id, revision, out, staging):
        _fetch(repo_id, commit, staging, endpoint)
    problems = verify_files(staging, files)
    if problems:
        raise DownloadError(
            f"{repo_id} at {commit} did not verify: {'; '.join(problems)}. Run the command again to fetch "
            f"the missing files anew (the verified ones stay in {staging})"
        )
    check_model_dir(staging, repo_id)
    status.unlink(missing_ok=True)
    _publish(staging, out, files)
    return Downloaded(out, repo_id, commit, files)


def progress_file(out: Path) -> Path:
    """Where a download into ``out`` that is under way says what it fetches (repo, commit, total bytes)."""
    return out.parent / STAGING_DIR / f"{out.name}.json"


@dataclass(frozen=True)
class Progress:
    repo_id: str | None
    commit: str | None
    bytes_done: int
    bytes_total: int | None


def download_progress(out: str | Path) -> Progress:
    """How far a download into ``out`` has come: the bytes in its staging directory (finished files and the
    hub client's partial ones) against the total the hub listed (None until the listing is in)."""
    out = Path(out)
    try:
        info = json.loads(progress_file(out).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = {}
    staging = out.parent / STAGING_DIR / out.name
    done = 0
    with suppress(OSError):
        done = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    total = info.get("bytes_total")
    if isinstance(total, int):
        done = min(done, total)
    return Progress(info.get("repo_id"), info.get("commit"), done, total if isinstance(total, int) else None)


def list_hub_files(api: HfApi, repo_id: str, revision: str) -> tuple[str, list[HubFile]]:
    """The commit ``revision`` points at and the repo's files there, with sizes and checksums."""
    info = api.model_info(repo_id, revision=revision, files_metadata=True)
    if not info.sha:
        raise DownloadError(
            f"{api.endpoint} named no commit for {repo_id}@{revision}; is it a Hugging Face hub?"
        )
    files = [
        HubFile(
            path=s.rfilename,
            size=s.lfs.size if s.lfs else s.size,
            sha256=s.lfs.sha256 if s.lfs else None,
            blob_id=s.blob_id,
        )
        for s in info.siblings or []
    ]
    return info.sha, files


def _fetch(repo_id: str, commit: str, staging: Path, endpoint: str) -> None:
    from huggingface_hub import snapshot_download

    import engine

    # Pinned to the commit the file listing came from, so the files and their checksums cannot disagree.
    snapshot_download(
        repo_id,
        revision=commit,
        local_dir=staging,
        endpoint=endpoint,
        library_name="ernie-studio",
        library_version=engine.__version__,
    )


def verify_files(root: Path, files: list[HubFile]) -> list[str]:
    """Check every listed file's size and checksum under ``root``; delete the ones that differ. Returns
    one line per problem, naming the file."""
    from huggingface_hub.utils import tqdm

    total = sum(f.size or 0 for f in files)
    with (
        tqdm(total=total, unit="B", unit_scale=True, desc="Verifying checksums") as bar,
        ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool,
    ):
        problems = list(pool.map(lambda f: _file_problem(root, f, bar.update), files))
    return [p for p in problems if p]


def _file_problem(root: Path, f: HubFile, progress: Callable[[int], object]) -> str | None:
    path = root / f.path
    if not path.is_file():
        return f"{f.path} is missing"
    if f.size is None or not (f.sha256 or f.blob_id):
        return f"{f.path}: the hub listed no size or checksum for it, so it cannot be verified"
    size = path.stat().st_size
    if size != f.size:
        path.unlink()
        return f"{f.path} has {size} bytes where the hub lists {f.size} (deleted)"
    algorithm, expected = ("sha256", f.sha256) if f.sha256 else ("git blob sha1", f.blob_id)
    # git names a blob by the sha1 of "blob <size>\0" + content
    digest = hashlib.sha256() if f.sha256 else hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
            progress(len(chunk))
    if digest.hexdigest() != expected.lower():
        path.unlink()
        return f"{f.path} is corrupt: {algorithm} {digest.hexdigest()}, the hub lists {expected} (deleted)"
    return None


def check_model_dir(directory: Path, repo_id: str) -> None:
    """The directory must read as an ERNIE 4.5 config and hold the weights it needs."""
    from engine.models.config import ErnieConfig

    keep = f"the verified files stay in {directory}"
    try:
        config = ErnieConfig.from_file(directory)
    except (FileNotFoundError, ValueError) as e:
        raise DownloadError(f"{repo_id} is not an ERNIE 4.5 model directory: {e}; {keep}") from e
    if not config.model_type.startswith(ERNIE_MODEL_TYPE_PREFIX):
        raise DownloadError(
            f"{repo_id} is not an ERNIE 4.5 model: {directory / 'config.json'} has model_type "
            f"{config.model_type!r} (ERNIE 4.5 models have {ERNIE_MODEL_TYPE_PREFIX}*); {keep}"
        )
    # The loader's own check (index shards present, safetensors headers readable); it imports Paddle.
    from engine.models.checkpoint import CheckpointError, TensorStore

    try:
        TensorStore(directory)
    except (CheckpointError, ValueError, OSError) as e:
        raise DownloadError(f"{repo_id} has no usable weights: {e}; {keep}") from e


def _publish(staging: Path, out: Path, files: list[HubFile]) -> None:
    """Move the verified staging directory to ``out``, without the hub client's bookkeeping or files left
    from an earlier revision that this one does not list."""
    shutil.rmtree(staging / HUB_BOOKKEEPING, ignore_errors=True)
    listed = {f.path for f in files}
    for path in sorted(staging.rglob("*"), reverse=True):
        rel = path.relative_to(staging).as_posix()
        if path.is_file() and rel not in listed:
            log.info("removing %s: not in this revision", rel)
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    if out.exists():
        out.rmdir()  # empty, checked before the download
    os.replace(staging, out)
    with suppress(OSError):  # not empty while other downloads are under way
        staging.parent.rmdir()


@contextmanager
def _hub_errors(endpoint: str, repo_id: str, revision: str, out: Path, staging: Path) -> Iterator[None]:
    """Turn the hub client's exceptions into a DownloadError that says what to do."""
    try:
        yield
    except DownloadError:
        raise
    except Exception as e:
        explained = _explain(e, endpoint, repo_id, revision, out, staging)
        if explained is None:
            raise
        raise explained from e


def _explain(
    error: Exception, endpoint: str, repo_id: str, revision: str, out: Path, staging: Path
) -> DownloadError | None:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import httpx

    kept = ""
    if staging.is_dir() and any(staging.iterdir()):
        kept = f" (the files fetched so far stay in {staging}; run the command again to continue)"
    cause = _root_cause(error, (httpx.TransportError, OfflineModeIsEnabled, HfHubHTTPError))
    if isinstance(cause, OfflineModeIsEnabled):
        return DownloadError(f"HF_HUB_OFFLINE is set, so nothing is downloaded; unset it{kept}")
    if isinstance(cause, httpx.TransportError):
        reason = str(cause) or type(cause).__name__
        return DownloadError(
            f"cannot reach {_failed_host(cause, endpoint)}: {reason}; set HF_ENDPOINT for a mirror or copy "
            f"the model into {out} by hand{kept}"
        )
    if isinstance(cause, GatedRepoError):
        return DownloadError(
            f"{repo_id} is gated on {endpoint}: accept its terms on the model's page, then set HF_TOKEN "
            "(or run `hf auth login`)"
        )
    if isinstance(cause, RepositoryNotFoundError):
        return DownloadError(
            f"{endpoint} has no model repo {repo_id} (or it is private: set HF_TOKEN); "
            f"official presets: {', '.join(HUB_IDS)}"
        )
    if isinstance(cause, RevisionNotFoundError):
        return DownloadError(f"{repo_id} has no revision {revision!r} on {endpoint}")
    if isinstance(cause, HfHubHTTPError | OSError):
        return DownloadError(f"downloading {repo_id} from {endpoint} failed: {cause}{kept}")
    return None


def _root_cause(error: BaseException, kinds: tuple[type, ...]) -> BaseException:
    """The first exception of ``kinds`` along the cause chain (the hub client wraps network errors), else
    ``error`` itself."""
    link: BaseException | None = error
    seen: set[int] = set()
    while link is not None and id(link) not in seen:
        if isinstance(link, kinds):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return error


def _failed_host(error: Exception, endpoint: str) -> str:
    """The endpoint, or scheme://host[:port] of another host that failed (a CDN: its signed URLs carry
    credentials in the query, so only the host is shown)."""
    try:
        url = str(error.request.url)
    except (AttributeError, RuntimeError):  # httpx raises RuntimeError when an error has no request
        return endpoint
    if url.startswith(endpoint + "/"):
        return endpoint
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _readable_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
