"""The report pipeline behind ``cachecert demo`` and ``cachecert bench agents``: a reference use of the wrapper.

Three LangGraph nodes over the same source documents (a FreshWiki article's sections):

- ``planner`` (model A) reads the sources and outlines the report: the first step prefills them;
- ``writer`` (model B) writes the summary from the same sources and the outline: model A's cache is transferred
  when a certified route A -> B exists and its certificate accepts the request, else model B prefills;
- ``reviewer`` (model A again) checks the summary against the sources: exact reuse of model A's cache.

:func:`prepare_route` builds everything a route needs from a workload's *calibration* split only: the mapper
(first ``n_mapper + n_heldout`` calibration articles), labelled requests (the remaining calibration articles:
transfer vs full prefill, agreement by the workload's criterion) and a CRC certificate. The pipeline then runs on
*evaluation* articles, so nothing it is measured on was used to fit or certify the route.
"""

from __future__ import annotations

import logging
import operator
import statistics
import time
from pathlib import Path
from typing import Annotated, Any, Callable, TypedDict

from cachecert_agents.agents.node import ModelCall, cachecert_node
from cachecert_agents.agents.runtime import CacheCertRuntime, RouteConfig
from cachecert_agents.eval.workloads import Example, Workload
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.paths import cache_home

logger = logging.getLogger(__name__)

PLANNER_MODEL = "gemma3-270m"
WRITER_MODEL = "smollm2-135m"


class ReportState(TypedDict, total=False):
    topic: str
    documents: list[str]
    outline: str
    report: str
    review: str
    decisions: Annotated[list[dict], operator.add]


# The node bodies: what each step asks its model. The wrapper decides how the model runs.
def plan(state: ReportState) -> ModelCall:
    return ModelCall(context=state["documents"], max_new_tokens=48,
                     instruction=f"Outline a short encyclopedic summary of '{state['topic']}' from the sources "
                                 f"above: list its three main points, one line each.")


def write(state: ReportState) -> ModelCall:
    return ModelCall(context=state["documents"], max_new_tokens=96,
                     instruction=f"Write a short encyclopedic summary (2-3 sentences) of '{state['topic']}' based on "
                                 f"the sources above. Outline: {' '.join(state.get('outline', '').split())[:300]}")


def review(state: ReportState) -> ModelCall:
    return ModelCall(context=state["documents"], max_new_tokens=32,
                     instruction=f"Is this summary supported by the sources above? Answer yes or no, then one "
                                 f"reason. Summary: {' '.join(state.get('report', '').split())[:400]}")


STEPS: list[tuple[str, Callable[[ReportState], ModelCall], str, str]] = [
    ("planner", plan, "planner", "outline"), ("writer", write, "writer", "report"),
    ("reviewer", review, "planner", "review")]


def build_report_graph(runtime: CacheCertRuntime, planner_model: str = PLANNER_MODEL,
                       writer_model: str = WRITER_MODEL) -> Any:
    """The compiled LangGraph graph, every node wrapped with :func:`cachecert_node`."""
    from langgraph.graph import END, START, StateGraph

    models = {"planner": planner_model, "writer": writer_model}
    graph = StateGraph(ReportState)
    previous = START
    for name, body, role, key in STEPS:
        graph.add_node(name, cachecert_node(runtime, model=models[role], output_key=key, name=name,
                                            decisions_key="decisions")(body))
        graph.add_edge(previous, name)
        previous = name
    graph.add_edge(previous, END)
    return graph.compile()


def run_plain(models: dict[str, ModelHandle], state: ReportState) -> tuple[ReportState, list[float]]:
    """The same three steps without the wrapper: every step prefills its full prompt. Returns the final state and
    each step's seconds."""
    state = dict(state)  # type: ignore[assignment]
    times = []
    for _, body, role, key in STEPS:
        call = body(state)
        handle = models[role]
        t0 = time.perf_counter()
        prompt = handle.format_prompt(call.context_text(), call.instruction, call.system)
        state[key] = handle.generate(prompt.input_ids, max_new_tokens=call.max_new_tokens or 96).text
        times.append(time.perf_counter() - t0)
    return state, times  # type: ignore[return-value]


def example_state(ex: Example) -> ReportState:
    return {"topic": ex.meta.get("title", ex.id), "documents": [ex.context]}


