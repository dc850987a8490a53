"""CacheCert: risk scores (synthetic and on tiny models), certificates as artifacts, labelled-request validation."""

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cachecert_agents.artifacts import file_fingerprint
from cachecert_agents.cert.certificate import Certificate, build_certificate
from cachecert_agents.cert.conformal import InfeasibleRiskError
from cachecert_agents.cert.scores import (SCORE_VERSION, RiskScorer, entropy_score, margin_score,
                                          residual_covariance, rotation_averaged_diagonal, score_definition)
from cachecert_agents.errors import CertificateError
from cachecert_agents.eval.cert_eval import labelled_requests, validate
from cachecert_agents.jsonl import append_jsonl
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.apply import transfer
from cachecert_agents.transfer.calibrate import collect_statistics
from cachecert_agents.transfer.features import sender_features
from cachecert_agents.transfer.mappers import RidgeMapper
from tests.conftest import tiny_model
from tests.test_transfer import CONTEXTS, _synthetic_stats


def test_residual_covariance_matches_the_direct_residuals():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=gen)
    stats, x, y = _synthetic_stats(w, torch.zeros(4), n_chunks=4, seed=1, noise=0.5)
    mapper = RidgeMapper.fit(stats, rho=0.1)
    r = y.double() - (x.double() @ mapper.weights["kv:0"].double() + mapper.biases["kv:0"].double())
    direct = (r - r.mean(0)).T @ (r - r.mean(0)) / r.shape[0]
    assert torch.allclose(residual_covariance(stats, "kv:0", mapper.weights["kv:0"]), direct, atol=1e-5)


def test_rotation_average_pools_each_frequency_pair():
    cov = torch.diag(torch.tensor([1.0, 3.0, 5.0, 7.0, 9.0, 11.0]))  # rotary_dim 4: (0,2) and (1,3) pair, 4,5 pass
    got = rotation_averaged_diagonal(cov, rotary_dim=4)
    assert torch.equal(got, torch.tensor([3.0, 5.0, 3.0, 5.0, 9.0, 11.0]))
    # the pooled quadratic form is what a query sees averaged over every relative rotation of a frequency
    theta = torch.linspace(0, 2 * math.pi, 721)[:-1]
    q = torch.tensor([1.0, 0.0, 2.0, 0.0])
    c = torch.diag(torch.tensor([1.0, 3.0, 5.0, 7.0]))
    vals = []
    for t in theta:  # rotate pair (0,2) by t: transformers' rotate_half convention
        rot = torch.eye(4)
        rot[0, 0] = rot[2, 2] = torch.cos(t)
        rot[0, 2], rot[2, 0] = -torch.sin(t), torch.sin(t)
        vals.append(q @ rot @ c @ rot.T @ q)
    assert float(torch.stack(vals).mean()) == pytest.approx(float((q * q) @ rotation_averaged_diagonal(c, 4)), 1e-4)


def test_entropy_and_margin_orientation():
    sure, unsure = torch.tensor([10.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])
    assert entropy_score(sure) < entropy_score(unsure) == pytest.approx(math.log(3))
    assert margin_score(sure) < 0.01 and margin_score(unsure) == pytest.approx(1.0)


@pytest.fixture
def tiny_pair(tiny_tokenizer):
    sender = ModelHandle("tiny-s", tiny_model("llama", seed=1), tiny_tokenizer)
    receiver = ModelHandle("tiny-r", tiny_model("qwen2", seed=2), tiny_tokenizer)
    stats = collect_statistics(sender, receiver, [(c, "q") for c in CONTEXTS], [1], progress=False)
    return sender, receiver, stats, RidgeMapper.fit(stats, rho=1e-2)


def test_scoring_pass_scores_and_answers_like_plain_generation(tiny_pair):
    sender, receiver, stats, mapper = tiny_pair
    scorer = RiskScorer.from_statistics(receiver, mapper, stats)
    L = receiver.geometry.num_layers
    assert set(scorer.layers) == set(range(L)) and set(scorer.streams) == {1}
    prompt = receiver.format_prompt(CONTEXTS[1], "where did the cat sit")
    feats = sender_features(sender, sender.format_prompt(CONTEXTS[1], "where did the cat sit"))
    for split in (1, L):
        plain = receiver.generate(prompt.suffix_ids, transfer(receiver, prompt, feats, mapper, split).cache,
                                  max_new_tokens=5)
        cache = transfer(receiver, prompt, feats, mapper, split).cache
        scores, out, cost = scorer.scoring_pass(cache, prompt.suffix_ids, prompt.context_span, split, feats)
        assert set(scores) == {"geometry", "entropy", "margin", "constant", "version"}
        assert all(math.isfinite(v) for v in scores.values()) and scores["geometry"] > 0
        assert cost["pass_s"] > 0 and cost["score_s"] >= 0
        assert receiver.decode(out.cache, out.logits[-1], max_new_tokens=5).token_ids == plain.token_ids
        cache = transfer(receiver, prompt, feats, mapper, split).cache  # a plain pass when geometry is not needed
        light, out, _ = scorer.scoring_pass(cache, prompt.suffix_ids, prompt.context_span, split, feats,
                                            geometry=False)
        assert "geometry" not in light and light["entropy"] == pytest.approx(scores["entropy"], rel=1e-4)
        assert receiver.decode(out.cache, out.logits[-1], max_new_tokens=5).token_ids == plain.token_ids


