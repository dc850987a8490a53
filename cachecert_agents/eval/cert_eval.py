"""``cachecert eval cert`` and the data behind ``cachecert certify``: labelled requests and split validation.

A *labelled request* is one transfer record of ``cachecert eval transfer`` that carries risk scores (see
:mod:`cachecert_agents.cert.scores`): its label is ``unsafe = not agree`` (the answer served from the transferred
cache disagrees with the receiver's own full-prefill answer under the workload's criterion). Another criterion
(:class:`~cachecert_agents.eval.workloads.Agreement`, e.g. ``token-f1>=0.5``) relabels the same records from their
recorded answers and the receiver's cached full-prefill answers, with no model run.

Prefill saved per request (fraction of the receiver's context prefill time, net of costs):

- served (accepted): ``1 - (transfer_s + overhead) / prefill_s``;
- refused: ``-(transfer_s + overhead) / prefill_s`` (the transfer and scoring were wasted, then a full prefill);

with ``overhead`` the score arithmetic (``score_s``) plus, when refused, the recorded suffix pass (``pass_s``) for every
score but ``constant`` (0): when served, that pass *is* the answer's first step, since its last logits seed
decoding (the runtime answers from it). This holds for ``geometry`` too: the pass that records its queries and
attention costs what a plain suffix pass costs (``docs/results/suffix_pass_cost.json``: 2.58 against 2.45 s,
2.54 against 2.50 s and 2.06 against 2.07 s on three hotpotqa requests). Rows written before 2026-12-03 charged
geometry the whole pass even when served.

**Screened** requests (:func:`screened_requests`, method ``"<method>|screen:<screen>"``) decide an expensive
transfer (a split transfer, whose receiver repair costs a large part of a prefill) from the risk score of a cheap
one (``ridge-kv``, mapping only) run first: the screen's transfer, suffix pass and scoring are paid either way
(``screen_s``), the expensive transfer only when served. The label stays the served transfer's.
"""

from __future__ import annotations

import logging
import re
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from cachecert_agents.cert.conformal import split_validation
from cachecert_agents.cert.scores import SCORE_VERSION, SCORES, scores_are_current, version_is_current
from cachecert_agents.errors import CacheCertError
from cachecert_agents.eval.transfer_eval import full_reference_path, parse_method, records_path
from cachecert_agents.eval.workloads import Agreement
from cachecert_agents.jsonl import read_jsonl

logger = logging.getLogger(__name__)