# ---------------------------------------------------------------------------------------------------- routes
def prepare_route(sender: ModelHandle, receiver: ModelHandle, workload: Workload, split: int, alpha: float = 0.1,
                  score: str = "geometry", n_mapper: int = 10, n_heldout: int = 2,
                  labels_dir: Path | None = None, cert_dir: Path | None = None) -> RouteConfig:
    """Mapper, labelled requests and certificate for ``sender -> receiver`` from ``workload``'s calibration split
    (see the module docstring); artifacts are cached, so a second call only checks them. An existing certificate
    that no longer matches (another mapper, another label set) is moved aside, never overwritten."""
    from cachecert_agents.artifacts import keep_aside
    from cachecert_agents.cert.certificate import Certificate, build_certificate
    from cachecert_agents.cert.scores import score_definition
    from cachecert_agents.errors import CertificateError
    from cachecert_agents.eval.cert_eval import labelled_requests
    from cachecert_agents.eval.transfer_eval import (artifact_stem, build_mapper, build_scorer, evaluate_transfer,
                                                      mapper_stem, method_name)
    from cachecert_agents.transfer.calibrate import pair_fingerprints, pair_header

    L = receiver.geometry.num_layers
    method = method_name(split, L)
    mapper = build_mapper(sender, receiver, workload, [split] if 0 < split < L else [], n_mapper, n_heldout)
    labels_dir = labels_dir or cache_home() / "labels"
    offset = n_mapper + n_heldout
    n_labels = len(workload.examples("calibration")) - offset
    if n_labels < 10:
        raise ValueError(f"{workload.name} has only {n_labels} calibration examples left for labels after the "
                         f"mapper's {offset}; use fewer mapper contexts")
    evaluate_transfer(sender, receiver, workload, mapper, [split], n_labels, labels_dir,
                      scorer=build_scorer(sender, receiver, workload, mapper), controls=False, subset="calibration",
                      offset=offset, require_mapper=True)
    # only this mapper's labels, on the examples it was not fitted on (earlier runs may have left others)
    labelled = labelled_requests(labels_dir, sender.name, receiver.name, workload.name,
                                 mapper_fingerprint=mapper.fingerprint,
                                 ids=[e.id for e in workload.examples("calibration")[offset:]])[method]
    stem = mapper_stem(sender.name, receiver.name, workload.name)
    header = pair_header(sender, receiver)
    fps = pair_fingerprints(header)
    mapper_fp = mapper.fingerprint
    cert_path = (cert_dir or cache_home() / "certificates") / (
        f"{artifact_stem(sender.name, receiver.name, workload.name)}__{method}__{score}__a{alpha:g}.json")
    cert = build_certificate(labelled.ids, labelled.scores[score], labelled.unsafe, alpha=alpha, delta=None,
                             sender=sender.name, receiver=receiver.name, pair_fingerprints=fps,
                             mapper_fingerprint=mapper_fp, workload=workload.name, method=method,
                             split=labelled.split, score=score,
                             score_definition=score_definition(score))
    if cert_path.exists():
        try:
            old = Certificate.load(cert_path)
            old.check_for(fps, mapper_fp, method)
            if old.calibration_fingerprint == cert.calibration_fingerprint and old.alpha == alpha:
                cert = None  # still valid: keep it
        except CertificateError as exc:
            logger.info("existing certificate %s is stale (%s)", cert_path, exc)
        if cert is not None:
            keep_aside(cert_path)
    if cert is not None:
        cert.save(cert_path)
        logger.info("certificate %s: %s", cert_path, cert.threshold)
    return RouteConfig(sender=sender.name, receiver=receiver.name, mapper=str(stem), certificate=str(cert_path))


# ---------------------------------------------------------------------------------------------------- runs
def run_pipeline(runtime: CacheCertRuntime, examples: list[Example], planner_model: str, writer_model: str,
                 compare_plain: bool = True, agree: Callable[[str, str], bool] | None = None,
                 progress: bool = True, records_path: Path | None = None) -> list[dict]:
    """Run the wrapped pipeline on each example (and, with ``compare_plain``, the plain one, alternating order to
    share the machine's drift fairly). One record per document set, also appended to ``records_path`` (JSONL) as
    soon as it exists, so an interrupted benchmark keeps what it measured."""
    from cachecert_agents.jsonl import append_jsonl

    from tqdm.auto import tqdm

    graph = build_report_graph(runtime, planner_model, writer_model)
    models = {"planner": runtime.model(planner_model), "writer": runtime.model(writer_model)}
    records = []
    for i, ex in enumerate(tqdm(examples, desc="report pipeline", unit="set", disable=not progress)):
        state = example_state(ex)
        plain, plain_times = None, None
        if compare_plain and i % 2 == 1:
            plain, plain_times = run_plain(models, state)
        t0 = time.perf_counter()
        out = graph.invoke(state)
        wrapped_s = time.perf_counter() - t0
        if compare_plain and i % 2 == 0:
            plain, plain_times = run_plain(models, state)
        rec: dict[str, Any] = {"id": ex.id, "topic": state["topic"], "wrapped_s": wrapped_s,
                               "decisions": out["decisions"], "outline": out["outline"], "report": out["report"],
                               "review": out["review"]}
        if plain is not None:
            rec.update(plain_s=sum(plain_times), plain_step_s=plain_times, plain_report=plain["report"],
                       same_outline=plain["outline"] == out["outline"])
            writer = out["decisions"][1]
            if agree is not None and writer["action"] == "transfer":
                rec["writer_agrees_with_prefill"] = bool(agree(out["report"], plain["report"]))
        records.append(rec)
        if records_path is not None:
            append_jsonl(records_path, rec)
    runtime.flush()
    return records


def summarise_runs(records: list[dict], runtime: CacheCertRuntime) -> dict[str, Any]:
    """Totals and medians over document sets, the decisions, and the audit summary."""
    from cachecert_agents.cert.audit import clopper_pearson_interval

    actions: dict[str, int] = {}
    for r in records:
        for d in r["decisions"]:
            actions[f"{d['node']}:{d['action']}"] = actions.get(f"{d['node']}:{d['action']}", 0) + 1
    out: dict[str, Any] = {"sets": len(records), "decisions": actions, **runtime.summary()}
    if records and "plain_s" in records[0]:
        ratios = [r["wrapped_s"] / r["plain_s"] for r in records]
        out.update(wrapped_s_total=sum(r["wrapped_s"] for r in records),
                   plain_s_total=sum(r["plain_s"] for r in records),
                   wrapped_s_median=statistics.median(r["wrapped_s"] for r in records),
                   plain_s_median=statistics.median(r["plain_s"] for r in records),
                   time_ratio_median=statistics.median(ratios),
                   outlines_identical=sum(r["same_outline"] for r in records))
        checked = [r["writer_agrees_with_prefill"] for r in records if "writer_agrees_with_prefill" in r]
        failures = sum(not a for a in checked)
        lo, hi = clopper_pearson_interval(failures, len(checked))
        out["served_transfers_checked"] = {"n": len(checked), "silent_failures": failures,
                                           "rate": failures / len(checked) if checked else None,
                                           "exact_95_interval": [lo, hi]}
    return out
