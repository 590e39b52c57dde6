"""Tests of the loss registry: names, defaults, inits, the uniform call."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses.engine import cases
from tests.losses.reference import loss_ref


# The names and the paper defaults each loss must expose.
_SPEC = {
    "circle": {"margin": 0.4, "gamma": 80.0},
    "unified": {"gamma": 80.0, "margin": 0.4},
    "circle_class_level": {"margin": 0.25, "gamma": 256.0},
    "multi_similarity": {"alpha": 2.0, "beta": 50.0, "base": 0.5,
                         "epsilon": 0.1, "mining": True},
    "ranked_list": {"alpha": 1.2, "margin": 0.4, "t_neg": 10.0,
                    "t_pos": 0.0, "imbalance": 0.5},
    "proxy_anchor": {"margin": 0.1, "alpha": 32.0},
    "ranked_proxy_anchor": {"alpha": 1.4, "margin": 0.4, "t_neg": 20.0,
                            "distance": "euclidean"},
    "contrastive": {"pos_margin": 0.0, "neg_margin": 0.5},
    "triplet": {"margin": 0.2, "mining": "all"},
    "lifted_structure": {"margin": 1.0},
    "n_pair": {"l2_reg": 0.02},
    "margin": {"margin": 0.2, "nu": 0.0},
    "proxy_nca": {},
    "soft_triple": {"centers_per_class": 10, "la": 20.0, "gamma": 0.1,
                    "margin": 0.01},
    "normface": {},
    "cosface": {"margin": 0.35, "scale": 64.0},
    "arcface": {"margin": 0.5, "scale": 64.0},
    "subcenter_arcface": {"centers_per_class": 3, "margin": 0.5,
                          "scale": 64.0},
    "softmax": {},
    "supcon": {"tau": 0.1},
    "nt_xent": {"tau": 0.1},
    "pairwise_ce": {"tau": 0.2},
    "pairwise_sigmoid": {"t": 10.0, "b": -10.0},
    "smooth_ap": {"tau": 0.01},
    "fastap": {"L": 10},
}
_SPEC["nca"] = {"softmax_scale": 1.0}
_SPEC["angular"] = {"alpha": 40.0}
_SPEC["generalized_lifted_structure"] = {"neg_margin": 1.0,
                                        "pos_margin": 0.0}
_SPEC["intra_pair_variance"] = {"pos_eps": 0.01, "neg_eps": 0.01}
_SPEC["snr_contrastive"] = {"pos_margin": 0.0, "neg_margin": 1.0}
_SPEC["tuplet_margin"] = {"margin": 5.73, "scale": 64.0}
# The default geometry of the losses that take the `geometry` option.
_GEOMETRY = {"pairwise_ce": "poincare", "n_pair": "dot"}
_GEOMETRY["snr_contrastive"] = "snr"
_PARAM = {"circle_class_level": "class_weights", "proxy_anchor": "proxies",
          "ranked_proxy_anchor": "proxies", "margin": "beta",
          "proxy_nca": "proxies", "soft_triple": "centers",
          "normface": "class_weights", "cosface": "class_weights",
          "arcface": "class_weights", "softmax": "class_weights",
          "subcenter_arcface": "class_weights"}
# Issue #40's class-matrix losses (helper h40b), at PML 2.9's defaults.
_SPEC.update({
    "large_margin_softmax": {"margin": 4, "scale": 1.0},
    "sphereface": {"margin": 4, "scale": 1.0},
    "p2s_grad": {},
    "vicreg": {"invariance_lambda": 25.0, "variance_mu": 25.0,
               "covariance_v": 1.0, "eps": 1e-4},
    "threshold_consistent_margin": {"lambda_plus": 1.0, "lambda_minus": 1.0,
                                    "margin_plus": 0.9, "margin_minus": 0.5},
    "pnp": {"b": 2.0, "alpha": 1.0, "anneal": 0.01, "variant": "O"},
    "manifold": {"lambdaC": 1.0, "alpha": 0.8, "margin": 5e-4},
})
# Issue #40's last three (helper h40loss), at PML 2.9's defaults.
_SPEC["instance"] = {"gamma": 64.0}
_SPEC["histogram"] = {"n_bins": None, "delta": None}
_SPEC["dynamic_soft_margin"] = {"min_val": -2.0, "num_bins": 10,
                                "momentum": 0.01}
_GEOMETRY["vicreg"] = None  # no pairs compared: no geometry
# Issue #41's RS@k (helper h41rsk), at the paper's defaults.
_SPEC["recall_at_k"] = {"k": (1, 2, 4, 8, 16), "tau1": 0.01, "tau2": 1.0,
                        "rank_counts_query": False, "simix": False,
                        "samples_per_class": 4}
_NEEDS_KEY = ("margin", "triplet", "recall_at_k", "subspace_arcface", "hier")
_PARAM.update({"large_margin_softmax": "class_weights",
               "sphereface": "class_weights", "p2s_grad": "class_weights",
               "manifold": "proxies"})
# Issue 41: Unicom's subspace ArcFace (the official retrieval scripts').
_SPEC["subspace_arcface"] = {"margin": 0.25, "scale": 32.0,
                             "num_features": 512, "straight_through": True}
_PARAM["subspace_arcface"] = "class_weights"
# Issue 41: Potential Field DML (defaults ours: no public code).
_SPEC["potential_field"] = {"alpha": 1.0, "delta": 0.5, "lambda_rep": 1.0,
                            "lambda_proxy": 1.0}
_PARAM["potential_field"] = "proxies"
# Issue #41: HIER (helper h41hier), at the official scripts' settings.
_SPEC["hier"] = {"delta": 0.1, "tau": 0.1, "topk": 20,
                 "triplets_per_anchor": 50, "c": 0.1, "r": 2.3,
                 "num_proxies": 512, "embed_inputs": True,
                 "riemannian": True, "self_negative": False}
_PARAM["hier"] = "proxies"
# VPTSP-G (Ren et al., ICLR 2024): the official CUB proxy_bias_ratio.
_SPEC["vptsp_proxy_anchor"] = {"proxy_bias_ratio": 0.5, "margin": 0.1,
                               "alpha": 32.0}
_PARAM["vptsp_proxy_anchor"] = "proxies"

C, D = 4, 8
Y = np.repeat(np.arange(C), 4)  # P x K = 4 x 4
X = np.random.default_rng(0).normal(size=(16, D)).astype(np.float32)


def test_names_kinds_params_and_paper_defaults():
  assert sorted(losses.LOSSES) == sorted(_SPEC)
  for name, entry in losses.LOSSES.items():
    assert isinstance(entry, losses.LossEntry) and entry.name == name
    assert entry.kind in ("pair", "proxy", "classifier")
    assert entry.param_name == _PARAM.get(name), name
    assert entry.kind == "pair" or entry.param_name is not None
    assert entry.needs_key == (name in _NEEDS_KEY)
    assert entry.paper and entry.reduction
    for key, value in _SPEC[name].items():
      assert entry.defaults[key] == value, (name, key)
    assert entry.geometry == (
        _GEOMETRY.get(name, "cosine") if entry.kind == "pair" else None)
    # Defaults are read from the signature: a single source of truth.
    params = inspect.signature(entry.fn).parameters
    for key, value in entry.defaults.items():
      assert params[key].default == value
    # The pair losses take axis_name among their shared **options.
    assert entry.supports_axis_name == ("axis_name" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()))
  with pytest.raises(TypeError):
    losses.LOSSES["circle"].defaults["margin"] = 1.0  # read-only


def test_get_loss_unknown_name_lists_the_known_ones():
  assert losses.get_loss("arcface") is losses.LOSSES["arcface"]
  with pytest.raises(ValueError, match="circle, circle_class_level"):
    losses.get_loss("circel")


@pytest.fixture(scope="module")
def round_trip():
  """Every entry initialised, called through ``apply`` under jit and
  differentiated w.r.t. the embeddings and its parameters: one program."""
  names = sorted(losses.LOSSES)
  init_key, loss_key = jax.random.split(jax.random.PRNGKey(1))
  hyper = {"soft_triple": {"centers_per_class": 2},
           # neighbourhoods smaller than the batch (else no negatives)
           "hier": {"topk": 4, "num_proxies": 16, "triplets_per_anchor": 4}}
  params = {
      n: losses.LOSSES[n].init_params(init_key, C, D, **hyper.get(n, {}))
      for n in names}

  @jax.jit
  def run(x, y, params):
    out = {}
    for n in names:
      entry = losses.LOSSES[n]
      f = lambda x, p: entry.apply(x, y, p, key=loss_key, **hyper.get(n, {}))
      out[n] = jax.value_and_grad(f, argnums=(0, 1))(x, params[n])
    return out
  return run(X, Y, params)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_SPEC))
def test_every_entry_initialises_runs_under_jit_and_differentiates(
    round_trip, name):
  value, (g_x, g_p) = round_trip[name]
  assert value.dtype == jnp.float32 and value.shape == ()
  assert np.isfinite(float(value))
  g_x = np.asarray(g_x)
  assert g_x.shape == (16, D) and np.all(np.isfinite(g_x))
  assert np.abs(g_x).max() > 0
  if losses.LOSSES[name].param_name is None:
    assert g_p is None
  else:
    assert np.all(np.isfinite(np.asarray(g_p))) and np.abs(g_p).max() > 0


# ----------------------------------------------------------------------------
# Defaults written once (issue 39): the signature, the rule, the registry.
# ----------------------------------------------------------------------------


class _Built(Exception):
  """Carries the rule a loss hands to an engine front end."""

  def __init__(self, rule):
    super().__init__()
    self.rule = rule


def _rule_built_by(entry, monkeypatch):
  """The rule ``entry.fn`` builds from its own defaults (None: no engine)."""
  from circle_jax.losses import engine

  def capture(rule, *args, **kwargs):
    raise _Built(rule)

  for front in ("embedding_loss", "matrix_loss", "class_level_loss"):
    monkeypatch.setattr(engine, front, capture)
  x, y = jnp.ones((4, 3)), jnp.array([0, 0, 1, 1])
  args = (x, y) if entry.param_name is None else (
      x, y, entry.init_params(jax.random.PRNGKey(0), 2, 3))
  kwargs = {"key": None} if entry.needs_key else {}
  try:  # traced abstractly: a loss without a rule is not run
    jax.eval_shape(lambda *a: entry.fn(*a, **kwargs), *args)
  except _Built as built:
    return built.rule
  return None


def _public_losses():
  """Every public function of ``circle_jax.losses`` defined in a loss
  module (the losses, their matrix forms, the pair weights, the miners)."""
  return [fn for name, fn in vars(losses).items()
          if inspect.isfunction(fn) and not name.startswith("_")
          and fn.__module__.startswith("circle_jax.losses.")
          and fn.__module__ != "circle_jax.losses.registry"]


@pytest.mark.parametrize("fn", _public_losses(), ids=lambda f: f.__name__)
def test_a_public_loss_is_a_plain_def_reading_its_defaults_from_one_place(
    fn):
  """``def name(...)`` in its module, and each default that is a field of a
  rule or declaration (``margin: float = Circle.margin``) is read from the
  field of the same name, with that field's value."""
  import ast
  import dataclasses

  source = inspect.getsource(fn)
  assert source.startswith(f"def {fn.__name__}("), source[:80]
  tree = ast.parse(source).body[0]
  params = inspect.signature(fn).parameters
  for arg, default in zip(tree.args.kwonlyargs, tree.args.kw_defaults):
    if isinstance(default, ast.Attribute):
      owner = eval(ast.unparse(default.value), fn.__globals__)  # noqa: S307
      assert dataclasses.is_dataclass(owner), (fn.__name__, arg.arg)
      assert default.attr == arg.arg, (fn.__name__, arg.arg, default.attr)
      assert params[arg.arg].default == getattr(owner, default.attr)


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_signature_rule_and_registry_defaults_agree(name, monkeypatch):
  """The registry's defaults are the signature's hyperparameters, and the
  rule a loss builds from them carries exactly those values: every field of
  the rule (but the shared ``geometry`` option and the form's
  ``on_distance``) is a keyword of the public loss."""
  entry = losses.get_loss(name)
  params = inspect.signature(entry.fn).parameters
  for key, value in entry.defaults.items():
    assert params[key].default == value, (name, key)
  rule = _rule_built_by(entry, monkeypatch)
  if rule is None:  # a loss written without a rule (e.g. the classifiers)
    return
  import dataclasses
  fields = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule)
            if f.name not in ("geometry", "on_distance")}
  missing = sorted(set(fields) - set(entry.defaults))
  assert not missing, (name, missing)
  for key, value in fields.items():
    assert value == entry.defaults[key], (name, key, value)


