"""The ``ernie-studio`` command line (also ``python -m engine``).

Engine commands live here; packages that sit above the engine (the studio) add theirs through the
``ernie_studio.commands`` entry-point group, so the engine never imports them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points

log = logging.getLogger("ernie_studio")


def cmd_init_model(args: argparse.Namespace) -> int:
    from engine.models.initialize import init_model

    out = init_model(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.preset} model to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ernie-studio", description="Fine-tune and serve ERNIE 4.5 models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("init-model", help="write a small random-initialised model directory")
    p.add_argument("--preset", required=True, choices=["tiny", "tiny-moe", "tiny-vl"])
    p.add_argument("--out", required=True, help="new directory to create")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype stored on disk")
    p.set_defaults(func=cmd_init_model)

    for module in ENGINE_COMMANDS:
        __import__(module, fromlist=["register"]).register(sub)
    for ep in entry_points(group="ernie_studio.commands"):
        try:
            ep.load()(sub)
        except ImportError as e:  # a broken optional plugin must not take the engine CLI down
            log.debug("command plugin %s unavailable: %s", ep.name, e)
    return parser


# Engine command modules, each with ``register(subparsers)``; added as the stages land.
ENGINE_COMMANDS: list[str] = ["engine.serve.cli", "engine.train.cli", "engine.data.cli"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
