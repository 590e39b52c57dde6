"""The report of a loss comparison: ``OUT.md`` (tables) and ``OUT.png``.

From the runs of ``experiments/compare/losses.py`` (its ``Run`` objects: loss,
seed, config, status, ``metrics.json``, wall time, machine), writes the
protocol (``circle_jax.results.describe_*``), the results table
(:func:`circle_jax.results.table_markdown`), the few-shot table when the
runs report episodic few-shot accuracy (``fewshot_{N}way_{K}shot`` keys of
``metrics.json``) with a row per ablation, the hyperparameters, every run,
optional notes, and the bar chart (``experiments/figures/plots.py``).
"""

from __future__ import annotations

import datetime
import math
import pathlib
import re
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from circle_jax import hostenv
from circle_jax import results
from circle_jax.results import Stat, aggregate, format_stat, table_markdown

# (metrics.json key, column title) in table order; recall@K columns are
# inserted after P@1 for every K the runs report.
_HEAD_METRICS = (("precision@1", "P@1"),)
_TAIL_METRICS = (("map@r", "MAP@R"), ("nmi", "NMI"))
# The chart's panels.
PLOT_METRICS = (("recall@1", "R@1"), ("map@r", "MAP@R"))
_FEWSHOT = re.compile(r"fewshot_(\d+)way_(\d+)shot")


def _variant(run) -> str:
  return getattr(run, "variant", "")


# ----------------------------------------------------------------------------
# Aggregation.
# ----------------------------------------------------------------------------


def metric_columns(runs: Sequence[Any]) -> List[Tuple[str, str]]:
  """``(key, title)`` of the table: P@1, R@K for every K, MAP@R, NMI."""
  keys = set()
  for r in runs:
    if r.metrics is not None:
      keys.update(r.metrics["result"]["test"])
  ks = sorted(int(k.split("@")[1]) for k in keys
              if re.fullmatch(r"recall@\d+", k))
  return (list(_HEAD_METRICS) + [(f"recall@{k}", f"R@{k}") for k in ks]
          + list(_TAIL_METRICS))


def summarize(runs: Sequence[Any], losses: Sequence[str],
              keys: Sequence[str]) -> Dict[str, Dict[str, Optional[Stat]]]:
  """``{loss: {metric: Stat over the loss's complete runs}}``.

  Besides the metric keys, ``"train_seconds"`` (metrics.json) and
  ``"wall_seconds"`` (the process) are aggregated too.
  """
  out = {}
  for loss in losses:
    done = [r for r in runs if r.loss == loss and r.metrics is not None]
    row = {}
    for key in keys:
      row[key] = aggregate([r.metrics["result"]["test"][key] for r in done
                            if r.metrics["result"]["test"].get(key)
                            is not None])
    row["train_seconds"] = aggregate(
        [r.metrics["train_seconds"] for r in done
         if r.metrics.get("train_seconds") is not None])
    row["wall_seconds"] = aggregate(
        [r.wall_seconds for r in done if r.wall_seconds is not None])
    out[loss] = row
  return out


def fewshot_columns(runs: Sequence[Any]) -> List[Tuple[str, str]]:
  """``(key, title)`` of every ``fewshot_{N}way_{K}shot`` accuracy the runs
  report, by N then K (``[]`` when none does)."""
  found = set()
  for r in runs:
    if r.metrics is not None:
      for key in r.metrics["result"]["test"]:
        m = _FEWSHOT.fullmatch(key)
        if m:
          found.add((int(m.group(1)), int(m.group(2))))
  return [(f"fewshot_{n}way_{k}shot", f"{n}-way {k}-shot")
          for n, k in sorted(found)]


