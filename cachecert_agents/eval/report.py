"""Readable reports from results files: Markdown tables and plots (``cachecert eval report``)."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, list):
        return " .. ".join(_fmt(v, digits) for v in value)
    return str(value)


def transfer_markdown(results_file: str | Path, out_md: str | Path, plot_dir: str | Path | None = None,
                      available: dict[str, int] | None = None) -> Path:
    """Write ``transfer.md``: the rows of ``transfer.json`` as a table, a coverage grid (``available``: evaluation
    examples per workload, see :func:`coverage_grid`), and one frontier plot per pair (task-score retention against
    prefill saved, one point per method/split, the no-context floor dashed)."""
    payload = json.loads(Path(results_file).read_text())
    rows = payload["results"]
    cols = ["sender", "receiver", "workload", "method", "n", "score_full", "score_transfer", "score_no_context",
            "score_sender", "score_random_map", "retention", "retention_ci95", "agreement", "agreement_no_context", "prefill_saved",
            "prefill_saved_total", "prefill_s_median", "transfer_s_median"]
    lines = ["# Cross-model transfer: measured retention", "",
             f"Produced by `{payload['command']}` (merged per pair/workload/method; date {payload['date']}).", "",
             "Scores are the workload's task score (token F1 against gold answers for QA; ROUGE-L for report). "
             "`retention` = score_transfer / score_full (`retention_ci95`: paired bootstrap over the examples, 2,000 "
             "resamples); `agreement` = share of answers that agree with the "
             "receiver's own full-prefill answer under the workload's criterion (no gold needed); "
             "`prefill_saved` = 1 - median transfer time / median receiver context-prefill time on this 2-core CPU "
             "machine, both timed in the same run, except where marked †: there the receiver's prefill time is "
             "the cached full-prefill reference's, possibly timed in another run under another load (rows "
             "evaluated before same-run timing; `transfer_cost.json` measures both in one run). "
             "`prefill_saved_total` = 1 - total transfer time / total prefill time over the row's examples (in "
             "transfer.json with a paired-bootstrap `prefill_saved_total_ci95` and the median per-example saving; "
             "- in rows summarised before 2026-12-03). Each row in transfer.json also names the `mappers` its "
             "transfers were made with (fingerprint -> count; `unrecorded` for records from before fingerprints).",
             "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sorted(rows, key=lambda r: (r["sender"], r["receiver"], r["workload"], r.get("split") or 0)):
        cells = [_fmt(r.get(c)) + (" †" if c == "prefill_saved" and r.get("prefill_timing") != "same run" else "")
                 for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    from cachecert_agents.eval.workloads import WORKLOADS
    from cachecert_agents.models.registry import EMBEDDED_MODELS

    lines += ["", "## Coverage of the pair x workload grid", "",
              "Largest n of any transfer method per cell (✓: the required n is reached). A workload whose data "
              "has fewer evaluation examples than the required n cannot reach it: ✓ all marks a cell where every "
              "one of them is measured. Evaluation examples in the data this report was written with: "
              + (", ".join(f"{w} {k}" for w, k in sorted(available.items())) if available else "not read") + ".",
              "", *coverage_grid(rows, list(EMBEDDED_MODELS), list(WORKLOADS), available)]
    plots = _frontier_plots(rows, Path(plot_dir)) if plot_dir else []
    if plots:
        lines += ["", "## Frontiers", ""]
        base = Path(out_md).resolve().parent
        for p in plots:
            p = p.resolve()
            lines.append(f"![{p.stem}]({p.relative_to(base) if p.is_relative_to(base) else p})")
    Path(out_md).write_text("\n".join(lines) + "\n")
    return Path(out_md)


#: Evaluation examples a (pair, workload) cell needs: 100, or 50 where the receiver is the 1.5B model (whose
#: prefill runs at about 60 tokens/s on CPU).
REQUIRED_N_DEFAULT = 100
REQUIRED_N_BY_RECEIVER = {"qwen2.5-coder-1.5b": 50}


def coverage_grid(rows: list[dict], models: list[str], workloads: list[str],
                  available: dict[str, int] | None = None) -> list[str]:
    """Markdown lines: one row per directed pair of ``models``, one column per workload; a cell is the largest
    ``n`` of any transfer method measured there (``-``: none), with ``✓`` where it reaches the required ``n``
    (``REQUIRED_N_BY_RECEIVER``, else ``REQUIRED_N_DEFAULT``) or ``✓ all`` where it falls short of it but covers
    all ``available[workload]`` evaluation examples of the data, and a last line counting the cells."""
    best: dict[tuple[str, str, str], int] = {}
    for r in rows:
        if _is_transfer(r["method"]):
            key = (r["sender"], r["receiver"], r["workload"])
            best[key] = max(best.get(key, 0), int(r["n"]))
    lines = ["| sender -> receiver | " + " | ".join(workloads) + " |", "|---|" + "---|" * len(workloads)]
    measured = complete = exhausted = 0
    for sender in models:
        for receiver in models:
            if sender == receiver:
                continue
            need = REQUIRED_N_BY_RECEIVER.get(receiver, REQUIRED_N_DEFAULT)
            cells = []
            for workload in workloads:
                n = best.get((sender, receiver, workload))
                everything = n is not None and n < need and n >= (available or {}).get(workload, need)
                measured += n is not None
                complete += n is not None and n >= need
                exhausted += everything
                cells.append("-" if n is None else f"{n}" + (" ✓" if n >= need else " ✓ all" if everything else ""))
            lines.append(f"| {sender} -> {receiver} (needs {need}) | " + " | ".join(cells) + " |")
    total = len(models) * (len(models) - 1) * len(workloads)
    lines += ["", f"{measured} of {total} cells measured, {complete} at the required n"
              + (f", {exhausted} at every evaluation example of a smaller workload." if exhausted else ".")]
    return lines


def _is_transfer(method: str) -> bool:
    """A transfer method (split@K..., ridge-kv, their +wW/+aA/+rP variants), not a control such as
    ``pruned-context@20``."""
    from cachecert_agents.eval.transfer_eval import parse_method

    try:
        parse_method(method)
    except ValueError:
        return False
    return True


def pareto_frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points ``(prefill_saved, retention)`` that no other point beats on both (at least as much saved and
    strictly more retained, or strictly more saved and at least as much retained), sorted by saving."""
    front = [p for p in points
             if not any((q[0] >= p[0] and q[1] > p[1]) or (q[0] > p[0] and q[1] >= p[1]) for q in points)]
    return sorted(set(front))


