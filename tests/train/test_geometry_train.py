"""``--config.loss.geometry=poincare`` in the trainer: the head hands the
raw features to the ball (no L2 normalisation), the run trains (its loss
falls) and evaluates by cosine on the normalised features."""

import json
import os

import jax
import numpy as np
import pytest

from circle_jax import config as config_lib
from circle_jax.evaluation import embedding as embedding_lib
from circle_jax.train import config_checks
from circle_jax.train import loop
from circle_jax.train import run as run_lib
from circle_jax.train import writers
from tests.train import helpers

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def _config(data_dir, loss, **overrides):
  c = helpers.digits_config(**{"dataset.data_dir": data_dir,
                               "dataset.num_threads": 2})
  c.loss = loss
  return helpers.override(c, **overrides)


@pytest.mark.parametrize("loss, normalizes", [
    (config_lib.loss_config("circle"), True),
    (config_lib.loss_config("circle", geometry="poincare"), False),
    (config_lib.loss_config("pairwise_ce"), False),
    (config_lib.loss_config("pairwise_ce", geometry="cosine"), True),
])
def test_the_head_normalises_unless_the_ball_takes_raw_features(
    data_dir, loss, normalizes):
  c = _config(data_dir, loss)
  model = run_lib.build_model(c)
  assert model.normalize is normalizes
  images = jax.random.uniform(jax.random.PRNGKey(0), (3, 28, 28, 1))
  variables = model.init(jax.random.PRNGKey(1), images, train=False)
  raw = model.apply(variables, images, train=False)
  norms = np.linalg.norm(np.asarray(raw), axis=1)
  assert np.allclose(norms, 1.0, atol=1e-5) is normalizes
  # Evaluation compares directions (cosine) either way.
  evaluated = embedding_lib.eval_apply(c, model)(variables, images)
  np.testing.assert_allclose(np.linalg.norm(np.asarray(evaluated), axis=1),
                             1.0, atol=1e-5)
  np.testing.assert_allclose(
      np.asarray(evaluated),
      np.asarray(raw) / norms[:, None], atol=1e-6)


def test_a_poincare_run_trains_and_evaluates(data_dir, tmp_path):
  steps = 40
  c = _config(data_dir, config_lib.loss_config("circle", geometry="poincare",
                                               gamma=8.0),
              num_train_steps=steps, eval_every_steps=steps,
              checkpoint_every_steps=steps, log_every_steps=10,
              eval_clustering=False)
  loop.train_and_evaluate(c, str(tmp_path))
  with open(os.path.join(tmp_path, "metrics.json")) as f:
    final = json.load(f)["final"]
  assert all(np.isfinite(v) for v in final.values()
             if isinstance(v, (int, float))), final
  tb = os.path.join(tmp_path, "tensorboard")
  (events,) = os.listdir(tb)
  losses = [v for _, t, v in writers.read_scalars(os.path.join(tb, events))
            if t == "train/loss"]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_the_geometry_fields_are_checked_at_config_time(data_dir):
  c = _config(data_dir, config_lib.loss_config("multi_similarity",
                                               geometry="poincare", r=-1.0))
  with pytest.raises(config_checks.ConfigError, match=r"^config\.loss\.r: "):
    config_checks.check_config(c, device_count=1, process_count=1)
