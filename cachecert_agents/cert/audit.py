"""Audits in production (DESIGN.md section 6): shadow full prefills of served transfers, a durable log, the
silent-failure rate per pair and node with a confidence interval, and the rule that takes a pair out of service.

The log is append-only JSONL (:mod:`cachecert_agents.jsonl`): each record is written and fsynced in one
``write``; a crash can cut only the record being written, which readers skip. A record::

    {"time", "node", "sender", "receiver", "method", "score_name", "score", "lambda", "alpha",
     "certificate", "agree", "unsafe", "served_answer", "full_answer", "served_s", "full_s"}

A *silent failure* is an audited transfer that was served (certified) and disagrees with the full prefill.
:func:`wilson_interval` and :func:`clopper_pearson_interval` bound its rate; when the exact (Clopper-Pearson)
interval's lower bound exceeds the certificate's alpha, the pair is flagged (:class:`AuditMonitor`): the policy
falls back to prefill and logs that it needs recalibration.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from cachecert_agents.jsonl import append_jsonl, read_jsonl

logger = logging.getLogger(__name__)


def _normal_quantile(p: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""
    a = [-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00]
    b = [-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01]
    c = [-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549732539343734e+00,
         4.374664141464968e+00, 2.938163982698783e+00]
    d = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00]
    if not 0 < p < 1:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if p > 1 - 0.02425:
        return -_normal_quantile(1 - p)
    q = p - 0.5
    r = q * q
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / \
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


def wilson_interval(failures: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval (Wilson 1927) for a binomial rate: ``(lower, upper)``; ``(0, 1)`` when ``n == 0``."""
    if n == 0:
        return 0.0, 1.0
    if not 0 <= failures <= n:
        raise ValueError(f"failures must lie in [0, n={n}], got {failures}")
    z = _normal_quantile(0.5 + confidence / 2)
    p = failures / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _binom_sf(k: int, n: int, p: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)``, summed in log space over the tail away from the mode (the upper
    tail when ``k > n p``, else one minus the lower one), stopping once terms fall below ``e^-40`` of the first:
    O(sqrt(n)) terms, so an audit log of any length is cheap to re-check."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    log_p, log_q, log_n1 = math.log(p), math.log1p(-p), math.lgamma(n + 1)

    def tail(indices: range) -> float:  # terms fall monotonically along ``indices`` (they walk away from the mode)
        first, total = None, 0.0
        for i in indices:
            x = log_n1 - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
            first = x if first is None else first
            if x - first < -40:
                break
            total += math.exp(x - first)
        return 0.0 if first is None else math.exp(first) * total

    if k > n * p:
        return min(1.0, tail(range(k, n + 1)))
    return max(0.0, 1.0 - tail(range(k - 1, -1, -1)))


def rate_exceeds(failures: int, n: int, alpha: float, confidence: float = 0.95) -> bool:
    """Whether the exact (Clopper-Pearson) two-sided interval's lower bound for the rate ``failures / n`` lies above
    ``alpha``: the same decision as ``clopper_pearson_interval(failures, n, confidence)[0] > alpha``, from one
    binomial tail (``P(X >= failures | alpha) < (1 - confidence) / 2``) instead of a bisection."""
    if n == 0 or failures == 0:
        return False
    return _binom_sf(failures, n, alpha) < (1 - confidence) / 2


