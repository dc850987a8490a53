"""``cachecert bench agents``: the wrapper's own overhead, and ``agents.md`` from the benchmark's JSON."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

from cachecert_agents.agents.runtime import CacheCertRuntime, RouteConfig, RuntimeConfig
from cachecert_agents.eval.workloads import Example
from cachecert_agents.models.handle import ModelHandle


@contextlib.contextmanager
def _forward_timer(handle: ModelHandle) -> Iterator[list[float]]:
    """Accumulate the seconds spent inside ``handle.forward`` (every model forward of prefill and decoding)."""
    spent = [0.0]
    inner = handle.forward

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    handle.forward = timed  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        del handle.forward


def wrapper_overhead(handle: ModelHandle, examples: list[Example], max_new_tokens: int = 32,
                     repeats: int = 1) -> dict[str, Any]:
    """The same step three ways per example (order rotated, ``repeats`` rounds): the plain model call, the wrapped
    call with nothing to reuse (a fresh runtime: prefill, store insert, generation from a copy of the cache), and
    the wrapped call of a model that is a route's sender (it also keeps its normalised residual stream).

    Reports per variant the end-to-end overhead ``wrapped / plain - 1`` (wall clock; on a shared machine its
    spread is several percent per step, so read the median over many steps) and the wrapper's *own* time: wall
    time outside model forward calls minus the plain call's, as a fraction of the plain step. The latter is what
    the wrapper adds by itself (prompt hashing, store, cache copy, bookkeeping) and is nearly free of the noise
    that the forwards carry; forward time itself differs only by the split into prefill + suffix calls and, for a
    sender, the feature capture (``forward_ratio``)."""
    rows = []
    sender_cfg = RuntimeConfig(routes=[RouteConfig(sender=handle.name, receiver="(none)", mapper="-", certificate="-")])
    for r in range(repeats):
        for i, ex in enumerate(examples):
            def plain() -> Any:
                return handle.generate(handle.format_prompt(ex.context, ex.instruction).input_ids,
                                       max_new_tokens=max_new_tokens).text

            def wrapped(config: RuntimeConfig | None) -> Any:
                runtime = CacheCertRuntime(config, models={handle.name: handle})  # built once per user, untimed
                return lambda: runtime.generate(handle.name, ex.context, ex.instruction,
                                                max_new_tokens=max_new_tokens)[0]

            runs = [("plain", lambda: plain), ("wrapped", lambda: wrapped(None)),
                    ("wrapped_sender", lambda: wrapped(sender_cfg))]
            k = (i + r) % 3
            row: dict[str, Any] = {"id": ex.id, "round": r, "context_chars": len(ex.context)}
            texts = {}
            for name, make in runs[k:] + runs[:k]:
                fn = make()
                with _forward_timer(handle) as spent:
                    t0 = time.perf_counter()
                    texts[name] = fn()
                    row[name] = time.perf_counter() - t0
                row[f"{name}_forward"] = spent[0]
            row["same_answer"] = len(set(texts.values())) == 1
            rows.append(row)

    def med(values: Any) -> float:
        return statistics.median(list(values))

    def own(r: dict, name: str) -> float:
        return r[name] - r[f"{name}_forward"]

    out: dict[str, Any] = {"model": handle.name, "n": len(rows), "examples": len(examples), "repeats": repeats,
                           "max_new_tokens": max_new_tokens, "plain_s_median": med(r["plain"] for r in rows),
                           "same_answer": sum(r["same_answer"] for r in rows), "steps": rows}
    for name, label in (("wrapped", "overhead"), ("wrapped_sender", "overhead_sender")):
        ratios = sorted(r[name] / r["plain"] - 1 for r in rows)
        out[f"{label}_median"] = med(ratios)
        out[f"{label}_iqr"] = [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]
        out[f"{label}_own_median"] = med((own(r, name) - own(r, "plain")) / r["plain"] for r in rows)
        out[f"{label}_own_s_median"] = med(own(r, name) - own(r, "plain") for r in rows)
        out[f"{label}_forward_ratio_median"] = med(r[f"{name}_forward"] / r["plain_forward"] for r in rows)
    return out


def write_agents_markdown(payload: dict, path: Path) -> None:
    """``agents.md``: the report pipeline's measured figures, readable."""
    res = payload["results"]
    s, o = res["summary"], res["overhead"]
    m = s["metrics"]
    lines = ["# Agent middleware: the report pipeline, measured", "", f"Command: `{payload['command']}`  ",
             f"Date: {payload['date']}; machine: {payload['machine']}", "",
             "Pipeline per document set (a FreshWiki article's sections): planner (outline) -> writer (summary from "
             "the sources and the outline) -> reviewer (checks the summary), planner and reviewer on one model, "
             "writer on another. The route planner -> writer was fitted and certified on calibration articles only; "
             "the sets below are evaluation articles.", "",
             "| figure | value |", "|---|---|",
             f"| document sets | {s['sets']} |",
             f"| decisions | {', '.join(f'{k} {v}' for k, v in sorted(s['decisions'].items()))} |",
             f"| prefill tokens avoided | {m['prefill_tokens_avoided']} of {m['context_tokens']} context tokens "
             f"({m['prefill_tokens_avoided'] / max(m['context_tokens'], 1):.1%}) |",
             f"| certificate refusals / errors | {m['refused']} / {m['errors']} |"]
    if "plain_s_total" in s:
        chk = s["served_transfers_checked"]
        lines += [f"| end-to-end time, wrapped vs plain (sum) | {s['wrapped_s_total']:.1f} s vs "
                  f"{s['plain_s_total']:.1f} s |",
                  f"| median per set, wrapped vs plain | {s['wrapped_s_median']:.2f} s vs {s['plain_s_median']:.2f} s "
                  f"(median ratio {s['time_ratio_median']:.3f}) |",
                  f"| planner outlines identical to plain | {s['outlines_identical']} of {s['sets']} |",
                  f"| served transfers checked against plain | {chk['silent_failures']} disagree of {chk['n']} "
                  f"(exact 95% interval {chk['exact_95_interval'][0]:.2f}-{chk['exact_95_interval'][1]:.2f}) |"]
    for a in s.get("audits", []):
        lines.append(f"| audits {a['sender']}->{a['receiver']} node {a['node']} | {a['silent_failures']} silent "
                     f"failures in {a['audited']} (rate {a['rate']:.3f}, exact 95% interval {a['exact_low']:.3f}-"
                     f"{a['exact_high']:.3f}, alpha {a['alpha']:g}{', flagged' if a['above_alpha'] else ''}) |")
    if "overhead_own_median" in o:
        lines += [f"| wrapper's own time on a prefill step with nothing to reuse ({o['model']}, {o['n']} steps) | "
                  f"median {o['overhead_own_median']:+.2%} of the plain step ({o['overhead_own_s_median'] * 1000:.1f}"
                  f" ms; plain step median {o['plain_s_median']:.2f} s) |",
                  f"| same step end to end, wrapped / plain - 1 | median {o['overhead_median']:+.2%} (interquartile "
                  f"{o['overhead_iqr'][0]:+.1%} to {o['overhead_iqr'][1]:+.1%}); model forward time ratio "
                  f"{o['overhead_forward_ratio_median']:.3f} |",
                  f"| same, model that is a route's sender (keeps features): own time / end to end | median "
                  f"{o['overhead_sender_own_median']:+.2%} / {o['overhead_sender_median']:+.2%}; forward time ratio "
                  f"{o['overhead_sender_forward_ratio_median']:.3f} |",
                  f"| answers identical, plain vs wrapped vs sender | {o['same_answer']} of {o['n']} steps |"]
        if "command" in o:
            lines.append(f"| overhead command | `{o['command']}` ({o.get('date', '')}) |")
    else:
        lines += [f"| wrapper overhead, prefill step with nothing to reuse ({o['model']}, n={o['n']}) | median "
                  f"{o['overhead_median']:+.2%} (plain step median {o['plain_s_median']:.2f} s) |",
                  f"| same, model that is a route's sender (keeps features) | median "
                  f"{o['overhead_sender_median']:+.2%} |"]
    lines += [
              "", "Per-set records (decisions, outputs, times) are in the JSON beside this file."]
    path.write_text("\n".join(lines) + "\n")
