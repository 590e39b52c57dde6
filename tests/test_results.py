"""Specification of circle_jax/results.py: the results table codec."""

import pathlib

import numpy as np
import pytest

from circle_jax import results

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_aggregate_is_mean_and_sample_std():
  s = results.aggregate([0.5, 0.6, 0.7])
  assert s.n == 3
  assert s.mean == pytest.approx(0.6)
  # ddof=1: sqrt((0.01 + 0 + 0.01) / 2) = 0.1 (ddof=0 would give 0.0816).
  assert s.std == pytest.approx(0.1)
  assert results.aggregate([0.25]) == results.Stat(0.25, None, 1)
  assert results.aggregate([]) is None


def test_table_rows_mean_std_in_percent_and_best_mean_bold():
  agg = results.aggregate
  summary = {
      "a": {"recall@1": agg([0.5, 0.7]), "map@r": agg([0.30, 0.34]),
            "train_seconds": agg([10.0, 20.0])},
      "b": {"recall@1": agg([0.62]), "map@r": agg([0.2]),
            "train_seconds": None},
  }
  table = results.table_markdown(
      summary, [("recall@1", "R@1"), ("map@r", "MAP@R")],
      {"a": (2, 2), "b": (1, 2)})
  # a: R@1 mean 60.0, std sqrt(2 * 10^2) = 14.14; MAP@R 32.0 +- 2.83;
  # train s 15 +- 7.07. b: one seed (no std), 1 of 2 runs complete.
  assert table.splitlines() == [
      "| loss | runs | R@1 | MAP@R | train s |",
      "| --- | ---: | ---: | ---: | ---: |",
      "| `a` | 2 | 60.0 ± 14.1 | **32.0 ± 2.8** | 15 ± 7 |",
      "| `b` | 1/2 | **62.0** | 20.0 | – |",
  ]


def test_table_bolds_every_loss_tied_at_the_shown_precision():
  agg = results.aggregate
  summary = {"a": {"nmi": agg([0.41, 0.43])}, "b": {"nmi": agg([0.4201])},
             "c": {"nmi": None}}
  rows = results.table_markdown(summary, [("nmi", "NMI")],
                                {"a": (2, 2), "b": (1, 1), "c": (0, 1)}
                                ).splitlines()[2:]
  assert rows == ["| `a` | 2 | **42.0 ± 1.4** | – |",
                  "| `b` | 1 | **42.0** | – |",
                  "| `c` | 0/1 | – | – |"]


def test_read_table_markdown_inverts_table_markdown_to_the_shown_digits():
  agg = results.aggregate
  summary = {"a": {"recall@1": agg([0.5, 0.7]), "map@r": agg([0.30, 0.34])},
             "b": {"recall@1": agg([0.62]), "map@r": None}}
  table = results.table_markdown(
      summary, [("recall@1", "R@1"), ("map@r", "MAP@R")],
      {"a": (2, 2), "b": (1, 2)})
  got = results.read_table_markdown("# title\n\n" + table + "\n\nmore text")
  assert list(got) == ["a", "b"]
  a, b = got["a"], got["b"]
  assert list(a) == ["R@1", "MAP@R"]           # no loss/runs/train s columns
  assert a["R@1"] == results.Stat(pytest.approx(0.600), pytest.approx(0.141),
                                  2)
  assert a["MAP@R"].mean == pytest.approx(0.320)    # bold best mean
  assert a["MAP@R"].std == pytest.approx(0.028)
  assert b["R@1"] == results.Stat(pytest.approx(0.62), None, 1)  # 1 of 2 runs
  assert b["MAP@R"] is None
  with pytest.raises(ValueError, match="no '| loss | runs"):
    results.read_table_markdown("| a | b |\n| --- | --- |")
  with pytest.raises(ValueError, match="'6O.0 ± 14.1' is not"):
    results.read_table_markdown(table.replace("60.0", "6O.0"))


def test_committed_results_tables_read_back():
  for name, losses in (("digits", 17), ("omniglot_small", 17)):
    text = (REPO / "experiments/results/compare"
            / f"losses_{name}.md").read_text()
    rows = results.read_table_markdown(text)
    assert len(rows) == losses and all(
        s is not None and s.n == 3 and s.std is not None
        and 0 < s.mean < 1 for row in rows.values() for s in row.values())


