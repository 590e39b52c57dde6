"""The official Omniglot 20-way one-shot runs with a trained model or an ensemble.

  python -m experiments.tools.omniglot_oneshot --workdir W [--workdir W2 ...] \\
      [--runs all_runs.zip | --stand_in [--stand_in_seed S] [--stand_in_draws N]] \\
      [--which best|latest] [--eval_shift S] \\
      [--align | --no-align] [--align_shift S] [--align_angles A,B,...]

By default it scores the 20 official runs (Lake et al. 2015,
``python/one-shot-classification/all_runs.zip`` of
https://github.com/brendenlake/omniglot), from the copy shipped with the
package (:func:`circle_jax.evaluation.omniglot_oneshot.official_runs`);
``--runs`` takes another copy of them or its extracted folder; nothing is
downloaded. ``--stand_in`` draws 20 runs by the same protocol from the
alphabets that ``omniglot_small`` holds out
(:func:`circle_jax.evaluation.omniglot_oneshot.stand_in_runs`; not the
official runs): choose models and settings there, never on the official
runs, whose alphabets are the evaluation set. ``--stand_in_draws N`` scores
N draws at once (seeds S to S + N - 1, 20 runs each; the stand-in set has
two alphabets, so one draw of 20 runs is a noisy measure) and prints each
draw's mean and the mean over all of them. Each test image is classified
by 1-nearest neighbour (cosine) among its run's training images, embedded
with the workdir's model and eval preprocessing
(:mod:`circle_jax.evaluation.omniglot_oneshot`); ``--eval_shift`` replaces
the runs' test-time shift (``config.eval_shift``); several ``--workdir``
make one ensemble, the mean of their cosine similarities. ``--align``
compares images by alignment instead
(:func:`circle_jax.evaluation.omniglot_oneshot.aligned_similarity`: each
image's embedding against the best of the other's views shifted by up to
``--align_shift`` pixels and rotated by each of ``--align_angles``
degrees); by default each run's ``config.oneshot`` decides, and these
flags replace its fields. Prints the error
of each run and their mean, in %, as the paper reports them (and each
member's mean first, for an ensemble).
"""

import argparse
import sys
from typing import Optional, Sequence

from circle_jax import config_facts
from circle_jax import hostenv
from circle_jax.evaluation import omniglot_oneshot
from circle_jax.train import config_checks
from circle_jax.train import console
from circle_jax.train import restore as restore_lib


def _print_errors(result, args) -> None:
  """Each run's error (or each stand-in draw's mean, for several draws: the
  runs come draw after draw, as many in each), then the mean over all
  runs."""
  if args.stand_in_draws == 1:
    for name, error in zip(result.runs, result.errors):
      print(f"{name}  {error:6.2f}%")
  else:
    size = len(result.errors) // args.stand_in_draws
    for i in range(args.stand_in_draws):
      errors = result.errors[i * size:(i + 1) * size]
      print(f"seed{args.stand_in_seed + i}  {sum(errors) / size:6.2f}% "
            f"(mean of {size} runs)")
  print(f"mean   {result.mean_error:6.2f}% over {len(result.runs)} runs")


def _angles(text: str):
  try:
    return tuple(float(a) for a in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"expected degrees separated by commas, e.g. -10,0,10; got "
        f"{text!r}") from None


