r"""Loss comparison in one command: every (loss, seed), one table, one chart.

Trains every registered loss you name with the *same* trunk, embedding,
batch, optimiser, number of steps and evaluation (the config's), for several
seeds, and writes a Markdown table and a bar chart. This is the protocol of
Musgrave et al., "A Metric Learning Reality Check" (ECCV 2020) where it fits
this codebase: only the loss and its own hyperparameters change, and those
are its paper's defaults (``--config.loss.name=NAME`` swaps in the whole
``config.loss`` section of ``NAME``; ``circle_jax.config_flag.switch_loss``).

Each run is the real main job in its own process::

  python -m experiments.main --config=CFG --config.loss.name=LOSS \
      --config.seed=S --workdir=WORKDIR/LOSS/seed_S [--config.* overrides]

* A run whose workdir holds a complete ``metrics.json`` (with ``result``) of
  the same config is reused, so an interrupted comparison resumes where it
  stopped (the interrupted run itself resumes from its last checkpoint).
* A finished run whose config differs only in how it is evaluated
  (``eval_ks``, ``eval_clustering``, ``eval_shift``, ``fewshot``;
  ``circle_jax.train.workdir.EVALUATION_FIELDS``) is re-evaluated, not retrained: its
  main job resumes at the last step and evaluates it again
  (``metrics.json``'s ``config_changes`` records the change; the training
  time is kept).
* A workdir that holds a run of *another* config (other steps, batch, ...)
  is not touched: that run is reported as failed, naming the differing
  fields (use another ``--workdir``).
* A failed run is reported with its workdir and the tail of its stderr
  (``WORKDIR/LOSS/seed_S/compare.stderr.log``); the other runs go on, and the
  command exits with status 1 at the end.

The table reports each run's ``metrics.json['result']['test']``: the
test-split metrics of the step that the main job selected (on a validation
split of held-out train classes, on the test split, or the last step; the
file's header says which). Values are the mean and the *sample* standard
deviation (ddof=1) over the seeds, in %; the best mean of each column is in
bold.

By default every run shares a persistent XLA compilation cache
(``WORKDIR/jax_cache``): the seeds of a loss and the evaluation programs of
all losses are compiled once (``--no-compilation-cache`` to disable).

Examples::

  # the full table on Omniglot-small (17 losses x 3 seeds x 2000 steps),
  # the step of each run selected on 20 % of the train classes held out
  python -m experiments.compare.losses --config experiments/configs/omniglot_small.py \
      --losses all --seeds 3 --out experiments/results/compare/losses_omniglot_small \
      --config.dataset.validation_fraction=0.2

  # a smoke test: 3 losses x 2 seeds x 50 steps on digits
  python -m experiments.compare.losses --config experiments/configs/digits.py \
      --losses circle,multi_similarity,proxy_anchor --seeds 2 \
      --out /tmp/compare_smoke --config.num_train_steps=50

Ablations and few-shot accuracy::

  # 6 losses x 3 seeds, and Circle x 3 seeds without rotations / without
  # the affine augmentation, 8 runs at a time, with published numbers
  python -m experiments.compare.losses --config experiments/configs/omniglot_fewshot.py \
      --losses circle,multi_similarity,ranked_list,contrastive,proxy_anchor,triplet \
      --ablation "no_rotations:--config.dataset.rotations=1" \
      --ablation "no_affine:--config.dataset.preprocess.preset=grayscale" \
      --notes experiments/results/compare/losses_omniglot_fewshot_notes.md --jobs 8 ...

An ablation ``NAME:OVERRIDES`` trains ``--ablation-loss`` (default: the first
loss) for every seed with those overrides after the common ones, in
``WORKDIR/ablation_NAME/``; ``NAME@LOSS:OVERRIDES`` trains ``LOSS`` instead
(a variant of a loss that is not in ``--losses``, e.g. NT-Xent on two views
of each image: ``--ablation "two_views@nt_xent:--config.batch.sampler=views
--config.batch.classes_per_batch=32 --config.batch.images_per_class=2"``); when the runs report few-shot accuracy
(``config.fewshot``), the report adds a few-shot table with a row per loss
and per ablation. ``--notes FILE`` follows the report's results tables. ``--jobs N``
trains N runs at once (their timings then include the contention).

The official Omniglot one-shot runs (Lake et al. 2015), single models and
ensembles in one command (``experiments/compare/oneshot.py``): ``--oneshot
M`` scores the finished runs of each loss on the 20 official runs as
ensembles of ``M`` seeds taken in order, and reports each ensemble's error
per run and their mean and spread::

  # 3 independent ensembles of 3 Circle models (9 runs)
  python -m experiments.compare.losses --config experiments/configs/omniglot_fewshot.py \
      --losses circle --seeds 9 --oneshot 3 --jobs 2 \
      --out experiments/results/compare/losses_omniglot_fewshot_oneshot

Writes ``OUT.md`` and ``OUT.png`` (default ``OUT``:
``experiments/results/compare/losses_<config name>``); the runs live under
``--workdir`` (default ``/tmp/circle_jax_compare/<config name>``).
``--dry-run`` lists the runs (to train, reused, conflicting) and their
commands without training anything.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import shlex
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from circle_jax import losses as losses_lib
from experiments.compare import oneshot as compare_oneshot
from experiments.compare import report as compare_report
from experiments.compare import runs as compare_runs
from experiments.compare.runs import Run

_REPO = pathlib.Path(__file__).resolve().parents[2]



def ablation_losses(texts: Sequence[str]) -> Dict[str, str]:
  """``{NAME: LOSS}`` of the ``--ablation 'NAME@LOSS:...'`` texts that name
  their own loss."""
  out = {}
  for text in texts:
    name, _, loss = text.partition(":")[0].strip().partition("@")
    if loss:
      out[name] = loss
  return out


def parse_ablations(texts: Sequence[str], losses: Sequence[str]
                    ) -> List[Tuple[str, List[str]]]:
  """``--ablation 'NAME[@LOSS]:--config.A=1 --config.B=2'`` -> ``(NAME,
  overrides)`` (:func:`ablation_losses` gives the LOSS).

  Raises:
    ValueError: a malformed, repeated or loss-named NAME, an unknown LOSS, or
      bad overrides.
  """
  out = []
  for text in texts:
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not re.fullmatch(r"[a-z0-9_]+(@[a-z0-9_]+)?", name):
      raise ValueError(
          f"--ablation {text!r}: expected 'NAME[@LOSS]:--config.FIELD=VALUE "
          "...' with NAME in lower-case letters, digits and _.")
    name, _, own_loss = name.partition("@")
    if own_loss and own_loss not in losses_lib.LOSSES:
      raise ValueError(f"--ablation {text!r}: unknown loss {own_loss!r}.")
    if name in losses or name in (n for n, _ in out):
      raise ValueError(f"--ablation {text!r}: the name {name!r} is taken.")
    overrides = shlex.split(rest)
    if not overrides:
      raise ValueError(f"--ablation {text!r}: no --config.FIELD=VALUE.")
    check_overrides(overrides)
    out.append((name, overrides))
  return out


def check_overrides(overrides: Sequence[str]) -> None:
  """Only ``--config.FIELD=VALUE`` flags, and not the ones the runner sets."""
  for arg in overrides:
    m = re.fullmatch(r"--config\.([\w.]+)=(.*)", arg, flags=re.S)
    if not m:
      raise ValueError(
          f"unexpected argument {arg!r}: extra arguments must be config "
          "overrides of the form --config.FIELD=VALUE.")
    if m.group(1) in ("seed", "loss.name"):
      raise ValueError(
          f"{arg}: the comparison sets config.{m.group(1)} itself (use "
          "--losses / --seeds).")


# ----------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------


def config_name(config: str) -> str:
  """A config's short name (`paper.py:cub,circle` -> `paper_cub_circle`)."""
  path, _, arg = config.partition(":")
  name = pathlib.Path(path).stem
  if arg:
    name += "_" + re.sub(r"[^\w]+", "_", arg).strip("_")
  return name


