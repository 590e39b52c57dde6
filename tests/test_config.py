"""The config schema: defaults, locking, loss sections, saved configs."""

import json
import os

from absl import flags
import ml_collections
import pytest

from circle_jax import config as config_lib
from circle_jax import config_flag
from circle_jax import config_facts
from circle_jax import errors
from circle_jax import losses
from circle_jax.train import config_checks
from circle_jax.train import workdir as workdir_lib
from tests.train import helpers

# config.json as the code before the schema moved into the package wrote it
# (the digits job of commit 2c032ff).
OLD_DIGITS = os.path.join(os.path.dirname(__file__), "train", "data",
                          "digits_config_2c032ff.json")


@pytest.fixture
def config_file(tmp_path):
  """A config file built on the schema (a digits run)."""
  path = tmp_path / "tiny_config.py"
  path.write_text(
      "from circle_jax import config as config_lib\n\n"
      "def get_config():\n"
      "  c = config_lib.base_config()\n"
      "  c.loss = config_lib.loss_config('circle', gamma=80.0, margin=0.4)\n"
      "  c.batch.classes_per_batch = 5\n"
      "  return c\n")
  return str(path)


def parse(config_file, *overrides, define=config_flag.DEFINE_config_file):
  """The config that the --config flag (``define``) builds from these flags."""
  argv = ["main", f"--config={config_file}", *overrides]
  fv = flags.FlagValues()
  holder = define("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  return holder.value


def test_every_field_has_one_default_and_a_comment():
  c = config_lib.base_config()
  assert c.dataset.num_threads == 4
  assert c.eval_every_steps == c.checkpoint_every_steps == 500
  assert c.parallelism == "shard_map" and config_lib.PARALLELISM == (
      "shard_map", "pmap", "none")
  source = open(config_lib.__file__).read()
  body = source[source.index("def base_config"):source.index("def lock(")]
  for line in body.splitlines():
    if (line.lstrip().startswith("c.") and " = " in line
        and not line.rstrip().endswith("= Config()")):
      field = line.split("=")[0].strip()
      preceding = body[:body.index(line)].splitlines()[-1].strip()
      assert "#" in line or preceding.startswith("#"), field


def test_misspelt_fields_are_errors_naming_the_close_match(config_file):
  c = config_lib.base_config()
  want = ("config.optim.learing_rate: the config does not have this field; "
          "did you mean config.optim.learning_rate?")
  with pytest.raises(AttributeError) as err:
    c.optim.learing_rate = 1e-3
  assert str(err.value) == want
  with pytest.raises(AttributeError, match="config.loss.gama: .* config.loss"
                     ".gamma"):
    print(c.loss.gama)
  with pytest.raises(flags.IllegalFlagValueError) as err:
    parse(config_file, "--config.optim.learing_rate=1e-3")
  assert str(err.value) == want
  with open(config_file, "a") as f:
    f.write("\ndef get_config():  # noqa\n"
            "  c = config_lib.base_config()\n"
            "  c.optim.learing_rate = 1e-3\n"
            "  return c\n")
  with pytest.raises(flags.IllegalFlagValueError) as err:
    parse(config_file)
  assert str(err.value) == want
  # The free-form sections take new keys in config files.
  c.model.kwargs.width = 32
  c.dataset.preprocess.image_size = 224
  assert c.model.kwargs.width == 32


def _option_fields(name):
  """A loss section's `reduction` and regularizer fields (issue 40)."""
  entry = losses.get_loss(name)
  return {**dict.fromkeys(entry.reduction_fields()),
          **config_lib.regularizer_fields(entry)}


def test_loss_config_lists_every_hyperparameter_and_rejects_unknown_ones():
  for name, entry in losses.LOSSES.items():
    c = config_lib.loss_config(name)
    want = dict(entry.defaults, name=name, **entry.geometry_defaults(),
                **_option_fields(name))
    want.update(dict.fromkeys(entry.execution_options))
    if entry.shards_classes:  # the class matrix's layout (class_shard.Layout)
      want["shard_classes"] = False
    if entry.samples_classes:
      want["sample_rate"] = 1.0
    assert dict(c) == want, name
    with pytest.raises(AttributeError, match="does not have this field"):
      c.not_a_hyperparameter = 1.0
  with pytest.raises(ValueError, match="has no hyperparameter"):
    config_lib.loss_config("circle", alpha=1.0)


def test_loss_name_swaps_in_that_losses_own_defaults(config_file):
  c = parse(config_file, "--config.loss.name=multi_similarity")
  assert dict(c.loss) == {"name": "multi_similarity", "alpha": 2.0,
                          "beta": 50.0, "base": 0.5, "epsilon": 0.1,
                          "mining": True, "block_size": None,
                          "collective": None, "geometry": "cosine",
                          "c": 0.1, "r": 2.3, "p": 2.0, "power": 1.0,
                          "normalize_embeddings": True,
                          **_option_fields("multi_similarity")}
  # Circle's class-level variant gets its own gamma/m, not Circle's.
  c = parse(config_file, "--config.loss.name=circle_class_level")
  assert (c.loss.gamma, c.loss.margin) == (256.0, 0.25)


@pytest.mark.parametrize("order", [0, 1])
def test_hyperparameter_overrides_apply_in_any_order(config_file, order):
  flags_ = ["--config.loss.name=multi_similarity", "--config.loss.beta=40",
            "--config.loss.mining=false"]
  if order:
    flags_ = flags_[::-1]
  c = parse(config_file, *flags_)
  assert (c.loss.name, c.loss.beta, c.loss.mining, c.loss.alpha) == (
      "multi_similarity", 40.0, False, 2.0)


def test_the_files_loss_values_stay_without_a_name_change(config_file):
  c = parse(config_file, "--config.loss.gamma=64", "--config.loss.name=circle")
  assert (c.loss.gamma, c.loss.margin) == (64.0, 0.4)
  c = parse(config_file, "--config.loss.block_size=512",
            "--config.loss.collective=ring")
  assert c.loss.block_size == 512 and c.loss.gamma == 80.0
  assert c.loss.collective == "ring"


def test_unknown_loss_or_hyperparameter_names_what_is_accepted(config_file):
  with pytest.raises(flags.IllegalFlagValueError,
                     match=r"config\.loss\.gamma: loss 'multi_similarity' has "
                           r"no hyperparameter 'gamma'; it accepts \['alpha'"):
    parse(config_file, "--config.loss.name=multi_similarity",
          "--config.loss.gamma=3")
  with pytest.raises(flags.IllegalFlagValueError,
                     match="unknown loss 'circel'; known losses: angular, arcface"):
    parse(config_file, "--config.loss.name=circel")
  with pytest.raises(flags.IllegalFlagValueError, match="block_size"):
    parse(config_file, "--config.loss.name=proxy_anchor",
          "--config.loss.block_size=64")


def test_a_config_json_of_the_code_before_the_schema_moved_still_loads():
  with open(OLD_DIGITS) as f:
    old = json.load(f)
  c = config_lib.from_dict(old)
  assert isinstance(c, ml_collections.ConfigDict) and c.is_locked
  # Fields added since are at their defaults (config_diff reads them so).
  assert workdir_lib.config_diff(old, workdir_lib.config_to_dict(c)) == []
  new = workdir_lib.flatten(workdir_lib.config_to_dict(c))
  # (An empty section then, dataset.preprocess, has a field now.)
  flat_old = {k: v for k, v in workdir_lib.flatten(old).items() if v != {}}
  assert {k: new[k] for k in flat_old} == flat_old
  # ... and is the run the digits config trains: its workdirs resume.
  assert workdir_lib.config_diff(
      old, workdir_lib.config_to_dict(helpers.digits_config())) == []


def test_a_saved_config_with_unknown_fields_is_refused_in_one_line():
  with open(OLD_DIGITS) as f:
    old = json.load(f)
  old["optim"]["lr_decay"] = 0.5
  with pytest.raises(config_lib.SavedConfigError) as err:
    config_lib.from_dict(old, source="/w/config.json")
  (line,) = str(err.value).splitlines()
  assert line.startswith("/w/config.json does not fit this version's config "
                         "fields (")
  assert "lr_decay" in line and line.endswith("another --workdir.")
  old["optim"].pop("lr_decay")
  old["loss"]["gama"] = 80.0
  with pytest.raises(config_lib.SavedConfigError, match="gama"):
    config_lib.from_dict(old)


def test_contrastive_losses_and_the_poincare_geometry_by_flag(config_file):
  c = parse(config_file, "--config.loss.geometry=poincare",
            "--config.loss.name=supcon")
  assert dict(c.loss) == {"name": "supcon", "tau": 0.1,
                          "geometry": "poincare", "c": 0.1, "r": 2.3,
                          "p": 2.0, "power": 1.0,
                          "normalize_embeddings": True,
                          "block_size": None, "collective": None,
                          **_option_fields("supcon")}
  c = parse(config_file, "--config.loss.geometry=lp", "--config.loss.p=1",
            "--config.loss.normalize_embeddings=false")
  assert (c.loss.geometry, c.loss.p, c.loss.normalize_embeddings) == (
      "lp", 1.0, False)
  c = parse(config_file, "--config.loss.name=pairwise_ce")
  assert (c.loss.geometry, c.loss.tau) == ("poincare", 0.2)
  for name in ("nt_xent", "pairwise_sigmoid"):
    c = parse(config_file, f"--config.loss.name={name}")
    assert c.loss.geometry == "cosine"
  c = parse(config_file, "--config.loss.geometry=poincare",
            "--config.loss.c=0.5")
  assert (c.loss.name, c.loss.geometry, c.loss.c) == ("circle", "poincare",
                                                      0.5)
  assert config_lib.loss_config("n_pair").geometry == "dot"
  assert config_lib.loss_config("arcface").get("geometry") is None


def test_the_loss_options_are_read_from_the_engine_and_the_layout():
  """The config writes no list of execution or class-layout options: each
  loss's come from the registry entry, their types from the engine's
  signature, the layout's defaults from class_shard.Layout."""
  layout = losses.class_shard.Layout()
  for name, entry in losses.LOSSES.items():
    c = config_lib.loss_config(name)
    for option in entry.execution_options:
      assert c[option] is None, (name, option)
    types = config_lib.execution_option_types(entry)
    assert types == {k: {"block_size": int, "collective": str}[k]
                     for k in entry.execution_options}, name
    own = config_lib.class_layout_defaults(entry)
    assert own == {k: getattr(layout, k) for k in own}, name
    assert not set(own) & set(config_lib.LAYOUT_SET_BY_TRAINER)
    assert ("shard_classes" in own) == entry.shards_classes, name
    assert ("sample_rate" in own) == entry.samples_classes, name
  assert config_lib.loss_config("circle").get_type("block_size") is int
  assert config_lib.loss_config("circle").get_type("collective") is str


def test_the_geometry_says_whether_the_head_normalises():
  def config(**loss):
    c = config_lib.base_config()
    with c.unlocked():
      c.loss = config_lib.loss_config(**loss)
    return c
  engine = losses.engine
  assert engine.resolve_geometry("cosine").head_normalizes
  assert engine.resolve_geometry("dot").head_normalizes
  assert not losses.hyperbolic.Poincare(c=0.5).head_normalizes
  for name in engine.geometry_names():
    want = engine.resolve_geometry(name).head_normalizes
    assert config_facts.head_normalizes(
        config(name="supcon", geometry=name)) is want, name
  assert not config_facts.head_normalizes(config(name="pairwise_ce"))
  assert config_facts.head_normalizes(config(name="arcface"))  # no geometry


def test_a_loss_section_holds_another_losses_field_until_the_switch():
  c = config_lib.loss_config("circle")
  c["beta"] = 40                    # what --config.loss.beta=40 does
  assert c.held == {"beta": 40} and "beta" not in c
  with pytest.raises(config_lib.ConfigFieldError, match="config.loss.beta"):
    c.beta = 40                     # a config file's typo-safe assignment
  with pytest.raises(AttributeError, match="did you mean config.loss.gamma"):
    c["gama"] = 1.0                 # no loss has it: refused at once
  config = config_lib.base_config()
  config.loss = c
  with pytest.raises(config_lib.ConfigValueError,
                     match=r"config\.loss\.beta: loss 'circle' has no "
                           r"hyperparameter 'beta'"):
    config_flag.switch_loss(config, {"loss.beta": 40}, "circle")
  overrides = {"loss.beta": 40, "loss.name": "multi_similarity"}
  config_flag.switch_loss(config, overrides, "circle")
  assert (config.loss.name, config.loss.beta, config.loss.alpha) == (
      "multi_similarity", 40.0, 2.0)
  assert config.loss.held == {} and config.loss.is_locked
  # A config still holding one does not train: the checker refuses it.
  config = helpers.digits_config()
  config.loss["beta"] = 40
  with pytest.raises(config_checks.ConfigError,
                     match=r"config\.loss\.beta: loss 'circle' has no "):
    config_checks.check_config(config, device_count=1, process_count=1)


def test_config_errors_are_flag_errors_and_user_errors(config_file):
  """On the command line a refused field is an absl flag error (absl prints
  its one line); in Python an AttributeError; for the tools a UserError."""
  with pytest.raises(config_lib.ConfigFieldError) as err:
    parse(config_file, "--config.optim.learing_rate=1e-3")
  assert all(isinstance(err.value, kind) for kind in (
      flags.IllegalFlagValueError, AttributeError, errors.UserError))
  with pytest.raises(config_lib.ConfigValueError) as err:
    parse(config_file, "--config.model.name=vgg")
  assert all(isinstance(err.value, kind) for kind in (
      flags.IllegalFlagValueError, ValueError, errors.UserError))
  # ml_collections' FlagOrderError: an override of a field, then of its
  # section, is refused as before.
  with pytest.raises(flags.Error):
    parse(config_file, "--config.model.kwargs.width=3",
          "--config.model.kwargs={}")


def test_reduction_regularizers_and_more_losses_by_flag_and_saved(
    config_file):
  """Issue 40: a pair loss's `reduction` and its parameters, the
  regularizers (the `weight_*` ones only with a class matrix), and
  `more_losses` terms, set on the command line and reloaded from a saved
  config.json."""
  c = parse(config_file, "--config.loss.name=contrastive",
            "--config.loss.reduction=threshold",
            "--config.loss.reduction_low=0.1",
            "--config.loss.embedding_regularizer=lp")
  assert (c.loss.reduction, c.loss.reduction_low, c.loss.reduction_high,
          c.loss.embedding_regularizer) == ("threshold", 0.1, None, "lp")
  assert "weight_regularizer" not in c.loss
  assert "weight_regularizer" in config_lib.loss_config("arcface")
  c.more_losses.cls = config_lib.more_loss("normface", weight=0.5, scale=16.0)
  saved = json.loads(json.dumps(c.to_dict()))
  back = config_lib.from_dict(saved)
  assert (back.more_losses.cls.name, back.more_losses.cls.weight,
          back.more_losses.cls.scale) == ("normface", 0.5, 16.0)
  assert back.loss.reduction_low == 0.1
  [(key, entry, weight, hyper)] = config_facts.more_losses(back)
  assert (key, entry.name, weight, hyper["scale"]) == (
      "cls", "normface", 0.5, 16.0)