def t95(n: int) -> float:
  """Student's t quantile 0.975 with ``n - 1`` degrees of freedom."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  return float(stats.t.ppf(0.975, n - 1))


def seed_ci95(stat: Optional[Stat]) -> Optional[Stat]:
  """``stat`` with the half-width of the 95 % Student-t confidence interval
  of the mean over the seeds, ``t95(n) * std / sqrt(n)``, in place of the
  standard deviation (unchanged for one seed)."""
  if stat is None or stat.std is None:
    return stat
  return Stat(stat.mean, t95(stat.n) * stat.std / math.sqrt(stat.n), stat.n)


def variant_groups(runs: Sequence[Any], losses: Sequence[str],
                   ablations: Sequence[Tuple[str, Sequence[str]]]
                   ) -> List[Tuple[str, List[Any]]]:
  """``(row label, runs)``: each loss, then each ablation as ``loss (NAME)``."""
  groups = [(loss, [r for r in runs if not _variant(r) and r.loss == loss])
            for loss in losses]
  for name, _ in ablations:
    rs = [r for r in runs if _variant(r) == name]
    if rs:
      groups.append((f"{rs[0].loss} ({name})", rs))
  return groups


def fewshot_rows(runs: Sequence[Any], losses: Sequence[str],
                 ablations: Sequence[Tuple[str, Sequence[str]]],
                 keys: Sequence[str]):
  """``(summary, counts)`` for :func:`circle_jax.results.table_markdown`:
  a row per :func:`variant_groups` group, few-shot cells :func:`seed_ci95`."""
  summary, counts = {}, {}
  for label, rs in variant_groups(runs, losses, ablations):
    row = summarize(rs, [rs[0].loss], keys)[rs[0].loss]
    summary[label] = {k: seed_ci95(v) if k in keys else v
                      for k, v in row.items()}
    counts[label] = (sum(r.metrics is not None for r in rs), len(rs))
  return summary, counts


def chart_panels(runs: Sequence[Any]) -> Tuple[Tuple[str, str], ...]:
  """The chart's ``(key, title)`` panels: :data:`PLOT_METRICS`, or R@1 and
  the hardest 1-shot accuracy (largest N) when the runs report few-shot."""
  one_shot = [c for c in fewshot_columns(runs) if c[0].endswith("way_1shot")]
  return (PLOT_METRICS[0], one_shot[-1]) if one_shot else PLOT_METRICS


def _fewshot_lines(runs, losses, ablations) -> List[str]:
  """The few-shot section ([] when the runs report no few-shot accuracy)."""
  columns = fewshot_columns(runs)
  if not columns:
    return []
  keys = [k for k, _ in columns]
  summary, counts = fewshot_rows(runs, losses, ablations, keys)
  fs = next(r.metrics for r in runs if r.metrics is not None)["config"].get(
      "fewshot", {})
  lines = [
      "## Few-shot accuracy", "",
      "Episodic N-way K-shot classification of the test split's unseen "
      f"classes with the embedding of the reported step: {fs.get('episodes')}"
      f" episodes per setting, {fs.get('queries')} queries per class, "
      f"classifier `{fs.get('classifier')}`, episode seed {fs.get('seed')}. "
      "Cells: accuracy in %, mean over the seeds ± the half-width of the 95 % "
      "Student-t confidence interval of that mean (t(0.975, n-1) x std / "
      "sqrt(n), n seeds); the runs table gives each run's episode interval.",
      "", table_markdown(summary, columns, counts), ""]
  labels = list(summary)[len(losses):]
  lines += [f"- `{label}`: `{' '.join(more)}`"
            for label, (_, more) in zip(labels, ablations)]
  # The hardest 1-shot setting (largest N): its lowest error.
  one_shot = [k for k in keys if k.endswith("way_1shot")]
  if one_shot:
    key = max(one_shot, key=lambda k: int(_FEWSHOT.fullmatch(k).group(1)))
    rows = [(lbl, row[key]) for lbl, row in summary.items()
            if row.get(key) is not None]
    lbl, st = max(rows, key=lambda lr: lr[1].mean)
    ci = f" ± {100 * st.std:.1f}" if st.std is not None else ""
    lines += ["", f"Lowest {dict(columns)[key]} error (100 - accuracy): "
              f"{100 * (1 - st.mean):.1f}{ci} % (`{lbl}`, {st.n} seeds)."]
  return lines + [""]


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------


def plural(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else ("es" if noun.endswith("s")
                                             else "s"))


def _loss_config(loss: str, runs: Sequence[Any]) -> Dict[str, Any]:
  """The config of ``loss``'s first complete run (as saved), else as built."""
  mine = [r for r in runs if r.loss == loss]
  done = [r for r in mine if r.metrics is not None]
  return (done[0].metrics.get("config") or done[0].config) if done else (
      mine[0].config)


def machine_text(runs: Sequence[Any]) -> str:
  """The report's machine line: the runs' CPUs, GPUs and load averages
  (``compare_run.json``), or this host's when no run recorded one."""
  infos = [r.info for r in runs if r.info.get("cpu")]
  cpus = sorted({hostenv.cpu_text(i) for i in infos})
  if not cpus:
    cpus = [hostenv.cpu_text(hostenv.machine_info())]
  text = "; ".join(cpus)
  gpus = sorted({i.get("accelerators") for i in infos if i.get("accelerators")})
  if gpus:
    text += f"; GPUs present: {'; '.join(gpus)}"
  loads = [v for i in infos for v in i.get("load_average", [])]
  if loads:
    text += (f"; 1-min load average {min(loads):.1f}-{max(loads):.1f} at "
             "the runs' start and end")
  return text


