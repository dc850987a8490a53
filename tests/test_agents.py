"""The agent middleware: store, policy (reuse / transfer / prefill), node wrapper in real LangGraph graphs,
audits, and the fault cases of the issue (each must end in a correct answer or an intact log)."""

import asyncio
import json
import operator
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Annotated, TypedDict

import numpy as np
import pytest
import torch
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from cachecert_agents.agents.node import ModelCall, cachecert_node
from cachecert_agents.agents.runtime import CacheCertRuntime, RouteConfig, RuntimeConfig
from cachecert_agents.agents.store import CachedContext, KVCacheStore, text_key, token_key
from cachecert_agents.cert.audit import AuditLog, summarise_audits, wilson_interval
from cachecert_agents.cert.certificate import Certificate, build_certificate, file_fingerprint
from cachecert_agents.cert.scores import score_definition
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.calibrate import collect_statistics, pair_header
from cachecert_agents.transfer.mappers import RidgeMapper
from tests.conftest import tiny_model

DOCS = ["the cat sat on the mat and the dog ran in the park " * 4, "a bird sang in the tree by the river " * 4]
CONTEXT = "\n\n".join(DOCS)


@pytest.fixture
def pair(tiny_tokenizer):
    return (ModelHandle("tiny-s", tiny_model("llama", seed=1), tiny_tokenizer),
            ModelHandle("tiny-r", tiny_model("qwen2", seed=2), tiny_tokenizer))


@pytest.fixture
def artifacts(pair, tmp_path):
    sender, receiver = pair
    gen = torch.Generator().manual_seed(0)
    texts = [sender.tokenizer.decode(torch.randint(4, 320, (120,), generator=gen)) for _ in range(6)]
    stats = collect_statistics(sender, receiver, [(t, "summarise") for t in texts], [1], progress=False)
    mapper = RidgeMapper.fit(stats, rho=1e-2)
    mapper.save(tmp_path / "mapper")
    stats.save(tmp_path / "mapper.stats")
    header = pair_header(sender, receiver)
    fps = {k: header[k] for k in ("sender_kv", "receiver_kv", "sender_tokenizer", "receiver_tokenizer")}

    def certificate(name: str, all_unsafe: bool = False, alpha: float = 0.2, split: int | None = None,
                    threshold: float | None = None, screen: bool = False, method: str | None = None,
                    agreement: str | None = None) -> str:
        n = 50
        cert = build_certificate([str(i) for i in range(n)], np.linspace(0, 1, n), np.full(n, float(all_unsafe)),
                                 alpha=0.02 if all_unsafe else alpha, delta=None, sender="tiny-s", receiver="tiny-r",
                                 pair_fingerprints=fps,
                                 mapper_fingerprint=file_fingerprint(tmp_path / "mapper.safetensors"),
                                 workload="report",
                                 method=method or ("ridge-kv" if split is None else f"split@{split}"),
                                 split=receiver.geometry.num_layers if split is None else split, score="geometry",
                                 score_definition=score_definition("geometry"), agreement=agreement)
        if threshold is not None:
            cert = cert.model_copy(update={"threshold": threshold})
        if screen:  # two-stage: scored on the pure-KV transfer, serving the split one
            cert = cert.model_copy(update={"screen_method": "ridge-kv", "screen_split": receiver.geometry.num_layers})
        return str(cert.save(tmp_path / name, overwrite=True))

    return certificate


def make_runtime(pair, tmp_path, cert_path, **cfg):
    sender, receiver = pair
    route = RouteConfig(sender="tiny-s", receiver="tiny-r", mapper=str(tmp_path / "mapper"), certificate=cert_path)
    config = RuntimeConfig(routes=[route], audit_log=str(tmp_path / "audit.jsonl"), audit_in_background=False,
                           max_new_tokens=6, **cfg)
    return CacheCertRuntime(config, models={"tiny-s": sender, "tiny-r": receiver})


def plain_answer(handle, context, instruction, max_new_tokens=6):
    return handle.generate(handle.format_prompt(context, instruction).input_ids, max_new_tokens=max_new_tokens).text


class State(TypedDict, total=False):
    documents: list[str]
    outline: str
    draft: str
    review: str
    decisions: Annotated[list, operator.add]


def report_graph(runtime):
    @cachecert_node(runtime, model="tiny-s", output_key="outline", decisions_key="decisions")
    def planner(state: State) -> ModelCall:
        return ModelCall(context=state["documents"], instruction="outline")

    @cachecert_node(runtime, model="tiny-r", output_key="draft", decisions_key="decisions")
    def writer(state: State, config: RunnableConfig) -> ModelCall:
        assert config["configurable"]["thread"] == "t1"  # LangGraph still injects config through the wrapper
        return ModelCall(context=state["documents"], instruction="write from " + state["outline"][:10])

    @cachecert_node(runtime, model="tiny-s", output_key="review", decisions_key="decisions")
    async def reviewer(state: State) -> ModelCall:
        return ModelCall(context=state["documents"], instruction="review")

    g = StateGraph(State)
    for fn in (planner, writer, reviewer):
        g.add_node(fn.__name__, fn)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", "reviewer")
    g.add_edge("reviewer", END)
    return g.compile()


