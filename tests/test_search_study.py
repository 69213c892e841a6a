"""The search study's arms (eval/search_study.py), as eval/gpu_study.sh search passes them to hfpatch eval: the found
patch first and never twice, and the passkey cells' three arms chosen from the perplexity results."""

from eval import search_study
from hfpatch.evaluate.common import parse_patches

FOUND = {"position": "yarn", "factor": 4.0, "beta_fast": 16.0}


def ppl_results(cells: dict[tuple[str, int], float], incomplete: tuple[str, int] | None = None) -> dict:
    """hfpatch eval ppl's results.json, as far as passkey_arms reads it: {(patch, length): ppl}."""
    return {"cells": [{"patch": p, "length": n, "ppl": v, "complete": (p, n) != incomplete}
                      for (p, n), v in cells.items()]}


def test_a_found_patch_that_is_a_fixed_arm_is_evaluated_once():
    """A search that finds yarn x4 itself (spelled yarn:4.0) gives one arm for it: hfpatch eval refuses the same patch
    twice, which would lose the study's whole perplexity step."""
    arms = search_study.arms({"position": "yarn", "factor": 4.0}, 4)
    assert arms[0] == "yarn:4.0" and "yarn:4" not in arms and len(arms) == 8
    assert [name for name, _ in parse_patches(",".join(arms))] == arms


def test_the_arms_start_with_the_found_patch_then_every_fixed_arm():
    arms = search_study.arms(FOUND, 4)
    assert arms[0] == search_study.spec_string(FOUND) and len(arms) == 9
    assert arms[1:5] == ["none", "linear:4", "ntk:4", "yarn:4"] and arms[-2:] == ["self-extend", "dual-chunk"]
    assert len(parse_patches(",".join(arms))) == 9


def test_passkey_runs_on_the_found_patch_yarn_and_the_best_other_arm_at_the_longest_length():
    """The other arm is the one of lowest perplexity at 32k (not at 8k, and not an incomplete cell); the found
    patch and yarn:4 are there whatever their perplexity."""
    found = search_study.spec_string(FOUND)
    cells = {(found, 32768): 30.0, ("yarn:4", 32768): 41.5, ("none", 32768): 900.0, ("dual-chunk", 32768): 35.6,
             ("self-extend", 32768): 36.1, ("ntk:4", 32768): 34.0, ("ntk:4", 8192): 20.0,
             ("linear:4", 8192): 15.0, ("linear:4", 32768): 60.0}
    ppl = ppl_results(cells, incomplete=("ntk:4", 32768))
    assert search_study.passkey_arms(ppl, FOUND, 4) == [found, "yarn:4", "dual-chunk"]
    assert search_study.passkey_arms(ppl, {}, 4) == ["yarn:4", "dual-chunk"]  # no patch found
    assert search_study.passkey_arms(None, FOUND, 4) == [found, "yarn:4"]  # the perplexity step wrote nothing
