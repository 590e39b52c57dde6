"""The official Omniglot one-shot runs in a loss comparison's report.

``python -m experiments.compare.losses ... --oneshot M`` scores every finished
run of each loss on the 20 official one-shot runs (Lake et al. 2015; the copy
shipped with the package, :func:`circle_jax.evaluation.omniglot_oneshot.
official_runs`), and ensembles of ``M`` runs: the seeds in ``--seeds`` order,
taken ``M`` at a time (seeds 0-2, 3-5, 6-8 for ``--seeds 9 --oneshot 3``), so
that one command trains and evaluates independent ensembles and reports their
mean and spread. Each ensemble is 1-NN by the mean of its members' cosine
similarities (:func:`circle_jax.evaluation.omniglot_oneshot.ensemble_embedder`)
with each run's eval preprocessing and test-time shift, compared as each
run's ``config.oneshot`` says (cosine, or by alignment).
"""

from __future__ import annotations

from typing import Any, List, Sequence

from circle_jax.evaluation import omniglot_oneshot
from circle_jax.results import aggregate
from circle_jax.train import restore as restore_lib
from experiments.compare import report as compare_report


# People's error on these runs (Lake et al. 2015, Fig. 2), in %.
HUMAN_ERROR = 4.5


def check_members(members: int, num_seeds: int) -> None:
  """Raises ValueError unless ``num_seeds`` seeds make whole ensembles."""
  if members < 1:
    raise ValueError(f"--oneshot must be >= 1 (runs per ensemble); got "
                     f"{members}.")
  if num_seeds % members:
    raise ValueError(
        f"--oneshot {members}: the {num_seeds} seeds must split into "
        f"ensembles of {members} (--oneshot 1: every run alone; or --seeds "
        f"{members * max(1, num_seeds // members)}).")


def oneshot_lines(runs: Sequence[Any], losses: Sequence[str],
                  members: int) -> List[str]:
  """The report's one-shot section: for each loss, each ensemble's members
  and its error on every official run, then the mean over the ensembles ±
  the 95 % Student-t interval of that mean. Runs that did not finish leave
  their ensemble out."""
  official = omniglot_oneshot.official_runs()
  header = "| loss | seeds | members' errors | error | " + " | ".join(
      r.name for r in official) + " |"
  table = [header, "| --- | --- | --- | ---: |" + " ---: |" * len(official)]
  summary, configs = [], []
  for loss in losses:
    own = [r for r in runs if not r.variant and r.loss == loss]
    errors = []
    for start in range(0, len(own), members):
      group = own[start:start + members]
      if any(r.metrics is None for r in group):  # a run did not finish
        continue
      restored = [restore_lib.restore_run(r.workdir) for r in group]
      configs += [r.config for r in restored]
      embedders = [omniglot_oneshot.cached_embedder(
          omniglot_oneshot.run_embedder(r)) for r in restored]
      alone = [omniglot_oneshot.oneshot_errors(e, official).mean_error
               for e in embedders]
      result = omniglot_oneshot.oneshot_errors(
          omniglot_oneshot.ensemble_embedder(embedders), official)
      errors.append(result.mean_error)
      table.append(
          f"| `{loss}` | {', '.join(str(r.seed) for r in group)} | "
          f"{', '.join(f'{a:.2f}' for a in alone)} | "
          f"**{result.mean_error:.2f}** | "
          + " | ".join(f"{e:.0f}" for e in result.errors) + " |")
    stat = aggregate(errors)
    if stat is not None:
      ci = compare_report.seed_ci95(stat)
      spread = ("" if stat.std is None else
                f" ± {ci.std:.2f} (95 % interval; std {stat.std:.2f}, "
                f"range {min(errors):.2f}-{max(errors):.2f})")
      upper = stat.mean + (ci.std or 0.0)
      people = f"people's {HUMAN_ERROR} %"
      verdict = (f"its whole 95 % interval is below {people}"
                 if stat.n > 1 and upper < HUMAN_ERROR else
                 f"below {people} on average only"
                 if stat.mean < HUMAN_ERROR else f"not below {people}")
      summary.append(f"- `{loss}`: {stat.mean:.2f}{spread} % over "
                     f"{compare_report.plural(stat.n, 'ensemble')} of "
                     f"{compare_report.plural(members, 'run')}: {verdict}.")
  lines = [
      "## Omniglot one-shot: the 20 official runs", "",
      "The 20-way one-shot runs of Lake, Salakhutdinov, Tenenbaum, "
      "\"Human-level concept learning through probabilistic program "
      "induction\", Science 2015 (`all_runs.zip`, shipped with the package), "
      f"scored by 1-NN ({omniglot_oneshot.comparison(configs)}) with each "
      "run's eval preprocessing and "
      f"test-time shift; an ensemble of {members} runs (seeds in order, "
      f"{members} at a time) ranks by the mean of its members' "
      f"similarities. Errors in %; people: {HUMAN_ERROR} % (Lake et al. "
      "2015). Summary: "
      "mean over the ensembles ± the half-width of the 95 % Student-t "
      "interval of that mean, and the sample standard deviation.", ""]
  return lines + summary + [""] + table + [""]