@pytest.mark.parametrize("scale, digits", [(100.0, 1), (1.0, 0), (1.0, 3)])
def test_parse_stat_is_the_inverse_of_format_stat(scale, digits):
  rng = np.random.default_rng(0)
  for mean, std in zip(rng.uniform(-2, 2, 50), rng.uniform(0, 1, 50)):
    for stat in (results.Stat(float(mean), float(std), 3),
                 results.Stat(float(mean), None, 1)):
      text = results.format_stat(stat, scale, digits)
      back = results.parse_stat(text, scale, stat.n)
      # Back to the shown digits: half a unit of the last digit, scaled.
      tol = 0.5 * 10.0**-digits / scale + 1e-12
      assert back.n == stat.n
      assert back.mean == pytest.approx(stat.mean, abs=tol)
      if stat.std is None:
        assert back.std is None
      else:
        assert back.std == pytest.approx(stat.std, abs=tol)
      # And format_stat inverts parse_stat exactly on shown texts.
      assert results.format_stat(back, scale, digits) == text
      assert results.parse_stat(f"**{text}**", scale, stat.n) == back
  assert results.format_stat(None) == "–"
  assert results.parse_stat("–") is None


@pytest.mark.parametrize("text", ["", "61.2 +- 0.4", "61.2 ± ", "abc",
                                  "± 0.4"])
def test_parse_stat_rejects_other_forms(text):
  with pytest.raises(ValueError, match="is not 'mean ± std'"):
    results.parse_stat(text)


def test_table_markdown_of_read_table_markdown_is_the_committed_table():
  """Reading a committed table and writing it again gives the same rows."""
  text = (REPO / "experiments/results/compare/losses_digits.md").read_text()
  rows = results.read_table_markdown(text)
  lines = text.splitlines()
  start = next(i for i, l in enumerate(lines)
               if l.startswith("| loss | runs |"))
  titles = [t.strip() for t in lines[start].strip("|").split("|")][2:-1]
  summary = {loss: dict(row) for loss, row in rows.items()}
  counts = {loss: (next(iter(row.values())).n,) * 2
            for loss, row in rows.items()}
  table = results.table_markdown(summary, [(t, t) for t in titles], counts,
                                 scale=100.0, digits=1)
  written = [" | ".join(l.split(" | ")[:-1]) for l in table.splitlines()]
  committed = [" | ".join(l.split(" | ")[:-1])
               for l in lines[start:start + 2 + len(rows)]]
  assert written[2:] == committed[2:]


# ----------------------------------------------------------------------------
# The protocol lines.
# ----------------------------------------------------------------------------


def test_selection_on_validation_and_test_is_stated():
  def run(selection):
    return {"result": {"selection": selection, "metric": "recall@1",
                       "test": {}}}
  cfg = {"eval_every_steps": 500}
  assert results.describe_selection(cfg, [run("validation")]).startswith(
      "the step with the best validation recall@1 (held-out train classes)")
  text = results.describe_selection(cfg, [run("test")])
  assert "best **test** recall@1" in text and "optimistic" in text
  assert text.endswith("(evaluated every 500 steps and at the end)")


def test_describe_model_batch_and_optimiser():
  cfg = {
      "model": {"name": "conv4", "kwargs": {"width": 64}, "embedding_dim": 64,
                "pooling": "avg", "dtype": "float32", "pretrained": "",
                "freeze_bn": False},
      "batch": {"sampler": "pk", "classes_per_batch": 32,
                "images_per_class": 4},
      "optim": {"name": "sgd", "learning_rate": 0.1, "weight_decay": 5e-4,
                "momentum": 0.9, "schedule": "step", "decay_factor": 0.1,
                "decay_every_steps": 1000, "lr_warmup_steps": 0,
                "lr_multipliers": {"loss": 10.0, "model": 1.0}},
  }
  assert results.describe_model(cfg) == (
      "conv4 (width=64), avg pooling, embedding dim 64, float32, trained "
      "from scratch")
  assert results.describe_batch(cfg) == (
      "P x K = 32 classes x 4 images = 128")
  assert results.describe_batch({"batch": {"sampler": "random", "size": 60}}
                                ) == "60 random images"
  assert results.describe_batch({"batch": {
      "sampler": "views", "classes_per_batch": 32, "images_per_class": 2}}
      ) == "32 images x 2 augmented views = 64 (each image its own label)"
  assert results.describe_optim(cfg) == (
      "sgd, lr 0.1, weight decay 0.0005, momentum 0.9, step schedule (x0.1 "
      "every 1000 steps), lr x 10 (loss)")