def test_context_attention_places_a_sliding_window_at_the_end():
    from cachecert_agents.kv.segment import context_attention

    full = torch.rand(2, 3, 20)  # 20 positions: prefix 0..3, context 4..16, suffix 17..19
    np.testing.assert_array_equal(context_attention(full, (4, 17), 20), full[..., 4:17])
    window = torch.rand(2, 3, 8)  # a sliding layer kept the last 8 positions: 12..19
    ctx = context_attention(window, (4, 17), 20)
    assert ctx.shape == (2, 3, 13)
    np.testing.assert_array_equal(ctx[..., :8], 0)  # context tokens 4..11 fell out of the window
    np.testing.assert_array_equal(ctx[..., 8:], window[..., :5])


def test_geometry_score_on_a_sliding_window_receiver(tiny_tokenizer):
    """Gemma 3 receivers: the suffix's sliding-window layers see only the window, not the whole context."""
    sender = ModelHandle("tiny-s", tiny_model("llama", seed=1), tiny_tokenizer)
    receiver = ModelHandle("tiny-g", tiny_model("gemma3", seed=2), tiny_tokenizer)
    stats = collect_statistics(sender, receiver, [(c, "q") for c in CONTEXTS], [1], progress=False)
    mapper = RidgeMapper.fit(stats, rho=1e-2)
    scorer = RiskScorer.from_statistics(receiver, mapper, stats)
    prompt = receiver.format_prompt(CONTEXTS[1], "where did the cat sit")
    assert prompt.context_ids.numel() > 2 * receiver.geometry.sliding_window
    feats = sender_features(sender, sender.format_prompt(CONTEXTS[1], "where did the cat sit"))
    for split in (1, receiver.geometry.num_layers):
        cache = transfer(receiver, prompt, feats, mapper, split).cache
        scores, _, _ = scorer.scoring_pass(cache, prompt.suffix_ids, prompt.context_span, split, feats)
        assert math.isfinite(scores["geometry"]) and scores["geometry"] > 0


def test_geometry_score_grows_with_the_mapper_error(tiny_pair):
    sender, receiver, stats, mapper = tiny_pair
    L = receiver.geometry.num_layers
    prompt = receiver.format_prompt(CONTEXTS[2], "where")
    feats = sender_features(sender, sender.format_prompt(CONTEXTS[2], "where"))
    worse = mapper.randomised(seed=3)  # a map that explains nothing leaves the whole variance as residual
    got = []
    for m in (mapper, worse):
        scorer = RiskScorer.from_statistics(receiver, m, stats)
        cache = transfer(receiver, prompt, feats, m, L).cache
        got.append(scorer.scoring_pass(cache, prompt.suffix_ids, prompt.context_span, L, feats)[0]["geometry"])
    assert got[1] > got[0]


def test_geometry_score_leaves_recomputed_tokens_out(tiny_pair):
    """Tokens repaired by selective recompute hold the receiver's own keys/values: no error, no score. Recomputing
    every context token leaves nothing mapped (score 0); recomputing some lowers the score of the same cache."""
    sender, receiver, stats, mapper = tiny_pair
    scorer = RiskScorer.from_statistics(receiver, mapper, stats)
    prompt = receiver.format_prompt(CONTEXTS[2], "where")
    feats = sender_features(sender, sender.format_prompt(CONTEXTS[2], "where"))
    for split in (1, receiver.geometry.num_layers):
        full = transfer(receiver, prompt, feats, mapper, split, recompute=1.0)
        assert full.recomputed == prompt.context_ids.numel()
        scores = scorer.scoring_pass(full.cache, prompt.suffix_ids, prompt.context_span, split, full.features,
                                     exact=full.recomputed_index)[0]
        assert scores["geometry"] == 0.0
        part = transfer(receiver, prompt, feats, mapper, split, recompute=0.3)
        assert 0 < part.recomputed < prompt.context_ids.numel()
        args = (prompt.suffix_ids, prompt.context_span, split, part.features)
        ignoring = scorer.scoring_pass(copy.deepcopy(part.cache), *args)[0]["geometry"]
        knowing = scorer.scoring_pass(part.cache, *args, exact=part.recomputed_index)[0]["geometry"]
        assert 0 < knowing < ignoring


def _cert(tmp_path, scores, unsafe, alpha=0.2, delta=None):
    return build_certificate([str(i) for i in range(len(scores))], np.asarray(scores), np.asarray(unsafe),
                             alpha=alpha, delta=delta, sender="s", receiver="r",
                             pair_fingerprints={"sender_kv": "a", "receiver_kv": "b"}, mapper_fingerprint="m1",
                             workload="w", method="ridge-kv", split=4, score="geometry",
                             score_definition=score_definition("geometry"))


