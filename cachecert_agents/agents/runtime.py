"""The policy behind the node wrapper: reuse, transfer or prefill, with audits and metrics.

For a model call ``(model, context, instruction)``:

1. **reuse** — this model already holds the exact cache of ``prefix + context`` (same tokens): no risk;
2. **transfer** — another model holds the context and a *route* exists for that (sender, receiver) pair (mapper,
   risk scorer, certificate, all checked against each other and the loaded models): the receiver's cache is
   built by the transfer, the request is scored in the suffix pass, and the answer is served iff the
   certificate accepts the score (a two-stage certificate scores a cheap *screen* transfer first and builds the
   served, more expensive transfer only when that score is accepted); a refused score, a flagged pair, or any
   error falls through to
3. **prefill** — the model prefills the context itself; the exact cache (and, if the model is a sender of some
   route, its features) is kept in the store for later steps.

Every call returns a :class:`Decision` (action, reason, score, lambda, prefill tokens avoided, times) and updates
:class:`Metrics`. With probability ``audit_probability`` a served transfer is shadowed by a full prefill (in a
background thread by default; it never changes what was served), compared with the certificate's workload
agreement criterion and appended to the audit log; :class:`~cachecert_agents.cert.audit.AuditMonitor` takes a
pair out of service when its audited silent-failure rate is above alpha.

Work on one model is serialised by a per-model lock (a transfer temporarily swaps decoder layers, so two threads
must never run the same model at once); different models run concurrently.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import random
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from cachecert_agents.agents.store import (
    CachedContext,
    KVCacheStore,
    text_key,
    token_key,
)
from cachecert_agents.cert.audit import AuditLog, AuditMonitor
from cachecert_agents.cert.certificate import Certificate
from cachecert_agents.cert.scores import RiskScorer
from cachecert_agents.errors import CertificateError
from cachecert_agents.models.handle import ModelHandle, PromptSegments

logger = logging.getLogger(__name__)

DECISIONS_KEPT = 10_000  # CacheCertRuntime.decisions keeps the most recent ones; Metrics counts every call


class RouteConfig(BaseModel):
    """A certified transfer route: the mapper artifact stem, its statistics (default ``<mapper>.stats``) and the
    certificate file. ``audit_probability`` overrides the runtime's default for this pair."""

    sender: str
    receiver: str
    mapper: str
    certificate: str
    statistics: str | None = None
    audit_probability: float | None = Field(default=None, ge=0, le=1)

    @field_validator("mapper", "certificate", "statistics")
    @classmethod
    def _expand_user(cls, path: str | None) -> str | None:
        return None if path is None else str(Path(path).expanduser())


class RuntimeConfig(BaseModel):
    """Configuration of a :class:`CacheCertRuntime`."""

    routes: list[RouteConfig] = Field(default_factory=list)
    store_max_bytes: int = Field(default=2 << 30, gt=0)
    store_dir: str | None = Field(default=None, description="keep context caches here and reuse them in later runs")
    store_dir_max_bytes: int = Field(default=8 << 30, gt=0)
    audit_log: str | None = None
    audit_probability: float = Field(default=0.1, ge=0, le=1)
    audit_in_background: bool = True
    audit_confidence: float = Field(default=0.95, gt=0, lt=1)
    max_new_tokens: int = Field(default=96, gt=0)
    device: str = "cpu"
    seed: int = 0

    @field_validator("store_dir", "audit_log")
    @classmethod
    def _expand_user(cls, path: str | None) -> str | None:
        return None if path is None else str(Path(path).expanduser())


@dataclass
class Decision:
    """What the policy did for one model call (recorded per step; ``asdict`` gives the JSON form)."""

    node: str | None
    model: str
    action: str  # "reuse" | "transfer" | "prefill"
    reason: str
    context_tokens: int
    prefill_tokens_avoided: int = 0
    sender: str | None = None
    score_name: str | None = None
    score: float | None = None
    lam: float | None = None
    alpha: float | None = None
    transfer_s: float = 0.0
    prefill_s: float = 0.0
    step_s: float = 0.0
    audited: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["lam"] is not None and abs(d["lam"]) == float("inf"):
            d["lam"] = str(d["lam"])
        return d