def canonical_command(args, overrides: Sequence[str]) -> str:
  """The one command that regenerates the comparison's files."""
  cmd = ["python", "-m", "experiments.compare.losses", "--config", args.config,
         "--losses", args.losses, "--seeds", args.seeds, "--out", args.out]
  if args.workdir_given:
    cmd += ["--workdir", args.workdir]
  if not args.compilation_cache:
    cmd += ["--no-compilation-cache"]
  for text in args.ablation:
    cmd += ["--ablation", text]
  if args.ablation:
    cmd += ["--ablation-loss", args.ablation_loss]
  if args.notes:
    cmd += ["--notes", args.notes]
  if args.oneshot:
    cmd += ["--oneshot", str(args.oneshot)]
  return shlex.join(cmd + list(overrides))


def _summary_line(run: Run) -> str:
  test = run.metrics["result"]["test"]
  shown = ", ".join(f"{t} {100 * test[k]:.1f}" for k, t in
                    (("recall@1", "R@1"), ("map@r", "MAP@R"), ("nmi", "NMI"))
                    if k in test)
  if run.reevaluate:  # wall_seconds stays the training's
    wall = run.info["reevaluated"][-1]["wall_seconds"]
    return f"re-evaluated in {wall:.0f} s: {shown}"
  wall = f" in {run.wall_seconds:.0f} s" if run.wall_seconds else ""
  return f"{run.status}{wall}: {shown}"


