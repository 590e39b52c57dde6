"""The retrievals figure: layout, frames, thumbnails."""

import io

import numpy as np
from PIL import Image

from circle_jax.evaluation import retrieval_figure as fig


def _png(value):
  buf = io.BytesIO()
  Image.fromarray(np.full((8, 8), value, np.uint8)).save(buf, format="PNG")
  return buf.getvalue()


def test_frames_are_green_for_the_query_label_and_red_otherwise(tmp_path):
  path = str(tmp_path / "r.png")
  fig.draw_retrievals(path, [_png(0), np.zeros((8, 8, 1))],
                      [[_png(255), _png(128)], [_png(9), None]],
                      scores=np.array([[0.9, 0.5], [0.7, -np.inf]]),
                      correct=[[True, False], [None, None]], size=32)
  im = np.asarray(Image.open(path).convert("RGB"))
  cell = 32 + 2 * fig._BORDER  # pylint: disable=protected-access
  gap = fig._GAP  # pylint: disable=protected-access
  x1 = gap + (cell + gap) + gap   # first retrieval's frame, row 0
  x2 = x1 + cell + gap
  assert tuple(im[gap, x1]) == fig.GREEN
  assert tuple(im[gap, x2]) == fig.RED
  row1 = gap + (cell + 14 + gap)
  assert tuple(im[row1, x1]) == fig.GREY
  assert tuple(im[row1, x2]) == (255, 255, 255)  # no item drawn
  assert im.shape[0] == gap + 2 * (cell + 14 + gap)


def test_thumbnail_scales_any_array_and_sample_is_seeded():
  t = fig.thumbnail(np.array([[0.0, 2.0], [4.0, 4.0]]), 8)
  a = np.asarray(t)
  assert a.shape == (8, 8, 3) and a[0, 0, 0] == 0 and a[7, 7, 0] == 255
  s = fig.sample_queries(100, 8, seed=3)
  assert len(s) == 8 and (np.diff(s) > 0).all()
  np.testing.assert_array_equal(s, fig.sample_queries(100, 8, seed=3))
  assert len(fig.sample_queries(5, 8, seed=0)) == 5