def test_certificate_round_trip_and_rule(tmp_path):
    rng = np.random.default_rng(0)
    scores = rng.uniform(size=200)
    unsafe = (rng.uniform(size=200) < scores).astype(float)  # riskier scores fail more often
    cert = _cert(tmp_path, scores, unsafe)
    path = cert.save(tmp_path / "c.json")
    back = Certificate.load(path)
    assert back == cert and back.control == "crc" and back.n == 200
    assert back.accepts(back.lam - 1e-9) and back.accepts(back.lam) and not back.accepts(back.lam + 1e-6)
    assert not back.accepts(float("nan"))
    back.check_for({"sender_kv": "a"}, "m1", "ridge-kv")
    stale = back.model_copy(update={"score_definition": "cachecert_agents.cert.scores:geometry/v0"})
    with pytest.raises(CertificateError, match="score"):
        stale.check_for({"sender_kv": "a"})
    v2 = back.model_copy(update={"score_definition": "cachecert_agents.cert.scores:geometry/v2"})
    v2.check_for({"sender_kv": "a"})  # v2 geometry is v3's on a transfer without selective recompute ...
    with pytest.raises(CertificateError, match="score"):
        v2.model_copy(update={"method": "ridge-kv+r20"}).check_for({"sender_kv": "a"})  # ... not on a repaired one
    with pytest.raises(CertificateError, match="score"):
        v2.model_copy(update={"method": "split@2", "screen_method": "ridge-kv+r20"}).check_for({"sender_kv": "a"})
    with pytest.raises(CertificateError, match="mapper"):
        back.check_for({"sender_kv": "a"}, "m2")
    with pytest.raises(CertificateError, match="receiver_kv"):
        back.check_for({"receiver_kv": "zz"})
    with pytest.raises(FileExistsError):
        cert.save(path)  # never silently replaced
    ltt = _cert(tmp_path, scores, unsafe, alpha=0.2, delta=0.1)
    assert ltt.control == "ltt" and ltt.lam <= cert.lam


def test_certificate_extremes_and_corruption(tmp_path):
    all_safe = _cert(tmp_path, np.arange(50.0), np.zeros(50))
    assert all_safe.threshold == "inf" and all_safe.accepts(1e12)
    Certificate.load(all_safe.save(tmp_path / "inf.json"))
    none = _cert(tmp_path, np.arange(50.0), np.ones(50), alpha=0.02)  # all unsafe; budget below one in 50
    assert none.threshold == "-inf"
    path = none.save(tmp_path / "none.json")
    assert not Certificate.load(path).accepts(-1e12)  # accept nothing
    payload = json.loads(path.read_text())
    payload["alpha"] = 0.5  # a hand edit
    path.write_text(json.dumps(payload))
    with pytest.raises(CertificateError, match="checksum"):
        Certificate.load(path)
    path.write_text(path.read_text()[:40])
    with pytest.raises(CertificateError, match="JSON"):
        Certificate.load(path)
    with pytest.raises(CertificateError, match="no certificate"):
        Certificate.load(tmp_path / "missing.json")
    with pytest.raises(InfeasibleRiskError):
        _cert(tmp_path, np.arange(5.0), np.ones(5), alpha=0.05)


