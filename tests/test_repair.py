"""Query-aware selective recompute (transfer/repair.py) on tiny models: chunk selection, exactness of recomputed
rows, r = 1 is a full prefill (also on a sliding-window receiver), caches that evicted rows refused."""

import copy

import pytest
import torch

from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.apply import transfer
from cachecert_agents.transfer.calibrate import collect_statistics
from cachecert_agents.transfer.features import sender_features
from cachecert_agents.transfer.mappers import RidgeMapper
from cachecert_agents.transfer.repair import (full_length_cache, lexical_relevance, recompute_tokens,
                                               select_chunks, suffix_pass_relevance)
from tests.conftest import tiny_model

CONTEXT = "the cat sat on the mat and the dog ran in the park where the cat sat " * 2
QUESTION = "where did the cat sit"


def test_select_chunks_takes_whole_chunks_by_total_relevance_and_trims_to_budget():
    rel = torch.zeros(40)  # chunks of 8: 0-7, 8-15, 16-23, 24-31, 32-39
    rel[20:24] = 5.0   # chunk 16-23 totals 20
    rel[0] = 3.0       # chunk 0-7 totals 3
    rel[35] = 1.0      # chunk 32-39 totals 1
    assert select_chunks(rel, 0.4, chunk=8).tolist() == list(range(0, 8)) + list(range(16, 24))
    # 20 tokens: the two best chunks, then the first 4 tokens of the third
    assert select_chunks(rel, 0.5, chunk=8).tolist() == list(range(0, 8)) + list(range(16, 24)) + [32, 33, 34, 35]
    assert select_chunks(rel, 0.0).numel() == 0
    assert select_chunks(rel, 1.0, chunk=7).tolist() == list(range(40))
    with pytest.raises(ValueError, match="fraction"):
        select_chunks(rel, 1.5)


def test_lexical_relevance_weights_shared_tokens_by_rarity():
    ctx = torch.tensor([5, 7, 5, 9, 5, 7, 11])
    rel = lexical_relevance(ctx, torch.tensor([3, 5, 11]))
    assert torch.allclose(rel, torch.tensor([1 / 3, 0, 1 / 3, 0, 1 / 3, 0, 1.0], dtype=torch.float64))