def test_store_is_lru_under_a_byte_bound(pair):
    sender, _ = pair
    prompts = [sender.format_prompt(d, "q") for d in ("one two three", "four five six", "seven eight nine")]
    entries = []
    for p in prompts:
        cache = sender.prefill(torch.cat([p.prefix_ids, p.context_ids])).cache
        entries.append(CachedContext("tiny-s", token_key("tiny-s", p), text_key(p.context_text), p, cache, None, 0.1))
    store = KVCacheStore(max_bytes=int(entries[0].nbytes * 2.5))
    assert store.put(entries[0]) and store.put(entries[1])
    assert store.get(entries[0].key) is entries[0]  # now most recent: entry 1 is the LRU one
    assert store.put(entries[2])
    assert store.get(entries[1].key) is None and store.get(entries[0].key) is entries[0] and store.evictions == 1
    assert store.nbytes <= store.max_bytes
    tiny = KVCacheStore(max_bytes=10)
    assert not tiny.put(entries[0]) and len(tiny) == 0 and tiny.rejected == 1
    copy = entries[0].fresh_cache()
    assert copy is not entries[0].cache and copy.get_seq_length() == entries[0].cache.get_seq_length()


def test_report_graph_reuses_transfers_and_answers_like_prefill(pair, artifacts, tmp_path):
    runtime = make_runtime(pair, tmp_path, artifacts("accept.json"), audit_probability=1.0)
    graph = report_graph(runtime)
    out = asyncio.run(graph.ainvoke({"documents": DOCS}, config={"configurable": {"thread": "t1"}}))
    actions = [d["action"] for d in out["decisions"]]
    assert actions == ["prefill", "transfer", "reuse"]
    sender, receiver = pair
    # prefill and reuse are exact: the same text as the model answering on its own
    assert out["outline"] == plain_answer(sender, CONTEXT, "outline")
    assert out["review"] == plain_answer(sender, CONTEXT, "review")
    transfer = out["decisions"][1]
    assert transfer["sender"] == "tiny-s" and transfer["score"] is not None and transfer["prefill_tokens_avoided"] > 0
    assert transfer["audited"]
    records = AuditLog(tmp_path / "audit.jsonl").records()
    assert len(records) == 1 and records[0]["receiver"] == "tiny-r"
    assert records[0]["full_answer"] == plain_answer(receiver, CONTEXT, "write from " + out["outline"][:10])
    m = runtime.metrics
    assert m.actions == {"reuse": 1, "transfer": 1, "prefill": 1} and m.audits_done == 1
    summary = runtime.summary()
    assert summary["audits"][0]["audited"] == 1
    assert summary["store"]["entries"] == 1  # transferred caches are not stored


def test_refused_certificate_falls_back_to_an_exact_prefill(pair, artifacts, tmp_path):
    runtime = make_runtime(pair, tmp_path, artifacts("refuse.json", threshold=1e-12))
    runtime.generate("tiny-s", CONTEXT, "outline")
    text, decision = runtime.generate("tiny-r", CONTEXT, "write")
    assert decision.action == "prefill" and "refused" in decision.reason
    assert text == plain_answer(pair[1], CONTEXT, "write") and runtime.metrics.refused == 1


def test_a_certificate_switched_off_by_the_savings_guard_prefills_and_says_why(pair, artifacts, tmp_path):
    off = Certificate.load(artifacts("off.json")).model_copy(update={
        "threshold": "-inf", "guard": "savings guard: saves -0.2 of prefill on its calibration requests"})
    path = off.save(tmp_path / "guarded.json")
    runtime = make_runtime(pair, tmp_path, str(path))
    runtime.generate("tiny-s", CONTEXT, "outline")
    text, decision = runtime.generate("tiny-r", CONTEXT, "write")
    assert decision.action == "prefill" and "savings guard" in decision.reason
    assert text == plain_answer(pair[1], CONTEXT, "write")


def test_a_holder_without_sender_features_is_named_in_the_prefill_reason(pair, artifacts, tmp_path):
    """A context prefilled while its model was no route's sender kept no features: the receiver prefills, and the
    reason says who holds the context and why it cannot be transferred (not "no other model holds it")."""
    sender, receiver = pair
    config = RuntimeConfig(routes=[], audit_log=str(tmp_path / "audit.jsonl"), audit_in_background=False,
                           max_new_tokens=6)
    runtime = CacheCertRuntime(config, models={"tiny-s": sender, "tiny-r": receiver})
    runtime.generate("tiny-s", CONTEXT, "outline")  # no route yet: prefilled without features
    runtime.add_route(RouteConfig(sender="tiny-s", receiver="tiny-r", mapper=str(tmp_path / "mapper"),
                                  certificate=artifacts("accept.json")))
    text, decision = runtime.generate("tiny-r", CONTEXT, "write")
    assert decision.action == "prefill" and "tiny-s hold(s) this context but kept no sender features" in decision.reason
    assert text == plain_answer(receiver, CONTEXT, "write")