def test_the_rule_based_losses_are_checked_by_the_test_above(monkeypatch):
  """The agreement test reaches the rule of every loss that has one (it
  cannot pass vacuously)."""
  with_rule = [name for name, entry in losses.LOSSES.items()
               if _rule_built_by(entry, monkeypatch) is not None]
  assert {"circle", "unified", "circle_class_level", "multi_similarity",
          "ranked_list", "contrastive", "supcon", "nt_xent", "pairwise_ce",
          "pairwise_sigmoid"} <= set(with_rule)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(cases.FAMILY_FNS))
def test_contrastive_family_registered_with_paper_defaults_and_ranges(name):
  entry = losses.get_loss(name)
  assert entry.fn is cases.FAMILY_FNS[name] and entry.kind == "pair"
  assert entry.execution_options == ("block_size", "collective")
  assert {"c", "r"} <= set(entry.field_ranges())
  defaults = dict(entry.defaults)
  assert entry.geometry == ("poincare" if name == "pairwise_ce"
                            else "cosine")
  assert entry.geometry_defaults() == {
      "geometry": entry.geometry, "c": 0.1, "r": 2.3, "p": 2.0, "power": 1.0,
      "normalize_embeddings": True}
  with pytest.raises(ValueError, match="`c`"):
    losses.validate_hyper(name, c=-1.0)
  x, labels = cases.family_batch(), cases.FAMILY_LABELS
  np.testing.assert_allclose(
      float(entry.apply(jnp.asarray(x), jnp.asarray(labels))),
      loss_ref(name, x, labels, defaults), rtol=2e-5)