def clopper_pearson_interval(failures: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson 1934) two-sided interval for a binomial rate, by bisection on the binomial tails:
    conservative (coverage >= ``confidence`` for every true rate), so a pair is never flagged on the luck of a
    handful of audits. ``(0, 1)`` when ``n == 0``."""
    if n == 0:
        return 0.0, 1.0
    if not 0 <= failures <= n:
        raise ValueError(f"failures must lie in [0, n={n}], got {failures}")
    tail = (1 - confidence) / 2

    def solve(f, target: float) -> float:  # f increasing in p
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if failures == 0 else solve(lambda p: _binom_sf(failures, n, p), tail)
    upper = 1.0 if failures == n else solve(lambda p: _binom_sf(failures + 1, n, p), 1 - tail)
    return lower, upper


class AuditRecord(NamedTuple):
    """The fields of an audit record that rates and flags read (the log holds more, see the module docstring)."""

    sender: str
    receiver: str
    certificate_id: str | None  # None: written before audits named their certificate
    node: str
    unsafe: bool
    alpha: float


def parse_audit_record(record: Any) -> AuditRecord:
    """Validate one log record; raises ``ValueError`` naming what is missing or malformed (every reader skips such
    a record with a warning, so one bad line never stops the runtime or a report)."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    missing = [k for k in ("sender", "receiver", "unsafe", "alpha") if k not in record]
    if missing:
        raise ValueError(f"record lacks {', '.join(missing)}")
    for key in ("sender", "receiver"):
        if not isinstance(record[key], str) or not record[key]:
            raise ValueError(f"{key} must be a model name, got {record[key]!r}")
    if not isinstance(record.get("certificate_id"), (str, type(None))):
        raise ValueError(f"certificate_id must be a string, got {record['certificate_id']!r}")
    if not (isinstance(record["unsafe"], bool) or record["unsafe"] in (0, 1)):  # 0/1 from other writers too
        raise ValueError(f"unsafe must be true or false, got {record['unsafe']!r}")
    try:
        alpha = float(record["alpha"])
    except (TypeError, ValueError):
        raise ValueError(f"alpha must be a number, got {record['alpha']!r}") from None
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    return AuditRecord(record["sender"], record["receiver"], record.get("certificate_id"),
                       str(record.get("node") or "-"), bool(record["unsafe"]), alpha)


def valid_audit_records(records: list[Any], source: str | Path = "audit log") -> list[AuditRecord]:
    """The records that :func:`parse_audit_record` accepts; each one skipped is said in a warning."""
    out = []
    for i, r in enumerate(records):
        try:
            out.append(parse_audit_record(r))
        except ValueError as exc:
            logger.warning("%s: skipping audit record %d: %s", source, i + 1, exc)
    return out


def summarise_audits(records: list[dict], confidence: float = 0.95) -> list[dict]:
    """Silent-failure rate per pair, certificate and node, and per pair and certificate (``node = "*"``), with
    Wilson and exact (Clopper-Pearson) intervals. Each certificate is judged against its own alpha, as
    :class:`AuditMonitor` does (pooling an old lenient certificate's clean audits with a new one's would hide the
    new one's failures). Malformed records are skipped with a warning."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    groups: dict[tuple[str, str, str, str], list[AuditRecord]] = defaultdict(list)
    for r in valid_audit_records(records):
        cert = r.certificate_id or "-"
        groups[(r.sender, r.receiver, cert, r.node)].append(r)
        groups[(r.sender, r.receiver, cert, "*")].append(r)
    rows = []
    for (sender, receiver, cert, node), recs in sorted(groups.items()):
        k = sum(r.unsafe for r in recs)
        lo, hi = wilson_interval(k, len(recs), confidence)
        cp_lo, cp_hi = clopper_pearson_interval(k, len(recs), confidence)
        alpha = min(r.alpha for r in recs)  # one certificate has one alpha; the strictest if a log mixes them
        rows.append({"sender": sender, "receiver": receiver, "certificate_id": cert, "node": node,
                     "audited": len(recs), "silent_failures": k, "rate": k / len(recs), "wilson_low": lo,
                     "wilson_high": hi, "exact_low": cp_lo, "exact_high": cp_hi, "confidence": confidence,
                     "alpha": alpha, "above_alpha": cp_lo > alpha})
    return rows


class AuditLog:
    """The durable audit log: append one record per audited transfer; read back every intact record."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def append(self, record: dict[str, Any]) -> None:
        with self._lock:
            append_jsonl(self.path, record)

    def records(self) -> list[dict]:
        return read_jsonl(self.path)