def _frontier_plots(rows: list[dict], plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    out = []
    pairs = sorted({(r["sender"], r["receiver"]) for r in rows})
    for sender, receiver in pairs:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        top = 1.2
        for workload in sorted({r["workload"] for r in rows if (r["sender"], r["receiver"]) == (sender, receiver)}):
            mine = [r for r in rows if (r["sender"], r["receiver"], r["workload"]) == (sender, receiver, workload)
                    and r.get("prefill_saved") is not None and r.get("retention") is not None]
            if not mine:  # e.g. a full-prefill score of 0: retention is undefined, nothing to draw
                continue
            # the frontier, its floor and its controls come from the rows measured on the most examples (one
            # common set); methods measured on fewer are drawn apart (x) with their n, never joined to the line
            n_max = max(r["n"] for r in mine)
            common = [r for r in mine if r["n"] == n_max]
            methods = [r for r in common if _is_transfer(r["method"])]
            controls = [r for r in common if not _is_transfer(r["method"])]
            fewer = [r for r in mine if r["n"] != n_max]
            pts = sorted((r["prefill_saved"], r["retention"] or 0.0, r["method"]) for r in methods)
            front = pareto_frontier([(x, y) for x, y, _ in pts])
            line, = ax.plot([p[0] for p in front], [p[1] for p in front], "-", alpha=0.6,
                            label=f"{workload} (n={n_max})")
            color = line.get_color()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color)
            ax.plot([r["prefill_saved"] for r in controls], [r["retention"] or 0.0 for r in controls], "s",
                    mfc="none", color=color)
            ax.plot([r["prefill_saved"] for r in fewer], [r["retention"] or 0.0 for r in fewer], "x", color=color,
                    alpha=0.6)
            for r in methods + controls + fewer:
                label = r["method"] + (f" (n={r['n']})" if r["n"] != n_max else "")
                ax.annotate(label, (r["prefill_saved"], r["retention"] or 0.0), fontsize=6,
                            textcoords="offset points", xytext=(3, 3))
                top = max(top, (r["retention"] or 0.0) + 0.1)
            floor = [r for r in common if r.get("score_no_context") is not None and r["score_full"]]
            if floor:
                ax.axhline(floor[0]["score_no_context"] / floor[0]["score_full"], ls="--", color=color, alpha=0.5)
        ax.set_xlabel("receiver prefill saved (measured)")
        ax.set_ylabel("retention (score transfer / score full)")
        ax.set_title(f"{sender} -> {receiver}", fontsize=9)
        ax.set_xlim(-0.05, 1.05)
        ax.set_ylim(-0.05, top)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="line: frontier of transfer methods\nsquares: controls; dashed: no context\n"
                                    "x: measured on fewer examples (n shown)",
                  title_fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        path = plot_dir / f"frontier_{sender}__{receiver}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
