"""Integration tests on the real SmolLM2-135M-Instruct (installed from PyPI into the user cache on first use)."""

import pytest
import torch

from cachecert_agents.eval.kv_check import context_of_tokens, kv_check
from cachecert_agents.kv.alignment import align_tokens
from cachecert_agents.kv.rope import apply_rope, rope_tables
from cachecert_agents.kv.segment import KVSegment

pytestmark = pytest.mark.real_model


def test_kv_check_is_exact_over_600_tokens(smollm2):
    result = kv_check(smollm2, context_tokens=640)
    assert result["context_tokens"] == 640
    assert result["max_abs_logit_diff"] <= 1e-3
    assert result["same_next_token"]
    assert result["corrupted_max_abs_logit_diff"] > 1.0
    assert result["corrupted_max_abs_logit_diff"] > 1000 * max(result["max_abs_logit_diff"], 1e-6)


def test_geometry_and_chat_template(smollm2):
    geo = smollm2.geometry
    assert (geo.num_layers, geo.num_heads, geo.num_kv_heads, geo.head_dim, geo.hidden_size) == (30, 9, 3, 64, 576)
    assert geo.rope["full_attention"].theta == 100000.0 and not geo.sliding_layers
    prompt = smollm2.format_prompt("Paris is the capital of France.", "What is the capital of France?")
    text = smollm2.tokenizer.decode(prompt.input_ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "Paris is the capital of France.\n\nWhat is the capital of France?<|im_end|>" in text


def test_generation_uses_the_context(smollm2):
    prompt = smollm2.format_prompt("The secret code word is 'tangerine'.", "What is the secret code word?")
    answer = smollm2.generate(prompt.input_ids, max_new_tokens=20)
    assert "tangerine" in answer.text.lower()
    start, end = prompt.context_span
    seg = KVSegment.from_cache(smollm2.prefill(prompt.input_ids[:end]).cache, smollm2.geometry)
    resumed = smollm2.generate(prompt.suffix_ids, cache=seg.to_cache(smollm2.geometry), max_new_tokens=20)
    assert resumed.text == answer.text


def test_pre_rope_keys_from_hooks_match_the_cache(smollm2):
    prompt = smollm2.format_prompt(context_of_tokens(smollm2, 100), "Summarise.")
    with smollm2.capture_qk(layers=[0, 15, 29]) as cap:
        out = smollm2.prefill(prompt.input_ids)
    n = len(prompt)
    for layer in (0, 15, 29):
        cos, sin = rope_tables(smollm2.geometry.rope_for_layer(layer), torch.arange(n))
        assert torch.allclose(apply_rope(cap.key(layer), cos, sin), out.cache.layers[layer].keys, atol=1e-4)
        assert cap.query(layer).shape == (1, 9, n, 64)


def test_alignment_with_itself_is_identity_and_with_words_pools(smollm2):
    text = context_of_tokens(smollm2, 200)
    _, offsets = smollm2.tokenize(text)
    assert align_tokens(offsets, offsets).is_identity
    words, pos = [], 0
    for w in text.split(" "):
        words.append((pos, pos + len(w)))
        pos += len(w) + 1
    cov = align_tokens(words, offsets).coverage()
    assert cov["char_coverage"] > 0.99 and cov["mean_senders_per_receiver"] >= 1.0


def test_middleware_on_a_real_model_reuses_transfers_and_audits(smollm2, tmp_path):
    """The whole path on real weights: a route between two handles of SmolLM2 (same weights, two names), mapper
    from real statistics, a certificate, a LangGraph graph; prefill and reuse are exact, the certified transfer is
    served and audited against a real full prefill."""
    import operator
    from pathlib import Path
    from typing import Annotated, TypedDict

    import numpy as np
    from langgraph.graph import END, START, StateGraph

    from cachecert_agents.agents.node import ModelCall, cachecert_node
    from cachecert_agents.agents.runtime import CacheCertRuntime, RouteConfig, RuntimeConfig
    from cachecert_agents.cert.audit import AuditLog
    from cachecert_agents.cert.certificate import build_certificate, file_fingerprint
    from cachecert_agents.cert.scores import score_definition
    from cachecert_agents.models.handle import ModelHandle
    from cachecert_agents.transfer.calibrate import collect_statistics, pair_header
    from cachecert_agents.transfer.mappers import RidgeMapper

    twin = ModelHandle("smollm2-twin", smollm2.model, smollm2.tokenizer)
    text = (Path(__file__).parents[1] / "cachecert_agents" / "data" / "sample_context.txt").read_text()
    chunks = [text[i:i + 1500] for i in range(0, 9000, 1500)]
    stats = collect_statistics(smollm2, twin, [(c, "Summarise.") for c in chunks], [], progress=False)
    RidgeMapper.fit(stats, rho=1e-4).save(tmp_path / "mapper")
    stats.save(tmp_path / "mapper.stats")
    header = pair_header(smollm2, twin)
    fps = {k: header[k] for k in ("sender_kv", "receiver_kv", "sender_tokenizer", "receiver_tokenizer")}
    L = twin.geometry.num_layers
    cert = build_certificate([str(i) for i in range(40)], np.linspace(0, 1, 40), np.zeros(40), alpha=0.1,
                             delta=None, sender=smollm2.name, receiver=twin.name, pair_fingerprints=fps,
                             mapper_fingerprint=file_fingerprint(tmp_path / "mapper.safetensors"), workload="report",
                             method="ridge-kv", split=L, score="geometry",
                             score_definition=score_definition("geometry"))
    cert.save(tmp_path / "cert.json")
    runtime = CacheCertRuntime(RuntimeConfig(
        routes=[RouteConfig(sender=smollm2.name, receiver=twin.name, mapper=str(tmp_path / "mapper"),
                            certificate=str(tmp_path / "cert.json"))],
        audit_log=str(tmp_path / "audit.jsonl"), audit_probability=1.0, audit_in_background=False,
        max_new_tokens=16),
        models={smollm2.name: smollm2, twin.name: twin})
    docs = text[9000:10500]

    def node(model, key, instruction):
        return cachecert_node(runtime, model=model, output_key=key, name=key, decisions_key="decisions")(
            lambda state: ModelCall(context=state["docs"], instruction=instruction))

    class S(TypedDict, total=False):
        docs: str
        a: str
        b: str
        c: str
        decisions: Annotated[list, operator.add]

    g = StateGraph(S)
    g.add_node("a", node(smollm2.name, "a", "Who is mentioned first?"))
    g.add_node("b", node(twin.name, "b", "Summarise in one sentence."))
    g.add_node("c", node(smollm2.name, "c", "Name one place."))
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    g.add_edge("c", END)
    out = g.compile().invoke({"docs": docs})
    assert [d["action"] for d in out["decisions"]] == ["prefill", "transfer", "reuse"]

    def plain(handle, instruction):
        return handle.generate(handle.format_prompt(docs, instruction).input_ids, max_new_tokens=16).text

    assert out["a"] == plain(smollm2, "Who is mentioned first?")
    assert out["c"] == plain(smollm2, "Name one place.")
    runtime.flush()
    record = AuditLog(tmp_path / "audit.jsonl").records()[0]
    assert record["full_answer"] == plain(twin, "Summarise in one sentence.")
    # identical weights: the map is near-exact, so the served answer should agree with the full prefill
    assert record["agree"], (record["served_answer"], record["full_answer"])
    runtime.close()


def test_anchored_split_transfer_on_the_real_model(smollm2):
    """SmolLM2 -> itself through an anchored mapper (anchor 4, split 20) fitted on a few hundred tokens: the
    receiver's own layers below the anchor are exact, and the answer still reads the context."""
    from cachecert_agents.transfer.apply import transfer
    from cachecert_agents.transfer.calibrate import collect_statistics
    from cachecert_agents.transfer.features import sender_features
    from cachecert_agents.transfer.mappers import RidgeMapper

    sample = context_of_tokens(smollm2, 1200)
    texts = [sample[i * len(sample) // 8:(i + 1) * len(sample) // 8] for i in range(8)]
    stats = collect_statistics(smollm2, smollm2, [(t, "Summarise.") for t in texts], [20], progress=False,
                               anchor=4, kv_until=20)
    assert set(stats.targets) == {f"kv:{layer}" for layer in range(4, 20)} | {"hidden:20"}
    mapper = RidgeMapper.fit(stats, rho=1e-2)
    prompt = smollm2.format_prompt("The secret code word is 'tangerine'. " + texts[0], "What is the secret code word?")
    feats = sender_features(smollm2, prompt)
    result = transfer(smollm2, prompt, feats, mapper, split=20)
    start, end = prompt.context_span
    exact = smollm2.prefill(prompt.input_ids[:end]).cache
    for layer in range(4):
        assert torch.allclose(result.cache.layers[layer].keys[:, :, start:end],
                              exact.layers[layer].keys[:, :, start:end], atol=1e-4)
    answer = smollm2.generate(prompt.suffix_ids, cache=result.cache, max_new_tokens=20)
    assert "tangerine" in answer.text.lower()


def test_cti_propagation_on_the_real_model(smollm2):
    """The CTI's propagated split model on SmolLM2 -> itself: without noise the receiver's recomputed layers
    reproduce its own keys/values (template prefix, masks and positions are right), and a stream error at layer
    10 reaches every later layer with a finite, positive deviation that enters the split prediction."""
    from cachecert_agents.cti.index import compute_cti, stream_residuals
    from cachecert_agents.cti.propagation import propagated_error_moments
    from cachecert_agents.cti.queries import collect_query_statistics
    from cachecert_agents.transfer.calibrate import collect_statistics

    sample = context_of_tokens(smollm2, 900)
    texts = [(sample[i * len(sample) // 3:(i + 1) * len(sample) // 3], "Summarise.") for i in range(3)]
    L, hidden = smollm2.geometry.num_layers, smollm2.geometry.hidden_size
    zero = torch.zeros(hidden, hidden, dtype=torch.float64)
    exact, _, _ = propagated_error_moments(smollm2, texts[:1], {10: zero}, progress=False)
    assert all(float(m.abs().max()) < 1e-8 for m in exact[10].values())
    stats = collect_statistics(smollm2, smollm2, texts, [10], progress=False)
    moments, _, _ = propagated_error_moments(smollm2, texts[:1], stream_residuals(stats),
                                             progress=False)
    queries = collect_query_statistics(smollm2, texts[:2], progress=False)
    split = compute_cti(stats, queries, smollm2, propagated=moments)["splits"]["10"]
    assert split["propagated"] and len(split["recomputed_profile"]) == L - 10
    assert all(0 < p["deviation"] < float("inf") for p in split["recomputed_profile"])


def test_screened_certificate_on_the_real_model(smollm2, tmp_path):
    """A two-stage route on real weights (SmolLM2 -> a twin handle): the entropy of the pure-KV screen transfer
    decides, the split@4 transfer answers, and its answer reads the context like the full prefill does."""
    import numpy as np

    from cachecert_agents.agents.runtime import CacheCertRuntime, RouteConfig, RuntimeConfig
    from cachecert_agents.cert.certificate import build_certificate, file_fingerprint
    from cachecert_agents.cert.scores import score_definition
    from cachecert_agents.models.handle import ModelHandle
    from cachecert_agents.transfer.calibrate import collect_statistics, pair_fingerprints, pair_header
    from cachecert_agents.transfer.mappers import RidgeMapper

    twin = ModelHandle("smollm2-twin", smollm2.model, smollm2.tokenizer)
    sample = context_of_tokens(smollm2, 1200)
    texts = [sample[i * len(sample) // 6:(i + 1) * len(sample) // 6] for i in range(6)]
    stats = collect_statistics(smollm2, twin, [(t, "Summarise.") for t in texts], [4], progress=False)
    RidgeMapper.fit(stats, rho=1e-1).save(tmp_path / "mapper")  # 1.2k tokens: a small rho overfits the stream map
    stats.save(tmp_path / "mapper.stats")
    L = twin.geometry.num_layers
    cert = build_certificate([str(i) for i in range(40)], np.linspace(0, 5, 40), np.zeros(40), alpha=0.1,
                             delta=None, sender=smollm2.name, receiver=twin.name,
                             pair_fingerprints=pair_fingerprints(pair_header(smollm2, twin)),
                             mapper_fingerprint=file_fingerprint(tmp_path / "mapper.safetensors"), workload="hotpotqa",
                             method="split@4", split=4, score="entropy", score_definition=score_definition("entropy"),
                             screen_method="ridge-kv", screen_split=L)
    cert.save(tmp_path / "cert.json")
    runtime = CacheCertRuntime(RuntimeConfig(
        routes=[RouteConfig(sender=smollm2.name, receiver=twin.name, mapper=str(tmp_path / "mapper"),
                            certificate=str(tmp_path / "cert.json"))],
        audit_log=str(tmp_path / "audit.jsonl"), audit_probability=0.0, max_new_tokens=12),
        models={smollm2.name: smollm2, twin.name: twin})
    context = "The secret code word is 'tangerine'. " + texts[0]
    runtime.generate(smollm2.name, context, "Summarise.")
    text, decision = runtime.generate(twin.name, context, "What is the secret code word?")
    assert decision.action == "transfer" and decision.score_name == "entropy" and decision.score is not None
    assert decision.prefill_tokens_avoided == int(decision.context_tokens * 4 / L)
    assert "tangerine" in text.lower()
    runtime.close()


def test_selective_recompute_on_the_real_model(smollm2):
    """SmolLM2 -> itself through a ridge KV map fitted on ~1,200 tokens: the question's attention on the
    transferred cache finds the one sentence that answers it (the chunk selected at 10% holds it), and recomputing
    every token reproduces the full prefill's next-token logits."""
    from cachecert_agents.transfer.apply import transfer
    from cachecert_agents.transfer.calibrate import collect_statistics
    from cachecert_agents.transfer.features import sender_features
    from cachecert_agents.transfer.mappers import RidgeMapper
    from cachecert_agents.transfer.repair import select_chunks, suffix_pass_relevance

    sample = context_of_tokens(smollm2, 1200)
    texts = [sample[i * len(sample) // 8:(i + 1) * len(sample) // 8] for i in range(8)]
    stats = collect_statistics(smollm2, smollm2, [(t, "Summarise.") for t in texts], [], progress=False)
    mapper = RidgeMapper.fit(stats, rho=1e-2)
    needle = " The secret code word is 'tangerine'. "
    context = sample[:len(sample) // 2] + needle + sample[len(sample) // 2:]
    prompt = smollm2.format_prompt(context, "What is the secret code word?")
    at = context.index(needle) + 1
    needle_tokens = [i for i, (a, b) in enumerate(prompt.context_offsets.tolist()) if a < at + len(needle) - 2 and b > at]
    L = smollm2.geometry.num_layers
    feats = sender_features(smollm2, prompt)
    cache = transfer(smollm2, prompt, feats, mapper, split=L).cache
    relevance = suffix_pass_relevance(smollm2, cache, prompt.suffix_ids, prompt.context_span)[0]
    chosen = set(select_chunks(relevance, 0.1).tolist())
    assert len(chosen & set(needle_tokens)) >= len(needle_tokens) // 2, (needle_tokens, sorted(chosen))
    exact = smollm2.forward(prompt.input_ids, logits_to_keep=1).logits[-1]
    repaired = transfer(smollm2, prompt, feats, mapper, split=L, recompute=1.0)
    got = smollm2.continue_from(repaired.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    assert torch.allclose(got, exact, atol=1e-3), (got - exact).abs().max()


def test_receiver_floor_on_the_real_model(smollm2, tmp_path):
    """The no-context floor of a real receiver: it answers from the context and not without it."""
    from cachecert_agents.eval.receiver_floor import receiver_floor
    from tests.conftest import tiny_workload

    wl = tiny_workload(["The cat sat on the mat in the hall.", "In the hall, the cat sat on a red mat."],
                       n_calibration=2)
    row = receiver_floor(smollm2, wl, n=2, results_dir=tmp_path, progress=False)
    assert row["n"] == 2 and row["score_full"] > row["score_no_context"]
    assert 0 <= row["floor"] < 1


def _door_codes():
    from cachecert_agents.eval.workloads import Example, HotpotQA

    class Codes(HotpotQA):
        name = "codes"

        def examples(self, split=None, limit=None):
            out = [Example(id=str(i), workload="codes", context=f"Note {i}: the door code is {code}.",
                           instruction="What is the door code? Reply with the code only.", references=[code],
                           split="calibration") for i, code in enumerate(["4711", "2390"])]
            return out[:limit]

    return Codes()


def test_likelihood_floor_on_the_real_model(smollm2):
    """The likelihood floor of a real receiver: the reference answer is likelier after the context than without
    it, so the floor lies below 1."""
    from cachecert_agents.eval.receiver_floor import likelihood_floor

    row = likelihood_floor(smollm2, _door_codes(), n=2, progress=False)
    assert row["n"] == 2 and row["p_full"] > row["p_no_context"] > 0
    assert 0 < row["floor"] < 1


def test_the_cti_pass_reads_the_floor_answers_on_the_real_model(smollm2):
    """The CTI's statistics pass reads the reference answers after their contexts (one prefill each): their NLLs
    are those of a prefill of their own, the statistics those of the pass without them, and the floor built on
    them is the floor measured separately."""
    from cachecert_agents.cti.single_pass import cti_inputs
    from cachecert_agents.eval.receiver_floor import answer_nll, likelihood_floor, reference_continuations

    wl = _door_codes()
    examples = wl.examples("calibration")
    contexts = [(e.context, e.instruction) for e in examples]
    plain = cti_inputs(smollm2, smollm2, contexts, [15], propagation_contexts=0, progress=False)
    read = cti_inputs(smollm2, smollm2, contexts, [15], propagation_contexts=0, progress=False,
                      continuations=reference_continuations(smollm2, examples))
    for ex, nll in zip(examples, read.continuation_nll, strict=True):
        assert nll == pytest.approx(answer_nll(smollm2, ex.context, ex.instruction, ex.references[0]), rel=1e-4)
    for name in ("kv:0", "kv:29", "hidden:15"):
        a, b = read.statistics.targets[name].xy, plain.statistics.targets[name].xy
        assert float((a - b).norm() / b.norm()) < 1e-5, name
    fused = likelihood_floor(smollm2, wl, 2, progress=False, with_context=read.continuation_nll)
    assert fused["n_from_pass"] == 2
    assert fused["floor"] == pytest.approx(likelihood_floor(smollm2, wl, 2, progress=False)["floor"], rel=1e-3)
