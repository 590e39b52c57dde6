"""Tests of the Poincaré ball (circle_jax/losses/hyperbolic.py): the distance
against the float64 Möbius form, the boundary, identical points and bad
curvatures. The ball as every pair loss's geometry: engine/test_geometry.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses.reference import mobius_distance_ref, poincare_ref
from tests.losses.engine.cases import FAMILY_B as B
from tests.losses.engine.cases import FAMILY_FNS as FNS
from tests.losses.engine.cases import FAMILY_LABELS as LABELS
from tests.losses.engine.cases import family_batch
from tests.losses.engine.cases import family_vg as vg


def test_poincare_distance_equals_the_float64_mobius_form():
  g = losses.Poincare(c=0.7, r=3.0)
  x = family_batch(seed=8, d=6) * 2
  z = np.asarray(g.embed(jnp.asarray(x)), np.float64)
  np.testing.assert_allclose(z, poincare_ref(x, 0.7, 3.0), rtol=1e-5,
                             atol=1e-6)
  got = np.asarray(g.distance(jnp.asarray(z, jnp.float32),
                              jnp.asarray(z, jnp.float32)))
  want = mobius_distance_ref(z, z, 0.7)
  off = ~np.eye(B, dtype=bool)
  np.testing.assert_allclose(got[off], want[off], rtol=1e-4)
  # Self distances: the float32 cancellation of |x|^2 + |y|^2 - 2 x.y,
  # magnified near the boundary (hyperbolic.py's accuracy note).
  sq = (z * z).sum(1)
  bound = np.sqrt(2 * 1e-6 * sq / (1 - 0.7 * sq) ** 2)
  assert np.all(np.abs(np.diag(got)) <= np.maximum(bound, 1e-5))


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1e30])
def test_poincare_is_safe_at_the_boundary_under_jit(scale):
  """Norms driven to the ball's edge 1/sqrt(c) (no clipping, huge inputs):
  finite points, distances, losses and gradients, and the distances of the
  projected points equal the float64 Möbius form."""
  c, r = 1.0, 1e3
  g = losses.Poincare(c=c, r=r)
  x = family_batch(seed=9) * scale
  z = jax.jit(g.embed)(jnp.asarray(x))
  norms = np.linalg.norm(np.asarray(z, np.float64), axis=1)
  assert np.all(norms < 1 / np.sqrt(c)) and np.all(np.isfinite(norms))
  d = np.asarray(jax.jit(g.distance)(z, z))
  assert np.all(np.isfinite(d))
  off = ~np.eye(B, dtype=bool)
  want = mobius_distance_ref(np.asarray(z, np.float64),
                             np.asarray(z, np.float64), c)
  np.testing.assert_allclose(d[off], want[off], rtol=2e-3, atol=1e-2)
  for name, fn in FNS.items():
    for bs in (None, 4):
      value, grad = vg(fn, x, jnp.asarray(LABELS), geometry="poincare", c=c,
                        r=r, block_size=bs)
      assert np.isfinite(float(value)), name
      assert np.all(np.isfinite(np.asarray(grad))), name


def test_poincare_identical_points_have_a_finite_gradient():
  x = np.repeat(family_batch(seed=10)[:8], 2, axis=0)  # every point twice
  labels = jnp.asarray(np.repeat(np.arange(8), 2).astype(np.int32))
  for bs in (None, 4):
    value, grad = vg(losses.supcon_loss, x, labels, geometry="poincare",
                      block_size=bs)
    assert np.isfinite(float(value)) and np.all(np.isfinite(grad))


def test_unknown_geometry_and_bad_curvature_are_one_line_errors():
  x, labels = jnp.asarray(family_batch()), jnp.asarray(LABELS)
  with pytest.raises(ValueError, match="geometry") as info:
    losses.supcon_loss(x, labels, geometry="sphere")
  assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match="`c`"):
    losses.nt_xent_loss(x, labels, geometry=losses.Poincare(c=0.0))
  with pytest.raises(ValueError, match="`tau`"):
    losses.supcon_loss(x, labels, tau=1e-4)
