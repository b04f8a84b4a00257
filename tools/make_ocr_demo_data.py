"""Write the PaddleOCR-VL demo set under examples/data/ocr_demo/ with PIL alone (no external data).

Run: ``.venv/bin/python tools/make_ocr_demo_data.py [--out examples/data/ocr_demo]``. It renders:

- lines: a small vocabulary of short document lines, each drawn several times in a few fonts, sizes,
  rotations and paper shades; held-out renderings of the same lines form the eval split. The vocabulary is
  small and the lines differ in length on purpose: the tiny preset cannot read, but it can learn which
  line an image of a given shape shows, so its character error rate visibly falls;
- receipts: receipt-like tables (shop, items with quantity and price, total), labelled in the OTSL form
  PaddleOCR-VL's table task answers in (``<fcel>`` cells, ``<ecel>`` empty ones, ``<lcel>`` merged into the
  cell on their left, ``<nl>`` rows; ERNIEKit's docs/paddleocr_vl_sft.md).

Records are OCR pairs (``{"image", "text", "task"}``). The images depend on the fonts found: the TrueType
files below where they exist (fonts-dejavu, fonts-liberation, fonts-wqy-zenhei), else PIL's built-in font;
the files are deterministic for one machine's fonts.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

FONT_DIRS = ("/usr/share/fonts/truetype", "/usr/local/share/fonts")
FONTS = {
    "sans": "dejavu/DejaVuSans.ttf",
    "serif": "liberation/LiberationSerif-Regular.ttf",
    "mono": "dejavu/DejaVuSansMono.ttf",
    "narrow": "liberation/LiberationSansNarrow-Regular.ttf",
    "cjk": "wqy/wqy-zenhei.ttc",
}
LINES = [
    "TOTAL 12.50",
    "Thank you!",
    "INVOICE NO. 2024-0117",
    "Paid by card",
    "发票号码 0042",
    "Keep this receipt for returns",
]
SHOPS = ["CORNER CAFE", "BOOK NOOK", "FRESH MARKET"]
ITEMS = [("Tea", 2.5), ("Bread", 3.2), ("Apples", 4.0), ("Pen", 1.1), ("Notebook", 5.5), ("Milk", 1.8)]
RENDERINGS_TRAIN = 6  # per line
RENDERINGS_EVAL = 2


def find_font(name: str) -> str | None:
    for base in FONT_DIRS:
        path = Path(base) / FONTS[name]
        if path.is_file():
            return str(path)
    return None


def load_font(name: str, size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    path = find_font(name)
    return ImageFont.truetype(path, size) if path else ImageFont.load_default(size)


def render_line(text: str, font_name: str, size: int, angle: float, shade: int) -> Image.Image:
    """One line of text on paper of ``shade`` grey, rotated by ``angle`` degrees, with a small margin."""
    font = load_font("cjk" if any(ord(c) > 0x2E80 for c in text) else font_name, size)
    left, top, right, bottom = font.getbbox(text)
    pad = max(4, size // 3)
    image = Image.new("L", (right - left + 2 * pad, bottom - top + 2 * pad), shade)
    ImageDraw.Draw(image).text((pad - left, pad - top), text, fill=20, font=font)
    if angle:
        image = image.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=shade)
    return image.convert("RGB")


def receipt(rng: random.Random) -> tuple[Image.Image, str]:
    """A receipt: shop name, a table of items (item, quantity, price) and the total; its OTSL label."""
    shop = rng.choice(SHOPS)
    items = rng.sample(ITEMS, rng.randint(2, 4))
    rows = [("Item", "Qty", "Price")]
    total = 0.0
    for name, price in items:
        qty = rng.randint(1, 3)
        total += qty * price
        rows.append((name, str(qty), f"{qty * price:.2f}"))
    rows.append(("TOTAL", "", f"{total:.2f}"))
    font = load_font("mono", 16)
    title = load_font("sans", 20)
    width, line = 300, 24
    image = Image.new("RGB", (width, 60 + line * len(rows) + 20), (250, 248, 240))
    draw = ImageDraw.Draw(image)
    draw.text((width // 2, 12), shop, fill=(10, 10, 10), font=title, anchor="mt")
    y = 48
    draw.line((10, y - 4, width - 10, y - 4), fill=(90, 90, 90))
    for k, (name, qty, price) in enumerate(rows):
        if k == len(rows) - 1:
            draw.line((10, y - 2, width - 10, y - 2), fill=(90, 90, 90))
        draw.text((14, y), name, fill=(10, 10, 10), font=font)
        draw.text((180, y), qty, fill=(10, 10, 10), font=font, anchor="ra")
        draw.text((width - 14, y), price, fill=(10, 10, 10), font=font, anchor="ra")
        y += line
    # the shop's name spans the three columns (OTSL: a cell, then two cells merged into it from the left)
    otsl = f"<fcel>{shop}<lcel><lcel><nl>"
    otsl += "".join("".join(f"<fcel>{c}" if c else "<ecel>" for c in row) + "<nl>" for row in rows)
    return image, otsl


def write(out: Path, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict]] = {
        "lines_train": [],
        "lines_eval": [],
        "receipts_train": [],
        "receipts_eval": [],
    }
    n = 0
    for text in LINES:
        for k in range(RENDERINGS_TRAIN + RENDERINGS_EVAL):
            font = rng.choice(["sans", "serif", "mono", "narrow"])
            image = render_line(
                text, font, rng.randint(14, 26), rng.choice([0, 0, -3, 2, 4]), rng.randint(215, 255)
            )
            name = f"images/line_{n:03d}.png"
            image.save(out / name, optimize=True)
            split = "lines_train" if k < RENDERINGS_TRAIN else "lines_eval"
            splits[split].append({"image": name, "text": text, "task": "ocr"})
            n += 1
    for k in range(6):
        image, otsl = receipt(rng)
        name = f"images/receipt_{k:03d}.png"
        image.save(out / name, optimize=True)
        splits["receipts_train" if k < 4 else "receipts_eval"].append(
            {"image": name, "text": otsl, "task": "table"}
        )
    for split, records in splits.items():
        if split.endswith("train"):
            rng.shuffle(records)
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return {split: len(records) for split, records in splits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "examples/data/ocr_demo"))
    args = parser.parse_args()
    missing = [name for name in FONTS if find_font(name) is None]
    if missing:
        print(f"fonts not found, PIL's built-in font instead: {', '.join(missing)}")
    print(write(Path(args.out)))


if __name__ == "__main__":
    main()