def _label(run: Run) -> str:
  return f"{run.loss} ({run.variant})" if run.variant else run.loss


def build_runs(args, overrides: Sequence[str],
               ablations: Sequence[Tuple[str, List[str]]] = (),
               own_losses: Optional[Dict[str, str]] = None) -> List[Run]:
  """Every (loss, seed) run with its command and resolved config; right
  after the runs of ``args.ablation_loss``, the ablations' runs: that loss x
  seeds with each ablation's overrides after the common ones (in
  ``WORKDIR/ablation_NAME/``); last, the ablations that train their own
  loss (``own_losses``, :func:`ablation_losses`)."""
  own_losses = own_losses or {}

  def cell(name, loss, more):
    return (name, loss, os.path.join(args.workdir, f"ablation_{name}"),
            [*overrides, *more])

  cells = []
  for loss in compare_runs.parse_losses(args.losses):
    cells.append(("", loss, args.workdir, list(overrides)))
    if loss == args.ablation_loss:
      cells += [cell(name, loss, more) for name, more in ablations
                if name not in own_losses]
  cells += [cell(name, own_losses[name], more) for name, more in ablations
            if name in own_losses]
  runs = []
  for variant, loss, root, flags_ in cells:
    for seed in compare_runs.parse_seeds(args.seeds):
      workdir = os.path.join(root, loss, f"seed_{seed}")
      cfg_flags = compare_runs.config_args(args.config, loss, seed, flags_)
      runs.append(Run(loss, seed, workdir, compare_runs.main_command(cfg_flags, workdir),
                      compare_runs.resolve_config(cfg_flags), variant=variant))
  return runs


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Parses the command line, runs what is missing, writes the report."""
  p = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      epilog="Extra --config.FIELD=VALUE arguments are passed to every run "
             "(e.g. --config.num_train_steps=1000).")
  p.add_argument("--config", default="experiments/configs/omniglot_small.py",
                 help="the main job's config file (FILE or FILE:ARG)")
  p.add_argument("--losses", default="all",
                 help="comma-separated registry names, or 'all'")
  p.add_argument("--seeds", default="3",
                 help="number of seeds (0..N-1) or a comma-separated list")
  p.add_argument("--out", default="",
                 help="writes OUT.md and OUT.png (default "
                      "experiments/results/compare/losses_<config name>)")
  p.add_argument("--workdir", default="",
                 help="folder of the runs (default "
                      "/tmp/circle_jax_compare/<config name>)")
  p.add_argument("--no-compilation-cache", dest="compilation_cache",
                 action="store_false",
                 help="do not share a persistent XLA compilation cache "
                      "(WORKDIR/jax_cache) between the runs")
  p.add_argument("--ablation", action="append", default=[],
                 metavar="'NAME:--config.FIELD=VALUE ...'",
                 help="also train --ablation-loss x seeds with these "
                      "overrides (repeatable); reported in an ablation table")
  p.add_argument("--ablation-loss", default="",
                 help="the loss of the ablations (default: the first of "
                      "--losses)")
  p.add_argument("--notes", default="",
                 help="a Markdown file put after the results tables of "
                      "OUT.md (published numbers, how the recipe was chosen)")
  p.add_argument("--jobs", type=int, default=1,
                 help="runs trained at the same time (each a process; their "
                      "timings then include the contention)")
  p.add_argument("--oneshot", type=int, default=0, metavar="M",
                 help="also score the runs on the 20 official Omniglot "
                      "one-shot runs, as ensembles of M seeds (seeds in "
                      "order, M at a time; 1: each run alone)")
  p.add_argument("--dry-run", action="store_true",
                 help="list the runs (reused / to train / conflicting) and "
                      "their commands; train nothing, write nothing")
  args, overrides = p.parse_known_args(argv)
  started = time.time()
  name = config_name(args.config)
  args.workdir_given = bool(args.workdir)
  args.workdir = args.workdir or os.path.join("/tmp/circle_jax_compare", name)
  args.out = args.out or str(pathlib.Path("experiments/results/compare")
                             / f"losses_{name}")
  try:
    check_overrides(overrides)
    losses = compare_runs.parse_losses(args.losses)
    seeds = compare_runs.parse_seeds(args.seeds)
    args.ablation_loss = args.ablation_loss or losses[0]
    if (any("@" not in a.partition(":")[0] for a in args.ablation)
        and args.ablation_loss not in losses):
      raise ValueError(f"--ablation-loss {args.ablation_loss!r} must be one "
                       "of --losses.")
    ablations = parse_ablations(args.ablation, losses)
    if args.jobs < 1:
      raise ValueError(f"--jobs must be >= 1; got {args.jobs}.")
    if args.oneshot:
      compare_oneshot.check_members(args.oneshot, len(seeds))
    if args.notes and not os.path.isfile(args.notes):
      raise ValueError(f"--notes {args.notes}: no such file.")
    runs = build_runs(args, overrides, ablations,
                      ablation_losses(args.ablation))
  except ValueError as e:
    p.error(str(e))
  for run in runs:
    compare_runs.prepare(run)
    if run.status == "failed":
      print(f"[compare] {_label(run)} seed {run.seed}: {run.error}",
            file=sys.stderr)
  todo = [r for r in runs if r.status == "pending"]
  conflicts = sum(r.status == "failed" for r in runs)
  again = sum(r.reevaluate for r in todo)
  print(f"[compare] {len(runs)} runs ({compare_report.plural(len(losses), 'loss')} x "
        f"{compare_report.plural(len(seeds), 'seed')}"
        + (f" + {compare_report.plural(len(ablations), 'ablation')}"
           if ablations else "") + f") in {args.workdir}: "
        f"{len(runs) - len(todo) - conflicts} finished, "
        f"{len(todo) - again} to train"
        + (f", {again} to re-evaluate" if again else "")
        + (f", {conflicts} with another config there" if conflicts else ""),
        flush=True)
  if args.dry_run:
    for r in runs:
      state = ("re-eval" if r.reevaluate else
               {"pending": "train", "reused": "reuse"}.get(r.status,
                                                           "CONFLICT"))
      print(f"{state:8s} {shlex.join(r.command)}")
      if r.error:
        print(f"         {r.error}")
    return 0
  env = compare_runs.child_env(args.workdir, args.compilation_cache)

  def train(i_run):
    i, run = i_run
    print(f"[compare] {i + 1}/{len(todo)} {_label(run)} seed {run.seed} ...",
          flush=True)
    compare_runs.execute(run, env)
    if run.status == "failed":
      print(f"[compare] FAILED {_label(run)} seed {run.seed}: {run.error}",
            file=sys.stderr, flush=True)
    else:
      print(f"[compare]   {_label(run)} seed {run.seed} "
            f"{_summary_line(run)}", flush=True)

  try:
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
      list(pool.map(train, enumerate(todo)))
  except KeyboardInterrupt:
    print("\n[compare] interrupted; run the same command again to resume:\n"
          f"  {canonical_command(args, overrides)}", file=sys.stderr)
    return 130
  sections = []
  if args.oneshot:
    sections = compare_oneshot.oneshot_lines(runs, losses, args.oneshot)
    for line in sections:
      if line.startswith("- `"):
        print(f"[compare] one-shot {line[2:]}", flush=True)
  md_path, png_path = compare_report.report(
      args.out, command=canonical_command(args, overrides),
      config_name=args.config, losses=losses, seeds=seeds, runs=runs,
      elapsed=time.time() - started, ablations=ablations, notes=args.notes,
      sections=sections)
  print(f"[compare] wrote {md_path} and {png_path}")
  failed = [r for r in runs if r.status == "failed"]
  if failed:
    print(f"[compare] {len(failed)} of {len(runs)} runs failed:",
          file=sys.stderr)
    for r in failed:
      print(f"  {_label(r)} seed {r.seed}: {r.workdir}\n    "
            + r.error.replace("\n", "\n    "), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
