"""`hfpatch supported` against the family sweep this version ships (hfpatch/data/sweep.json): a family the sweep has
not seen is "not yet measured", with the reason, never counted as supported."""

from __future__ import annotations

import pytest
import transformers

from hfpatch import families, tiny


def test_the_shipped_sweep_covers_every_family_of_a_transformers_it_passed_on():
    baseline = families.sweep_baseline()
    if transformers.__version__ not in baseline["passed_on"]:
        pytest.skip(f"transformers {transformers.__version__} is not one the shipped sweep passed on "
                    f"({', '.join(baseline['passed_on'])}): its new families are reported as not yet measured")
    assert sorted(baseline["model_types"]) == tiny.causal_lm_types()


def test_a_family_the_sweep_has_not_seen_is_not_yet_measured_with_the_reason(monkeypatch):
    real = families.sweep_baseline()
    without_llama = {**real, "model_types": [t for t in real["model_types"] if t != "llama"]}
    monkeypatch.setattr(families, "sweep_baseline", lambda: without_llama)
    results = families.measure(["llama", "mistral"], use_cache=False)
    assert results["mistral"]["sweep"] == "swept"
    status = results["llama"]["sweep"]
    assert status.startswith("not yet measured: ") and "llama" in status
    assert all(v in status for v in real["passed_on"])
    table = families.markdown(results)
    llama_row = next(line for line in table.splitlines() if line.startswith("| llama |"))
    assert "not yet measured" in llama_row and "yarn" not in llama_row
    assert "not yet measured by the family sweep (not counted above): 1: llama" in table
    assert "RoPE schemes apply to 1" in table  # mistral alone is counted


def test_a_scheme_whose_cached_decoding_failed_in_the_sweep_is_not_listed(monkeypatch):
    real = families.sweep_baseline()
    checks = {**real["rope_checks"]["llama"], families.DECODE_CHECK + "self-extend": "FAIL: cached decoding differs "
              "from the full forward by 0.5"}
    monkeypatch.setattr(families, "sweep_baseline",
                        lambda: {**real, "rope_checks": {**real["rope_checks"], "llama": checks}})
    results = families.measure(["llama", "mistral"], use_cache=False)
    llama, mistral = results["llama"]["patches"], results["mistral"]["patches"]
    assert "self-extend" not in llama["position"] and "dual-chunk" in llama["position"]
    assert "self-extend" in mistral["position"]
    why = llama["not_available"]["position=self-extend"]
    assert "failed the family sweep's cached-decoding check" in why and "differs from the full forward by 0.5" in why
    assert "self-extend: 1" in families.counts(results)  # mistral alone
