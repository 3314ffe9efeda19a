"""Can modelled memory terms judge "fits" better than the seed's 80% rule? Cross-validated on the
published Megatron-LM outcomes shipped with fourfold (fourfold/plan/data; docs/planner.md, "Memory verdicts").

Each verdict model adds up to two terms to the seed's estimate (the CSV's fujii_estimate_gib,
which the megatron profile reproduces) and says "fits" when the sum is at most a fitted limit.
Coefficients and limit are fitted on the training rows as the most permissive choice that
passes no failed run; each configuration (tp, cp, pp, micro-batch) is left out in turn and its
rows are judged by the fit on the others. Issue #17 asks for no "fits" on a failed run and
fewer refusals of runs that ran than the 80% rule.

    python benchmarks/memory_verdicts.py [--data DIR]   # default: the shipped fourfold/plan/data
"""

from __future__ import annotations

import argparse
import csv
import itertools
from pathlib import Path

import numpy as np

from fourfold.models.config import load_config
from fourfold.plan.measured import DATA
from fourfold.plan.memory import GIB, layer_params

FILE = "megatron_llama31_8b_a100.csv"
COEFFICIENTS = np.linspace(0.0, 3.0, 31)  # per term: GiB per unit of the term


def terms(row: dict[str, str]) -> dict[str, float]:
    """Candidate terms the seed's formulas may miss, each in units a coefficient turns into GiB
    (the byte counts in GiB; "cp:" terms only under context parallelism)."""
    cfg = load_config("llama-3.1-8b")
    tp, cp, pp, mb, dp = (int(row[k]) for k in ("tp", "cp", "pp", "mbs", "dp"))
    seq, ring = int(row["seq"]), float(cp > 1)
    matrices, vectors = layer_params(cfg)
    params = (cfg.layers / pp * (matrices + vectors) + cfg.hidden * cfg.vocab) / tp  # first stage
    tokens = mb * seq / cp
    return {
        "cp: per sequence of a micro-batch": ring * mb,
        "cp: whole-sequence fp32 logits": ring * mb * seq * cfg.vocab / tp * 4 / GIB,
        "cp: layer inputs at full length": ring * tokens * cfg.layers * cfg.hidden / tp * 2 / GIB,
        "cp: optimizer sharded over dp only": ring * 12 * params / dp * (1 - 1 / cp) / GIB,
        "bf16 weights": 2 * params / GIB,
        "fp32 logits": tokens * cfg.vocab / tp * 4 / GIB,
        "a communicator per parallel dim": sum(n > 1 for n in (tp, cp, pp, dp)),
        "dp = 1": float(dp == 1),
    }


def fit(estimates: np.ndarray, features: np.ndarray, ran: np.ndarray) -> tuple[np.ndarray, float]:
    """(coefficients, limit): no failed training row passes; fewest rows that ran refused."""
    best, best_key = None, None
    for coefficients in itertools.product(COEFFICIENTS, repeat=features.shape[1]):
        score = estimates + features @ np.array(coefficients)
        limit = score[~ran].min() - 1e-9
        key = (int((score[ran] > limit).sum()), sum(coefficients))
        if best_key is None or key < best_key:
            best, best_key = (np.array(coefficients), limit), key
    return best


def cross_validate(estimates, features, ran, groups) -> tuple[int, int]:
    """(failed runs passed, runs that ran refused), each configuration judged by the others' fit."""
    passed = refused = 0
    for group in sorted(set(groups)):
        held = groups == group
        coefficients, limit = fit(estimates[~held], features[~held], ran[~held])
        verdict = estimates[held] + features[held] @ coefficients <= limit
        passed += int((verdict & ~ran[held]).sum())
        refused += int((~verdict & ran[held]).sum())
    return passed, refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA), help="the folder of the shipped calibration CSVs")
    rows = list(csv.DictReader(open(Path(parser.parse_args().data) / FILE)))
    estimates = np.array([float(r["fujii_estimate_gib"]) for r in rows])
    ran = np.array([r["outcome"] == "ran" for r in rows])
    groups = np.array([f"tp{r['tp']} cp{r['cp']} pp{r['pp']} mb{r['mbs']}" for r in rows])
    table = {name: [] for name in terms(rows[0])}
    for row in rows:
        for name, value in terms(row).items():
            table[name].append(value)
    names = list(table)
    card = np.array([float(r["gpu_mem_gb"]) for r in rows])  # an A100-40GB has 40,960 MiB: GiB, as the profile takes it
    rule = estimates <= 0.8 * card
    print(f"{len(rows)} runs ({int(ran.sum())} ran, {int((~ran).sum())} failed), {len(set(groups))} configurations")
    print(f"{'verdict model':<80} {'failed, passed':>15} {'ran, refused':>13}")
    print(f"{'the 80% rule (no fit)':<80} {int((rule & ~ran).sum()):>15} {int((~rule & ran).sum()):>13}")
    results = []
    for k in (0, 1, 2):
        for chosen in itertools.combinations(names, k):
            features = np.array([table[n] for n in chosen]).T.reshape(len(rows), k)
            results.append((*cross_validate(estimates, features, ran, groups), " + ".join(("estimate", *chosen))))
    for passed, refused, label in sorted(results, key=lambda r: (r[0] + r[1], r[0]))[:12]:
        print(f"{label:<80} {passed:>15} {refused:>13}")
    print("(the 12 models with the fewest wrong verdicts, of", len(results), "tried)")


if __name__ == "__main__":
    main()
