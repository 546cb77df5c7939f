"""Export the Glyphs dataset as an image table for ``CSVDataModule``: the worked example of ``docs/own_task.md``.

    .venv/bin/python examples/export_glyphs_table.py --out glyphs_table

writes ``glyphs_table/images/<script>/<code point>_<font>.png`` (32 x 32 grey PNGs) and ``glyphs_table/glyphs.csv``
with one row per image:

* ``path``: the PNG, relative to the table's folder;
* ``label``: the character (Latin ``A``, Greek ``Α`` and Cyrillic ``А`` are three classes);
* ``labels``: for the look-alike characters (homoglyphs, :func:`lightning_dml.data.glyphs.homoglyph_groups`: ``A``,
  ``Α``, ``А``), the label set of the whole group (``A;Α;А``): a rendering of Latin ``A`` is a correct answer to a
  query of Greek Alpha, since nothing in the picture tells them apart. Empty for the other characters (their
  ``label`` alone);
* ``split``: by character, seeded: characters without a look-alike 60 % ``train``, 20 % ``validation``, 20 %
  ``test``; each homoglyph group as a whole in ``validation`` or ``test`` (so the training rows have one label
  each, and the groups never straddle two splits);
* ``category``: the script, ``latin``, ``greek``, ``cyrillic``, ``digit`` or ``symbol``;
* ``sequence``: the font family (``DejaVu Sans``, ``DejaVu Sans Mono``, ``DejaVu Serif``, ``STIX General``,
  ``Computer Modern``): renderings of one family look alike, so evaluation ignores them as answers to each other
  and asks for the character in *other* families;
* ``is_query``: every evaluation rendering; ``is_gallery``: the upright regular fonts only (no bold, oblique or
  italic): styled renderings are searched against a gallery of regular ones, and a regular rendering that is both
  query and gallery never matches itself.

Deterministic: the same table for the same ``--seed`` (the renderings' variations follow
:func:`~lightning_dml.data.glyphs.render_glyphs`'s seed, the split this one).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import unicodedata
from pathlib import Path

from PIL import Image

from lightning_dml.data.glyphs import homoglyph_groups, render_glyphs

#: font file -> family (the sequence): one family's renderings are excluded as answers to each other
FAMILIES = {
    "DejaVuSans": "DejaVu Sans",
    "DejaVuSansMono": "DejaVu Sans Mono",
    "DejaVuSerif": "DejaVu Serif",
    "DejaVuSansDisplay": "DejaVu Sans",
    "DejaVuSerifDisplay": "DejaVu Serif",
    "STIXGeneral": "STIX General",
    "STIXNonUni": "STIX General",
    "cm": "Computer Modern",
    "LastResortHE": "Last Resort",
}
#: font-file name parts of the styled (not upright regular) fonts
STYLED = ("Bold", "Oblique", "Italic", "Bol", "Ita", "cmb10", "cmti10", "cmmi10")


def family(font: str) -> str:
    stem = font.rsplit(".", 1)[0].split("-")[0]
    for prefix in sorted(FAMILIES, key=len, reverse=True):
        if stem.startswith(prefix):
            return FAMILIES[prefix]
    return stem


def script(char: str) -> str:
    if char.isdigit():
        return "digit"
    if not char.isalpha():
        return "symbol"
    name = unicodedata.name(char, "")
    for word in ("LATIN", "GREEK", "CYRILLIC"):
        if name.startswith(word):
            return word.lower()
    return "symbol"  # the micro sign and the like


def unit_draw(seed: int, key: str) -> float:
    """A uniform draw in [0, 1) from ``(seed, key)`` alone (a character's split does not depend on the others)."""
    digest = hashlib.sha256(f"{seed}|{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def export(out: Path, image_size: int = 32, seed: int = 0) -> Path:
    images, labels, class_names, fonts = render_glyphs(image_size, seed, homoglyph_threshold=1.0)  # keep homoglyphs
    present = set(class_names)
    groups = [tuple(c for c in group if c in present) for group in homoglyph_groups()]
    groups = [g for g in groups if len(g) > 1]
    group_of = {char: group for group in groups for char in group}
    split_of: dict[str, str] = {}
    for group in groups:
        split_of.update((char, "validation" if unit_draw(seed, "".join(group)) < 0.5 else "test") for char in group)
    for char in class_names:
        if char not in split_of:
            u = unit_draw(seed, char)
            split_of[char] = "train" if u < 0.6 else "validation" if u < 0.8 else "test"
    rows = []
    pixels = images.numpy()[:, 0]
    for i, (label, font) in enumerate(zip(labels.tolist(), fonts)):
        char = class_names[label]
        category = script(char)
        rel = Path("images") / category / f"U+{ord(char):04X}_{font.rsplit('.', 1)[0]}.png"
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[i], "L").save(out / rel)
        split = split_of[char]
        evaluated = split != "train"
        rows.append({
            "path": rel.as_posix(),
            "label": char,
            "labels": ";".join(group_of[char]) if char in group_of else "",
            "split": split,
            "category": category,
            "sequence": family(font),
            "is_query": "true" if evaluated else "",
            "is_gallery": ("false" if any(s in font for s in STYLED) else "true") if evaluated else "",
        })
    table = out / "glyphs.csv"
    with table.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    counts = {s: sum(r["split"] == s for r in rows) for s in ("train", "validation", "test")}
    chars = {s: len({r["label"] for r in rows if r["split"] == s}) for s in counts}
    print(f"wrote {table}: {len(rows)} images of {len(class_names)} characters "
          + ", ".join(f"{s} {counts[s]} images / {chars[s]} characters" for s in counts)
          + f"; {len(groups)} look-alike groups ({sum(len(g) for g in groups)} characters) with label sets")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("glyphs_table"), help="output folder (default glyphs_table)")
    parser.add_argument("--image-size", type=int, default=32, help="side of the PNGs (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the renderings and the split (default 0)")
    args = parser.parse_args(argv)
    export(args.out, args.image_size, args.seed)


if __name__ == "__main__":
    main()
