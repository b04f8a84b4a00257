"""``ernie-studio data validate|stats|preview``: dataset checks from the command line."""

from __future__ import annotations

import argparse
import json

from engine.data.record_types import FORMATS


def _tokenizer(model: str | None):
    if not model:
        return None
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(model)


def cmd_validate(args: argparse.Namespace) -> int:
    from engine.data.validate import validate_file
    from engine.models.paddleocr_vl_config import is_paddleocr_vl_dir

    worst = 0
    tok = _tokenizer(args.model)
    for path in args.files:
        if args.model and is_paddleocr_vl_dir(
            args.model
        ):  # what a PaddleOCR-VL run checks, by line and field
            from engine.data.loader import check_ocr_file
            from engine.data.paddleocr_vl_processor import OCRProcessorSettings

            settings = OCRProcessorSettings.from_model_dir(args.model)
            report = check_ocr_file(path, tok, args.max_seq_len, settings, args.format)
        else:
            # The command line fetches images named by URL, as a run would (the studio does it in a worker job).
            report = validate_file(path, args.format, args.kind, tok, args.max_problems, fetch_urls=True)
        if args.json:
            print(json.dumps(report.to_dict(), ensure_ascii=False))
        else:
            print(report.summary(limit=args.max_problems))
        worst = max(worst, 0 if report.ok else 1)
    return worst


def cmd_stats(args: argparse.Namespace) -> int:
    from engine.data.formats import detect_format
    from engine.data.stats import dataset_stats

    fmt, kind = (args.format, args.kind) if args.format and args.kind else detect_format(args.file)
    stats = dataset_stats(
        args.file, args.format or fmt, args.kind or kind, _tokenizer(args.model), args.max_seq_len
    )
    print(json.dumps(stats, ensure_ascii=False, indent=2))
    return 0


def cmd_preview(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.data.encode import render_record
    from engine.data.formats import detect_format
    from engine.data.records import read_page

    page = read_page(args.file, args.offset, args.limit)
    fmt, kind = detect_format(args.file)
    tok = _tokenizer(args.model)
    for line, rec in zip(page.lines, page.records, strict=True):
        print(f"--- line {line}")
        for span in render_record(
            rec, args.format or fmt, kind, tok, base_dir=Path(args.file).resolve().parent
        ):
            mark = "[loss] " if span["trained"] else ""
            print(f"{mark}{span['text']!r}")
    total = "?" if page.total is None else page.total
    print(f"--- {len(page.records)} records from {args.offset} (of {total}); next offset {page.next_offset}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("data", help="validate, inspect and preview dataset files")
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    v = sub.add_parser("validate", help="report every problem of dataset files as file:line: message")
    v.add_argument("files", nargs="+")
    v.add_argument("--format", choices=FORMATS, help="default: detected from the first records")
    v.add_argument("--kind", choices=["sft", "dpo", "pt"])
    v.add_argument(
        "--model",
        help="model directory whose tokenizer checks reserved tokens; a PaddleOCR-VL one adds its run's checks "
        "(images decoded, an image in every record, samples within --max-seq-len)",
    )
    v.add_argument("--max-seq-len", type=int, default=4096, help="with a PaddleOCR-VL --model")
    v.add_argument("--max-problems", type=int, default=1000)
    v.add_argument("--json", action="store_true", help="one JSON report per file")
    v.set_defaults(func=cmd_validate)

    s = sub.add_parser("stats", help="token-length statistics with a model's tokenizer")
    s.add_argument("file")
    s.add_argument("--model", required=True, help="model directory (its tokenizer counts the tokens)")
    s.add_argument("--max-seq-len", type=int, default=4096)
    s.add_argument("--format", choices=FORMATS)
    s.add_argument("--kind", choices=["sft", "dpo", "pt"])
    s.set_defaults(func=cmd_stats)

    r = sub.add_parser("preview", help="records rendered with the chat template, loss spans marked")
    r.add_argument("file")
    r.add_argument("--offset", type=int, default=0)
    r.add_argument("--limit", type=int, default=5)
    r.add_argument("--model", help="model directory (tokenizer special tokens)")
    r.add_argument("--format", choices=FORMATS)
    r.set_defaults(func=cmd_preview)