class AuditMonitor:
    """Flags a certificate when its audited silent-failure rate is above alpha with the given confidence (the
    Clopper-Pearson lower bound exceeds alpha). Audits are counted per pair *and certificate* (records name it by
    ``certificate_id``, :attr:`Certificate.identity`), so a recalibrated pair starts afresh and old clean audits
    never dilute a new certificate's failures; records written before the field existed count for the pair
    whatever its certificate (the cautious reading). A flagged pair is served by full prefill until recalibrated
    (a new certificate, or :meth:`clear`)."""

    def __init__(self, log: AuditLog, confidence: float = 0.95):
        self.log, self.confidence = log, confidence
        self._counts: dict[tuple[str, str, str | None], list[int]] = defaultdict(lambda: [0, 0])
        self._flagged: set[tuple[str, str, str | None]] = set()
        self._lock = threading.Lock()
        alphas: dict[tuple[str, str, str | None], float] = {}
        # a restarted process remembers what earlier runs audited; a malformed record is skipped, said once each
        for r in valid_audit_records(log.records(), log.path):
            key = (r.sender, r.receiver, r.certificate_id)
            self._counts[key][0] += r.unsafe
            self._counts[key][1] += 1
            alphas[key] = min(r.alpha, alphas.get(key, 1.0))
        for key, (k, n) in self._counts.items():
            if rate_exceeds(k, n, alphas[key], confidence):
                self._flagged.add(key)
                logger.warning("audit log %s: %s->%s (certificate %s) has %d silent failures in %d audits, above "
                               "alpha=%g; its transfers fall back to prefill until it is recalibrated", log.path,
                               key[0], key[1], key[2] or "not recorded", k, n, alphas[key])

    @property
    def flagged(self) -> set[tuple[str, str]]:
        """The flagged ``(sender, receiver)`` pairs."""
        with self._lock:
            return {(s, r) for s, r, _ in self._flagged}

    def record(self, record: dict[str, Any]) -> bool:
        """Append ``record`` to the log and update its certificate's rate; returns True when it is (now)
        flagged. A flagged certificate stays flagged; an unflagged one is re-checked with one binomial tail
        (:func:`rate_exceeds`), outside the lock that transfers wait on."""
        self.log.append(record)
        key = (record["sender"], record["receiver"], record.get("certificate_id"))
        with self._lock:
            counts = self._counts[key]
            counts[0] += bool(record["unsafe"])
            counts[1] += 1
            k, n = counts
            if key in self._flagged:
                return True
        if not rate_exceeds(k, n, record["alpha"], self.confidence):
            return False
        lo, hi = clopper_pearson_interval(k, n, self.confidence)
        with self._lock:
            if key not in self._flagged:
                self._flagged.add(key)
                logger.warning("audits of %s->%s: %d silent failures in %d (rate %.3f, %.0f%% interval %.3f-%.3f) "
                               "exceed alpha=%g; transfers for this pair fall back to prefill until it is "
                               "recalibrated (`cachecert certify`)", key[0], key[1], k, n, k / n,
                               100 * self.confidence, lo, hi, record["alpha"])
        return True

    def is_flagged(self, sender: str, receiver: str, certificate_id: str | None = None) -> bool:
        """Whether the pair is out of service: its certificate ``certificate_id`` (None: any of them) is flagged,
        or audits that named no certificate are."""
        with self._lock:
            if certificate_id is None:
                return any((s, r) == (sender, receiver) for s, r, _ in self._flagged)
            return bool({(sender, receiver, certificate_id), (sender, receiver, None)} & self._flagged)

    def clear(self, sender: str, receiver: str) -> None:
        """Return a pair to service by hand: every certificate's audit counts and flag for it are forgotten in
        this process (the log keeps them, so a restart flags them again). Not needed after a recalibration: a new
        certificate is audited afresh under its own identity."""
        logger.warning("audit flags and counts of %s->%s cleared by hand (the audit log keeps its records)",
                       sender, receiver)
        with self._lock:
            for key in [k for k in self._counts if k[:2] == (sender, receiver)]:
                self._counts.pop(key)
            self._flagged = {k for k in self._flagged if k[:2] != (sender, receiver)}
