"""A receiver's no-context floor from teacher-forced likelihood, as a predictor of retention beside the CTI.

Retention decomposes as ``floor + (1 - floor) * context_gain`` (``cti_eval.context_gain``), and the floor
``score_no_context / score_full`` ranks the tool-results points the CTI cannot (``cti_floor.py``: 0.69 against
0.02). Measured by generation on 20 calibration examples it is too noisy to deploy (its agreement with the
evaluation split's floor is 0.46, and ``floor + (1 - floor) x CTI`` then ranks 0.49 pooled). This script measures
the same ratio without generating: on the first ``--examples`` calibration examples of each workload the receiver
reads the reference answer teacher-forced, once after the full prompt and once after the instruction alone, and
``p = exp(-mean NLL per answer token)`` (the geometric-mean probability of the answer's tokens) stands in for the
task score: ``floor_nll = mean p_no_context / mean p_full`` (``eval/receiver_floor.likelihood_floor``, also ``cachecert eval
floor --measure likelihood``). Receiver only; no sender, mapper or generation.

Analysis fixed before any figure was seen (thirty-fifth session): Spearman's rho against the current retention
table of ``floor_nll`` alone and of ``floor_nll + (1 - floor_nll) x CTI`` (the form ``cti_floor.py`` uses),
pooled, per workload and on the pure-KV points, next to the CTI and to the generation floor of
``docs/results/receiver_floors.json`` (and its combination) on the same points. Calibration examples share no
question with retention (evaluation split), so nothing is cross-fitted.

    python benchmarks/cti_likelihood_floor.py --out docs/results/cti_likelihood_floor.json

How many examples a floor needs (no model run; thirty-sixth session):

    python benchmarks/cti_likelihood_floor.py --floors docs/results/cti_likelihood_floor_24.json --examples 24 \
        --sizes 1,2,4,8,12,16,24 --out docs/results/cti_floor_size.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shlex
import sys
from pathlib import Path

from tqdm import tqdm

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.cti_eval import correlate, grouped_spearman, predicted_retention
from cachecert_agents.eval.receiver_floor import likelihood_floor, mean_answer_probability
from cachecert_agents.eval.workloads import get_workload
from cachecert_agents.models.handle import ModelHandle

RECEIVERS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
WORKLOADS = ("hotpotqa", "musique", "squad-long", "tool-results")


def _floors_from(floors: dict, pick) -> dict:
    """The floors recomputed from the stored per-example NLLs of the examples ``pick(n)`` returns (indices)."""
    out: dict = {}
    for receiver, by_workload in floors.items():
        for workload, f in by_workload.items():
            idx = list(pick(len(f["nll_full"])))
            p_full = mean_answer_probability([f["nll_full"][i] for i in idx])
            p_none = mean_answer_probability([f["nll_no_context"][i] for i in idx])
            out.setdefault(receiver, {})[workload] = {"floor": p_none / p_full}
    return out


def robustness(pairs: list[dict], transfer_rows: list[dict], floors: dict, generation: dict, resamples: int,
               seed: int) -> dict:
    """Added after the pre-registered figures were seen: how the pooled combination moves when the floors rest on
    the first 4 (the CTI's own calibration examples) or 8 examples, and its spread over ``resamples`` bootstrap
    draws of each floor's examples (with replacement), against the CTI's pooled figure."""
    def pooled(f: dict) -> dict:
        result = analyse(pairs, transfer_rows, f, generation)
        return result["correlations"]["pooled"] | result["correlations_exploratory_scale_free"]["pooled"]

    keys = ("floor_nll", "floor_nll_plus_cti", "predicted_retention")
    first = {str(k): {key: pooled(_floors_from(floors, lambda n, k=k: range(min(k, n))))[f"spearman_{key}"]
                      for key in keys} for k in (4, 8)}
    rng = random.Random(seed)
    draws = [pooled(_floors_from(floors, lambda n: [rng.randrange(n) for _ in range(n)])) for _ in range(resamples)]
    cti = pooled(floors)["spearman_cti"]
    boot = {"resamples": resamples, "seed": seed, "spearman_cti": cti}
    for key in keys[1:]:
        d = sorted(x[f"spearman_{key}"] for x in draws)
        boot[key] = {"median": d[len(d) // 2], "q05": d[int(0.05 * len(d))], "q95": d[int(0.95 * len(d)) - 1],
                     "fraction_above_cti": sum(v > cti for v in d) / len(d)}
    return {"first_examples": first, "bootstrap": boot}


def by_size(pairs: list[dict], transfer_rows: list[dict], floors: dict, generation: dict, sizes: list[int],
            draws: int, seed: int) -> dict:
    """Added in the thirty-sixth session, after every figure above was seen: how many examples a floor needs.
    For each ``k`` in ``sizes``, the pooled Spearman of the predicted retention (and of the floor alone) with the
    floors on the first ``k`` examples (those the CTI's statistics pass reads when ``k`` is at most its context
    count, so they cost no prefill of their own) and over ``draws`` random ``k``-subsets of each floor's examples
    (without replacement): median and 5-95% range, and the fraction of draws above the CTI."""
    def pooled(f: dict) -> dict:
        result = analyse(pairs, transfer_rows, f, generation)
        return result["correlations"]["pooled"] | result["correlations_exploratory_scale_free"]["pooled"]

    rng = random.Random(seed)
    cti = pooled(floors)["spearman_cti"]
    out = {"draws": draws, "seed": seed, "spearman_cti": cti, "sizes": {}}
    for k in sizes:
        first = pooled(_floors_from(floors, lambda n, k=k: range(min(k, n))))
        row = {"first": {key: first[f"spearman_{key}"] for key in ("floor_nll", "predicted_retention")}}
        sampled = [pooled(_floors_from(floors, lambda n, k=k: rng.sample(range(n), min(k, n))))
                   for _ in range(draws)]
        for key in ("floor_nll", "predicted_retention"):
            d = sorted(x[f"spearman_{key}"] for x in sampled)
            row[key] = {"median": d[len(d) // 2], "q05": d[int(0.05 * len(d))], "q95": d[max(int(0.95 * len(d)) - 1, 0)],
                        "fraction_above_cti": sum(v > cti for v in d) / len(d)}
        out["sizes"][str(k)] = row
    return out


def extend_floor(receiver: ModelHandle, workload, earlier: dict, n: int) -> dict:
    """``earlier`` (a floor of :func:`likelihood_floor` on the first calibration examples) grown to the first ``n``
    (only the examples it lacks are measured); ``floor_nll`` kept in step for files of the first run's naming."""
    grown = likelihood_floor(receiver, workload, n, progress=False, earlier=earlier)
    return dict(earlier, **grown, floor_nll=grown["floor"])


def analyse(pairs: list[dict], transfer_rows: list[dict], floors: dict, generation_floors: dict) -> dict:
    rows = []
    for p in correlate(pairs, transfer_rows)["points"]:
        f = floors.get(p["receiver"], {}).get(p["workload"])
        g = generation_floors.get((p["receiver"], p["workload"]))
        if f is None or g is None:
            continue  # a partial (smoke) run
        fl = f["floor"]
        deviation = 10 ** -p["cti"]  # the index's predicted relative deviation (CTI = -log10 of it)
        rows.append(dict(p, floor_nll=fl, floor_nll_plus_cti=fl + (1 - fl) * p["cti"], floor_generation=g,
                         floor_generation_plus_cti=g + (1 - g) * p["cti"],
                         predicted_retention=predicted_retention(fl, deviation),
                         predicted_retention_generation_floor=predicted_retention(g, deviation)))
    keys = ("cti", "floor_nll", "floor_nll_plus_cti", "floor_generation", "floor_generation_plus_cti")
    # exploratory, added after the figures above were seen (a review found the fixed form depends on the index's
    # log scale: on ln instead of log10 it ranks 0.148): the scale-free 1 - (1 - floor) x 10^-CTI
    later = ("cti", "predicted_retention", "predicted_retention_generation_floor")
    return {"correlations": grouped_spearman(rows, keys),
            "correlations_exploratory_scale_free": grouped_spearman(rows, later),
            "points": [{k: r[k] for k in ("sender", "receiver", "workload", "method", "n", "retention", *keys,
                                           *later[1:])} for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cti", default="docs/results/cti_k4_p1.json", help="a `cachecert cti --all` result")
    ap.add_argument("--transfer", default="docs/results/transfer.json", help="the current retention table")
    ap.add_argument("--generation-floors", default="docs/results/receiver_floors.json",
                    help="the rows of `cachecert eval floor` (the generation floor compared with)")
    ap.add_argument("--examples", type=int, default=12, help="calibration examples per receiver and workload")
    ap.add_argument("--receivers", default=",".join(RECEIVERS), help="comma-separated (a smoke run: one)")
    ap.add_argument("--floors", default=None,
                    help="reuse the likelihood floors of an earlier --out instead of running the receivers")
    ap.add_argument("--extend", action="store_true",
                    help="with --floors: measure only the examples the earlier floors lack, up to --examples, and "
                         "add them (the earlier per-example NLLs are kept)")
    ap.add_argument("--resamples", type=int, default=500, help="bootstrap draws of the floors' examples (>= 1)")
    ap.add_argument("--restrict-to", default=None, metavar="CTI_FILE",
                    help="rank only the pairs (sender, receiver, workload) that this other `cachecert cti` result "
                         "holds: two indices compared on the same points")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated example counts: also rank with floors on the first k and on random "
                         "k-subsets of each floor's examples (--resamples draws each; by_size in the output)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/cti_likelihood_floor.json")
    args = ap.parse_args()
    if args.resamples < 1 or args.examples < 1:
        ap.error("--resamples and --examples must be at least 1")
    command = shlex.join(["python", *sys.argv])
    floors_command = command
    if args.floors:
        earlier = json.loads(Path(args.floors).read_text())
        floors, floors_command = earlier["floors"], earlier.get("floors_command", earlier["command"])
        for by_workload in floors.values():  # the first run of this script named the floor "floor_nll"
            for f in by_workload.values():
                f.setdefault("floor", f.get("floor_nll"))
        if args.extend:
            floors_command = f"{floors_command}; extended: {command}"
            for name in tqdm(args.receivers.split(","), desc="receivers"):
                receiver = ModelHandle.load(name)
                for w in WORKLOADS:
                    floors[name][w] = extend_floor(receiver, get_workload(w), floors[name][w], args.examples)
                del receiver
    else:
        floors = {}
        for name in tqdm(args.receivers.split(","), desc="receivers"):
            receiver = ModelHandle.load(name)
            floors[name] = {w: likelihood_floor(receiver, get_workload(w), args.examples) for w in WORKLOADS}
            del receiver
    generation = {(r["receiver"], r["workload"]): r["floor"]
                  for r in json.loads(Path(args.generation_floors).read_text())["results"]}
    pairs = json.loads(Path(args.cti).read_text())["results"]["pairs"]
    if args.restrict_to:
        keep = {(p["sender"], p["receiver"], p["workload"])
                for p in json.loads(Path(args.restrict_to).read_text())["results"]["pairs"]}
        pairs = [p for p in pairs if (p["sender"], p["receiver"], p["workload"]) in keep]
    transfer_rows = json.loads(Path(args.transfer).read_text())["results"]
    result = analyse(pairs, transfer_rows, floors, generation)
    result["robustness_exploratory"] = robustness(pairs, transfer_rows, floors, generation, args.resamples,
                                                  args.seed)
    if args.sizes:
        result["by_size"] = by_size(pairs, transfer_rows, floors, generation,
                                    [int(k) for k in args.sizes.split(",")], args.resamples, args.seed)
    out = {"command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(), "cti_file": args.cti,
           "restricted_to": args.restrict_to,
           "transfer_file": args.transfer, "generation_floors_file": args.generation_floors,
           "examples": args.examples, **result, "floors_command": floors_command, "floors": floors}
    write_json_atomic(Path(args.out), out)
    for name, c in result["correlations"].items():
        print(f"{name:>13} n={c['n_points']:>2}  CTI {c['spearman_cti']:+.3f}  nll-floor {c['spearman_floor_nll']:+.3f}"
              f"  +CTI {c['spearman_floor_nll_plus_cti']:+.3f}  gen-floor {c['spearman_floor_generation']:+.3f}"
              f"  +CTI {c['spearman_floor_generation_plus_cti']:+.3f}")
    c = result["correlations_exploratory_scale_free"]
    print("exploratory, 1 - (1 - floor) x 10^-CTI: " + ", ".join(
        f"{name} {g['spearman_predicted_retention']:+.3f}" for name, g in c.items()))
    print(json.dumps(result["robustness_exploratory"]))
    for k, row in result.get("by_size", {}).get("sizes", {}).items():
        pr = row["predicted_retention"]
        print(f"floor on {k:>2} examples: first {row['first']['predicted_retention']:+.3f}; random subsets median "
              f"{pr['median']:+.3f} ({pr['q05']:+.3f} to {pr['q95']:+.3f}), above the CTI in "
              f"{pr['fraction_above_cti']:.0%}")


if __name__ == "__main__":
    main()