def test_a_screened_certificate_scores_the_cheap_transfer_and_serves_the_split_one(pair, artifacts, tmp_path):
    from cachecert_agents.agents.store import text_key
    from cachecert_agents.transfer.apply import transfer

    sender, receiver = pair
    runtime = make_runtime(pair, tmp_path, artifacts("screened.json", split=1, screen=True))
    runtime.generate("tiny-s", CONTEXT, "outline")
    text, decision = runtime.generate("tiny-r", CONTEXT, "write")
    assert decision.action == "transfer" and decision.prefill_tokens_avoided > 0
    route = runtime.route("tiny-s", "tiny-r")
    (holder,) = runtime.store.holders(text_key(CONTEXT, None), exclude_model="tiny-r")
    prompt = receiver.format_prompt(CONTEXT, "write")
    L = receiver.geometry.num_layers
    screen = transfer(receiver, prompt, holder.features, route.mapper, L)
    scores, _, _ = route.scorer.scoring_pass(screen.cache, prompt.suffix_ids, prompt.context_span, L, screen.features)
    assert decision.score == pytest.approx(scores["geometry"])  # scored on the screen transfer
    served = transfer(receiver, prompt, holder.features, route.mapper, 1)
    assert text == receiver.generate(prompt.suffix_ids, cache=served.cache, max_new_tokens=6).text  # split@1 answers

    refusing = make_runtime(pair, tmp_path, artifacts("screened_refuse.json", split=1, screen=True, threshold=-1.0))
    refusing.generate("tiny-s", CONTEXT, "outline")
    text, decision = refusing.generate("tiny-r", CONTEXT, "write")
    assert decision.action == "prefill" and "ridge-kv screen" in decision.reason
    assert text == plain_answer(receiver, CONTEXT, "write")


def test_a_selective_recompute_certificate_is_served_with_its_recompute(pair, artifacts, tmp_path):
    """A ridge-kv+r100 certificate: the runtime must recompute every context token (what was certified), so the
    served answer is the receiver's own and nothing counts as avoided."""
    runtime = make_runtime(pair, tmp_path, artifacts("r100.json", method="ridge-kv+r100"))
    runtime.generate("tiny-s", CONTEXT, "outline")
    text, decision = runtime.generate("tiny-r", CONTEXT, "write")
    assert decision.action == "transfer" and decision.prefill_tokens_avoided == 0
    assert text == plain_answer(pair[1], CONTEXT, "write")


def test_a_certificate_that_accepts_nothing_is_not_even_tried(pair, artifacts, tmp_path):
    runtime = make_runtime(pair, tmp_path, artifacts("never.json", all_unsafe=True))
    runtime.generate("tiny-s", CONTEXT, "outline")
    text, decision = runtime.generate("tiny-r", CONTEXT, "write")
    assert decision.action == "prefill" and "accepts no transfer" in decision.reason
    assert text == plain_answer(pair[1], CONTEXT, "write") and runtime.metrics.refused == 0


@pytest.mark.parametrize("fault", ["mapper raises", "corrupt certificate", "mismatched certificate",
                                   "missing certificate", "certificate of another pair",
                                   "certificate of other weights", "statistics of another fit"])
def test_faults_end_in_a_correct_prefilled_answer(pair, artifacts, tmp_path, fault, caplog):
    cert = artifacts("accept.json")
    if fault in ("certificate of another pair", "certificate of other weights"):
        loaded = Certificate.load(cert)
        update = ({"sender": "tiny-x"} if fault == "certificate of another pair" else
                  {"pair_fingerprints": dict(loaded.pair_fingerprints, receiver_weights="0" * 16)})
        loaded.model_copy(update=update).save(cert, overwrite=True)
    elif fault == "statistics of another fit":  # e.g. a calibration interrupted between statistics and mapper
        sender, receiver = pair
        text = sender.tokenizer.decode(torch.arange(4, 100))
        collect_statistics(sender, receiver, [(text, "summarise")], [1], progress=False).save(
            tmp_path / "mapper.stats")
    if fault == "corrupt certificate":
        with open(cert, "a") as fh:
            fh.write("garbage")
    elif fault == "mismatched certificate":
        payload = json.loads(open(cert).read())
        RidgeMapper.load(tmp_path / "mapper").randomised(1).save(tmp_path / "mapper")  # a different mapper now
        assert payload["mapper_fingerprint"] != file_fingerprint(tmp_path / "mapper.safetensors")
    elif fault == "missing certificate":
        cert = str(tmp_path / "nowhere.json")
    runtime = make_runtime(pair, tmp_path, cert)
    if fault == "mapper raises":
        route = runtime.route("tiny-s", "tiny-r")

        def boom(*a, **k):
            raise RuntimeError("mapper exploded")

        route.mapper.predict = boom
    runtime.generate("tiny-s", CONTEXT, "outline")
    with caplog.at_level("WARNING"):
        text, decision = runtime.generate("tiny-r", CONTEXT, "write")
    assert decision.action == "prefill"
    assert text == plain_answer(pair[1], CONTEXT, "write")
    expected = {"mapper raises": "mapper exploded", "corrupt certificate": "JSON",
                "mismatched certificate": "mapper", "missing certificate": "no certificate",
                "certificate of another pair": "is for tiny-x->tiny-r", "certificate of other weights":
                "receiver_weights", "statistics of another fit": "fitted on"}[fault]
    assert expected in caplog.text or expected in decision.reason


