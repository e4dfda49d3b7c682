"""Draw the kernel's logo: a 3x3 mesh of nodes on a rounded square (no letter, so the
launcher card does not look like Markdown's "M").

    .venv/bin/python scripts/make_logo.py     # writes monarch_kernel/kernelspec_assets/

Writes logo-svg.svg by hand and rasterises the same drawing with Pillow (drawn at 8x,
then downsampled, for smooth edges) into logo-32x32.png and logo-64x64.png.
"""
from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parents[1] / "monarch_kernel" / "kernelspec_assets"
BG, EDGE, NODE, HUB = "#3b2a8c", "#b9a8ff", "#ffffff", "#ff9f1c"
NODES = [(x, y) for y in (16, 32, 48) for x in (16, 32, 48)]   # in a 64-unit box
LINKS = [(a, b) for a in NODES for b in NODES if a < b and abs(a[0] - b[0]) + abs(a[1] - b[1]) == 16]


def svg() -> str:
    lines = "".join(f'<line x1="{a[0]}" y1="{a[1]}" x2="{b[0]}" y2="{b[1]}"/>' for a, b in LINKS)
    dots = "".join(f'<circle cx="{x}" cy="{y}" r="{6 if (x, y) == (32, 32) else 4.5}" '
                   f'fill="{HUB if (x, y) == (32, 32) else NODE}"/>' for x, y in NODES)
    return ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 64 64" width="64" height="64">'
            f'<rect width="64" height="64" rx="12" fill="{BG}"/>'
            f'<g stroke="{EDGE}" stroke-width="2.5" stroke-linecap="round">{lines}</g>{dots}</svg>\n')


def png(size: int) -> Image.Image:
    k = 8 * size / 64
    img = Image.new("RGBA", (8 * size, 8 * size), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    d.rounded_rectangle([0, 0, 8 * size - 1, 8 * size - 1], radius=12 * k, fill=BG)
    for a, b in LINKS:
        d.line([a[0] * k, a[1] * k, b[0] * k, b[1] * k], fill=EDGE, width=round(2.5 * k))
    for x, y in NODES:
        r = (6 if (x, y) == (32, 32) else 4.5) * k
        d.ellipse([x * k - r, y * k - r, x * k + r, y * k + r], fill=HUB if (x, y) == (32, 32) else NODE)
    return img.resize((size, size), Image.LANCZOS)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / "logo-svg.svg").write_text(svg())
    for size in (32, 64):
        png(size).save(OUT / f"logo-{size}x{size}.png")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