def test_hyperparameter_lines_mark_values_off_the_paper_default():
  lines = results.hyperparameter_lines({
      "circle": {"loss": {"name": "circle", "margin": 0.4, "gamma": 80.0,
                          "block_size": 512}},
      "multi_similarity": {"loss": {"name": "multi_similarity",
                                    "alpha": 2.0, "beta": 40.0,
                                    "base": 0.5, "epsilon": 0.1}}})
  assert lines[:2] == ["| loss | hyperparameters | learnable | source |",
                       "| --- | --- | --- | --- |"]
  circle, ms = lines[2:]
  # The registry's defaults (margin 0.4, gamma 80) are not marked; an
  # execution option (block_size) is listed as it is.
  assert circle.startswith(
      "| `circle` | `margin=0.4`, `gamma=80.0`, `block_size=512` | none | "
      "Sun et al.")
  assert ms.startswith("| `multi_similarity` | `alpha=2.0`, `beta=40.0` "
                       "(paper default 50.0), `base=0.5`, `epsilon=0.1` |")


def test_terms_added_to_the_loss_get_their_own_rows_and_protocol_line():
  """A config with ``more_losses`` (HIER on Proxy-Anchor) names the added
  term in the protocol and lists its hyperparameters under the loss's, so
  a table of such runs cannot read as the loss alone."""
  cfg = {"loss": {"name": "proxy_anchor", "alpha": 32.0, "margin": 0.1},
         "more_losses": {"hier": {
             "name": "hier", "weight": 0.5, "miner": {"name": ""},
             "topk": 20, "delta": 0.2, "num_proxies": 512}}}
  lines = results.hyperparameter_lines({"proxy_anchor": cfg})
  loss, term = lines[2:]
  assert loss.startswith("| `proxy_anchor` | `alpha=32.0`, `margin=0.1` |")
  assert term.startswith(
      "| + 0.5 x `hier` (more_losses.hier) | `topk=20`, `delta=0.2` (paper "
      "default 0.1), `num_proxies=512` | `proxies`:")
  assert "weight" not in term and "miner" not in term
  assert term.endswith("| Kim, Jeong & Kwak, \"HIER: Metric Learning Beyond "
                       "Class Labels via Hierarchical Regularization\", CVPR "
                       "2023 |")
  assert results.describe_more_losses(cfg) == (
      "0.5 x `hier` (Kim, Jeong & Kwak, \"HIER: Metric Learning Beyond Class "
      "Labels via Hierarchical Regularization\", CVPR 2023)")
  assert results.describe_more_losses({"loss": cfg["loss"]}) == ""
  assert len(results.hyperparameter_lines({"proxy_anchor": {
      "loss": cfg["loss"]}})) == 3


def test_describe_data_names_class_copies_and_held_out_alphabets():
  cfg = {"dataset": {"name": "omniglot_small", "rotations": 4,
                     "mirror_classes": True}}
  metrics = [{"result": {"test": {"num_queries": 2120}},
              "validation": {"num_classes": 22, "num_images": 440,
                             "fraction": 0.2, "by": "superclass"}}]
  text = results.describe_data(cfg, metrics)
  assert text.startswith(
      "omniglot_small: train on 114 classes x 4 rotations x 2 mirror images "
      "= 912 classes (dataset.rotations=4, dataset.mirror_classes=True), "
      "select on 22 held-out train classes of held-out alphabets (440 "
      "images, dataset.validation_fraction=0.2, "
      "dataset.validation_by=superclass); test on 106 unseen classes"), text
  metrics[0]["validation"]["by"] = "class"
  cfg["dataset"].update(rotations=1, mirror_classes=False)
  assert results.describe_data(cfg, metrics).startswith(
      "omniglot_small: train on 114 classes, select on 22 held-out train "
      "classes (440 images, dataset.validation_fraction=0.2); test on 106")
