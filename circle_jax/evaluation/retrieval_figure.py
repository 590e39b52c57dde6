"""The figure of the papers: queries and their top retrievals.

One row per query: the query, then its ``k`` nearest gallery items, best
first, each with its cosine similarity. Where labels are known, a retrieved
item is framed green when it has the query's label and red when it does not
(grey: unknown). Drawn with PIL, no display needed. Used by the training job
(``retrievals.png`` in the workdir) and by ``python -m circle_jax.search
query --grid``.
"""

from __future__ import annotations

import io
import os
from typing import Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

GREEN = (30, 160, 60)
RED = (210, 40, 40)
GREY = (150, 150, 150)
QUERY = (40, 40, 40)
_BORDER = 4
_GAP = 6
_TEXT = 14


def thumbnail(image, size: int) -> Image.Image:
  """``image`` (encoded bytes, a PIL image, or an ``[H, W]`` / ``[H, W,
  C]`` array of any range) as an RGB ``size x size`` PIL image; small images
  are enlarged without smoothing so their pixels stay visible."""
  if isinstance(image, (bytes, bytearray)):
    image = Image.open(io.BytesIO(image))
  if not isinstance(image, Image.Image):
    a = np.asarray(image, np.float64)
    if a.ndim == 3 and a.shape[-1] == 1:
      a = a[..., 0]
    lo, hi = float(a.min()), float(a.max())
    a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
    image = Image.fromarray((a * 255).round().astype(np.uint8))
  image = image.convert("RGB")
  w, h = image.size
  scale = size / max(w, h)
  resample = Image.NEAREST if scale >= 2 else Image.BILINEAR
  image = image.resize((max(1, round(w * scale)), max(1, round(h * scale))),
                       resample)
  out = Image.new("RGB", (size, size), (255, 255, 255))
  out.paste(image, ((size - image.size[0]) // 2, (size - image.size[1]) // 2))
  return out


def draw_retrievals(path: str, queries: Sequence, neighbors: Sequence[
    Sequence], *, scores: Optional[np.ndarray] = None,
                    correct: Optional[Sequence[Sequence]] = None,
                    titles: Optional[Sequence[str]] = None,
                    size: int = 72) -> str:
  """Draws each query with its retrievals to the PNG ``path``.

  Args:
    path: the output file (``.png``).
    queries: ``Q`` images (see :func:`thumbnail`).
    neighbors: ``Q`` lists of ``k`` images (None: no item).
    scores: ``[Q, k]`` similarities written under the items, or None.
    correct: ``Q`` lists of ``k`` bools (None: label unknown) for the
      frames, or None (all grey).
    titles: ``Q`` captions under the queries (e.g. their labels).
    size: thumbnail side in pixels.

  Returns:
    ``path``.
  """
  font = ImageFont.load_default()
  k = max((len(n) for n in neighbors), default=0)
  cell_w, cell_h = size + 2 * _BORDER, size + 2 * _BORDER + _TEXT
  width = _GAP + (cell_w + _GAP) * (k + 1) + _GAP
  height = _GAP + (cell_h + _GAP) * len(queries)
  canvas = Image.new("RGB", (width, height), (255, 255, 255))
  draw = ImageDraw.Draw(canvas)

  def cell(x, y, image, colour, text):
    draw.rectangle([x, y, x + cell_w - 1, y + cell_w - 1], fill=colour)
    canvas.paste(thumbnail(image, size), (x + _BORDER, y + _BORDER))
    if text:
      draw.text((x + 2, y + cell_w + 1), text, fill=(0, 0, 0), font=font)

  for r, q in enumerate(queries):
    y = _GAP + r * (cell_h + _GAP)
    cell(_GAP, y, q, QUERY, titles[r] if titles is not None else "query")
    for j, item in enumerate(neighbors[r]):
      if item is None:
        continue
      ok = None if correct is None else correct[r][j]
      colour = GREY if ok is None else (GREEN if ok else RED)
      text = "" if scores is None else f"{float(scores[r][j]):.3f}"
      x = _GAP + (cell_w + _GAP) * (j + 1) + _GAP
      cell(x, y, item, colour, text)
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  canvas.save(path, format="PNG")
  return path


def sample_queries(num_items: int, num: int, seed: int) -> np.ndarray:
  """A fixed, seeded sample of ``min(num, num_items)`` positions, sorted."""
  rng = np.random.default_rng(seed)
  return np.sort(rng.choice(num_items, min(num, num_items), replace=False))