def _preprocessing(cfg: Dict[str, Any]) -> str:
  """The preset overrides of the config (train; evaluation: the preset's
  deterministic variant)."""
  pre = cfg["dataset"].get("preprocess") or {}
  if not pre:
    return "the dataset's default preset"
  return ", ".join(f"{k}={v}" for k, v in sorted(pre.items())) + (
      " (train; the evaluation uses the preset's deterministic variant)")


def _times(runs: Sequence[Any], elapsed: float) -> str:
  walls = [r.wall_seconds for r in runs if r.wall_seconds is not None]
  trains = [r.metrics["train_seconds"] for r in runs
            if r.metrics is not None and r.metrics.get("train_seconds")
            is not None]
  now = sum(r.status == "done" and not r.reevaluate for r in runs)
  reevaluated = sum(r.status == "done" and r.reevaluate for r in runs)
  reused = sum(r.status == "reused" for r in runs)
  again = f", {reevaluated} re-evaluated" if reevaluated else ""
  text = (f"this invocation {elapsed:.0f} s ({now} runs trained{again}, "
          f"{reused} reused)")
  if walls:
    text += (f"; all {len(walls)} timed runs {sum(walls):.0f} s, per run "
             f"{statistics.fmean(walls):.0f} s wall (min {min(walls):.0f}, "
             f"max {max(walls):.0f}; process start, compilation, data, "
             "training, evaluations)")
  if trains:
    text += (f"; training loop {statistics.fmean(trains):.0f} s per run "
             "(metrics.json train_seconds)")
  return text


