"""Tests of circle_jax/models/convert.py: Keras ResNet and BN-Inception weights.

Parity tests compare our converted models with the source framework's own
forward pass on random weights: Keras' ResNet50 (needs keras==3.15.1 and
h5py==3.16.0) and a PyTorch functional transcription of Cadene's BN-Inception
(needs torch). Without those packages they skip; the NumPy-only tests of the
key mapping and of the error reports always run.
"""

import flax
import jax
import numpy as np
import pytest

from circle_jax import models
from circle_jax.models import convert
from tests.models import helpers

# Slow (compared with the reference framework): not in the fast tier.
pytestmark = pytest.mark.slow

# Non-square, so that a height/width swap cannot go unnoticed.
HW = (64, 96)


def _relative_error(got, want):
  return np.abs(np.asarray(got) - want).max() / np.abs(want).max()


def _features_fn(model):
  return jax.jit(lambda v, x: model.apply(v, x, train=False,
                                          method="features"))


# ---------------------------------------------------------------------------
# Keras ResNet50.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keras_resnet(tmp_path_factory):
  """A Keras ResNet50 with random weights, saved in the three file layouts."""
  keras = pytest.importorskip("keras")
  pytest.importorskip("h5py")
  from keras.src.legacy.saving import legacy_h5_format  # pylint: disable=g-import-not-at-top
  import h5py  # pylint: disable=g-import-not-at-top

  km = keras.applications.ResNet50(weights=None, include_top=False,
                                   input_shape=HW + (3,))
  rng = np.random.default_rng(0)
  for layer in km.layers:
    new = []
    for w in layer.weights:
      shape, name = tuple(w.shape), w.name
      if "variance" in name or "gamma" in name:
        v = rng.uniform(0.5, 1.5, shape)
      elif "kernel" in name:
        v = rng.normal(size=shape) * np.sqrt(2.0 / np.prod(shape[:-1]))
      else:
        v = rng.normal(size=shape) * 0.1
      new.append(v.astype(np.float32))
    if new:
      layer.set_weights(new)
  d = tmp_path_factory.mktemp("keras")
  files = {"weights.h5": d / "r.weights.h5", "keras": d / "r.keras",
           "legacy.h5": d / "r_legacy.h5"}
  km.save_weights(files["weights.h5"])
  km.save(files["keras"])
  with h5py.File(files["legacy.h5"], "w") as f:  # The layout Keras downloads.
    legacy_h5_format.save_weights_to_hdf5_group(f, km)
  x = rng.uniform(-1.0, 1.0, (2,) + HW + (3,)).astype(np.float32)
  return files, x, np.asarray(km(x, training=False))


@pytest.fixture(scope="module")
def resnet_model():
  model = models.get_model("resnet50", embedding_dim=8)
  shapes = helpers.variable_shapes(model, (1,) + HW + (3,))
  return model, helpers.random_variables(shapes), _features_fn(model)


def test_keras_resnet50_parity_for_every_file_layout(keras_resnet,
                                                      resnet_model):
  files, x, want = keras_resnet
  model, variables, features = resnet_model
  for layout in ("legacy.h5", "weights.h5", "keras"):
    converted = models.replace_backbone(
        variables, models.load_keras_resnet50(files[layout]))
    got = features(converted, x)
    assert got.shape == want.shape == (2, 2, 3, 2048), layout
    assert _relative_error(got, want) < 1e-5, layout


def test_keras_legacy_names_with_tf_suffix(tmp_path):
  h5py = pytest.importorskip("h5py")
  path = tmp_path / "tf.h5"
  with h5py.File(path, "w") as f:  # As in resnet50_..._notop.h5 (TF-Keras).
    f.attrs["layer_names"] = [b"conv1_conv", b"conv1_relu"]
    g = f.create_group("conv1_conv")
    g.attrs["weight_names"] = [b"conv1_conv/kernel:0", b"conv1_conv/bias:0"]
    g.create_dataset("conv1_conv/kernel:0", data=np.ones((7, 7, 3, 64)))
    g.create_dataset("conv1_conv/bias:0", data=np.arange(64.0))
    f.create_group("conv1_relu").attrs["weight_names"] = []
  layers = convert._read_keras_weights(str(path))
  assert sorted(layers) == ["conv1_conv"]
  np.testing.assert_array_equal(layers["conv1_conv"]["bias"], np.arange(64.0))
  assert layers["conv1_conv"]["kernel"].shape == (7, 7, 3, 64)


