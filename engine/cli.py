"""The ``ernie-studio`` command line (also ``python -m engine``).

Engine commands live here; packages that sit above the engine (the studio) add theirs through the
``ernie_studio.commands`` entry-point group, so the engine never imports them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points
from typing import NoReturn

from engine.models.download import SOURCES
from engine.models.presets import HUB_IDS
from engine.priority import nice_own_session
from engine.startup import around_paddle_import, collection_paused, end_rank, launched_rank

log = logging.getLogger("ernie_studio")


def cmd_init_model(args: argparse.Namespace) -> int:
    from engine.models.initialize import init_model

    out = init_model(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.preset} model to {out}")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from engine.models.download import DownloadError, download_model

    # The hub client prints its warnings (a retried connection) through a handler of its own, which the root
    # handler would repeat, and its HTTP library logs every request at INFO.
    logging.getLogger("huggingface_hub").propagate = False
    if not args.verbose:
        for http_logger in ("httpx", "httpx2"):
            logging.getLogger(http_logger).setLevel(logging.WARNING)
    try:
        done = download_model(args.model, args.out, source=args.source, revision=args.revision)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"downloaded {done.repo_id} at {done.commit} to {done.path} ({len(done.files)} files, verified)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ernie-studio", description="Fine-tune and serve ERNIE 4.5 models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "init-model",
        help="write a random-initialised model directory: a tiny preset, or the official 0.3B shape",
    )
    p.add_argument(
        "--preset", required=True, choices=["tiny", "tiny-moe", "tiny-vl", "tiny-ocr-vl", "ernie-4.5-0.3b"]
    )
    p.add_argument("--out", required=True, help="new directory to create")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype stored on disk")
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser(
        "download",
        help="download an official checkpoint (or a hub model repo), verified against the hub's checksums",
        description="Download a model directory with huggingface_hub (HF_ENDPOINT selects a mirror, HF_TOKEN "
        "a token), check every file's size and checksum against the hub's listing and that it reads as an "
        "ERNIE 4.5 model; only then does it appear at --out. Run it again after a failure to continue.",
    )
    p.add_argument(
        "model", metavar="PRESET_OR_HUB_ID", help=f"{', '.join(HUB_IDS)}, or a repo id (owner/name)"
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="new directory (default: $ERNIE_STUDIO_HOME/models/NAME, else ./models/NAME)",
    )
    p.add_argument("--source", default="huggingface", choices=SOURCES, help="aistudio is not supported yet")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    p.set_defaults(func=cmd_download)

    for module in ENGINE_COMMANDS:
        __import__(module, fromlist=["register"]).register(sub)
    for ep in entry_points(group="ernie_studio.commands"):
        try:
            ep.load()(sub)
        except ImportError as e:  # a broken optional plugin must not take the engine CLI down
            log.debug("command plugin %s unavailable: %s", ep.name, e)
    return parser


# Engine command modules, each with ``register(subparsers)``; added as the stages land.
ENGINE_COMMANDS: list[str] = [
    "engine.serve.cli",
    "engine.train.cli",
    "engine.eval.cli",
    "engine.data.cli",
    "engine.doctor.cli",
]


def main(argv: list[str] | None = None) -> int:
    # Every command that needs Paddle imports it lazily: without collecting while it arrives (engine.startup)
    around_paddle_import(collection_paused)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # A rank of paddle.distributed.launch leads a session of its own: it keeps the nice value the worker gave
    # the launcher, and this gives its new autogroup the same (engine/priority.py).
    nice_own_session()
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run(argv: list[str] | None = None) -> NoReturn:
    """The program: ``main``, then the process's exit. A rank of a multi-rank job leaves without the C++
    teardown, which rank 0's TCP store thread can abort (engine.startup.end_rank)."""
    code = main(argv)
    if launched_rank():
        end_rank(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