def test_a_held_cache_that_fails_to_serve_is_dropped_and_prefilled(pair, artifacts, tmp_path, monkeypatch, caplog):
    """The exact-reuse path is fail-safe too: an error while serving a held cache means a prefill."""
    runtime = make_runtime(pair, tmp_path, artifacts("accept.json"))
    runtime.generate("tiny-r", CONTEXT, "write")
    real, calls = CachedContext.fresh_cache, []

    def fail_once(self, device=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("cache on the wrong device")
        return real(self, device)

    monkeypatch.setattr(CachedContext, "fresh_cache", fail_once)
    with caplog.at_level("WARNING"):
        text, decision = runtime.generate("tiny-r", CONTEXT, "write")
    assert decision.action == "prefill" and "wrong device" in decision.reason and runtime.metrics.errors == 1
    assert text == plain_answer(pair[1], CONTEXT, "write")
    assert runtime.generate("tiny-r", CONTEXT, "write")[1].action == "reuse"  # the fresh prefill is held again


def test_bad_call_arguments_get_clear_errors_and_paths_expand_user(pair, artifacts, tmp_path):
    runtime = make_runtime(pair, tmp_path, artifacts("accept.json"))
    with pytest.raises(TypeError, match="stop_strings"):
        runtime.generate("tiny-r", CONTEXT, "write", stop_strings="\n\n")
    with pytest.raises(ValueError, match="max_new_tokens"):
        runtime.generate("tiny-r", CONTEXT, "write", max_new_tokens=0)
    route = RouteConfig(sender="a", receiver="b", mapper="~/m", certificate="~/c.json")
    assert not route.mapper.startswith("~") and not route.certificate.startswith("~")
    assert not RuntimeConfig(audit_log="~/audit.jsonl").audit_log.startswith("~")


def test_two_branches_share_the_store_safely(pair, artifacts, tmp_path):
    runtime = make_runtime(pair, tmp_path, artifacts("accept.json"), store_max_bytes=50_000_000)

    class S(TypedDict, total=False):
        documents: list[str]
        a: str
        b: str
        c: str

    @cachecert_node(runtime, model="tiny-s", output_key="a")
    def left(state):
        return ModelCall(context=state["documents"], instruction="left")

    @cachecert_node(runtime, model="tiny-s", output_key="b")
    def right(state):
        return ModelCall(context=state["documents"], instruction="right")

    @cachecert_node(runtime, model="tiny-r", output_key="c")
    def middle(state):
        return ModelCall(context=state["documents"], instruction="middle")

    g = StateGraph(S)
    for fn in (left, right, middle):
        g.add_node(fn.__name__, fn)
        g.add_edge(START, fn.__name__)
        g.add_edge(fn.__name__, END)
    graph = g.compile()
    for _ in range(3):
        out = graph.invoke({"documents": DOCS})
        assert out["a"] == plain_answer(pair[0], CONTEXT, "left")
        assert out["b"] == plain_answer(pair[0], CONTEXT, "right")
    assert runtime.metrics.errors == 0 and runtime.metrics.actions["reuse"] >= 4


def test_audits_flag_a_failing_pair_and_it_falls_back(pair, artifacts, tmp_path, caplog):
    runtime = make_runtime(pair, tmp_path, artifacts("accept.json", alpha=0.05), audit_probability=1.0)
    route = runtime.route("tiny-s", "tiny-r")
    route.agree = lambda served, full: False  # every audited transfer disagrees: a silently failing pair
    actions = []
    with caplog.at_level("WARNING"):
        for i in range(12):
            ctx = CONTEXT + f" item {i}"
            runtime.generate("tiny-s", ctx, "outline")
            actions.append(runtime.generate("tiny-r", ctx, "write")[1].action)
    assert actions[0] == "transfer" and actions[-1] == "prefill"
    assert "recalibrated" in caplog.text and runtime.summary()["flagged_pairs"] == ["tiny-s->tiny-r"]
    rows = summarise_audits(AuditLog(tmp_path / "audit.jsonl").records())
    pair_row = next(r for r in rows if r["node"] == "*")
    assert pair_row["above_alpha"] and pair_row["silent_failures"] == pair_row["audited"] >= 2


def failing_runtime(pair, tmp_path, cert_path):
    """A runtime whose every audited transfer disagrees, run until the certificate at ``cert_path`` is flagged."""
    runtime = make_runtime(pair, tmp_path, cert_path, audit_probability=1.0)
    runtime.route("tiny-s", "tiny-r").agree = lambda served, full: False
    for i in range(12):
        runtime.generate("tiny-s", CONTEXT + f" item {i}", "outline")
        runtime.generate("tiny-r", CONTEXT + f" item {i}", "write")
    return runtime


def test_audit_flags_belong_to_a_certificate_across_restarts(pair, artifacts, tmp_path):
    """A restarted runtime keeps the flag of the certificate that earned it, and a recalibrated pair (another
    certificate) starts afresh: old failures neither block it nor are diluted by its clean audits."""
    failing = artifacts("failing.json", alpha=0.05)
    runtime = failing_runtime(pair, tmp_path, failing)
    assert runtime.summary()["flagged_pairs"] == ["tiny-s->tiny-r"]
    records = AuditLog(tmp_path / "audit.jsonl").records()
    assert {r["certificate_id"] for r in records} == {Certificate.load(failing).identity}
    assert all(r["served_s"] > 0 for r in records)  # the served step's own time, even for synchronous audits

    def first_action(cert):
        restarted = make_runtime(pair, tmp_path, cert)  # the same audit log
        restarted.generate("tiny-s", CONTEXT + " again", "outline")
        return restarted.generate("tiny-r", CONTEXT + " again", "write")[1]

    again = first_action(failing)
    assert again.action == "prefill" and "flagged by audits" in again.reason
    assert first_action(artifacts("recalibrated.json", alpha=0.06)).action == "transfer"


def test_re_adding_a_flagged_certificate_does_not_return_it_to_service(pair, artifacts, tmp_path):
    """Flags belong to a certificate's identity: registering the flagged one again, under its path or a copy's,
    leaves the pair out of service; only a new certificate is served."""
    failing = artifacts("failing.json", alpha=0.05)
    runtime = failing_runtime(pair, tmp_path, failing)
    copy_path = tmp_path / "copy.json"
    copy_path.write_bytes(Path(failing).read_bytes())
    for path in (failing, str(copy_path)):
        runtime.add_route(RouteConfig(sender="tiny-s", receiver="tiny-r", mapper=str(tmp_path / "mapper"),
                                      certificate=path))
        runtime.generate("tiny-s", CONTEXT + " later", "outline")
        decision = runtime.generate("tiny-r", CONTEXT + " later", "write")[1]
        assert decision.action == "prefill" and "flagged by audits" in decision.reason
        runtime.store.clear()
    runtime.add_route(RouteConfig(sender="tiny-s", receiver="tiny-r", mapper=str(tmp_path / "mapper"),
                                  certificate=artifacts("recalibrated.json", alpha=0.06)))
    runtime.generate("tiny-s", CONTEXT + " later", "outline")
    assert runtime.generate("tiny-r", CONTEXT + " later", "write")[1].action == "transfer"


def test_a_sender_holding_a_featureless_cache_prefills_again_to_keep_features(pair, artifacts, tmp_path):
    """A context prefilled before a route named its model as sender is prefilled again on that model's next call
    (keeping features), so later transfers from it are possible."""
    sender, receiver = pair
    config = RuntimeConfig(routes=[], audit_log=str(tmp_path / "audit.jsonl"), audit_in_background=False,
                           max_new_tokens=6)
    runtime = CacheCertRuntime(config, models={"tiny-s": sender, "tiny-r": receiver})
    runtime.generate("tiny-s", CONTEXT, "outline")
    assert runtime.generate("tiny-s", CONTEXT, "outline")[1].action == "reuse"  # no route: plain reuse
    runtime.add_route(RouteConfig(sender="tiny-s", receiver="tiny-r", mapper=str(tmp_path / "mapper"),
                                  certificate=artifacts("accept.json")))
    text, decision = runtime.generate("tiny-s", CONTEXT, "outline")
    assert decision.action == "prefill" and "no sender features" in decision.reason
    assert text == plain_answer(sender, CONTEXT, "outline")
    assert runtime.generate("tiny-r", CONTEXT, "write")[1].action == "transfer"


def test_a_slow_model_load_holds_up_only_the_callers_of_that_model(pair, monkeypatch):
    import threading

    sender, _ = pair
    runtime = CacheCertRuntime(RuntimeConfig(max_new_tokens=4), models={"tiny-s": sender})
    release, loads = threading.Event(), []

    def slow_load(name, device="cpu"):
        loads.append(name)
        assert release.wait(30)
        return sender

    monkeypatch.setattr(ModelHandle, "load", staticmethod(slow_load))
    waiters = [threading.Thread(target=runtime.model, args=("slow-model",)) for _ in range(2)]
    for t in waiters:
        t.start()
    while not loads:
        time.sleep(0.01)
    assert runtime.generate("tiny-s", CONTEXT, "q")[1].action == "prefill"  # not blocked by the load
    release.set()
    for t in waiters:
        t.join(30)
    assert loads == ["slow-model"] and runtime.model("slow-model") is sender  # loaded once for both callers


def test_a_closed_runtime_refuses_work_and_closing_twice_is_harmless(pair, artifacts, tmp_path):
    runtime = make_runtime(pair, tmp_path, artifacts("accept.json"), store_dir=str(tmp_path / "store"))
    runtime.generate("tiny-r", CONTEXT, "write")
    runtime.close()
    runtime.close()
    with pytest.raises(RuntimeError, match="closed"):
        runtime.generate("tiny-r", CONTEXT, "write")


def test_a_held_cache_is_handed_over_on_the_models_device(pair):
    """A cache read back from disk lands where the store was told; the model gets a copy on its own device."""
    sender, _ = pair
    prompt = sender.format_prompt(CONTEXT, "q")
    from cachecert_agents.transfer.features import prefill_with_features

    cache, feats, secs = prefill_with_features(sender, prompt, keep_features=False)
    entry = CachedContext(sender.name, token_key(sender.identity, prompt), text_key(CONTEXT), prompt, cache, feats,
                          secs)
    moved = entry.fresh_cache("meta")
    assert all(layer.keys.device.type == "meta" and layer.values.device.type == "meta" for layer in moved.layers)
    assert all(layer.keys.device.type == "cpu" for layer in entry.cache.layers)  # the held one is untouched


def test_audits_judge_by_the_certificates_agreement_criterion(pair, artifacts, tmp_path):
    """A certificate calibrated on labels of another criterion is audited by that criterion, not the workload's."""
    own = make_runtime(pair, tmp_path, artifacts("own.json")).route("tiny-s", "tiny-r")
    strict = make_runtime(pair, tmp_path, artifacts("strict.json", agreement="rouge-l>=0.6")).route("tiny-s", "tiny-r")
    # ROUGE-L F1 of these two is 4/7 = 0.571: agrees under report's own rouge-l>=0.5, not under rouge-l>=0.6
    assert own.agree("red green blue", "red green x y") and not strict.agree("red green blue", "red green x y")


def test_clopper_pearson_interval():
    from cachecert_agents.cert.audit import clopper_pearson_interval

    lo, hi = clopper_pearson_interval(1, 10)
    assert lo == pytest.approx(0.00253, abs=1e-4) and hi == pytest.approx(0.44502, abs=1e-4)  # textbook values
    assert clopper_pearson_interval(0, 10)[0] == 0 and clopper_pearson_interval(10, 10)[1] == 1
    assert clopper_pearson_interval(1, 1)[0] == pytest.approx(0.025, abs=1e-4)


def test_the_flag_decision_matches_the_exact_interval_and_stays_cheap_on_long_logs():
    """``rate_exceeds`` (one binomial tail) decides as the Clopper-Pearson lower bound does, and the truncated tail
    sum equals the full one."""
    import math
    import random

    from cachecert_agents.cert.audit import _binom_sf, clopper_pearson_interval, rate_exceeds

    def full_sf(k, n, p):
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 120)
        k, p = rng.randint(0, n), rng.choice([rng.random(), 0.05, 0.1, 0.2])
        assert _binom_sf(k, n, p) == pytest.approx(full_sf(k, n, p), abs=1e-12)
        assert rate_exceeds(k, n, p) == (clopper_pearson_interval(k, n)[0] > p)
    assert rate_exceeds(6_000, 50_000, 0.1) and not rate_exceeds(5_000, 50_000, 0.1)  # 0.12 and 0.10 of 50k audits


