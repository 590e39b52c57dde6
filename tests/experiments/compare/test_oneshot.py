"""experiments/compare/oneshot.py: the one-shot section's ensembles (the
section itself is checked end to end in test_losses.py's CLI test)."""

import pytest

from experiments.compare import oneshot


@pytest.mark.parametrize("members,seeds", [(1, 1), (1, 5), (3, 3), (3, 9)])
def test_seeds_that_split_into_whole_ensembles_pass(members, seeds):
  oneshot.check_members(members, seeds)


@pytest.mark.parametrize("members,seeds,hint", [
    (3, 4, "or --seeds 3"), (3, 2, "or --seeds 3"), (2, 5, "or --seeds 4")])
def test_seeds_that_do_not_split_are_one_line(members, seeds, hint):
  with pytest.raises(ValueError, match=(
      f"^--oneshot {members}: the {seeds} seeds must split into ensembles of "
      f"{members} .*{hint}")):
    oneshot.check_members(members, seeds)


def test_no_runs_per_ensemble_is_one_line():
  with pytest.raises(ValueError, match=r"^--oneshot must be >= 1 \(runs per "
                     r"ensemble\); got 0\.$"):
    oneshot.check_members(0, 3)
