"""``cti.md`` and the CTI plots (per-layer deviation profiles; CTI against measured retention)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable


def write_cti_report(payload: dict, path: Path, plots: Path, stem: Callable[[str, str, str], str]) -> None:
    """Write ``path`` (markdown) and its plots, named after ``path``'s stem (``cti`` -> ``cti_profiles.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = payload["results"]
    pairs, corr = res["pairs"], res.get("retention", {})
    plots.mkdir(parents=True, exist_ok=True)
    # One line per pair x statistics workload; the legend sits beside the axes in as many columns as it needs.
    columns = max(1, math.ceil(len(pairs) / 24))
    fig, ax = plt.subplots(figsize=(6 + 3.2 * columns, max(3.5, 0.16 * math.ceil(len(pairs) / columns))))
    for p in pairs:
        workload = p.get("statistics_workload") or p.get("workload")
        ax.plot([t["layer"] for t in p["profile"]], [t["deviation"] for t in p["profile"]], marker=".",
                label=f"{p['sender']}->{p['receiver']}" + (f" ({workload})" if workload else ""))
    ax.set_yscale("log")
    ax.set_xlabel("receiver layer")
    ax.set_ylabel("predicted deviation D_l")
    if pairs:
        ax.legend(fontsize=6, ncol=columns, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(plots / f"{path.stem}_profiles.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    points = corr.get("points", [])
    if points:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for p in points:
            ax.scatter(p["cti"], p["retention"])
            ax.annotate(f"{p['sender'][:6]}>{p['receiver'][:6]} {p['method']}", (p["cti"], p["retention"]),
                        fontsize=6)
        ax.set_xlabel("CTI (predicted, statistics only)")
        ax.set_ylabel("measured retention")
        fig.tight_layout()
        fig.savefig(plots / f"{path.stem}_vs_retention.png", dpi=110)
        plt.close(fig)
    f = lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"  # noqa: E731
    lines = ["# Cache Transferability Index: measured", "", f"Command: `{payload['command']}`  ",
             f"Date: {payload['date']}; machine: {payload['machine']}", "",
             "How it is computed: [../cti.md](../cti.md). Higher CTI = more transferable.", ""]
    if res.get("retention_workload"):
        lines += [f"Cross-workload check: the index is computed from **{res['statistics_workload']}** calibration "
                  f"text and correlated with retention measured on **{res['retention_workload']}**.", ""]
    lines += [

             "| pair (statistics workload) | statistics tokens | CTI (pure KV) | worst layer | R^2 baseline | 1 - residual | split CTIs | "
             "cost: statistics pass / query pass / propagation pass / index (s) |", "|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        c = p["cost"]
        lines.append(f"| {p['sender']} -> {p['receiver']} ({p.get('workload', '-')}) | {p['n_tokens']} | {p['cti']:.3f} | {p['worst_layer']} | "
                     f"{p['baselines']['r2']:.3f} | {p['baselines']['residual_fraction']:.3f} | "
                     + ", ".join(f"{s}: {v['cti']:.2f}" + (f" [{v['cti_first_order']:.2f}]" if v.get("propagated") else "")
                                 for s, v in p["splits"].items())
                     + (f" | {f(c.get('single_pass_s'))} / in that pass / " if "single_pass_s" in c else
                        f" | {f(c.get('statistics_pass_s'))} / {f(c.get('query_pass_s'))} / ")
                     + f"{f(c.get('propagation_pass_s'))} / {f(c['index_s'])} |")
    lines += ["", "Split CTIs: the split model with the stream error propagated through the receiver's own layers "
              "(measured on calibration text); in brackets, the first-order model that charges every recomputed layer "
              "the stream's relative error. A cost of '-' was not spent in this run (cached)."]
    if corr:
        lines += ["", "## Rank correlation with measured retention", "",
                  "| group | points | Spearman CTI | Spearman 1-residual | Spearman R^2 | Spearman attention-output "
                  "cosine (points; CTI on the same points) |", "|---|---|---|---|---|---|"]
        for name, c in corr["correlations"].items():
            cos = (f"{f(c['spearman_attention_cosine'])} ({c['n_points_attention_cosine']}; "
                   f"{f(c['spearman_cti_same_points'])})" if "spearman_attention_cosine" in c else "-")
            lines.append(f"| {name} | {c['n_points']} | {f(c['spearman_cti'])} | "
                         f"{f(c['spearman_residual_fraction'])} | {f(c['spearman_r2'])} | {cos} |")
        floor = [(name, c) for name, c in corr["correlations"].items() if "spearman_predicted_retention" in c]
        if floor:  # cachecert cti --floor-examples
            lines += ["", "Retention predicted with the receiver's likelihood floor, `1 - (1 - floor) x 10^-CTI` "
                      "(docs/cti.md):", "", "| group | points | Spearman predicted retention | Spearman CTI, same "
                      "points |", "|---|---|---|---|"]
            lines += [f"| {name} | {c['n_points_predicted_retention']} | {f(c['spearman_predicted_retention'])} | "
                      f"{f(c['spearman_cti_same_points_as_floor'])} |" for name, c in floor]
        pure = [(name, c) for name, c in corr["correlations"].items() if "n_points_pure_kv" in c]
        if pure:  # R^2 has one value per pair: on split points it ties within each pair, so compare on pure KV too
            lines += ["", "On the pure-KV points only (`ridge-kv`: the one point per pair where the R^2 baseline is "
                      "defined as it is for the index):", "",
                      "| group | points | Spearman CTI | Spearman 1-residual | Spearman R^2 |", "|---|---|---|---|---|"]
            lines += [f"| {name} | {c['n_points_pure_kv']} | {f(c['spearman_cti_pure_kv'])} | "
                      f"{f(c['spearman_residual_fraction_pure_kv'])} | {f(c['spearman_r2_pure_kv'])} |"
                      for name, c in pure]
        lines += ["", "| pair | workload | method | n | retention | agreement | CTI | 1-residual | R^2 | "
                  "attention cosine |", "|---|---|---|---|---|---|---|---|---|---|"]
        for p in points:
            lines.append(f"| {p['sender']} -> {p['receiver']} | {p['workload']} | {p['method']} | {p['n']} | "
                         f"{f(p['retention'])} | {f(p['agreement'])} | {f(p['cti'])} | {f(p['residual_fraction'])} | "
                         f"{f(p['r2'])} | {f(p.get('attention_cosine'))} |")
        sel = corr.get("split_selection") or {}
        if sel.get("groups"):
            lines += ["", "## Picking a split from statistics alone", "",
                      "Within each pair, across its measured methods (split layers and pure KV): Spearman's rho "
                      "between the predictor and retention, and the method each predictor would pick.", "",
                      "| pair | workload | methods | measured best | CTI rho (pick) | 1-residual rho (pick) | "
                      "attention cosine rho (pick) |", "|---|---|---|---|---|---|---|"]
            pick = lambda g, k: (f"{f(g[f'spearman_{k}'])} ({g[f'best_{k}']})"  # noqa: E731
                                 if f"spearman_{k}" in g else "-")
            for g in sel["groups"]:
                lines.append(f"| {g['sender']} -> {g['receiver']} | {g['workload']} | {g['n_methods']} | "
                             f"{g['measured_best']} | {pick(g, 'cti')} | {pick(g, 'residual_fraction')} | "
                             f"{pick(g, 'attention_cosine')} |")
            sm = sel["summary"]
            lines += ["", f"Mean within-pair rho over {sm['n_groups']} pairs: " + "; ".join(
                f"{label} {sm[f'mean_spearman_{k}']:.3f} (picks the best method in {sm[f'best_matches_{k}']})"
                for k, label in (("cti", "CTI"), ("residual_fraction", "1-residual"),
                                 ("attention_cosine", "attention cosine")) if f"mean_spearman_{k}" in sm)]
        cos_costs = [(q["sender"], q["receiver"], q["baselines"]["attention_cosine"]) for q in pairs
                     if q["baselines"].get("attention_cosine")]
        if cos_costs:
            lines += ["", "Attention-output cosine baseline (fitted mapper, receiver forward on evaluation "
                      "examples): " + "; ".join(f"{s} -> {r}: {c['n_examples']} examples, {c['seconds']:.0f} s "
                                                f"(mapper fit not included)" for s, r, c in cos_costs)]
    lines += ["", f"![profiles](plots/{path.stem}_profiles.png)"] + (
        [f"![CTI vs retention](plots/{path.stem}_vs_retention.png)"] if points else [])
    path.write_text("\n".join(lines) + "\n")


def _ratio_text(ratios: dict[str, float], eval_examples: int) -> str:
    """``1/N at n=E, 1/M at n=31 (extrapolated), ...`` for a cost ratio per evaluation-example count."""
    return ", ".join(f"1/{1 / v:.0f} at n={n}{'' if n == str(eval_examples) else ' (extrapolated)'}"
                     for n, v in ratios.items())


def write_cti_cost_report(payload: dict, path: Path) -> None:
    """``cti_cost.md`` from ``cti_cost.json`` (rows of :func:`cachecert_agents.eval.cti_cost.cti_cost`)."""
    rows = payload["results"]
    lines = ["# What the CTI costs against fitting a mapper and measuring retention", "",
             f"Date: {payload['date']}; machine: {payload['machine']}. Each row was timed in one run "
             "(`cachecert bench cti-cost`, its command below); both routes start from scratch on the same loaded "
             "models.", "",
             ("| pair | workload | CTI: single pass (contexts, tokens) / propagation / index = total (s) | "
              "mapper: statistics + held-out + fit (s) | evaluation (s per example, methods) | ratio CTI / mapper "
              "route |"), "|---|---|---|---|---|---|"]
    for r in rows:
        c, m = r["cti"], r["mapper_route"]
        ratios = _ratio_text(r["ratio_cti_to_mapper_route"], m["eval_examples"])
        passes = (f"{c['single_pass_s']:.0f} ({c['statistics_contexts']}, {c['statistics_tokens']})"
                  if "single_pass_s" in c else  # rows from before the single pass: separate statistics and queries
                  f"{c['statistics_pass_s']:.0f} ({c['statistics_contexts']}, {c['statistics_tokens']}) + queries "
                  f"{c['query_pass_s']:.0f}")
        lines.append(f"| {r['sender']} -> {r['receiver']} | {r['workload']} | {passes} / "
                     f"{c['propagation_pass_s']:.0f} / {c['index_s']:.1f} = **{c['total_s']:.0f}** | "
                     f"{m['statistics_pass_s']:.0f} + {m['heldout_pass_s']:.0f} + {m['fit_s']:.1f} | "
                     f"{m['eval_s_per_example']:.1f} ({m['methods_evaluated']}) | {ratios} |")
    lines += ["", "n = evaluation examples of the retention figure; the ones not timed extrapolate the measured "
              "per-example time linearly (the evaluation is a loop over independent examples). The single pass runs "
              "both models over the contexts once and collects the pair's statistics and the receiver's query "
              "statistics together; the propagation then runs only its perturbed receiver prefills."]
    varied = [r for r in rows if "cti_by_contexts" in r]
    if varied:
        lines += ["", "The CTI on fewer (or more) statistics contexts, timed in the same run against the same mapper "
                  "route:", "", "| pair | workload | contexts (tokens) | single pass / propagation / index = total (s) "
                  "| index | ratio / mapper route |", "|---|---|---|---|---|---|"]
        for r in varied:
            m = r["mapper_route"]
            for k, c in r["cti_by_contexts"].items():
                ratios = _ratio_text(r["ratio_by_contexts"][k], m["eval_examples"])
                lines.append(f"| {r['sender']} -> {r['receiver']} | {r['workload']} | {k} ({c['statistics_tokens']}) "
                             f"| {c['single_pass_s']:.0f} / {c['propagation_pass_s']:.0f} / {c['index_s']:.1f} = "
                             f"**{c['total_s']:.0f}** | {c['index']:.3f} | {ratios} |")
    floored = [r for r in rows if "floor" in r]
    if floored:
        lines += ["", "With the receiver's likelihood floor (`--floor-examples`, what predicted retention adds to the "
                  "index): the single pass above also read the first examples' reference answers after their "
                  "contexts (its time includes them); the floor then read every answer without the context and the "
                  "rest with it.", "",
                  "| pair | workload | floor: examples (read in the pass) | floor (s) | CTI + floor (s) | ratio with the "
                  "floor / mapper route |", "|---|---|---|---|---|---|"]
        for r in floored:
            f, m = r["floor"], r["mapper_route"]
            ratios = _ratio_text(r["ratio_cti_with_floor_to_mapper_route"], m["eval_examples"])
            lines.append(f"| {r['sender']} -> {r['receiver']} | {r['workload']} | {f['examples']} ({f['from_pass']}) "
                         f"| {f['floor_s']:.1f} | **{f['total_with_floor_s']:.0f}** | {ratios} |")
    lines += ["", "Commands:", ""] + [f"- `{r['command']}`" for r in rows]
    path.write_text("\n".join(lines) + "\n")