@pytest.mark.slow
def test_registry_apply_runs_both_ranking_losses():
  x = jnp.asarray(cases.ranking_batch())
  labels = jnp.asarray(cases.RANKING_LABELS)
  for name, (fn, _, key) in cases.RANKING_LOSS.items():
    entry = losses.get_loss(name)
    assert entry.kind == "pair" and entry.supports_ref
    assert key in entry.hyper_ranges
    np.testing.assert_allclose(
        float(entry.apply(x, labels, block_size=4)), float(fn(x, labels)),
        rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name,bad,message", [
    ("smooth_ap", {"tau": 1e-4}, "config.loss.tau: must be in [0.001, "
     "10000] for loss 'smooth_ap'"),
    ("fastap", {"L": 0}, "config.loss.L: must be in [1, 1000] for loss "
     "'fastap'"),
])
def test_the_trainer_takes_the_ranking_losses_by_name_and_checks_ranges(
    name, bad, message):
  from circle_jax import config as config_lib
  from circle_jax.train import config_checks
  from tests.train import helpers
  c = helpers.digits_config()
  c.loss = config_lib.loss_config(name, **bad)
  with pytest.raises(config_checks.ConfigError) as err:
    config_checks.check_config(c, device_count=8, process_count=1)
  assert str(err.value).startswith(message)
  c.loss = config_lib.loss_config(name, block_size=16)
  config_checks.check_config(c, device_count=8, process_count=1)