def write_markdown(path: pathlib.Path, *, command: str, config_name: str,
                   losses: Sequence[str], seeds: Sequence[int],
                   runs: Sequence[Any], elapsed: float,
                   plot_name: Optional[str] = None,
                   ablations: Sequence[Tuple[str, Sequence[str]]] = (),
                   notes: str = "", sections: Sequence[str] = ()) -> str:
  """Writes the comparison's Markdown file and returns its text.

  ``runs`` holds the ablations' runs too (``run.variant`` their name);
  ``ablations`` is ``[(NAME, overrides)]``; ``sections`` Markdown lines
  after the few-shot table (``experiments/compare/oneshot.py``); ``notes`` a
  Markdown file placed after the results tables.
  """
  every_run, runs = runs, [r for r in runs if not _variant(r)]
  cfg = runs[0].config
  done = [r.metrics for r in runs if r.metrics is not None]
  columns = metric_columns(runs)
  summary = summarize(runs, losses, [k for k, _ in columns])
  counts = {loss: (sum(r.loss == loss and r.metrics is not None
                       for r in runs),
                   sum(r.loss == loss for r in runs)) for loss in losses}
  every = (f"; evaluation every {cfg['eval_every_steps']} steps"
           if cfg.get("eval_every_steps") else "")
  lines = [
      f"# Loss comparison: {cfg['dataset']['name']}, {cfg['model']['name']} "
      f"{cfg['model']['embedding_dim']}-d, {plural(len(losses), 'loss')} x "
      f"{plural(len(seeds), 'seed')}",
      "",
      "Regenerate (reuses the finished runs in the workdir, trains the "
      "others):",
      "",
      "```bash",
      command,
      "```",
      "",
      "Protocol (Musgrave et al., \"A Metric Learning Reality Check\", ECCV "
      "2020, where it fits): every run has the same trunk, embedding, batch, "
      "optimiser, number of steps and evaluation; only the loss and its own "
      "hyperparameters (its paper's defaults, listed below) change. Config "
      f"`{config_name}`:",
      "",
      f"- data: {results.describe_data(cfg, done)}",
      f"- preprocessing: {_preprocessing(cfg)}",
      f"- model: {results.describe_model(cfg)}",
      f"- batch: {results.describe_batch(cfg)}",
      f"- optimiser: {results.describe_optim(cfg)}",
  ]
  more = results.describe_more_losses(cfg)
  if more:
    lines.append(f"- added to every loss (config.more_losses; its "
                 f"hyperparameters below): {more}")
  lines += [
      f"- steps: {cfg['num_train_steps']}{every}",
      f"- seeds: {', '.join(map(str, seeds))} (model and loss-parameter "
      "initialisation, batch order, augmentation)",
      f"- reported step: {results.describe_selection(cfg, done)}",
      "- values: test-split metrics in %, mean ± sample standard deviation "
      "(ddof=1) over the seeds; the best mean of each column in bold; "
      "`train s`: seconds in the training loop per run (including the "
      "compilation of the step where the shared compilation cache did not "
      "have it yet)",
      f"- time: {_times(every_run, elapsed)}",
      f"- machine: {machine_text(every_run)}",
      f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
      "",
      table_markdown(summary, columns, counts),
      "",
  ]
  if plot_name:
    shown = " and ".join(t for _, t in chart_panels(runs))
    lines += [f"![{shown} per loss]({plot_name})", ""]
  lines += _fewshot_lines(every_run, losses, ablations)
  lines += list(sections)
  if notes:
    lines += [pathlib.Path(notes).read_text().rstrip(), ""]
  lines += ["## Hyperparameters", "",
            "From each loss's `metrics.json` config; the source is the "
            "registry's reference (`circle_jax.losses.LOSSES`).", ""]
  lines += results.hyperparameter_lines(
      {loss: _loss_config(loss, runs) for loss in losses})
  few = fewshot_columns(every_run)
  lines += ["", "## Runs", ""]
  if few:
    lines += ["Few-shot cells: accuracy ± the 95 % interval over that run's "
              "episodes (`_ci95` in metrics.json).", ""]
  lines += ["| loss | seed | step | R@1 | MAP@R | NMI | "
            + "".join(f"{t} | " for _, t in few) + "train s | wall s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | "
            + "---: | " * len(few) + "---: | ---: |"]
  for r in every_run:
    label = f"{r.loss} ({_variant(r)})" if _variant(r) else r.loss
    if r.metrics is None:
      lines.append(f"| `{label}` | {r.seed} | failed |"
                   + " – |" * (5 + len(few)))
      continue
    res = r.metrics["result"]
    cells = [format_stat(aggregate([res["test"][k]])) if k in res["test"]
             else "–" for k in ("recall@1", "map@r", "nmi")]
    for k, _ in few:
      acc, ci = res["test"].get(k), res["test"].get(k + "_ci95")
      cells.append("–" if acc is None else f"{100 * acc:.1f}" + (
          "" if ci is None else f" ± {100 * ci:.1f}"))
    train = r.metrics.get("train_seconds")
    lines.append(
        f"| `{label}` | {r.seed} | {res['step']} ({res['selection']}) | "
        f"{' | '.join(cells)} | "
        f"{'–' if train is None else f'{train:.0f}'} | "
        f"{'–' if r.wall_seconds is None else f'{r.wall_seconds:.0f}'} |")
  failed = [r for r in every_run if r.status == "failed"]
  if failed:
    lines += ["", "## Failed runs", ""]
    lines += [f"- `{r.loss}` seed {r.seed}: {r.error.splitlines()[0]}"
              for r in failed]
  text = "\n".join(lines) + "\n"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  return text


def report(out: str, *, command: str, config_name: str,
           losses: Sequence[str], seeds: Sequence[int], runs: Sequence[Any],
           elapsed: float, ablations: Sequence[Tuple[str, Sequence[str]]] = (),
           notes: str = "", sections: Sequence[str] = ()
           ) -> Tuple[pathlib.Path, pathlib.Path]:
  """Writes ``OUT.md`` and ``OUT.png``; returns their paths."""
  md_path, png_path = pathlib.Path(out + ".md"), pathlib.Path(out + ".png")
  write_markdown(md_path, command=command, config_name=config_name,
                 losses=losses, seeds=seeds, runs=runs, elapsed=elapsed,
                 plot_name=png_path.name, ablations=ablations, notes=notes,
                 sections=sections)
  runs = [r for r in runs if not _variant(r)]
  from experiments.figures import plots  # pylint: disable=g-import-not-at-top
  cfg = runs[0].config
  columns = metric_columns(runs) + fewshot_columns(runs)
  summary = summarize(runs, losses, [k for k, _ in columns])
  plots.write_bars(png_path, summary, chart_panels(runs),
             f"{cfg['dataset']['name']}, {cfg['model']['name']} "
             f"{cfg['model']['embedding_dim']}-d, {cfg['num_train_steps']} "
             f"steps, {plural(len(seeds), 'seed')} (only the loss changes)")
  return md_path, png_path