def _keras_layers_of_our_resnet():
  """``{keras layer: {weight: array}}`` with our ResNet-50's shapes."""
  shapes = helpers.variable_shapes(models.ResNet(), (1, 64, 64, 3))
  names = {("params", "kernel"): "kernel", ("params", "scale"): "gamma",
           ("batch_stats", "mean"): "moving_mean",
           ("batch_stats", "var"): "moving_variance"}
  layers = {}
  for col in ("params", "batch_stats"):
    for path, s in flax.traverse_util.flatten_dict(shapes[col]).items():
      lname, kind = convert._keras_layer(path[:-1])
      wname = names.get((col, path[-1]), "beta" if kind == "bn" else "bias")
      layers.setdefault(lname, {})[wname] = np.zeros(s.shape, np.float32)
  return layers


def test_keras_mismatches_are_listed():
  layers = _keras_layers_of_our_resnet()
  assert "conv3_block2_1_conv" in layers and "conv2_block1_0_bn" in layers
  convert.convert_keras_resnet(layers)  # complete: no error
  del layers["conv2_block1_1_conv"]["kernel"]
  layers["conv1_bn"]["gamma"] = np.ones(65, np.float32)
  layers["extra_dense"] = {"kernel": np.ones((2, 2))}
  layers["predictions"] = {"kernel": np.ones((2048, 1000))}  # always ignored
  with pytest.raises(models.ConversionError) as e:
    convert.convert_keras_resnet(layers)
  msg = str(e.value)
  assert "missing (1)" in msg and "conv2_block1_1_conv/kernel" in msg
  assert "conv1_bn/gamma: checkpoint (65,), model needs (64,)" in msg
  assert "unexpected" in msg and "extra_dense" in msg
  assert "predictions" not in msg
  layers["conv1_bn"]["gamma"] = np.ones(64, np.float32)
  with pytest.raises(models.ConversionError, match="missing") as e:
    convert.convert_keras_resnet(layers, strict=False)
  assert "extra_dense" not in str(e.value)


# ---------------------------------------------------------------------------
# BN-Inception (Cadene / pretrainedmodels layout).
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bn_inception_state_dict():
  """Random weights in the PyTorch layout, as Cadene's checkpoint has them."""
  shapes = helpers.variable_shapes(models.BNInception(), (1, 64, 64, 3))
  ours = helpers.random_variables(shapes, seed=3)
  sd = {}
  for path, v in flax.traverse_util.flatten_dict(ours["params"]).items():
    module, leaf = ".".join(path[:-1]), path[-1]
    if leaf == "kernel":
      sd[f"{module}.weight"] = np.ascontiguousarray(v.transpose(3, 2, 0, 1))
    elif leaf == "scale":
      sd[f"{module}.weight"] = v
    else:
      sd[f"{module}.bias"] = v
  for path, v in flax.traverse_util.flatten_dict(ours["batch_stats"]).items():
    sd[f"{path[0]}.running_{path[1]}"] = v
    sd[f"{path[0]}.num_batches_tracked"] = np.array(0, np.int64)
  sd["last_linear.weight"] = np.zeros((1000, 1024), np.float32)
  sd["last_linear.bias"] = np.zeros((1000,), np.float32)
  return sd


def test_bn_inception_npz_maps_every_tensor(tmp_path, bn_inception_state_dict):
  sd = bn_inception_state_dict
  path = tmp_path / "bninception.npz"
  np.savez(path, **sd)
  got = models.load_bn_inception(path)
  params, stats = got["params"], got["batch_stats"]
  # PyTorch [out, in, kh, kw] -> Flax [kh, kw, in, out], element by element.
  w = sd["inception_4a_double_3x3_1.weight"]            # [128, 96, 3, 3]
  k = params["inception_4a_double_3x3_1"]["kernel"]
  assert k.shape == (3, 3, 96, 128)
  assert k[2, 0, 5, 7] == w[7, 5, 2, 0] and k[1, 2, 95, 0] == w[0, 95, 1, 2]
  np.testing.assert_array_equal(params["conv1_7x7_s2_bn"]["scale"],
                                sd["conv1_7x7_s2_bn.weight"])
  np.testing.assert_array_equal(params["conv1_7x7_s2_bn"]["bias"],
                                sd["conv1_7x7_s2_bn.bias"])
  np.testing.assert_array_equal(params["conv1_7x7_s2"]["bias"],
                                sd["conv1_7x7_s2.bias"])
  np.testing.assert_array_equal(stats["inception_5b_pool_proj_bn"]["var"],
                                sd["inception_5b_pool_proj_bn.running_var"])
  n_params = sum(v.size for v in jax.tree.leaves(params))
  n_torch = sum(v.size for k, v in sd.items()
                if k.endswith((".weight", ".bias")) and "last_linear" not in k)
  assert n_params == n_torch == 10_270_240