@dataclass
class Metrics:
    """Counters a user can read (``runtime.metrics``); thread-safe through the runtime's lock."""

    calls: int = 0
    actions: dict[str, int] = field(default_factory=lambda: {"reuse": 0, "transfer": 0, "prefill": 0})
    refused: int = 0
    errors: int = 0
    context_tokens: int = 0
    prefill_tokens_avoided: int = 0
    step_s: float = 0.0
    audits_scheduled: int = 0
    audits_done: int = 0
    silent_failures: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Route:
    """A loaded, mutually checked route (see :class:`RouteConfig`)."""

    config: RouteConfig
    mapper: Any
    scorer: RiskScorer
    certificate: Certificate
    agree: Any  # (served: str, full: str) -> bool, the certificate workload's criterion
    # selective recompute (fraction of the context) of the served transfer and of the one scored (a +rP
    # method: serve exactly what was certified)
    served_recompute: float = 0.0
    score_recompute: float = 0.0

    @cached_property
    def certificate_id(self) -> str:
        """:attr:`Certificate.identity`, hashed once (audits name the certificate by it on every request)."""
        return self.certificate.identity


class CacheCertRuntime:
    """Models, the shared cache store, routes, audits and metrics of one application (see module docstring).

    ``models`` may pre-register handles (e.g. tiny test models or models loaded elsewhere); other names are
    loaded on first use with :meth:`ModelHandle.load` (embedded name, local path or Hugging Face id).
    """

    def __init__(self, config: RuntimeConfig | None = None, models: dict[str, ModelHandle] | None = None):
        self.config = config or RuntimeConfig()
        self.store = KVCacheStore(self.config.store_max_bytes, self.config.store_dir,
                                  self.config.store_dir_max_bytes, device=self.config.device)
        self.metrics = Metrics()
        self.decisions: deque[Decision] = deque(maxlen=DECISIONS_KEPT)  # the most recent ones (metrics count all)
        self._models: dict[str, ModelHandle] = dict(models or {})
        self._model_locks: dict[str, threading.RLock] = {}
        self._lock = threading.RLock()
        self._routes: dict[tuple[str, str], Route | None] = {}
        self._route_configs = {(r.sender, r.receiver): r for r in self.config.routes}
        self._prefix_caches: dict[str, Any] = {}
        self._build_locks: dict[tuple[int, Any], threading.Lock] = {}  # see _once
        self._rng = random.Random(self.config.seed)
        self.audit_log = AuditLog(self.config.audit_log) if self.config.audit_log else None
        self.monitor = AuditMonitor(self.audit_log, self.config.audit_confidence) if self.audit_log else None
        self._audit_pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cachecert-audit")
                            if self.audit_log and self.config.audit_in_background else None)
        self._audit_futures: list[concurrent.futures.Future] = []  # guarded by self._lock
        self._closed = False
        if self.audit_log is None and (self.config.audit_probability > 0 or any(
                r.audit_probability for r in self.config.routes)):
            logger.info("no audit_log configured: served transfers are not audited (audit_probability has no "
                        "effect)")

    # ------------------------------------------------------------------ models and routes
    def _once(self, table: dict, key: Any, build: Any) -> Any:
        """``table[key]``, built by ``build()`` on first use. Builds of one key run once (under that key's own
        lock); the runtime's lock is never held while building, so a slow load (a model, a route's artifacts, a
        prefix prefill) holds up only the callers that need the same thing."""
        with self._lock:
            if key in table:
                return table[key]
            lock = self._build_locks.setdefault((id(table), key), threading.Lock())
        with lock:
            with self._lock:
                if key in table:
                    return table[key]
            value = build()
            with self._lock:
                return table.setdefault(key, value)

    def model(self, name: str) -> ModelHandle:
        handle = self._once(self._models, name, lambda: ModelHandle.load(name, device=self.config.device))
        self._model_lock(name)
        return handle

    def _model_lock(self, name: str) -> threading.RLock:
        with self._lock:
            return self._model_locks.setdefault(name, threading.RLock())

    def add_route(self, route: RouteConfig) -> None:
        """Register (or replace) a route; it is loaded and checked on first use. Audit flags are left alone:
        they belong to a certificate's identity, so a recalibrated certificate is audited afresh while a
        flagged one stays out of service under any path (``runtime.monitor.clear`` lifts a flag by hand)."""
        with self._lock:
            self._route_configs[(route.sender, route.receiver)] = route
            self._routes.pop((route.sender, route.receiver), None)

    def senders_for(self, model: str) -> bool:
        """Whether ``model`` is the sender of some route (then its prefills keep features)."""
        with self._lock:
            return any(s == model for s, _ in self._route_configs)

    def route(self, sender: str, receiver: str) -> Route | None:
        """The loaded route, or None (no route configured, or it failed its checks: logged once)."""
        key = (sender, receiver)
        with self._lock:
            cfg = self._route_configs.get(key)
        if cfg is None:
            return None

        def load() -> Route | None:
            try:
                return self._load_route(cfg)
            except Exception as exc:  # fail safe: a broken route means prefill, said loudly once
                logger.error("route %s->%s disabled, its transfers fall back to prefill: %s", sender, receiver, exc)
                return None

        route = self._once(self._routes, key, load)
        with self._lock:  # replaced by add_route while loading: load the new one
            replaced = self._route_configs.get(key) is not cfg
            if replaced and self._routes.get(key) is route:
                self._routes.pop(key)
        return self.route(sender, receiver) if replaced else route

    def _load_route(self, cfg: RouteConfig) -> Route:
        from cachecert_agents.eval.transfer_eval import load_mapper_statistics, parse_method
        from cachecert_agents.eval.workloads import get_workload
        from cachecert_agents.transfer.calibrate import pair_fingerprints, pair_header
        from cachecert_agents.transfer.mappers import RidgeMapper

        sender, receiver = self.model(cfg.sender), self.model(cfg.receiver)
        header = pair_header(sender, receiver)
        fps = pair_fingerprints(header)
        mapper = RidgeMapper.load(cfg.mapper, expect=fps)
        stats = load_mapper_statistics(mapper, cfg.statistics or f"{cfg.mapper}.stats", expect=fps)
        cert = Certificate.load(cfg.certificate)
        if (cert.sender, cert.receiver) != (cfg.sender, cfg.receiver):
            raise CertificateError(f"certificate {cfg.certificate} is for {cert.sender}->{cert.receiver}, not "
                                   f"{cfg.sender}->{cfg.receiver}")
        cert.check_for(fps, mapper.fingerprint)  # RidgeMapper.load always knows its file's fingerprint
        for split in {cert.split, cert.score_split}:
            if split < receiver.geometry.num_layers and f"hidden:{split}" not in mapper.weights:
                raise ValueError(f"certificate is for split {split} but the mapper has no hidden:{split} target")
        scorer = RiskScorer.from_statistics(receiver, mapper, stats)
        served_r = (parse_method(cert.method).recompute or 0) / 100
        score_r = (parse_method(cert.screen_method).recompute or 0) / 100 if cert.screen_method else served_r
        logger.info("route %s->%s ready: %s, %s score, %s alpha=%g lambda=%s (n=%d)", cfg.sender, cfg.receiver,
                    cert.method, cert.score, cert.control.upper(), cert.alpha, cert.threshold, cert.n)
        agree = get_workload(cert.workload, agreement=cert.agreement).agree  # the criterion the labels used
        return Route(cfg, mapper, scorer, cert, agree, served_r, score_r)

    # ------------------------------------------------------------------ the policy
    def generate(self, model: str, context: str, instruction: str, system: str | None = None,
                 node: str | None = None, max_new_tokens: int | None = None, stop_strings: tuple[str, ...] = ()
                 ) -> tuple[str, Decision]:
        """Answer ``instruction`` after ``context`` with ``model``, reusing, transferring or prefilling the
        context's cache (see the module docstring). Returns the text and the decision."""
        if not isinstance(context, str) or not isinstance(instruction, str):
            raise TypeError("context and instruction must be strings")
        if isinstance(stop_strings, str):
            raise TypeError(f"stop_strings must be a sequence of strings, e.g. ({stop_strings!r},), not a string")
        if max_new_tokens is not None and max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if self._closed:
            raise RuntimeError("this CacheCertRuntime is closed (close() was called); create a new one")
        t0 = time.perf_counter()
        handle = self.model(model)
        gen_kw = {"max_new_tokens": max_new_tokens or self.config.max_new_tokens, "stop_strings": tuple(stop_strings)}
        prompt = handle.format_prompt(context, instruction, system)
        n_ctx = int(prompt.context_ids.numel())
        key, tkey = token_key(handle.identity, prompt), text_key(context, system)
        text, decision, audit_route = None, None, None
        with self._model_lock(model):
            entry = self.store.get(key)
            if entry is not None and entry.features is None and self.senders_for(model):
                # held from before a route named this model as sender: prefill again, keeping the features that
                # transfers from it need (the new entry replaces the old one)
                text, decision = self._prefill(handle, prompt, key, tkey, node, gen_kw,
                                               "the held cache kept no sender features, which routes from this "
                                               "model need")
            elif entry is not None:
                try:
                    text = handle.generate(prompt.suffix_ids, cache=entry.fresh_cache(handle.device), **gen_kw).text
                    decision = Decision(node, model, "reuse", "exact cache of this context held by the same model",
                                        n_ctx, prefill_tokens_avoided=n_ctx)
                except Exception as exc:  # fail safe: a held cache that cannot be used means a prefill
                    logger.warning("reusing the held cache of %s failed, dropping it and prefilling: %r", model, exc)
                    with self._lock:
                        self.metrics.errors += 1
                    self.store.discard(key)
                    text, decision = self._prefill(handle, prompt, key, tkey, node, gen_kw,
                                                   f"reusing the held cache failed: {exc!r}")
            else:
                served = self._try_transfer(handle, prompt, tkey, node, gen_kw)
                if served is not None and served[0] is not None:
                    text, decision, audit_route = served
                else:
                    reason = served[1] if served is not None else "no other model holds this context for a route"
                    text, decision = self._prefill(handle, prompt, key, tkey, node, gen_kw, reason)
        decision.step_s = time.perf_counter() - t0  # what serving took; an audit's shadow prefill is not in it
        if audit_route is not None:
            try:
                decision.audited = self._maybe_audit(audit_route, handle, prompt, text, decision, gen_kw)
            except Exception:  # an audit must never break serving (e.g. scheduled after close())
                logger.exception("could not schedule the audit of %s->%s", decision.sender, handle.name)
        self._count(decision)
        logger.info("%s[%s]: %s (%s)%s", node or "-", model, decision.action, decision.reason,
                    f", score {decision.score:.4g} vs lambda {decision.lam}" if decision.score is not None else "")
        return text, decision

    def _prefill(self, handle: ModelHandle, prompt: PromptSegments, key: str, tkey: str, node: str | None,
                 gen_kw: dict, reason: str) -> tuple[str, Decision]:
        from cachecert_agents.transfer.features import prefill_with_features

        cache, feats, prefill_s = prefill_with_features(handle, prompt, keep_features=self.senders_for(handle.name))
        entry = CachedContext(handle.name, key, tkey, prompt, cache, feats, prefill_s, model_id=handle.identity)
        self.store.put(entry)
        text = handle.generate(prompt.suffix_ids, cache=entry.fresh_cache(handle.device), **gen_kw).text
        return text, Decision(node, handle.name, "prefill", reason,
                              int(prompt.context_ids.numel()), prefill_s=prefill_s)

    def _try_transfer(self, handle: ModelHandle, prompt: PromptSegments, tkey: str, node: str | None,
                      gen_kw: dict) -> tuple[Any, ...] | None:
        """Serve through a certified transfer if one applies: ``(text, decision, route)`` (the caller schedules
        the audit); ``(None, reason)`` when a holder existed but no transfer was served; None when no other model
        holds the context."""
        from cachecert_agents.transfer.apply import transfer

        holders = self.store.holders(tkey, exclude_model=handle.name)
        if not holders:
            featureless = self.store.models_without_features(tkey, exclude_model=handle.name)
            if featureless:  # held, but not transferable: say so rather than "nobody holds it"
                return None, (f"{', '.join(featureless)} hold(s) this context but kept no sender features (prefilled "
                              f"while no route had them as sender), so nothing can be transferred to "
                              f"{handle.name}")
            return None
        reasons = []
        for holder in holders:
            route = self.route(holder.model, handle.name)
            if route is None:
                reasons.append(f"no certified route {holder.model}->{handle.name}")
                continue
            if self.monitor is not None and self.monitor.is_flagged(holder.model, handle.name,
                                                                    route.certificate_id):
                reasons.append(f"pair {holder.model}->{handle.name} flagged by audits (needs recalibration)")
                continue
            loaded_id = self.model(holder.model).identity
            if holder.model_id != loaded_id:  # "" (a cache persisted by an earlier version): weights unknown
                reasons.append(f"the cache held for {holder.model} was computed by other weights "
                               f"({holder.model_id or 'not recorded'}, loaded: {loaded_id})")
                continue
            cert = route.certificate
            if cert.lam == float("-inf"):
                why = f" ({cert.guard})" if cert.guard else ""
                reasons.append(f"the certificate for {holder.model}->{handle.name} accepts no transfer{why}")
                continue
            try:
                prefix_cache = self._prefix_cache(handle, prompt)
                # the score is computed on the certificate's score transfer: the served one, or a cheaper screen
                result = transfer(handle, prompt, holder.features, route.mapper, cert.score_split,
                                  prefix_cache=prefix_cache, recompute=route.score_recompute)
                scores, out, cost = route.scorer.scoring_pass(result.cache, prompt.suffix_ids, prompt.context_span,
                                                              cert.score_split, result.features,
                                                              geometry=cert.score == "geometry",
                                                              exact=result.recomputed_index)
                score = scores[cert.score]
                spent_s = result.transfer_s + cost["pass_s"] + cost["score_s"]
                if not cert.accepts(score):
                    with self._lock:
                        self.metrics.refused += 1
                    on = f", on the {cert.screen_method} screen" if cert.screen_method else ""
                    reasons.append(f"certificate refused the transfer from {holder.model} (score {score:.4g} > "
                                   f"lambda {cert.lam:.4g}{on})")
                    continue
                if cert.screen_split is not None:  # accepted by the screen: now run the served transfer
                    result = transfer(handle, prompt, holder.features, route.mapper, cert.split,
                                      prefix_cache=prefix_cache, recompute=route.served_recompute)
                    out = handle.forward(prompt.suffix_ids, cache=result.cache, logits_to_keep=1)
                    spent_s += result.transfer_s
                base = dict(sender=holder.model, score_name=cert.score, score=score, lam=cert.lam, alpha=cert.alpha,
                            transfer_s=spent_s)
                text = handle.decode(out.cache, out.logits[-1], **gen_kw).text
            except Exception as exc:  # fail safe: any error means a full prefill, with the reason logged
                logger.warning("transfer %s->%s failed, falling back to prefill: %r", holder.model, handle.name, exc)
                with self._lock:
                    self.metrics.errors += 1
                reasons.append(f"transfer from {holder.model} failed: {exc!r}")
                continue
            avoided = max(0, int(prompt.context_ids.numel() * cert.split / handle.geometry.num_layers)
                          - result.recomputed)
            decision = Decision(node, handle.name, "transfer",
                                f"certified transfer from {holder.model} ({cert.method}, {cert.control.upper()} "
                                f"alpha={cert.alpha:g})", int(prompt.context_ids.numel()),
                                prefill_tokens_avoided=avoided, **base)
            return text, decision, route
        return None, "; ".join(reasons)

    def _prefix_cache(self, handle: ModelHandle, prompt: PromptSegments) -> Any:
        """The model's own cache of its template prefix (computed once per model and prefix)."""
        key = handle.name + "\0" + hashlib.sha256(prompt.prefix_ids.numpy().tobytes()).hexdigest()
        return self._once(self._prefix_caches, key, lambda: handle.prefill(prompt.prefix_ids).cache)

    # ------------------------------------------------------------------ audits
    def _maybe_audit(self, route: Route, handle: ModelHandle, prompt: PromptSegments, served: str,
                     decision: Decision, gen_kw: dict) -> bool:
        p = route.config.audit_probability
        p = self.config.audit_probability if p is None else p
        if self.monitor is None or self._rng.random() >= p:
            return False
        with self._lock:
            self.metrics.audits_scheduled += 1
        job = (route, handle, prompt, served, decision, gen_kw)
        if self._audit_pool is not None:
            future = self._audit_pool.submit(self._audit, *job)
            with self._lock:
                self._audit_futures = [f for f in self._audit_futures if not f.done()] + [future]
        else:
            self._audit(*job)
        return True

    def _audit(self, route: Route, handle: ModelHandle, prompt: PromptSegments, served: str, decision: Decision,
               gen_kw: dict) -> None:
        try:
            with self._model_lock(handle.name):
                t0 = time.perf_counter()
                full = handle.generate(prompt.input_ids, **gen_kw).text
                full_s = time.perf_counter() - t0
            agree = bool(route.agree(served, full))
            record = {"time": time.time(), "node": decision.node, "sender": decision.sender,
                      "receiver": handle.name, "method": route.certificate.method,
                      "score_name": decision.score_name, "score": decision.score, "lambda": route.certificate.threshold,
                      "alpha": route.certificate.alpha, "certificate": route.config.certificate,
                      "certificate_id": route.certificate_id, "agree": agree,
                      "unsafe": not agree, "served_answer": served, "full_answer": full,
                      "served_s": decision.step_s, "full_s": full_s}
            self.monitor.record(record)
            with self._lock:
                self.metrics.audits_done += 1
                self.metrics.silent_failures += int(not agree)
        except Exception:  # an audit must never break serving; it is logged and counted as not done
            logger.exception("audit of %s->%s failed", decision.sender, handle.name)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for scheduled background audits and store writes to finish."""
        with self._lock:
            futures, self._audit_futures = self._audit_futures, []
        concurrent.futures.wait(futures, timeout=timeout)
        self.store.flush(timeout)

    def close(self) -> None:
        """Finish pending audits and store writes and release the worker threads; the runtime then refuses
        :meth:`generate` (closing twice is harmless)."""
        self._closed = True
        self.flush()
        self.store.close()
        if self._audit_pool is not None:
            self._audit_pool.shutdown(wait=True)

    # ------------------------------------------------------------------ metrics
    def _count(self, d: Decision) -> None:
        with self._lock:
            self.decisions.append(d)
            m = self.metrics
            m.calls += 1
            m.actions[d.action] += 1
            m.context_tokens += d.context_tokens
            m.prefill_tokens_avoided += d.prefill_tokens_avoided
            m.step_s += d.step_s

    def summary(self) -> dict[str, Any]:
        """Metrics, store state and the audit summary (per pair and node), as a JSON-ready dict."""
        from cachecert_agents.cert.audit import summarise_audits

        self.flush()
        out = {"metrics": self.metrics.as_dict(),
               "store": {"entries": len(self.store), "bytes": self.store.nbytes, "evictions": self.store.evictions,
                         "max_bytes": self.store.max_bytes, "persist_dir": str(self.store.persist_dir or ""),
                         "loaded_from_disk": self.store.loaded_from_disk},
               "flagged_pairs": sorted(f"{s}->{r}" for s, r in (self.monitor.flagged if self.monitor else ()))}
        if self.audit_log is not None:
            out["audits"] = summarise_audits(self.audit_log.records(), self.config.audit_confidence)
        return out