def test_wilson_interval():
    lo, hi = wilson_interval(0, 10)
    assert lo == 0 and 0.25 < hi < 0.35  # textbook: (0, 0.278)
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_a_killed_writer_never_corrupts_earlier_audit_records(tmp_path):
    log = tmp_path / "audit.jsonl"
    script = textwrap.dedent(f"""
        from cachecert_agents.cert.audit import AuditLog
        log = AuditLog({str(log)!r})
        i = 0
        while True:
            log.append({{"sender": "s", "receiver": "r", "unsafe": False, "alpha": 0.1, "i": i, "pad": "x" * 5000}})
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=os.getcwd())
    deadline = time.time() + 60
    while (not log.exists() or log.stat().st_size < 200_000) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    records = AuditLog(log).records()
    assert len(records) >= 10 and [r["i"] for r in records] == list(range(len(records)))
    AuditLog(log).append({"sender": "s", "receiver": "r", "unsafe": True, "alpha": 0.1, "i": -1})
    after = AuditLog(log).records()
    assert after[:len(records)] == records and after[-1]["i"] == -1


def test_malformed_audit_records_are_skipped_and_never_counted(tmp_path, caplog):
    """A record missing a field, of the wrong type, not an object, or not UTF-8 is skipped with a warning: the
    runtime still starts, and only the valid records count towards a flag."""
    from cachecert_agents.cert.audit import AuditMonitor

    log = tmp_path / "audit.jsonl"
    good = {"sender": "s", "receiver": "r", "certificate_id": "c1", "unsafe": False, "alpha": 0.1}
    with log.open("wb") as fh:
        for line in ([{"sender": "s", "receiver": "r", "alpha": 0.1, "certificate_id": "c2"},  # no unsafe
                      {"sender": "s", "receiver": "r", "unsafe": True, "certificate_id": "c1"},  # no alpha
                      {"sender": "s", "receiver": "r", "unsafe": "yes", "alpha": 0.1, "certificate_id": "c1"},
                      5, good]):
            fh.write(json.dumps(line).encode() + b"\n")
        fh.write(b"\xff\xfe not utf-8\n")
    with caplog.at_level("WARNING"):
        monitor = AuditMonitor(AuditLog(log))
    assert monitor._counts == {("s", "r", "c1"): [0, 1]} and not monitor.flagged
    assert caplog.text.count("skipping") >= 5
    rows = summarise_audits(AuditLog(log).records())
    assert [(r["node"], r["audited"]) for r in rows] == [("*", 1), ("-", 1)]
    with pytest.raises(ValueError, match="confidence"):
        summarise_audits([], confidence=1.5)


def test_audit_report_judges_each_certificate_by_its_own_alpha():
    """An old lenient certificate's clean audits must not hide a new strict one's failures."""
    old = [{"sender": "s", "receiver": "r", "certificate_id": "old", "unsafe": False, "alpha": 0.3}] * 100
    new = [{"sender": "s", "receiver": "r", "certificate_id": "new", "unsafe": i < 15, "alpha": 0.05}
           for i in range(100)]
    rows = {(r["certificate_id"], r["node"]): r for r in summarise_audits(old + new)}
    assert rows[("new", "*")]["above_alpha"] and rows[("new", "*")]["alpha"] == 0.05
    assert not rows[("old", "*")]["above_alpha"]


def test_langchain_chat_model_goes_through_the_policy(pair, artifacts, tmp_path):
    from langchain_core.messages import HumanMessage, SystemMessage

    from cachecert_agents.integrations.langchain import CacheCertChatModel, split_messages

    runtime = make_runtime(pair, tmp_path, artifacts("accept.json"))
    planner = CacheCertChatModel(runtime=runtime, model_name="tiny-s", node="planner", max_new_tokens=6)
    writer = CacheCertChatModel(runtime=runtime, model_name="tiny-r", node="writer", max_new_tokens=6)
    docs = [HumanMessage(DOCS[0]), HumanMessage(DOCS[1])]
    first = planner.invoke(docs + [HumanMessage("outline")])
    second = planner.invoke(docs + [HumanMessage("review")])
    third = writer.invoke(docs + [HumanMessage("write")])
    assert [m.response_metadata["cachecert"]["action"] for m in (first, second, third)] == [
        "prefill", "reuse", "transfer"]
    system, context, instruction = split_messages([SystemMessage("be brief")] + docs + [HumanMessage("q")])
    assert first.content == plain_answer(pair[0], context, "outline")
    assert system == "be brief" and instruction == "q" and context.startswith("human: the cat")
    with pytest.raises(ValueError, match="non-system"):
        split_messages([SystemMessage("x")])


def test_langchain_v1_agent_middleware_serves_model_calls_locally(pair, artifacts, tmp_path):
    from langchain.agents import create_agent
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage

    from cachecert_agents.integrations.langchain import CacheCertMiddleware

    runtime = make_runtime(pair, tmp_path, artifacts("accept.json"))
    remote = GenericFakeChatModel(messages=iter([AIMessage("from the agent's own model")]))
    agent = create_agent(model=remote, tools=[], system_prompt="be brief",
                         middleware=[CacheCertMiddleware(runtime, "tiny-s", max_new_tokens=6)])
    out = agent.invoke({"messages": [HumanMessage(DOCS[0]), HumanMessage("outline")]})
    reply = out["messages"][-1]
    assert reply.response_metadata["cachecert"]["action"] == "prefill"
    expected = pair[0].generate(pair[0].format_prompt(f"human: {DOCS[0]}", "outline", "be brief").input_ids,
                                max_new_tokens=6).text
    assert reply.content == expected
    again = agent.invoke({"messages": [HumanMessage(DOCS[0]), HumanMessage("review")]})
    assert again["messages"][-1].response_metadata["cachecert"]["action"] == "reuse"
    # the async form (agent.ainvoke) goes through the same policy; content-block lists count as their text
    blocks = HumanMessage([{"type": "text", "text": DOCS[0]}])
    later = asyncio.run(agent.ainvoke({"messages": [blocks, HumanMessage("outline")]}))
    assert later["messages"][-1].response_metadata["cachecert"]["action"] == "reuse"
    assert later["messages"][-1].content == expected


def test_a_node_that_routes_with_a_command_has_its_calls_answered(pair, artifacts, tmp_path):
    """A node returning LangGraph's ``Command(update=..., goto=...)`` gets its ``ModelCall`` values answered like
    a plain dict return (the text, not the call object, lands in the state) and still routes."""
    from langgraph.types import Command

    runtime = make_runtime(pair, tmp_path, artifacts("accept.json"))

    class State(TypedDict, total=False):
        documents: list[str]
        outline: str
        done: bool

    @cachecert_node(runtime, model="tiny-s")
    def planner(state: State) -> Command:
        return Command(update={"outline": ModelCall(context=state["documents"], instruction="outline",
                                                    max_new_tokens=6)}, goto="finish")

    def finish(state: State) -> dict:
        return {"done": True}

    g = StateGraph(State)
    g.add_node("planner", planner)
    g.add_node("finish", finish)
    g.add_edge(START, "planner")
    g.add_edge("finish", END)
    out = g.compile().invoke({"documents": DOCS})
    assert out["done"] and out["outline"] == plain_answer(pair[0], CONTEXT, "outline")


def test_overhead_benchmark_times_the_three_variants_and_restores_the_handle(pair, tmp_path):
    from cachecert_agents.eval.agents_bench import wrapper_overhead, write_agents_markdown
    from cachecert_agents.eval.workloads import Example

    handle = pair[0]
    examples = [Example(id=f"e{i}", workload="report", context=d, instruction="summarise", references=[""],
                        split="evaluation") for i, d in enumerate(DOCS)]
    res = wrapper_overhead(handle, examples, max_new_tokens=4, repeats=2)
    assert res["n"] == 4 and res["same_answer"] == 4  # exact prefill: plain, wrapped and sender answer alike
    for row in res["steps"]:
        for name in ("plain", "wrapped", "wrapped_sender"):
            assert 0 < row[f"{name}_forward"] <= row[name]
    assert "forward" not in vars(handle)  # the timer is removed
    assert res["overhead_iqr"][0] <= res["overhead_median"] <= res["overhead_iqr"][1]
    summary = {"sets": 0, "decisions": {}, "metrics": {"prefill_tokens_avoided": 0, "context_tokens": 0,
                                                       "refused": 0, "errors": 0}}
    md = tmp_path / "agents.md"
    write_agents_markdown({"command": "x", "date": "d", "machine": "m",
                           "results": {"summary": summary, "overhead": res}}, md)
    assert "wrapper's own time" in md.read_text()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_persisted_cache_round_trips_exactly(arch, tiny_tokenizer, tmp_path):
    """A saved context cache (sliding-window layers included) answers exactly like the cache it was saved from."""
    from cachecert_agents.agents.store import load_cached_context, save_cached_context
    from cachecert_agents.transfer.features import prefill_with_features

    handle = ModelHandle(f"tiny-{arch}", tiny_model(arch, seed=3), tiny_tokenizer)
    prompt = handle.format_prompt(CONTEXT, "where did the cat sit")
    cache, feats, secs = prefill_with_features(handle, prompt, keep_features=True)
    entry = CachedContext(handle.name, token_key(handle.identity, prompt), text_key(CONTEXT), prompt, cache, feats,
                          secs, model_id=handle.identity)
    save_cached_context(entry, tmp_path / entry.key)
    loaded = load_cached_context(tmp_path / entry.key)
    assert loaded.key == entry.key and loaded.model_id == handle.identity
    assert torch.equal(loaded.features.hidden, feats.hidden)
    assert torch.equal(loaded.prompt.input_ids, prompt.input_ids) and loaded.prompt.context_text == CONTEXT
    want = handle.generate(prompt.suffix_ids, cache=entry.fresh_cache(), max_new_tokens=12)
    got = handle.generate(prompt.suffix_ids, cache=loaded.fresh_cache(), max_new_tokens=12)
    assert got.token_ids == want.token_ids
    assert torch.equal(got.first_logits, want.first_logits)


def test_store_persists_across_runs_and_refuses_other_weights(pair, tiny_tokenizer, tmp_path, caplog):
    sender, _ = pair
    store_dir = tmp_path / "store"
    cfg = RuntimeConfig(store_dir=str(store_dir))
    first = CacheCertRuntime(cfg, models={"tiny-s": sender})
    text1, d1 = first.generate("tiny-s", CONTEXT, "where did the cat sit", max_new_tokens=8)
    first.close()
    assert d1.action == "prefill" and len(list(store_dir.glob("*.safetensors"))) == 1
    # a new process: same model -> exact reuse from disk, identical answer
    second = CacheCertRuntime(cfg, models={"tiny-s": sender})
    text2, d2 = second.generate("tiny-s", CONTEXT, "where did the cat sit", max_new_tokens=8)
    assert d2.action == "reuse" and text2 == text1 and second.store.loaded_from_disk == 1
    second.close()
    # other weights under the same name never see that cache
    impostor = ModelHandle("tiny-s", tiny_model("llama", seed=7), tiny_tokenizer)
    assert impostor.identity != sender.identity
    third = CacheCertRuntime(cfg, models={"tiny-s": impostor})
    _, d3 = third.generate("tiny-s", CONTEXT, "where did the cat sit", max_new_tokens=8)
    assert d3.action == "prefill"
    third.close()
    # a corrupt file: warning, prefill, the file left in place
    for st in store_dir.glob("*.safetensors"):
        st.write_bytes(b"not a safetensors file")
    fourth = CacheCertRuntime(cfg, models={"tiny-s": sender})
    with caplog.at_level("WARNING"):
        text4, d4 = fourth.generate("tiny-s", CONTEXT, "where did the cat sit", max_new_tokens=8)
    fourth.close()
    assert d4.action == "prefill" and text4 == text1 and "cannot read persisted cache" in caplog.text


def test_a_persisted_header_missing_fields_is_skipped_with_a_warning(pair, tmp_path, caplog):
    sender, _ = pair
    store_dir = tmp_path / "store"
    first = CacheCertRuntime(RuntimeConfig(store_dir=str(store_dir)), models={"tiny-s": sender})
    text, _ = first.generate("tiny-s", CONTEXT, "q", max_new_tokens=4)
    first.close()
    (header_path,) = store_dir.glob("*.json")
    header = json.loads(header_path.read_text())
    del header["text_key"]
    header_path.write_text(json.dumps(header))
    with caplog.at_level("WARNING"):
        second = CacheCertRuntime(RuntimeConfig(store_dir=str(store_dir)), models={"tiny-s": sender})
        again, decision = second.generate("tiny-s", CONTEXT, "q", max_new_tokens=4)
    second.close()
    assert "lacks text_key" in caplog.text and decision.action == "prefill" and again == text


def test_persisted_store_keeps_to_its_disk_bound(pair, tmp_path):
    sender, _ = pair
    docs = ["one two three four", "five six seven eight", "nine ten eleven twelve"]

    def run(store_dir, bound) -> dict[str, int]:
        runtime = CacheCertRuntime(RuntimeConfig(store_dir=str(store_dir), store_dir_max_bytes=bound),
                                   models={"tiny-s": sender})
        keys = []
        for d in docs:
            runtime.generate("tiny-s", d, "q", max_new_tokens=2)
            runtime.store.flush()
            keys.append(runtime.decisions[-1] and next(reversed(runtime.store._entries)))
        runtime.close()
        return {k: (store_dir / f"{k}.safetensors").stat().st_size if (store_dir / f"{k}.safetensors").exists()
                else 0 for k in keys}

    sizes = run(tmp_path / "unbounded", 1 << 30)
    first, *newest = sizes
    assert all(sizes.values())
    bound = sum(sizes[k] for k in newest) + 16
    kept = run(tmp_path / "bounded", bound)
    assert kept[first] == 0 and all(kept[k] for k in newest)  # the least recently used file went first