def test_bn_inception_mismatches_are_listed(bn_inception_state_dict):
  sd = dict(bn_inception_state_dict)
  del sd["inception_3a_1x1_bn.running_var"]
  sd["inception_3a_3x3.weight"] = np.zeros((64, 64, 1, 1), np.float32)
  sd["aux_classifier.weight"] = np.zeros(3, np.float32)
  with pytest.raises(models.ConversionError) as e:
    models.convert_bn_inception(sd)
  msg = str(e.value)
  assert "inception_3a_1x1_bn.running_var" in msg
  assert ("inception_3a_3x3.weight: checkpoint (64, 64, 1, 1), model needs "
          "(64, 64, 3, 3)") in msg
  assert "aux_classifier.weight" in msg and "last_linear" not in msg


def _torch_bn_inception(torch, sd, x):
  """Cadene's BNInception.features, transcribed with torch.nn.functional."""
  f = torch.nn.functional
  t = {k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()}

  def cbr(x, name, stride=1):
    w = t[f"{name}.weight"]
    x = f.conv2d(x, w, t[f"{name}.bias"], stride=stride,
                 padding=w.shape[-1] // 2)
    x = f.batch_norm(x, t[f"{name}_bn.running_mean"],
                     t[f"{name}_bn.running_var"], t[f"{name}_bn.weight"],
                     t[f"{name}_bn.bias"], training=False, eps=1e-5)
    return f.relu(x)

  x = f.max_pool2d(cbr(x, "conv1_7x7_s2", 2), 3, 2, ceil_mode=True)
  x = cbr(cbr(x, "conv2_3x3_reduce"), "conv2_3x3")
  x = f.max_pool2d(x, 3, 2, ceil_mode=True)
  for b in ("3a", "3b", "3c", "4a", "4b", "4c", "4d", "4e", "5a", "5b"):
    p, reduction = f"inception_{b}", b in ("3c", "4e")
    s = 2 if reduction else 1
    outs = [] if reduction else [cbr(x, f"{p}_1x1")]
    outs.append(cbr(cbr(x, f"{p}_3x3_reduce"), f"{p}_3x3", s))
    y = cbr(cbr(x, f"{p}_double_3x3_reduce"), f"{p}_double_3x3_1")
    outs.append(cbr(y, f"{p}_double_3x3_2", s))
    if reduction:
      outs.append(f.max_pool2d(x, 3, 2, ceil_mode=True))
    elif b == "5b":
      outs.append(cbr(f.max_pool2d(x, 3, 1, 1, ceil_mode=True),
                      f"{p}_pool_proj"))
    else:
      outs.append(cbr(f.avg_pool2d(x, 3, 1, 1, ceil_mode=True,
                                   count_include_pad=True), f"{p}_pool_proj"))
    x = torch.cat(outs, 1)
  return x


def test_bn_inception_pth_parity_with_pytorch(tmp_path, bn_inception_state_dict):
  torch = pytest.importorskip("torch")
  sd = bn_inception_state_dict
  path = tmp_path / "bn_inception.pth"
  torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()}, path,
             _use_new_zipfile_serialization=False)  # as the 2017 checkpoint
  x = np.random.default_rng(5).uniform(-1, 1, (2,) + HW + (3,)).astype(
      np.float32)
  with torch.no_grad():
    want = _torch_bn_inception(
        torch, sd, torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
  model = models.get_model("bn_inception", embedding_dim=8)
  variables = helpers.random_variables(
      helpers.variable_shapes(model, (1,) + HW + (3,)))
  variables = models.replace_backbone(variables, models.load_bn_inception(path))
  got = np.asarray(_features_fn(model)(variables, x)).transpose(0, 3, 1, 2)
  assert got.shape == want.shape == (2, 1024, 2, 3)
  assert _relative_error(got, want) < 1e-5


def test_replace_backbone_rejects_weights_of_another_model(
    bn_inception_state_dict):
  conv4 = models.get_model("conv4", embedding_dim=8)
  variables = helpers.random_variables(
      helpers.variable_shapes(conv4, (1, 28, 28, 1)))
  with pytest.raises(models.ConversionError, match="block1_conv") as e:
    models.replace_backbone(
        variables, models.convert_bn_inception(bn_inception_state_dict))
  assert "inception_3a_1x1" in str(e.value)


# ---------------------------------------------------------------------------
# The first convolution on images of other channels (timm's rule).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("have,want", [(3, 1), (3, 2), (3, 4), (3, 7),
                                       (1, 3), (1, 2), (3, 3), (1, 1)])
def test_adapt_input_channels_is_timms_adapt_input_conv(have, want):
  from tests.models import timm_reference  # pylint: disable=g-import-not-at-top
  timm, torch = timm_reference.import_timm()
  from timm.models import _manipulate  # pylint: disable=g-import-not-at-top
  torch_kernel = np.random.default_rng(have * 10 + want).normal(
      size=(5, have, 3, 2)).astype(np.float32)          # [O, I, kh, kw]
  ref = _manipulate.adapt_input_conv(
      want, torch.from_numpy(torch_kernel.copy()), base_chans=have).numpy()
  got = convert.adapt_input_channels(torch_kernel.transpose(2, 3, 1, 0), want)
  assert got.dtype == np.float32 and got.shape == (3, 2, want, 5)
  np.testing.assert_allclose(got.transpose(3, 2, 0, 1), ref, rtol=1e-6,
                             atol=1e-6)
  del timm