def _run(args):
  if args.stand_in:
    runs = [r for k in range(args.stand_in_seed,
                             args.stand_in_seed + args.stand_in_draws)
            for r in omniglot_oneshot.stand_in_runs(k)]
  elif args.runs:
    runs = omniglot_oneshot.read_runs(args.runs)
  else:
    runs = omniglot_oneshot.official_runs()
  restored = [restore_lib.restore_run(w, args.which) for w in args.workdir]
  for run in restored:
    size = config_facts.eval_preprocess(run.config, run.info).image_size
    if args.eval_shift is not None:
      config_checks.check_eval_shift(args.eval_shift, size,
                                     name=f"--eval_shift (for {run.workdir})")
      run.config.eval_shift = args.eval_shift
    for field in ("align", "align_shift", "align_angles"):
      if getattr(args, field) is not None:
        run.config.oneshot[field] = getattr(args, field)
    config_checks.check_oneshot(
        run.config.oneshot, size,
        name=f"the one-shot alignment of {run.workdir} (--align*)")
  # Each model embeds the runs' images once: an ensemble's members are
  # scored alone and then together on the same images.
  embedders = [omniglot_oneshot.cached_embedder(
      omniglot_oneshot.run_embedder(r)) for r in restored]
  seeds = (f"seed {args.stand_in_seed}" if args.stand_in_draws == 1 else
           f"seeds {args.stand_in_seed}-"
           f"{args.stand_in_seed + args.stand_in_draws - 1}")
  what = ("official runs" if not args.stand_in else
          f"stand-in runs ({seeds}), not the official runs")
  how = omniglot_oneshot.comparison([r.config for r in restored])
  if len(restored) > 1:
    for run, embed in zip(restored, embedders):
      member = omniglot_oneshot.oneshot_errors(embed, runs)
      print(f"member {run.workdir}, {run.which} checkpoint at step "
            f"{run.step}: mean {member.mean_error:6.2f}%")
    print(f"ensemble of {len(restored)} models, {what}: 1-NN ({how}) "
          "one-shot error")
  else:
    run = restored[0]
    print(f"{run.workdir} ({run.config.dataset.name}), {run.which} checkpoint "
          f"at step {run.step}, {what}: 1-NN ({how}) one-shot error")
  result = omniglot_oneshot.oneshot_errors(
      omniglot_oneshot.ensemble_embedder(embedders), runs)
  _print_errors(result, args)


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, action="append",
                 help="a training run's folder (repeat for an ensemble)")
  which_runs = p.add_mutually_exclusive_group()
  which_runs.add_argument("--runs", help="all_runs.zip or its folder "
                          "(default: the official runs shipped with "
                          "circle_jax)")
  which_runs.add_argument("--stand_in", action="store_true",
                          help="runs drawn from omniglot_small's test "
                          "alphabets (not the official runs)")
  p.add_argument("--stand_in_seed", type=int, default=0)
  p.add_argument("--stand_in_draws", type=int, default=1, metavar="N",
                 help="with --stand_in: N draws of 20 runs, seeds "
                 "--stand_in_seed onwards (default 1)")
  p.add_argument("--which", choices=("best", "latest"), default=None,
                 help="checkpoint (default: best if the run kept one)")
  p.add_argument("--eval_shift", type=int, default=None,
                 help="test-time shift in pixels (default: each run's "
                 "config.eval_shift)")
  p.add_argument("--align", action=argparse.BooleanOptionalAction,
                 default=None, help="compare images by alignment (default: "
                 "each run's config.oneshot.align)")
  p.add_argument("--align_shift", type=int, default=None,
                 help="alignment's largest shift in pixels (default: "
                 "config.oneshot.align_shift)")
  p.add_argument("--align_angles", type=_angles, default=None,
                 metavar="A,B,...", help="alignment's rotations in degrees "
                 "(default: config.oneshot.align_angles)")
  p.add_argument("--verbose", action="store_true",
                 help="library INFO logs and full tracebacks")
  args = p.parse_args(argv)
  if args.stand_in_draws < 1:
    p.error(f"--stand_in_draws must be >= 1; got {args.stand_in_draws}.")
  if args.stand_in_draws > 1 and not args.stand_in:
    p.error("--stand_in_draws needs --stand_in (the official runs are one "
            "fixed set of 20).")
  console.configure_logging(args.verbose)
  hostenv.enable_compilation_cache()
  return console.run_tool(lambda: _run(args), verbose=args.verbose)


if __name__ == "__main__":
  sys.exit(main())
