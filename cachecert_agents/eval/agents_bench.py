"""``cachecert bench agents``: the wrapper's own overhead, and ``agents.md`` from the benchmark's JSON."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from cachecert_agents.agents.runtime import CacheCertRuntime, RouteConfig, RuntimeConfig
from cachecert_agents.eval.workloads import Example
from cachecert_agents.models.handle import ModelHandle


def wrapper_overhead(handle: ModelHandle, examples: list[Example], max_new_tokens: int = 32) -> dict[str, Any]:
    """Per example, the same step three ways, order rotated: the plain model call, the wrapped call with nothing
    to reuse (a fresh runtime: prefill, store insert), and the wrapped call of a model that is a route's sender
    (it also keeps its normalised residual stream for later transfers). Overhead = wrapped / plain - 1."""
    rows = []
    sender_cfg = RuntimeConfig(routes=[RouteConfig(sender=handle.name, receiver="(none)", mapper="-", certificate="-")])
    for i, ex in enumerate(examples):
        def plain() -> float:
            t0 = time.perf_counter()
            handle.generate(handle.format_prompt(ex.context, ex.instruction).input_ids, max_new_tokens=max_new_tokens)
            return time.perf_counter() - t0

        def wrapped(config: RuntimeConfig | None) -> float:
            runtime = CacheCertRuntime(config, models={handle.name: handle})
            t0 = time.perf_counter()
            runtime.generate(handle.name, ex.context, ex.instruction, max_new_tokens=max_new_tokens)
            return time.perf_counter() - t0

        runs = [("plain", plain), ("wrapped", lambda: wrapped(None)), ("wrapped_sender", lambda: wrapped(sender_cfg))]
        k = i % 3
        times = {name: fn() for name, fn in runs[k:] + runs[:k]}
        rows.append({"id": ex.id, **times, "context_chars": len(ex.context)})
    over = [r["wrapped"] / r["plain"] - 1 for r in rows]
    over_sender = [r["wrapped_sender"] / r["plain"] - 1 for r in rows]
    return {"model": handle.name, "n": len(rows), "max_new_tokens": max_new_tokens,
            "overhead_median": statistics.median(over), "overhead_sender_median": statistics.median(over_sender),
            "plain_s_median": statistics.median(r["plain"] for r in rows), "steps": rows}


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
    lines += [f"| wrapper overhead, prefill step with nothing to reuse ({o['model']}, n={o['n']}) | median "
              f"{o['overhead_median']:+.2%} (plain step median {o['plain_s_median']:.2f} s) |",
              f"| same, model that is a route's sender (keeps features) | median {o['overhead_sender_median']:+.2%} |",
              "", "Per-set records (decisions, outputs, times) are in the JSON beside this file."]
    path.write_text("\n".join(lines) + "\n")