def _pair(arch: str, tokenizer, splits: tuple[int, ...] = ()) -> tuple[ModelHandle, ModelHandle, RidgeMapper]:
    """Sender and receiver with DIFFERENT weights, and a (poor) ridge mapper between them (with residual-stream
    maps for split transfers at ``splits``)."""
    sender = ModelHandle("tiny-a", tiny_model(arch, seed=7), tokenizer)
    receiver = ModelHandle("tiny-b", tiny_model(arch, seed=8), tokenizer)
    gen = torch.Generator().manual_seed(0)
    texts = [tokenizer.decode(torch.randint(4, 320, (80,), generator=gen)) for _ in range(3)]
    stats = collect_statistics(sender, receiver, [(t, QUESTION) for t in texts], list(splits), progress=False)
    return sender, receiver, RidgeMapper.fit(stats, rho=1e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_recomputing_every_token_reproduces_the_full_prefill(arch, tiny_tokenizer):
    sender, receiver, mapper = _pair(arch, tiny_tokenizer)
    L = receiver.geometry.num_layers
    prompt = receiver.format_prompt(CONTEXT, QUESTION)
    feats = sender_features(sender, sender.format_prompt(CONTEXT, QUESTION))
    exact = receiver.forward(prompt.input_ids, logits_to_keep=1).logits[-1]
    mapped = transfer(receiver, prompt, feats, mapper, split=L)
    off = receiver.continue_from(mapped.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    assert not torch.allclose(off, exact, atol=1e-3)  # the mapper is poor: the repair has work to do
    repaired = transfer(receiver, prompt, feats, mapper, split=L, recompute=1.0)
    assert repaired.recomputed == prompt.context_ids.numel()
    assert repaired.cache.get_seq_length() == prompt.context_span[1]
    got = receiver.continue_from(repaired.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    assert torch.allclose(got, exact, atol=1e-4), (got - exact).abs().max()


def test_recomputed_rows_are_exact_where_their_past_is_and_other_rows_are_untouched(tiny_tokenizer):
    sender, receiver, mapper = _pair("llama", tiny_tokenizer)
    L = receiver.geometry.num_layers
    prompt = receiver.format_prompt(CONTEXT, QUESTION)
    start, end = prompt.context_span
    feats = sender_features(sender, sender.format_prompt(CONTEXT, QUESTION))
    cache = transfer(receiver, prompt, feats, mapper, split=L).cache
    before = copy.deepcopy(cache)
    full = receiver.prefill(torch.cat([prompt.prefix_ids, prompt.context_ids])).cache
    # a leading run of the context: its past (prefix + itself) is exact, so its rows are exact at every layer
    lead = torch.arange(0, 6)
    # a later token: exact at layer 0 only (its keys there depend on its own embedding and position)
    late = torch.tensor([20])
    recompute_tokens(receiver, cache, prompt.context_ids, start, torch.cat([lead, late]))
    for layer in range(L):
        got, want, old = cache.layers[layer], full.layers[layer], before.layers[layer]
        torch.testing.assert_close(got.keys[:, :, start:start + 6], want.keys[:, :, start:start + 6],
                                   atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values[:, :, start:start + 6], want.values[:, :, start:start + 6],
                                   atol=1e-5, rtol=1e-4)
        untouched = [i for i in range(end) if not start <= i < start + 6 and i != start + 20]
        assert torch.equal(got.keys[:, :, untouched], old.keys[:, :, untouched])
    torch.testing.assert_close(cache.layers[0].keys[:, :, start + 20], full.layers[0].keys[:, :, start + 20],
                               atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="expected prefix \\+ context"):
        recompute_tokens(receiver, full, prompt.context_ids[:-1], start, lead)


def test_recompute_reports_the_error_the_overwritten_rows_had(tiny_tokenizer):
    sender, receiver, mapper = _pair("llama", tiny_tokenizer)
    L = receiver.geometry.num_layers
    prompt = receiver.format_prompt(CONTEXT, QUESTION)
    start = prompt.context_span[0]
    feats = sender_features(sender, sender.format_prompt(CONTEXT, QUESTION))
    cache = transfer(receiver, prompt, feats, mapper, split=L).cache
    before = copy.deepcopy(cache)
    index = torch.tensor([0, 1, 2, 9, 20])
    observed = recompute_tokens(receiver, cache, prompt.context_ids, start, index)
    assert observed.shape == (L, 2) and observed.dtype == torch.float64
    rows = index + start
    for layer in range(L):
        for part, name in enumerate(("keys", "values")):
            new, old = getattr(cache.layers[layer], name)[:, :, rows], getattr(before.layers[layer], name)[:, :, rows]
            want = float(((new - old).double() ** 2).sum() / (new.double() ** 2).sum())
            assert observed[layer, part].item() == pytest.approx(want, rel=1e-6)
    assert observed.min() > 0  # the mapper is poor: every layer had an error to repair
    # the receiver's own cache has nothing to repair; an empty index reports nothing
    own = receiver.prefill(torch.cat([prompt.prefix_ids, prompt.context_ids])).cache
    assert recompute_tokens(receiver, own, prompt.context_ids, start, torch.arange(4)).max() < 1e-10
    assert recompute_tokens(receiver, own, prompt.context_ids, start, torch.zeros(0, dtype=torch.long)) is None
    repaired = transfer(receiver, prompt, feats, mapper, split=L, recompute=0.3)
    assert repaired.observed_error.shape == (L, 2)
    pure = transfer(receiver, prompt, feats, mapper, split=L)
    # the transfer reports what recompute_tokens measures on the pure transfer's cache for the chosen tokens
    direct = recompute_tokens(receiver, copy.deepcopy(pure.cache), prompt.context_ids, start,
                              repaired.recomputed_index)
    torch.testing.assert_close(repaired.observed_error, direct, atol=1e-8, rtol=1e-4)
    assert pure.observed_error is None and pure.unrepaired_logits is None
    # the choosing pass ran the suffix over the unrepaired transfer: its logits are the pure transfer's
    want = receiver.continue_from(pure.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    torch.testing.assert_close(repaired.unrepaired_logits, want, atol=1e-4, rtol=1e-4)


def test_suffix_relevance_leaves_the_cache_as_it_was(tiny_tokenizer):
    sender, receiver, mapper = _pair("qwen2", tiny_tokenizer)
    prompt = receiver.format_prompt(CONTEXT, QUESTION)
    cache = receiver.prefill(torch.cat([prompt.prefix_ids, prompt.context_ids])).cache
    before = copy.deepcopy(cache)
    rel = suffix_pass_relevance(receiver, cache, prompt.suffix_ids, prompt.context_span)[0]
    assert rel.shape == (prompt.context_ids.numel(),) and bool((rel >= 0).all()) and float(rel.sum()) > 0
    assert cache.get_seq_length() == before.get_seq_length()
    assert torch.equal(cache.layers[-1].keys, before.layers[-1].keys)


def test_sliding_window_receiver_r1_reproduces_the_full_prefill_and_keeps_its_cache_layout(tiny_tokenizer):
    """Gemma 3 (window 8 here, a context of dozens of tokens): the repair runs on a full-length cache with each
    layer type's mask, so recomputing every token equals the receiver's own prefill, and the cache handed back has
    the receiver's own layout (sliding layers keep their last window - 1 rows)."""
    sender, receiver, mapper = _pair("gemma3", tiny_tokenizer, splits=(2,))
    geo = receiver.geometry
    assert geo.sliding_layers and geo.sliding_window < 20
    prompt = receiver.format_prompt(CONTEXT, QUESTION)
    feats = sender_features(sender, sender.format_prompt(CONTEXT, QUESTION))
    native = receiver.prefill(torch.cat([prompt.prefix_ids, prompt.context_ids])).cache
    exact = receiver.continue_from(copy.deepcopy(native), prompt.suffix_ids, logits_to_keep=1).logits[-1]
    mapped = transfer(receiver, prompt, feats, mapper, split=geo.num_layers)
    off = receiver.continue_from(mapped.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    assert not torch.allclose(off, exact, atol=1e-3)
    for split in (geo.num_layers, 2):
        repaired = transfer(receiver, prompt, feats, mapper, split=split, recompute=1.0)
        assert repaired.recomputed == prompt.context_ids.numel()
        for got_layer, want_layer in zip(repaired.cache.layers, native.layers):
            assert type(got_layer) is type(want_layer)
            assert got_layer.keys.shape == want_layer.keys.shape
            torch.testing.assert_close(got_layer.keys, want_layer.keys, atol=1e-4, rtol=1e-4)
        got = receiver.continue_from(repaired.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
        assert torch.allclose(got, exact, atol=1e-4), (split, (got - exact).abs().max())
    # a partial repair hands back the receiver's layout too, and the unwindowed transfer answers the same
    part = transfer(receiver, prompt, feats, mapper, split=geo.num_layers, recompute=0.3)
    assert [type(x) for x in part.cache.layers] == [type(x) for x in native.layers]
    # its measurements: every layer's distance (sliding ones included) and the unrepaired transfer's logits
    assert part.observed_error.shape == (geo.num_layers, 2) and bool((part.observed_error > 0).all())
    torch.testing.assert_close(part.unrepaired_logits, off, atol=1e-4, rtol=1e-4)
    plain = transfer(receiver, prompt, feats, mapper, split=geo.num_layers, windowed=False)
    assert all(x.keys.shape[-2] == prompt.context_span[1] for x in plain.cache.layers)
    same = receiver.continue_from(plain.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    assert torch.allclose(same, off, atol=1e-4)


def test_selection_and_recompute_refuse_a_cache_that_evicted_rows(tiny_tokenizer):
    sender, receiver, mapper = _pair("gemma3", tiny_tokenizer)
    prompt = receiver.format_prompt(CONTEXT, QUESTION)
    native = receiver.prefill(torch.cat([prompt.prefix_ids, prompt.context_ids])).cache
    with pytest.raises(ValueError, match="full-length cache"):
        suffix_pass_relevance(receiver, native, prompt.suffix_ids, prompt.context_span)[0]
    with pytest.raises(ValueError, match="full-length cache"):
        recompute_tokens(receiver, native, prompt.context_ids, prompt.context_span[0], torch.arange(3))
    with pytest.raises(ValueError, match="dropped the rest"):
        full_length_cache(native)


def _evaluated_pair(tiny_tokenizer, tmp_path, extra_contexts=()):
    """A tiny cross-architecture pair, a workload of four examples (plus ``extra_contexts``, evaluation examples) and
    the pair's pure-KV mapper (fitted on 2 contexts)."""
    from cachecert_agents.eval.transfer_eval import build_mapper
    from tests.conftest import tiny_workload

    sender = ModelHandle("tiny-a", tiny_model("llama", seed=7), tiny_tokenizer)
    receiver = ModelHandle("tiny-b", tiny_model("qwen2", seed=8), tiny_tokenizer)
    wl = tiny_workload([CONTEXT, CONTEXT[::-1], CONTEXT.upper(), CONTEXT, *extra_contexts], n_calibration=3)
    L = receiver.geometry.num_layers
    return sender, receiver, wl, build_mapper(sender, receiver, wl, [L], n_contexts=2, n_heldout=1, out_dir=tmp_path)


def test_evaluation_runs_recompute_methods_and_the_pruned_context_control(tiny_tokenizer, tmp_path):
    """End to end on tiny models: ``--recompute`` adds ``ridge-kv+rP`` (with its recomputed token count) and the
    ``pruned-context@P`` control (a prefill of the same P percent of the tokens), and a rerun resumes."""
    from cachecert_agents.eval.transfer_eval import evaluate_transfer, summarise

    sender, receiver, wl, mapper = _evaluated_pair(tiny_tokenizer, tmp_path)
    L = receiver.geometry.num_layers
    controls, _ = evaluate_transfer(sender, receiver, wl, mapper, [L], n=1, results_dir=tmp_path / "r",
                                    progress=False, recompute=(30, 100), transfers=False)
    assert {r["method"] for r in controls} == {"pruned-context@30", "pruned-context@100", "lexical-context@30",
                                               "lexical-context@100", "no-context", "sender", "random-map"}
    records, full = evaluate_transfer(sender, receiver, wl, mapper, [L], n=1, results_dir=tmp_path / "r",
                                      progress=False, recompute=(30, 100))
    by = {r["method"]: r for r in records}
    assert {"ridge-kv", "ridge-kv+r30", "ridge-kv+r100", "pruned-context@30", "pruned-context@100",
            "lexical-context@30", "lexical-context@100", "no-context", "sender", "random-map"} == set(by)
    assert by["lexical-context@100"]["answer"] == full[0]["answer"]
    # the sender's answer comes from the prefill that also gave the transfers' features: as from its whole prompt
    ex = wl.examples("evaluation")[0]
    own = sender.generate(sender.format_prompt(ex.context, ex.instruction).input_ids,
                          max_new_tokens=wl.max_new_tokens, stop_strings=wl.stop_strings)
    assert by["sender"]["answer"] == own.text
    n = len(receiver.format_prompt(CONTEXT, QUESTION).context_ids)
    assert by["ridge-kv+r100"]["recomputed_tokens"] == n and by["pruned-context@100"]["recomputed_tokens"] == n
    assert by["ridge-kv+r30"]["recomputed_tokens"] == by["pruned-context@30"]["recomputed_tokens"] < n
    # everything recomputed, or the whole context prefilled: the receiver's own answer
    assert by["ridge-kv+r100"]["answer"] == full[0]["answer"] == by["pruned-context@100"]["answer"]
    rows = {r["method"]: r for r in summarise(records, full)}
    assert rows["pruned-context@30"]["n"] == 1 and rows["ridge-kv+r30"]["n"] == 1
    again, _ = evaluate_transfer(sender, receiver, wl, mapper, [L], n=1, results_dir=tmp_path / "r",
                                 progress=False, recompute=(30, 100))
    assert len(again) == len(records)


def test_controls_reuse_the_choice_of_the_repaired_transfer_in_the_same_pass(tiny_tokenizer, tmp_path, monkeypatch):
    """When ``+rP`` runs in the same pass, ``pruned-context@P`` and ``pruned-positions@P`` take its chosen tokens and
    its choosing time (``TransferResult.choice_s``) instead of transferring and choosing again."""
    import cachecert_agents.eval.transfer_eval as transfer_eval

    def no_second_choice(*args, **kwargs):
        raise AssertionError("the controls chose again although +rP had chosen")

    monkeypatch.setattr(transfer_eval, "choose_tokens", no_second_choice)
    sender, receiver, wl, mapper = _evaluated_pair(tiny_tokenizer, tmp_path)
    L = receiver.geometry.num_layers
    records, _ = transfer_eval.evaluate_transfer(sender, receiver, wl, mapper, [L], n=1, results_dir=tmp_path / "r",
                                                 progress=False, recompute=(30,), position_controls=True)
    by = {r["method"]: r for r in records}
    tokens = by["ridge-kv+r30"]["recomputed_tokens"]
    assert by["pruned-context@30"]["recomputed_tokens"] == by["pruned-positions@30"]["recomputed_tokens"] == tokens
    for m in ("pruned-context@30", "pruned-positions@30"):
        assert by[m]["choice_reused"] and by[m]["mapper_sha256"] == mapper.fingerprint
        assert 0 < by[m]["choice_s"] < by[m]["transfer_s"]
    ex = wl.examples("evaluation")[0]
    prompt = receiver.format_prompt(ex.context, ex.instruction)
    feats = sender_features(sender, sender.format_prompt(ex.context, ex.instruction))
    repaired = transfer(receiver, prompt, feats, mapper, L, recompute=0.3)
    assert 0 < repaired.choice_s <= repaired.transfer_s
    assert transfer(receiver, prompt, feats, mapper, L).choice_s is None


def test_cost_benchmark_times_recompute_methods(tiny_tokenizer):
    from cachecert_agents.eval.transfer_cost import transfer_cost

    sender, receiver, mapper = _pair("qwen2", tiny_tokenizer)
    L = receiver.geometry.num_layers
    rows = transfer_cost(sender, receiver, mapper, [L], [60], repeats=1, recompute=(25,))
    assert [r["method"] for r in rows] == ["ridge-kv", "ridge-kv+r25"]
    assert all(r["transfer_s_median"] > 0 and r["ratio"] > 0 for r in rows)


def test_evaluation_offset_runs_later_examples_only(tiny_tokenizer, tmp_path):
    """``offset`` (``eval transfer --offset``) starts at a later evaluation example; the examples before it are
    neither run nor returned, and the same results folder then holds both runs."""
    from cachecert_agents.eval.transfer_eval import evaluate_transfer

    sender, receiver, wl, mapper = _evaluated_pair(tiny_tokenizer, tmp_path, extra_contexts=(CONTEXT.lower(),))
    L = receiver.geometry.num_layers
    later, full = evaluate_transfer(sender, receiver, wl, mapper, [L], n=1, results_dir=tmp_path / "r",
                                    progress=False, offset=1, transfers=False)
    assert {r["id"] for r in later} == {r["id"] for r in full} == {"4"}
    both, _ = evaluate_transfer(sender, receiver, wl, mapper, [L], n=2, results_dir=tmp_path / "r",
                                progress=False, transfers=False)
    assert {r["id"] for r in both} == {"3", "4"}


def test_pruned_positions_control_keeps_the_original_positions(tiny_tokenizer, tmp_path):
    """``position_controls`` adds ``pruned-positions@P``: the same tokens as ``pruned-context@P``, prefilled at their
    original positions with the suffix after the whole context. At P = 100 that is the full prefill itself (same
    answer); below it, the chosen tokens and their count match the pruned control's, and the receiver sees them
    at other distances than in the pruned control (the logits differ)."""
    from cachecert_agents.eval.transfer_eval import evaluate_transfer
    from cachecert_agents.transfer.apply import transfer
    from cachecert_agents.transfer.features import sender_features
    from cachecert_agents.transfer.repair import choose_tokens

    sender, receiver, wl, mapper = _evaluated_pair(tiny_tokenizer, tmp_path)
    L = receiver.geometry.num_layers
    records, full = evaluate_transfer(sender, receiver, wl, mapper, [L], n=1, results_dir=tmp_path / "r",
                                      progress=False, recompute=(30, 100), transfers=False, position_controls=True)
    by = {r["method"]: r for r in records}
    assert {"pruned-positions@30", "pruned-positions@100"} <= set(by)
    assert by["pruned-positions@100"]["answer"] == full[0]["answer"]
    assert by["pruned-positions@30"]["recomputed_tokens"] == by["pruned-context@30"]["recomputed_tokens"]
    assert all(by[m]["transfer_s"] > 0 for m in ("pruned-positions@30", "pruned-context@30"))
    assert not any(by[m]["choice_reused"] for m in ("pruned-positions@30", "pruned-context@30"))  # no +rP ran
    # the positioned prefill: the chosen tokens at start + index, the suffix's first logits after the context's end
    ex = wl.examples("evaluation")[0]
    prompt = receiver.format_prompt(ex.context, ex.instruction)
    start, end = prompt.context_span
    kv = transfer(receiver, prompt, sender_features(sender, sender.format_prompt(ex.context, ex.instruction)),
                  mapper, L, windowed=False)
    index = choose_tokens(receiver, kv.cache, prompt, 0.3)
    chosen = prompt.context_ids.reshape(-1)[index]
    m = int(prompt.suffix_ids.numel())
    a = receiver.prefill(prompt.prefix_ids).cache
    receiver.forward(chosen, a, position_ids=index + start)
    at_original = receiver.forward(prompt.suffix_ids, a, position_ids=torch.arange(end, end + m)).logits[-1]
    b = receiver.prefill(prompt.prefix_ids).cache
    receiver.forward(chosen, b)
    packed = receiver.forward(prompt.suffix_ids, b).logits[-1]
    assert not torch.allclose(at_original, packed)
    # and the position ids do reach the model: a gap-free layout given explicitly equals the default
    c = receiver.prefill(prompt.prefix_ids).cache
    receiver.forward(chosen, c, position_ids=torch.arange(start, start + index.numel()))
    explicit = receiver.forward(prompt.suffix_ids, c,
                                position_ids=torch.arange(start + index.numel(), start + index.numel() + m)).logits[-1]
    assert torch.allclose(explicit, packed, atol=1e-5)


@pytest.mark.parametrize("split", [None, 1])  # None: every layer mapped (pure KV)
def test_a_half_precision_receiver_gets_a_cache_in_its_own_dtype(tiny_tokenizer, split):
    """The mapper runs in float32; its keys/values are cast to the receiver's dtype, so a bfloat16 receiver's
    cache stays bfloat16 and generation on it works (pure KV, split and repaired transfers)."""
    sender, receiver, mapper = _pair("llama", tiny_tokenizer, splits=(1,))
    half = ModelHandle("tiny-b16", copy.deepcopy(receiver.model).to(torch.bfloat16), tiny_tokenizer)
    split = half.geometry.num_layers if split is None else split
    prompt = half.format_prompt(CONTEXT, QUESTION)
    feats = sender_features(sender, sender.format_prompt(CONTEXT, QUESTION))
    for recompute in (0.0, 0.3):
        result = transfer(half, prompt, feats, mapper, split=split, recompute=recompute)
        assert {layer.keys.dtype for layer in result.cache.layers} == {torch.bfloat16}
        assert {layer.values.dtype for layer in result.cache.layers} == {torch.bfloat16}
        assert len(half.generate(prompt.suffix_ids, cache=result.cache, max_new_tokens=3).token_ids) >= 1


def test_a_prefix_cache_of_another_length_or_features_of_another_text_are_refused(tiny_tokenizer):
    sender, receiver, mapper = _pair("llama", tiny_tokenizer)
    prompt = receiver.format_prompt(CONTEXT, QUESTION)
    feats = sender_features(sender, sender.format_prompt(CONTEXT, QUESTION))
    wrong = receiver.prefill(torch.cat([prompt.prefix_ids, prompt.context_ids[:3]])).cache
    with pytest.raises(ValueError, match="prefix_cache holds"):
        transfer(receiver, prompt, feats, mapper, split=receiver.geometry.num_layers, prefix_cache=wrong)
    other = sender_features(sender, sender.format_prompt(CONTEXT + " and a bird", QUESTION))
    with pytest.raises(ValueError, match="another context text"):
        transfer(receiver, prompt, other, mapper, split=receiver.geometry.num_layers)
    with pytest.raises(ValueError, match="at least one input token"):
        receiver.generate(prompt.suffix_ids[:0])