def test_labelled_requests_and_split_validation(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "s__r__w.jsonl"
    for i in range(120):
        g = float(rng.uniform())
        append_jsonl(path, {"id": str(i), "method": "ridge-kv", "split": 4, "agree": bool(rng.uniform() > g),
                            "prefill_s": 2.0, "transfer_s": 0.1, "pass_s": 0.05, "score_s": 0.01,
                            "risk": {"geometry": g, "entropy": float(rng.uniform()), "margin": 0.5, "constant": 0.0,
                                     "version": SCORE_VERSION if i % 2 else 2}})
        append_jsonl(path, {"id": str(i), "method": "split@2", "split": 2, "agree": True, "prefill_s": 2.0,
                            "transfer_s": 0.1, "risk": {"geometry": 0.0, "entropy": 0.0, "margin": 0.0,
                                                        "constant": 0.0, "version": 1}})
        # v2 geometry differs from v3 only on repaired transfers: such a record is stale, a plain one is current
        append_jsonl(path, {"id": str(i), "method": "ridge-kv+r20", "split": 4, "agree": True, "prefill_s": 2.0,
                            "transfer_s": 0.1, "recomputed_tokens": 7, "risk": {
                                "geometry": 0.0, "entropy": 0.0, "margin": 0.0, "constant": 0.0, "version": 2}})
        append_jsonl(path, {"id": str(i), "method": "no-context", "agree": True})  # a control: no risk, skipped
    labelled = labelled_requests(tmp_path, "s", "r", "w")
    assert list(labelled) == ["ridge-kv"] and len(labelled["ridge-kv"]) == 120  # stale score versions: skipped
    rows = validate(labelled["ridge-kv"], [0.1, 0.2], splits=200, delta=0.1)
    assert len(rows) == 4 * 2 * 2
    for r in rows:
        if r["control"] == "crc" and r["n_infeasible"] == 0:
            assert r["risk_mean"] <= r["alpha"] + 3 * r["risk_se"] + 0.01
        assert r["prefill_saved"] <= 1 - 0.1 / 2.0
    geo = next(r for r in rows if r["score"] == "geometry" and r["alpha"] == 0.2 and r["control"] == "crc")
    const = next(r for r in rows if r["score"] == "constant" and r["alpha"] == 0.2 and r["control"] == "crc")
    assert geo["prefill_saved"] > const["prefill_saved"]  # an informative score accepts more at the same alpha
    from cachecert_agents.eval.cert_eval import summarise_at_alpha, write_markdown
    (s,) = summarise_at_alpha(rows, alpha=0.2)
    assert s["best_score"] == "geometry" and s["geometry_minus_best_baseline"] > 0  # geometry carries the signal
    assert s["silent_failure_always_transfer"] == pytest.approx(float(labelled["ridge-kv"].unsafe.mean()))
    assert s["risk_mean"]["geometry"] < s["silent_failure_always_transfer"]
    assert summarise_at_alpha(rows, alpha=0.3) == []  # no rows at that alpha
    write_markdown([dict(r, command="cachecert eval cert x") for r in rows], "ignored", tmp_path / "cert.md")
    text = (tmp_path / "cert.md").read_text()
    assert "`cachecert eval cert x`" in text and "ignored" not in text and "## s -> r, w, ridge-kv" in text


def _write_screened_pool(path, n=80, seed=2, mapper_sha256=None):
    """Labelled requests of ``ridge-kv`` (the cheap screen) and ``split@2`` (labels follow the screen's score),
    made with the mapper of that fingerprint."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        hard = float(rng.uniform())
        risk = lambda g: {"geometry": g, "entropy": g, "margin": g, "constant": 0.0, "version": SCORE_VERSION}  # noqa: E731
        append_jsonl(path, {"id": str(i), "method": "ridge-kv", "split": 4, "agree": False, "prefill_s": 4.0,
                            "transfer_s": 0.1, "pass_s": 0.2, "score_s": 0.05, "risk": risk(hard),
                            "mapper_sha256": mapper_sha256})
        if i % 10:  # the split transfer was not labelled on every request
            append_jsonl(path, {"id": str(i), "method": "split@2", "split": 2, "agree": hard < 0.5,
                                "prefill_s": 4.0, "transfer_s": 2.0, "pass_s": 0.2, "score_s": 0.05,
                                "risk": risk(float(rng.uniform())), "mapper_sha256": mapper_sha256})


def test_every_score_but_the_constant_pays_the_suffix_pass_only_when_refused(tmp_path):
    """The scoring pass is the answer's first step (its logits seed decoding), for geometry as for entropy: served,
    a request pays its transfer and the score arithmetic; refused, the pass too, then a prefill."""
    _write_screened_pool(tmp_path / "s__r__w.jsonl")
    pool = labelled_requests(tmp_path, "s", "r", "w")["split@2"]
    for score in ("geometry", "entropy", "margin", "pooled:entropy+margin+geometry"):
        served, refused = pool.gains(score)
        np.testing.assert_allclose(served, 1 - (2.0 + 0.05) / 4.0)
        np.testing.assert_allclose(refused, -(2.0 + 0.2 + 0.05) / 4.0)
    np.testing.assert_allclose(pool.gains("constant")[0], 1 - 2.0 / 4.0)


def test_screened_requests_take_the_screen_scores_and_the_served_labels(tmp_path):
    """Two-stage transfers: the cheap transfer's score decides whether the expensive one runs, so a refusal costs
    only the screen, and the label is the served transfer's."""
    from cachecert_agents.eval.cert_eval import screened_requests, with_screens

    _write_screened_pool(tmp_path / "s__r__w.jsonl")
    pool = labelled_requests(tmp_path, "s", "r", "w")
    screened = with_screens(pool, "ridge-kv")["split@2|screen:ridge-kv"]
    assert set(with_screens(pool, "ridge-kv")) == {"ridge-kv", "split@2", "split@2|screen:ridge-kv"}
    assert len(screened) == 72 and screened.split == 2
    by_id = {i: k for k, i in enumerate(pool["ridge-kv"].ids)}
    for k, i in enumerate(screened.ids):  # scores from the screen, labels from the served transfer
        assert screened.scores["entropy"][k] == pool["ridge-kv"].scores["entropy"][by_id[i]]
        assert screened.unsafe[k] == pool["split@2"].unsafe[pool["split@2"].ids.index(i)]
    served, refused = screened.gains("entropy")
    np.testing.assert_allclose(served, 1 - (0.35 + 2.0) / 4.0)  # screen (0.1 + 0.2 + 0.05) + served transfer
    np.testing.assert_allclose(refused, -0.35 / 4.0)  # a refusal costs the screen only
    _, refused_alone = pool["split@2"].gains("entropy")
    np.testing.assert_allclose(refused_alone, -(2.0 + 0.2 + 0.05) / 4.0)
    np.testing.assert_allclose(screened.gains("constant")[0], 1 - 2.0 / 4.0)  # no screen needed to serve all
    # the screen's score carries the served transfer's risk here: certification accepts and stays within alpha
    rows = validate(screened, [0.2], splits=200, delta=None, scores=("entropy",))
    assert rows[0]["method"] == "split@2|screen:ridge-kv" and rows[0]["accept_rate"] > 0.2
    assert rows[0]["risk_mean"] <= 0.2 + 3 * rows[0]["risk_se"]
    with pytest.raises(ValueError, match="screened"):
        screened_requests(screened, pool["ridge-kv"])


def test_results_commands_refuse_files_that_are_not_theirs_and_keep_foreign_reports(tmp_path, capsys):
    """A --out/--summary that is not a cachecert results file (another JSON document, a list, garbage, a folder) is
    refused before any work, naming the flag, and left as it was; a report (.md) found beside a new results file
    is kept aside, not overwritten."""
    from cachecert_agents.cli import main

    results = tmp_path / "results"
    results.mkdir()
    _write_screened_pool(results / "s__r__w.jsonl")
    base = ["eval", "cert", "--pair", "s:r", "--workload", "w", "--alpha", "0.2", "--splits", "10", "--min-n", "20",
            "--results-dir", str(results), "--plots", str(tmp_path / "plots")]
    foreign = {"precious.json": '{"format": "cachecert-certificate", "alpha": 0.1}', "list.json": "[1, 2, 3]",
               "garbage.json": "not json", "rows.json": '{"results": [{"sender": "x"}]}'}
    for name, text in foreign.items():
        (tmp_path / name).write_text(text)
        assert main(base + ["--out", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and name in err and "Traceback" not in err
        assert (tmp_path / name).read_text() == text  # untouched
    (tmp_path / "folder").mkdir()
    assert main(base + ["--out", str(tmp_path / "folder")]) == 2 and "directory" in capsys.readouterr().err
    notes = tmp_path / "fresh.md"
    notes.write_text("my own notes")
    assert main(base + ["--out", str(tmp_path / "fresh.json")]) == 0
    kept = list(tmp_path.glob("fresh.md.replaced-*"))
    assert len(kept) == 1 and kept[0].read_text() == "my own notes" and notes.read_text() != "my own notes"
    assert main(base + ["--out", str(tmp_path / "fresh.json")]) == 0  # our own report is simply regenerated
    assert len(list(tmp_path.glob("fresh.md.replaced-*"))) == 1
    with pytest.raises(SystemExit):
        main(["eval", "cert", "--pair", "s:s", "--workload", "w"])
    assert "names 's' twice" in capsys.readouterr().err


def test_audit_report_names_a_log_with_nothing_valid(tmp_path, capsys):
    from cachecert_agents.cli import main

    empty, bad = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("")
    bad.write_text(json.dumps({"sender": "a", "receiver": "b", "unsafe": False, "alpha": 0.1, "certificate_id": 7})
                   + "\n" + json.dumps({"sender": None, "receiver": "b", "unsafe": False, "alpha": 0.1}) + "\n")
    assert main(["audit", "report", str(empty)]) == 2 and "holds no audit records" in capsys.readouterr().err
    assert main(["audit", "report", str(bad)]) == 2 and "no valid audit records" in capsys.readouterr().err
    assert main(["audit", "report", str(tmp_path)]) == 2 and "a directory" in capsys.readouterr().err


def test_eval_cert_and_certify_commands_with_a_screen(tmp_path, cache_home):
    """The two commands end to end on labelled requests (no model runs): validation rows and plots for the
    screened method, then a two-stage certificate bound to the pair's mapper."""
    from safetensors.torch import save_file

    from cachecert_agents.cli import main

    results = tmp_path / "results"
    results.mkdir()
    _write_screened_pool(results / "s__r__w.jsonl")
    out, plots = tmp_path / "cert.json", tmp_path / "plots"
    assert main(["eval", "cert", "--pair", "s:r", "--workload", "w", "--alpha", "0.1,0.2", "--splits", "50",
                 "--min-n", "20", "--screen", "ridge-kv", "--results-dir", str(results), "--out", str(out),
                 "--plots", str(plots)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["method"] for r in rows} == {"ridge-kv", "split@2", "split@2|screen:ridge-kv"}
    assert "split@2\\|screen:ridge-kv" in out.with_suffix(".md").read_text()  # escaped in the summary table
    assert all("|" not in p.name and ":" not in p.name for p in plots.iterdir())
    # a second pool merged into the same file plots only itself; the first pool's plots stay as they were
    _write_screened_pool(results / "s__r__w2.jsonl", seed=3)
    before = {p.name: p.stat().st_mtime_ns for p in plots.iterdir()}
    assert main(["eval", "cert", "--pair", "s:r", "--workload", "w2", "--alpha", "0.1", "--splits", "20",
                 "--min-n", "20", "--results-dir", str(results), "--out", str(out), "--plots", str(plots)]) == 0
    after = {p.name: p.stat().st_mtime_ns for p in plots.iterdir()}
    assert all(after[name] == t for name, t in before.items())
    assert any("w2" in name for name in set(after) - set(before))
    assert {r["workload"] for r in json.loads(out.read_text())["results"]} == {"w", "w2"}
    stem = cache_home / "mappers" / "s__r__w"
    stem.parent.mkdir(parents=True)
    save_file({"w": torch.zeros(1)}, f"{stem}.safetensors")
    Path(f"{stem}.json").write_text(json.dumps({k: k + "-fp" for k in ("sender_kv", "receiver_kv", "sender_tokenizer",
                                                                        "receiver_tokenizer")}))
    cert_path = tmp_path / "screened.json"
    args = ["certify", "--pair", "s:r", "--workload", "w", "--method", "split@2", "--screen", "ridge-kv",
            "--score", "entropy", "--alpha", "0.2", "--n", "72", "--no-run", "--results-dir", str(results),
            "--out", str(cert_path)]
    # the pool's records name no mapper (recorded before this one existed): a certificate cannot use them
    assert main(args) == 2 and not cert_path.exists()
    (results / "s__r__w.jsonl").unlink()
    _write_screened_pool(results / "s__r__w.jsonl", mapper_sha256=file_fingerprint(f"{stem}.safetensors"))
    assert main(args) == 0
    cert = Certificate.load(cert_path)
    assert (cert.method, cert.split, cert.screen_method, cert.screen_split, cert.n) == ("split@2", 2, "ridge-kv", 4, 72)
    assert cert.score_split == 4 and 0 < cert.accept_rate_calibration < 1
    assert main(args) == 2  # never silently replaced
    assert main(args[:-2] + ["--out", str(tmp_path / "x.json"), "--score", "constant"]) == 2
    assert main(args[:-2] + ["--out", str(tmp_path / "x.json"), "--n", "100"]) == 2  # too few labels, --no-run


def test_perfect_score_saving_takes_the_safe_requests_then_alpha_of_the_unsafe():
    """The ceiling on any score's savings: every safe request it gains on, then the unsafe ones with the largest
    gain over refusal, at most floor(alpha * n) of them; never below 0 (a certificate may accept nothing)."""
    from cachecert_agents.eval.cert_eval import perfect_score_saving

    unsafe = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    served = np.array([0.9, 0.8, 0.9, 0.7, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    refused = np.full(10, -0.1)
    # alpha 0: the two safe ones served, eight refused
    assert perfect_score_saving(unsafe, served, refused, 0.0) == pytest.approx((0.9 + 0.8 - 0.8) / 10)
    # alpha 0.2: plus the two unsafe ones that gain most (0.9 and 0.7)
    assert perfect_score_saving(unsafe, served, refused, 0.2) == pytest.approx((0.9 + 0.8 + 0.9 + 0.7 - 0.6) / 10)
    # every transfer unsafe and costly: never trying beats any acceptance set
    assert perfect_score_saving(np.ones(4), np.full(4, 0.5), np.full(4, -0.5), 0.1) == 0.0
    # a request whose serving loses against refusing it is not taken even when safe
    assert perfect_score_saving(np.array([0, 0]), np.array([0.5, -0.3]), np.array([-0.1, -0.1]), 0.0) == \
        pytest.approx((0.5 - 0.1) / 2)
    with pytest.raises(ValueError, match="equal-length"):
        perfect_score_saving(np.zeros(3), np.zeros(2), np.zeros(3), 0.1)


def test_validate_rows_carry_a_perfect_score_ceiling_above_the_certified_saving(tmp_path):
    """No certified row may save more than the in-sample perfect score (up to split noise, its mean over test
    halves is bounded by the pool-level optimum at the same alpha with the conformal correction on top)."""
    from cachecert_agents.eval.cert_eval import validate

    _write_screened_pool(tmp_path / "s__r__w.jsonl")
    pool = labelled_requests(tmp_path, "s", "r", "w")
    rows = validate(pool["split@2"], [0.1, 0.2], splits=50, delta=None)
    for r in rows:
        assert r["prefill_saved_perfect_score"] >= r["prefill_saved"] - 0.05
    assert {r["prefill_saved_perfect_score"] for r in rows if r["alpha"] == 0.2} != {0.0}


def test_requests_relabelled_by_another_agreement_criterion(tmp_path, cache_home):
    """``--agreement``: the same records relabelled from their answers and the cached full-prefill answers (no model
    run); eval cert keeps rows of different criteria in different files; the certificate records the criterion."""
    from safetensors.torch import save_file

    from cachecert_agents.cli import main
    from cachecert_agents.errors import CacheCertError
    from cachecert_agents.eval.transfer_eval import full_reference_path

    results = tmp_path / "results"
    risk = lambda g: {"geometry": g, "entropy": g, "margin": g, "constant": 0.0, "version": SCORE_VERSION}  # noqa: E731
    answers = ["Paris", "The answer is Paris", "London"]  # exact / token-F1 0.67 / wrong, against "Paris"
    for i in range(60):
        append_jsonl(results / "s__r__w.jsonl", {
            "id": str(i), "method": "ridge-kv", "split": 4, "answer": answers[i % 3], "agree": i % 3 == 0,
            "prefill_s": 2.0, "transfer_s": 0.1, "pass_s": 0.05, "score_s": 0.01, "risk": risk(i / 60)})
        append_jsonl(full_reference_path(results, "r", "w"), {"id": str(i), "answer": "Paris"})
    recorded = labelled_requests(results, "s", "r", "w")["ridge-kv"]
    f1 = labelled_requests(results, "s", "r", "w", agreement="token-f1>=0.5")["ridge-kv"]
    exact = labelled_requests(results, "s", "r", "w", agreement="exact")["ridge-kv"]
    assert recorded.agreement is None and f1.agreement == "token-f1>=0.5" and exact.agreement == "exact"
    np.testing.assert_array_equal(recorded.unsafe, exact.unsafe)  # the recorded labels were exact match
    np.testing.assert_array_equal(f1.unsafe, [float(int(i) % 3 == 2) for i in f1.ids])  # only "London" disagrees
    assert validate(f1, [0.2], splits=5, delta=None, scores=("constant",))[0]["agreement"] == "token-f1>=0.5"
    assert "agreement" not in validate(recorded, [0.2], splits=5, delta=None, scores=("constant",))[0]

    base = ["eval", "cert", "--pair", "s:r", "--workload", "w", "--alpha", "0.2", "--splits", "20", "--min-n", "20",
            "--results-dir", str(results), "--plots", str(tmp_path / "plots")]
    out = tmp_path / "cert.json"
    assert main(base + ["--out", str(out)]) == 0
    assert main(base + ["--out", str(out), "--agreement", "token-f1>=0.5"]) == 2  # not mixed into the same file
    assert all("agreement" not in r for r in json.loads(out.read_text())["results"])
    relabelled = tmp_path / "cert_f1.json"
    assert main(base + ["--out", str(relabelled), "--agreement", "token-F1>=0.5"]) == 0
    rows = json.loads(relabelled.read_text())["results"]
    assert {r["agreement"] for r in rows} == {"token-f1>=0.5"}
    assert all(r["unsafe_rate_always_transfer"] == pytest.approx(1 / 3) for r in rows)
    assert "`token-f1>=0.5`" in relabelled.with_suffix(".md").read_text()
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())  # beside the workload-labelled ones, not over
    assert len(plots) == 4 and sum("agree_token-f1" in p for p in plots) == 2
    with pytest.raises(SystemExit):
        main(base + ["--out", str(tmp_path / "x.json"), "--agreement", "f1"])  # a usage error names the forms

    append_jsonl(results / "s__r__w.jsonl", {"id": "60", "method": "ridge-kv", "split": 4, "answer": "x",
                                             "agree": False, "prefill_s": 2.0, "transfer_s": 0.1, "risk": risk(0.5)})
    with pytest.raises(CacheCertError, match="no full-prefill answer for '60'"):
        labelled_requests(results, "s", "r", "w", agreement="exact")

    stem = cache_home / "mappers" / "s__r__w"
    stem.parent.mkdir(parents=True)
    save_file({"w": torch.zeros(1)}, f"{stem}.safetensors")
    Path(f"{stem}.json").write_text(json.dumps({k: k + "-fp" for k in ("sender_kv", "receiver_kv", "sender_tokenizer",
                                                                        "receiver_tokenizer")}))
    fingerprint = file_fingerprint(f"{stem}.safetensors")  # the labels were made with this mapper
    (results / "s__r__w.jsonl").write_text("".join(
        json.dumps(dict(json.loads(line), mapper_sha256=fingerprint)) + "\n"
        for line in (results / "s__r__w.jsonl").read_text().splitlines()[:60]))
    cert_path = tmp_path / "c.json"
    assert main(["certify", "--pair", "s:r", "--workload", "w", "--score", "constant", "--alpha", "0.4", "--n", "60",
                 "--no-run", "--results-dir", str(results), "--out", str(cert_path), "--agreement",
                 "token-f1>=0.5"]) == 0
    cert = Certificate.load(cert_path)
    assert cert.agreement == "token-f1>=0.5" and cert.unsafe_rate_calibration == pytest.approx(1 / 3)


def test_a_certificate_saved_before_the_agreement_field_still_loads(tmp_path):
    """Certificates written by earlier versions have no ``agreement``: they load (checksum intact) as the
    workload's own criterion."""
    from cachecert_agents.cert.certificate import _checksum

    cert = _cert(tmp_path, np.arange(50.0), np.zeros(50))
    body = cert.model_dump()
    del body["agreement"]
    (tmp_path / "old.json").write_text(json.dumps(dict(body, checksum=_checksum(body))))
    assert Certificate.load(tmp_path / "old.json").agreement is None


def test_rows_of_repaired_transfers_scored_before_v3_are_marked_stale():
    from cachecert_agents.eval.cert_eval import stale_geometry

    assert stale_geometry({"method": "ridge-kv+r20"})  # no score_version: written by v2
    assert not stale_geometry({"method": "ridge-kv+r20", "score_version": 3})
    assert not stale_geometry({"method": "ridge-kv"}) and not stale_geometry({"method": "split@6"})
    assert not stale_geometry({"method": "ridge-kv+r20|screen:ridge-kv"})  # scored on the plain screen
    assert stale_geometry({"method": "split@6|screen:ridge-kv+r20"})


def test_score_auc_is_the_mann_whitney_statistic_with_half_ties():
    from cachecert_agents.eval.cert_eval import score_auc

    assert score_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0  # every unsafe request scores above every safe one
    assert score_auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0  # reversed orientation
    assert score_auc([0.0] * 4, [0, 1, 0, 1]) == 0.5  # a constant score: all ties
    assert score_auc([0.1, 0.5, 0.5, 0.9], [0, 0, 1, 1]) == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    assert score_auc([0.3, 0.4], [1, 1]) is None  # one class only


def test_always_transfer_saving_is_the_transfer_cost_alone_for_every_score(tmp_path):
    """Serving every transfer needs no score and no screen: its saving is 1 - transfer/prefill on every row, not
    the scored policy's cost model (which counted the scoring pass, or the screen)."""
    from cachecert_agents.eval.cert_eval import with_screens

    _write_screened_pool(tmp_path / "s__r__w.jsonl")
    pools = with_screens(labelled_requests(tmp_path, "s", "r", "w"), "ridge-kv")
    for method, expected in (("ridge-kv", 1 - 0.1 / 4.0), ("split@2|screen:ridge-kv", 1 - 2.0 / 4.0)):
        rows = validate(pools[method], [0.2], splits=10, delta=None)
        assert [r["prefill_saved_always_transfer"] for r in rows] == pytest.approx([expected] * len(rows))


def test_a_labelled_record_without_a_prefill_time_is_refused(tmp_path):
    from cachecert_agents.errors import CacheCertError

    path = tmp_path / "s__r__w.jsonl"
    _write_screened_pool(path, n=5)
    append_jsonl(path, {"id": "x", "method": "ridge-kv", "split": 4, "agree": True, "transfer_s": 0.1,
                        "risk": {"geometry": 0.1, "entropy": 0.1, "margin": 0.1, "constant": 0.0,
                                 "version": SCORE_VERSION}})
    with pytest.raises(CacheCertError, match="prefill_s"):
        labelled_requests(tmp_path, "s", "r", "w")


def test_eval_cert_of_one_pair_over_all_its_workloads(tmp_path):
    from cachecert_agents.cli import main

    _write_screened_pool(tmp_path / "s__r__w.jsonl")
    _write_screened_pool(tmp_path / "s__r__w2.jsonl", seed=3)
    _write_screened_pool(tmp_path / "other__r__w.jsonl", seed=4)
    out = tmp_path / "cert.json"
    assert main(["eval", "cert", "--pair", "s:r", "--alpha", "0.2", "--splits", "10", "--min-n", "20",
                 "--results-dir", str(tmp_path), "--out", str(out), "--plots", str(tmp_path / "plots")]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["sender"], r["workload"]) for r in rows} == {("s", "w"), ("s", "w2")}


@pytest.mark.parametrize("argv", [
    ["certify", "--pair", "s:r", "--workload", "w", "--alpha", "1.5", "--no-run"],
    ["certify", "--pair", "s:r", "--workload", "w", "--alpha", "nan", "--no-run"],
    ["certify", "--pair", "s:r", "--workload", "w", "--alpha", "0.1", "--delta", "2", "--no-run"],
    ["eval", "cert", "--pair", "s:r", "--alpha", "0.1,0"],
    ["eval", "cert", "--pair", "s:r", "--alpha", "abc"],
    ["eval", "cert", "--pair", "s:r", "--splits", "0"],
    ["audit", "report", "log.jsonl", "--confidence", "1.5"],
    ["eval", "transfer", "--pair", "s:r", "--workload", "w", "--splits", "x,L"],
])
def test_bad_numbers_are_usage_errors_before_anything_runs(argv, capsys):
    from cachecert_agents.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_missing_files_and_unknown_workloads_are_one_line_errors(tmp_path, capsys):
    from cachecert_agents.cli import main

    assert main(["eval", "report", "--results", str(tmp_path / "missing.json"), "--out", str(tmp_path / "t.md")]) == 2
    assert main(["eval", "summarise", "--pair", "s:r", "--workload", "nope"]) == 2
    err = capsys.readouterr().err
    assert "missing.json" in err and "unknown workload 'nope'" in err and "Traceback" not in err


def test_a_directory_is_not_a_certificate(tmp_path):
    with pytest.raises(CertificateError, match="cannot read"):
        Certificate.load(tmp_path)


def test_a_certificate_that_does_not_pay_is_switched_off_and_keeps_old_identities(tmp_path):
    """With the requests' gains, a rule that loses on calibration becomes threshold -inf with the reason recorded
    (unless guard=False); a certificate saved before the fields existed keeps its identity (audits name it)."""
    from cachecert_agents.cert.certificate import _checksum

    rng = np.random.default_rng(0)
    scores = rng.uniform(size=200)
    unsafe = (rng.uniform(size=200) < scores).astype(float)
    kw = dict(alpha=0.1, delta=None, sender="s", receiver="r", pair_fingerprints={"sender_kv": "a"},
              mapper_fingerprint="m1", workload="w", method="ridge-kv+r20", split=4, score="geometry",
              score_definition=score_definition("geometry"))
    ids = [str(i) for i in range(200)]
    losing = build_certificate(ids, scores, unsafe, gain_accepted=np.full(200, 0.3), gain_rejected=np.full(200, -0.5),
                               **kw)
    assert losing.threshold == "-inf" and "savings guard" in losing.guard and losing.calibration_saving < 0
    assert not losing.accepts(-1e9) and losing.accept_rate_calibration == 0.0
    kept = build_certificate(ids, scores, unsafe, gain_accepted=np.full(200, 0.3), gain_rejected=np.full(200, -0.5),
                             guard=False, **kw)
    assert kept.lam > -np.inf and kept.guard is None and kept.calibration_saving == losing.calibration_saving
    paying = build_certificate(ids, scores, unsafe, gain_accepted=np.full(200, 0.9),
                               gain_rejected=np.full(200, -0.01), **kw)
    assert paying.lam == kept.lam and paying.calibration_saving > 0 and paying.guard is None
    losing.save(tmp_path / "off.json")
    assert Certificate.load(tmp_path / "off.json").guard == losing.guard
    plain = build_certificate(ids, scores, unsafe, **kw)  # no gains: nothing recorded, as before
    body = plain.model_dump()
    del body["calibration_saving"], body["guard"]
    (tmp_path / "old.json").write_text(json.dumps(dict(body, checksum=_checksum(body))))
    old = Certificate.load(tmp_path / "old.json")
    assert old.identity == _checksum(body)[:16] == plain.identity


def test_labelled_requests_take_cuts_every_per_request_array_alike():
    import numpy as np

    from cachecert_agents.eval.cert_eval import LabelledRequests

    arr = np.arange(4.0)
    pool = LabelledRequests("s", "r", "w", "m", 2, ["a", "b", "c", "d"], {"entropy": arr * 10}, arr % 2, arr + 1,
                            arr + 2, arr + 3, arr + 4, screen_s=arr + 5)
    cut = pool.take([3, 1], scores={"x": np.array([7.0, 8.0])})
    assert cut.ids == ["d", "b"] and list(cut.scores) == ["x"] and list(cut.scores["x"]) == [7.0, 8.0]
    assert list(cut.unsafe) == [1.0, 1.0] and list(cut.prefill_s) == [4.0, 2.0] and list(cut.screen_s) == [8.0, 6.0]
    assert list(cut.transfer_s) == [5.0, 3.0] and list(cut.pass_s) == [6.0, 4.0] and list(cut.score_s) == [7.0, 5.0]
    assert list(pool.take([0]).scores["entropy"]) == [0.0] and cut.method == "m" and len(cut) == 2