def test_adapt_input_channels_by_hand():
  k = np.arange(2 * 3, dtype=np.float32).reshape(1, 1, 3, 2)  # [1,1,I=3,O=2]
  np.testing.assert_array_equal(convert.adapt_input_channels(k, 1)[0, 0],
                                [[0 + 2 + 4, 1 + 3 + 5]])
  # 3 -> 4: channels r, g, b, r, scaled by 3/4.
  np.testing.assert_allclose(convert.adapt_input_channels(k, 4)[0, 0],
                             0.75 * k[0, 0][[0, 1, 2, 0]])
  # A gray image tiled to RGB sees the same kernel response as the summed
  # kernel on the gray image; 1 -> 3 divides by 3 so the reverse holds too.
  g = np.array([[[[2.0, -1.0]]]], np.float32)                 # I=1, O=2
  np.testing.assert_allclose(convert.adapt_input_channels(g, 3)[0, 0],
                             [[2 / 3, -1 / 3]] * 3, rtol=1e-6)
  with pytest.raises(models.ConversionError, match="2-channel images"):
    convert.adapt_input_channels(np.ones((1, 1, 2, 4), np.float32), 3)


def test_grayscale_model_takes_rgb_bn_inception_weights(
    bn_inception_state_dict):
  """A 1-channel BN-Inception loads the RGB checkpoint with its first kernel
  summed over the channels, and then sees a gray image as the RGB model sees
  the same image tiled to three channels."""
  sd = bn_inception_state_dict
  got = models.convert_bn_inception(sd, in_channels=1)
  k = got["params"]["conv1_7x7_s2"]["kernel"]
  assert k.shape == (7, 7, 1, 64)
  np.testing.assert_allclose(
      k[..., 0, :], sd["conv1_7x7_s2.weight"].sum(1).transpose(1, 2, 0),
      rtol=1e-6)
  model = models.get_model("bn_inception", embedding_dim=8)
  gray = np.random.default_rng(1).uniform(-1, 1, (1,) + HW + (1,)).astype(
      np.float32)
  outs = []
  for x, in_channels in ((gray, 1), (np.repeat(gray, 3, -1), 3)):
    variables = helpers.random_variables(
        helpers.variable_shapes(model, x.shape))
    variables = models.replace_backbone(
        variables, models.convert_bn_inception(sd, in_channels=in_channels))
    outs.append(np.asarray(_features_fn(model)(variables, x)))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_grayscale_model_takes_rgb_keras_resnet_weights():
  layers = _keras_layers_of_our_resnet()
  rgb = np.random.default_rng(2).normal(size=(7, 7, 3, 64)).astype(np.float32)
  layers["conv1_conv"]["kernel"] = rgb
  got = convert.convert_keras_resnet(layers, in_channels=1)
  np.testing.assert_allclose(got["params"]["conv1_conv"]["kernel"],
                             rgb.sum(2, keepdims=True), rtol=1e-6)
  model = models.get_model("resnet50", embedding_dim=8)
  variables = helpers.random_variables(
      helpers.variable_shapes(model, (1, 32, 32, 1)))
  models.replace_backbone(variables, got)  # fits the 1-channel model


def test_a_misfit_names_its_first_problem_and_the_fix_on_the_first_line(
    bn_inception_state_dict):
  sd = dict(bn_inception_state_dict)
  sd["inception_3a_3x3.weight"] = np.zeros((64, 64, 1, 1), np.float32)
  del sd["inception_3a_1x1_bn.running_var"]
  with pytest.raises(models.ConversionError) as e:
    models.convert_bn_inception(sd)
  first = str(e.value).splitlines()[0]
  assert first.startswith(
      "The BN-Inception checkpoint does not match the model: shape mismatch "
      "inception_3a_3x3.weight: checkpoint (64, 64, 1, 1), model needs "
      "(64, 64, 3, 3) (and 1 more problem(s)); the weights are of another "
      "model or size: give the weights of --config.model.name")
  conv4 = models.get_model("conv4", embedding_dim=8)
  variables = helpers.random_variables(
      helpers.variable_shapes(conv4, (1, 28, 28, 1)))
  with pytest.raises(models.ConversionError) as e:
    models.replace_backbone(
        variables, models.convert_bn_inception(bn_inception_state_dict))
  first = str(e.value).splitlines()[0]
  assert "missing params/block1_" in first and "--config.model" in first