@dataclass
class LabelledRequests:
    """Labelled transfer requests of one pair, workload and method (arrays aligned with ``ids``)."""

    sender: str
    receiver: str
    workload: str
    method: str
    split: int
    ids: list[str]
    scores: dict[str, np.ndarray]
    unsafe: np.ndarray
    prefill_s: np.ndarray
    transfer_s: np.ndarray
    pass_s: np.ndarray
    score_s: np.ndarray
    same_run_timing: bool = True  # every request's prefill time was measured in the run of its transfer
    screen_s: np.ndarray | None = None  # screened requests: the screen's transfer + pass + scoring time
    agreement: str | None = None  # the criterion the labels were relabelled with; None: the workload's own

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, keep: list[int], **replace: Any) -> LabelledRequests:
        """These requests restricted to the positions ``keep`` (every per-request array cut alike), with the fields
        in ``replace`` replaced (e.g. ``scores`` holding extra scores on the kept requests)."""
        cut = {"ids": [self.ids[k] for k in keep], "scores": {s: v[keep] for s, v in self.scores.items()},
               "unsafe": self.unsafe[keep], "prefill_s": self.prefill_s[keep], "transfer_s": self.transfer_s[keep],
               "pass_s": self.pass_s[keep], "score_s": self.score_s[keep],
               "screen_s": None if self.screen_s is None else self.screen_s[keep]}
        return dataclasses.replace(self, **{**cut, **replace})

    def gains(self, score: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-request prefill fraction saved if served / if refused (see the module docstring)."""
        if self.screen_s is not None and score != "constant":  # a constant score needs no screen
            served_cost, refused_cost = self.screen_s + self.transfer_s, self.screen_s
        elif score == "constant":
            served_cost = refused_cost = self.transfer_s
        else:
            served_cost, refused_cost = self.transfer_s + self.score_s, self.transfer_s + self.pass_s + self.score_s
        return 1 - served_cost / self.prefill_s, -refused_cost / self.prefill_s


def pool_key(row: dict) -> tuple[str, str, str, str]:
    """``(sender, receiver, workload, method)``: the labelled pool a cert.json row was validated on."""
    return row["sender"], row["receiver"], row["workload"], row["method"]


def labelled_requests(results_dir: Path, sender: str, receiver: str, workload: str,
                      agreement: str | Agreement | None = None, mapper_fingerprint: str | None = None,
                      ids: Iterable[str] | None = None) -> dict[str, LabelledRequests]:
    """Every method's labelled requests in ``<results_dir>/<sender>__<receiver>__<workload>.jsonl`` (records
    without risk scores, e.g. controls or runs with ``--no-scores``, or with scores of another definition
    version, are skipped). The last record per (id, method) wins.

    ``mapper_fingerprint``: keep only the records labelled with that mapper (``mapper_sha256``; what a
    certificate for that mapper may be calibrated on; records from before it was recorded carry none and are
    skipped). ``ids``: keep only those examples.

    ``agreement`` (None: the label recorded under the workload's own criterion) relabels every request by that
    criterion between its recorded answer and the receiver's full-prefill answer cached beside the records; a
    request whose full-prefill answer is missing raises :class:`CacheCertError`."""
    path = records_path(results_dir, sender, receiver, workload)
    latest: dict[tuple[str, str], dict] = {}
    wanted = None if ids is None else set(ids)
    other_mapper = 0
    for rec in read_jsonl(path):
        if "risk" in rec and "agree" in rec and scores_are_current(rec) and (wanted is None or rec["id"] in wanted):
            if mapper_fingerprint is not None and rec.get("mapper_sha256") != mapper_fingerprint:
                other_mapper += 1
                continue
            latest[(rec["id"], rec["method"])] = rec
    if other_mapper:
        logger.info("%s: skipped %d labelled records not made with mapper %s", path, other_mapper, mapper_fingerprint)
    criterion = None if agreement is None else Agreement.parse(agreement)
    if criterion is not None:
        full_path = full_reference_path(Path(results_dir), receiver, workload)
        full = {r["id"]: r["answer"] for r in read_jsonl(full_path)}
        for rec in latest.values():
            if rec["id"] not in full:
                raise CacheCertError(f"{full_path}: no full-prefill answer for {rec['id']!r}, so {path} cannot be "
                                     f"relabelled by {criterion}")
            rec["agree"] = criterion(rec["answer"], full[rec["id"]])
    out: dict[str, LabelledRequests] = {}
    for method in sorted({m for _, m in latest}):
        recs = [r for (_, m), r in sorted(latest.items()) if m == method]
        untimed = [r["id"] for r in recs if not r.get("prefill_s")]
        if untimed:  # a saving relative to an unknown prefill time would be meaningless (or infinite)
            raise CacheCertError(f"{path}: {len(untimed)} labelled {method} record(s) carry no receiver prefill time "
                                 f"(prefill_s), e.g. {untimed[0]!r}; rerun `cachecert eval transfer` for them")
        arr = lambda key: np.array([float(r.get(key, 0.0)) for r in recs])  # noqa: E731
        out[method] = LabelledRequests(
            sender, receiver, workload, method, int(recs[0]["split"]), [r["id"] for r in recs],
            {s: np.array([float(r["risk"][s]) for r in recs]) for s in SCORES},
            np.array([0.0 if r["agree"] else 1.0 for r in recs]), arr("prefill_s"), arr("transfer_s"),
            arr("pass_s"), arr("score_s"), all(r.get("prefill_timed") == "same-run" for r in recs),
            agreement=None if criterion is None else str(criterion))
    return out


SCREEN_TAG = "|screen:"


def screened_requests(target: LabelledRequests, screen: LabelledRequests) -> LabelledRequests:
    """``target``'s requests (labels, transfer times) decided by ``screen``'s risk scores on the same requests
    (see the module docstring). Only requests both hold are kept; the method is ``"<target>|screen:<screen>"``.

    Validity: the score is still a fixed function of the request (the screen transfer is deterministic given the
    sender's features), so CRC/LTT hold for the served transfer's unsafe rate as for any other score."""
    if SCREEN_TAG in target.method or SCREEN_TAG in screen.method:
        raise ValueError("a screen cannot itself be screened")
    at = {i: k for k, i in enumerate(screen.ids)}
    keep = [k for k, i in enumerate(target.ids) if i in at]
    if not keep:
        raise ValueError(f"{target.method} and {screen.method} share no labelled request")
    j = [at[target.ids[k]] for k in keep]
    return LabelledRequests(
        target.sender, target.receiver, target.workload, f"{target.method}{SCREEN_TAG}{screen.method}",
        target.split, [target.ids[k] for k in keep], {s: v[j] for s, v in screen.scores.items()},
        target.unsafe[keep], target.prefill_s[keep], target.transfer_s[keep], screen.pass_s[j], screen.score_s[j],
        target.same_run_timing and screen.same_run_timing,
        screen_s=screen.transfer_s[j] + screen.pass_s[j] + screen.score_s[j], agreement=target.agreement)


def with_screens(labelled: dict[str, LabelledRequests], screen: str) -> dict[str, LabelledRequests]:
    """``labelled`` plus, for every other method, its requests screened by ``screen`` (when ``screen`` has
    labelled requests)."""
    out = dict(labelled)
    if screen in labelled:
        for method, target in labelled.items():
            if method != screen:
                screened = screened_requests(target, labelled[screen])
                out[screened.method] = screened
    return out


def score_auc(scores: np.ndarray, unsafe: np.ndarray) -> float | None:
    """How well a risk score ranks unsafe requests above safe ones: the ROC AUC, ``P(score_unsafe > score_safe)``
    with ties counted one half (the Mann-Whitney statistic over ``scores`` ``[n]`` and labels ``unsafe`` ``[n]``,
    1 = unsafe). 0.5 = no better than chance (a constant score), 1 = perfect. None when the pool holds only one
    class. The certificate's guarantee holds for any score; the AUC says how much it can accept within it."""
    scores, bad = np.asarray(scores, float), np.asarray(unsafe, float) > 0.5
    n_bad, n_good = int(bad.sum()), int((~bad).sum())
    if n_bad == 0 or n_good == 0:
        return None
    diff = scores[bad][:, None] - scores[~bad][None, :]  # [n_bad, n_good]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / (n_bad * n_good))


def perfect_score_saving(unsafe: np.ndarray, gain_served: np.ndarray, gain_refused: np.ndarray,
                         alpha: float) -> float:
    """The most prefill any risk score could save on this pool at risk ``alpha``: the in-sample optimum of
    ``mean_i(served_i if i accepted else refused_i)`` over acceptance sets whose served-and-unsafe count is at most
    ``floor(alpha * n)`` (0 if every such set loses: a certificate that accepts nothing is never tried).

    It accepts every safe request it gains on, then the unsafe requests with the largest gain over refusal while
    the budget lasts. On any test set where a certificate's realised risk is at most ``alpha`` it saves at most
    that set's optimum (and it pays the finite-sample correction besides). The pool's optimum is an in-sample
    reference, not a strict bound on the mean certified saving (a test half's optimum can exceed it, and CRC holds
    risk at ``alpha`` only on average): roughly, the gap to it is the score's, the rest of the way to 1 is the
    transfers' (their unsafe rate).
    Arrays of shape ``(n,)``: ``unsafe`` in {0, 1}, gains in fractions of the receiver's prefill time."""
    u = np.asarray(unsafe, dtype=float) > 0.5
    served, refused = np.asarray(gain_served, dtype=float), np.asarray(gain_refused, dtype=float)
    if not (u.shape == served.shape == refused.shape) or u.ndim != 1 or u.size == 0:
        raise ValueError(f"unsafe, gain_served and gain_refused must be equal-length 1-d arrays, got "
                         f"{u.shape}, {served.shape}, {refused.shape}")
    extra = served - refused  # what serving a request gains over refusing it
    take = ~u & (extra > 0)
    budget = int(np.floor(alpha * u.size + 1e-9))
    unsafe_extra = np.sort(extra[u & (extra > 0)])[::-1][:budget]
    return max(0.0, float((refused.sum() + extra[take].sum() + unsafe_extra.sum()) / u.size))


def validate(labelled: LabelledRequests, alphas: list[float], splits: int, delta: float | None = 0.1,
             scores: tuple[str, ...] = SCORES, cal_fraction: float = 0.5, seed: int = 0) -> list[dict]:
    """Rows of ``cert.json``: per score, alpha and control (CRC; and LTT at ``delta``), ``splits`` random
    calibration/test splits of the labelled pool, realised risk, acceptance and net prefill saved."""
    n = len(labelled)
    n_cal = max(1, min(n - 1, int(round(cal_fraction * n))))
    # serving every transfer costs the transfer only (no score, no screen): the same for every score's rows
    always_saved = float(labelled.gains("constant")[0].mean())
    rows = []
    for score in scores:
        served, refused = labelled.gains(score)
        auc = score_auc(labelled.scores[score], labelled.unsafe)
        for alpha in alphas:
            ceiling = perfect_score_saving(labelled.unsafe, served, refused, alpha)
            for d in ([None] if delta is None else [None, delta]):
                res = split_validation(labelled.scores[score], labelled.unsafe, alpha, n_cal, splits, rng_seed=seed,
                                       delta=d, gain_accepted=served, gain_rejected=refused)
                guarded = res["guarded"]  # the same splits, each switched off when it does not pay
                feasible_splits = max(1, splits - res["n_infeasible"])
                rows.append({
                    "sender": labelled.sender, "receiver": labelled.receiver, "workload": labelled.workload,
                    "method": labelled.method, "alpha": alpha, "delta": d, "control": res["method"],
                    "score": score, "n_pool": n, "n_cal": n_cal, "splits": splits,
                    "n_infeasible": res["n_infeasible"],
                    "risk_mean": res["test_risk_mean"], "risk_std": res["test_risk_std"],
                    "risk_se": res["test_risk_se"], "risk_max": res["test_risk_max"],
                    "frac_above_alpha": res["frac_risk_above_alpha"], "accept_rate": res["accept_rate_mean"],
                    "prefill_saved": res["gain_mean"], "prefill_saved_std": res["gain_std"],
                    "prefill_saved_guarded": guarded["gain_mean"], "risk_mean_guarded": guarded["test_risk_mean"],
                    "risk_max_guarded": guarded["test_risk_max"], "accept_rate_guarded": guarded["accept_rate_mean"],
                    "guarded_fraction": res["n_guarded"] / feasible_splits,
                    "unsafe_rate_always_transfer": float(labelled.unsafe.mean()),
                    "prefill_saved_always_transfer": always_saved,
                    "prefill_saved_perfect_score": ceiling,
                    "score_auc": auc,
                    "prefill_timing": "same run" if labelled.same_run_timing else "another run",
                    "score_version": SCORE_VERSION,
                    "test_risks": [round(float(x), 5) for x in res["test_risks"]],
                    **({} if labelled.agreement is None else {"agreement": labelled.agreement}),
                })
    return rows


def plot_certification(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per (pair, workload, method): realised-risk histograms against alpha (CRC, geometry score) and prefill
    saved against alpha for each score."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    groups = sorted({pool_key(r) for r in rows})
    for key in groups:
        sel = [r for r in rows if pool_key(r) == key]
        agreement = sel[0].get("agreement")  # relabelled pools plot beside, never over, the workloads' own
        stem = re.sub(r"[^A-Za-z0-9._+-]", "_", "cert_" + "__".join(key).replace("@", "")  # "|screen:" too
                      + (f"__agree_{agreement}" if agreement else ""))
        labels = f", labels: {agreement}" if agreement else ""
        crc_geo = [r for r in sel if r["control"] == "crc" and r["score"] == "geometry"]
        fig, axes = plt.subplots(1, len(crc_geo), figsize=(4 * len(crc_geo), 3), squeeze=False)
        for ax, r in zip(axes[0], crc_geo):
            ax.hist(r["test_risks"], bins=20, color="tab:blue", alpha=0.8)
            ax.axvline(r["alpha"], color="k", ls="--", label=f"alpha={r['alpha']}")
            ax.axvline(r["risk_mean"], color="tab:red", label=f"mean={r['risk_mean']:.3f}")
            ax.set_xlabel("realised risk (test)")
            ax.legend(fontsize=7)
        fig.suptitle(f"{key[0]}->{key[1]} {key[2]} {key[3]}: CRC, geometry score, {sel[0]['splits']} splits{labels}",
                     fontsize=9)
        fig.tight_layout()
        path = out_dir / f"{stem}_risk.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for score in sorted({r["score"] for r in sel}):
            pts = sorted((r["alpha"], r["prefill_saved"]) for r in sel if r["score"] == score and r["control"] == "crc")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=score)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("alpha (CRC)")
        ax.set_ylabel("prefill saved (net)")
        ax.set_title(f"{key[0]}->{key[1]} {key[2]} {key[3]}{labels}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}_saved.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def stale_geometry(row: dict) -> bool:
    """Whether a cert.json row's geometry score predates v3 on a repaired (``+rP``) transfer: rows written before
    ``score_version`` was recorded are v2, whose geometry counted recomputed tokens as mapped."""
    scored = parse_method(row["method"].split(SCREEN_TAG)[-1])  # a screened method is scored on its screen
    return not version_is_current(row.get("score_version", 2), bool(scored.recompute), "geometry")


def summarise_at_alpha(rows: list[dict], alpha: float = 0.1, control: str = "crc") -> list[dict]:
    """One row per (pair, workload, method) at one ``alpha``: the silent-failure rate (served and unsafe, as a
    fraction of all requests) when always transferring against the mean realised risk under each score's
    certificate, the prefill each saves, and which score saves the most (a tie goes to the constant score: the
    simplest rule that does as well).
    Scores infeasible on some splits are left out of the comparison."""
    out = []
    groups = sorted({pool_key(r) for r in rows})
    for key in groups:
        sel = {r["score"]: r for r in rows if pool_key(r) == key and r["control"] == control and r["alpha"] == alpha}
        if not sel:
            continue
        r0 = next(iter(sel.values()))
        feasible = {s: r for s, r in sel.items() if r["n_infeasible"] == 0 and r["risk_mean"] is not None}
        best = max(feasible, key=lambda s: (feasible[s]["prefill_saved"], s == "constant"), default=None)
        baselines = [r["prefill_saved"] for s, r in feasible.items() if s not in ("geometry", "constant")]
        out.append({
            "sender": key[0], "receiver": key[1], "workload": key[2], "method": key[3], "alpha": alpha,
            "control": control, "n_pool": r0["n_pool"], "n_cal": r0["n_cal"],
            "prefill_timing": r0.get("prefill_timing", "another run"),
            "silent_failure_always_transfer": r0["unsafe_rate_always_transfer"],
            "prefill_saved_always_transfer": r0["prefill_saved_always_transfer"],
            "risk_mean": {s: r["risk_mean"] for s, r in feasible.items()},
            "prefill_saved": {s: r["prefill_saved"] for s, r in feasible.items()},
            "prefill_saved_guarded": {s: r["prefill_saved_guarded"] for s, r in feasible.items()
                                      if r.get("prefill_saved_guarded") is not None},
            "prefill_saved_perfect_score": r0.get("prefill_saved_perfect_score")
            if best is None else feasible[best].get("prefill_saved_perfect_score"),
            "score_auc": {s: r.get("score_auc") for s, r in sel.items() if s != "constant"},
            "infeasible_scores": sorted(set(sel) - set(feasible)),
            "stale_geometry": stale_geometry(r0),
            "best_score": best,
            "geometry_minus_best_baseline": (feasible["geometry"]["prefill_saved"] - max(baselines))
            if "geometry" in feasible and baselines else None,
        })
    return out


def write_markdown(rows: list[dict], command: str, path: Path) -> None:
    """``cert.md``: a summary at alpha = 0.1, then one table per (pair, workload, method)."""
    commands = sorted({r["command"] for r in rows if r.get("command")}) or [command]
    lines = ["# CacheCert: certification measured on labelled transfers", "",
             "Commands (each row of cert.json records its own):", ""] + [f"- `{c}`" for c in commands] + [
             "",
             "Risk = rate of transfers served (score <= lambda) whose answer disagrees with full prefill, on the "
             "test half of each random split. Prefill saved is net of transfer and scoring cost, in fractions of "
             "the receiver's context prefill time (a refused transfer costs its transfer and scoring time). "
             "A method `M|screen:S` is two-stage: the risk score is computed on the cheap transfer S (run first), "
             "the transfer M runs and answers only when that score is accepted, and the label is M's answer; "
             "a refusal costs S's transfer and scoring pass only.", ""]
    relabelled = sorted({r["agreement"] for r in rows if r.get("agreement")})
    if relabelled:
        lines += [f"**Labels relabelled by the agreement criterion {', '.join(f'`{a}`' for a in relabelled)}** "
                  "(between the served answer and the receiver's full-prefill answer), not by the workloads' own "
                  "criterion: unsafe = disagrees under it.", ""]
    f = lambda v: "-" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.3f}"  # noqa: E731
    summary = summarise_at_alpha(rows)
    if summary:
        lines += ["## Summary at alpha = 0.1 (CRC)", "",
                  "Silent failures = transfers served whose answer disagrees with full prefill, as a fraction of "
                  "all requests (the realised risk). Without certification every transfer is served. "
                  "Geometry vs best baseline = the geometry score's prefill saved minus the best of entropy and "
                  "margin (positive: geometry saves more). Perfect score = the most any score could save on "
                  "this pool at the same alpha, with the best score's costs (in-sample: the safe requests plus "
                  "alpha of the unsafe ones; `perfect_score_saving`): what is left between it and 1 is the "
                  "transfers' doing, not the certificate's. † = the requests' prefill times come from the cached "
                  "full-prefill reference, possibly timed in another run under another load: those savings are "
                  "not comparable (see transfer.md). ‡ = the pool's geometry scores predate v3 on this repaired "
                  "transfer (they counted recomputed tokens as mapped; `stale_geometry`). AUC = how well each score "
                  "ranks the pool's unsafe requests above its safe ones (0.5: chance; `score_auc`; - in rows "
                  "written before it was recorded). Guarded = the same certificates with the savings guard "
                  "(`guard_threshold`: a split's certificate that does not save on its own calibration half is "
                  "switched off, serving nothing), best score; - in rows written before it existed.", "",
                  "| pair | workload | method | n (cal) | silent failures: always transfer -> certified (best "
                  "score) | prefill saved: always -> certified (perfect score) | guarded | best score | geometry "
                  "vs best baseline | AUC geometry / entropy / margin |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in summary:
            b = s["best_score"]
            cert = (f"{f(s['silent_failure_always_transfer'])} -> {f(s['risk_mean'][b])}" if b else
                    f"{f(s['silent_failure_always_transfer'])} -> infeasible")
            saved = (f"{f(s['prefill_saved_always_transfer'])} -> {f(s['prefill_saved'][b])}" if b else
                     f"{f(s['prefill_saved_always_transfer'])} -> -")
            saved += f" ({f(s.get('prefill_saved_perfect_score'))})"
            saved += " †" if s["prefill_timing"] != "same run" else ""
            method = s["method"].replace("|", "\\|") + (" ‡" if s["stale_geometry"] else "")  # escape the pipe
            guarded = s.get("prefill_saved_guarded") or {}
            best_guarded = max(guarded, key=lambda k: (guarded[k], k == "constant"), default=None)
            guard = f"{f(guarded[best_guarded])} ({best_guarded})" if best_guarded else "-"
            lines.append(f"| {s['sender']} -> {s['receiver']} | {s['workload']} | {method} | {s['n_pool']} "
                         f"({s['n_cal']}) | {cert} | {saved} | {guard} | {b or '-'} | "
                         f"{f(s['geometry_minus_best_baseline'])} | "
                         f"{' / '.join(f(s['score_auc'].get(k)) for k in ('geometry', 'entropy', 'margin'))} |")
        lines.append("")
    groups = sorted({pool_key(r) for r in rows})
    for key in groups:
        sel = [r for r in rows if pool_key(r) == key]
        r0 = sel[0]
        lines += [f"## {key[0]} -> {key[1]}, {key[2]}, {key[3]}", "",
                  f"{r0['n_pool']} labelled requests, calibration {r0['n_cal']}, {r0['splits']} splits; always "
                  f"transferring: unsafe rate {r0['unsafe_rate_always_transfer']:.3f}, prefill saved "
                  f"{r0['prefill_saved_always_transfer']:.3f}.", "",
                  "| score | control | alpha | delta | risk mean | risk std | risk max | P(risk > alpha) | accept | "
                  "prefill saved | guarded: saved (risk mean, splits off) | infeasible splits |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(sel, key=lambda r: (r["control"], r["alpha"], r["score"])):
            lines.append(f"| {r['score']} | {r['control']} | {r['alpha']} | {r['delta'] or '-'} | "
                         f"{f(r['risk_mean'])} | {f(r['risk_std'])} | {f(r['risk_max'])} | "
                         f"{f(r['frac_above_alpha'])} | {f(r['accept_rate'])} | {f(r['prefill_saved'])} | "
                         + (f"{f(r['prefill_saved_guarded'])} ({f(r['risk_mean_guarded'])}, "
                            f"{r['guarded_fraction']:.0%}) | " if "prefill_saved_guarded" in r else "- | ")
                         + f"{r['n_infeasible']} |")
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
