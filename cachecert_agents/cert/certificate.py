"""Certificates: the saved decision rule of CacheCert for one (pair, mapper, transfer method, score).

A certificate is one JSON file (no tensors are needed: the rule is ``accept iff score <= lambda``) recording the
pair and its fingerprints, the mapper it was calibrated with (sha256 of the mapper's tensors), the workload, the
transfer method (and, for a two-stage transfer, the cheap *screen* method whose risk score decides whether the
served method runs at all), the score definition, the guarantee (``crc``: expected rate of unsafe transfers served
``<= alpha``; ``ltt``: that rate ``<= alpha`` with probability ``>= 1 - delta``), ``n``, ``lambda``, a
fingerprint of the labelled calibration requests, the agreement criterion the labels used (None: the
workload's own; the runtime's audits judge served answers by the same one), the date and the library version.
Loading verifies the format and a checksum of the content, so a corrupt or hand-edited file is refused, not
trusted.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ValidationError

from cachecert_agents import __version__
from cachecert_agents.artifacts import file_fingerprint, first_identity_mismatch, write_atomic  # noqa: F401 (re-exported)
from cachecert_agents.cert.conformal import calibration_gain, guard_threshold
from cachecert_agents.cert.conformal import certify as fit_threshold
from cachecert_agents.errors import CertificateError

FORMAT = "cachecert-certificate/1"


def calibration_fingerprint(ids: list[str], scores: np.ndarray, unsafe: np.ndarray) -> str:
    """sha256 (16 hex) of the sorted ``(id, score, label)`` triples the threshold was fitted on."""
    rows = sorted(f"{i}\t{s:.9g}\t{int(u)}" for i, s, u in zip(ids, scores, unsafe))
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


class Certificate(BaseModel):
    """``accepts(score)`` is the certified rule; see the module docstring for the fields' meaning."""

    format: str = FORMAT
    sender: str
    receiver: str
    pair_fingerprints: dict[str, str]
    mapper_fingerprint: str
    workload: str
    method: str
    split: int
    score: str
    score_definition: str
    control: Literal["crc", "ltt"]
    alpha: float
    delta: float | None
    n: int
    threshold: float | Literal["inf", "-inf"]  # "inf": accept every transfer; "-inf": accept none
    accept_rate_calibration: float
    empirical_risk_calibration: float
    unsafe_rate_calibration: float
    calibration_fingerprint: str
    created: str
    library_version: str
    screen_method: str | None = None  # two-stage: the score is computed on this transfer, run first
    screen_split: int | None = None
    agreement: str | None = None  # the labels' agreement criterion (Agreement spec); None: the workload's own
    calibration_saving: float | None = None  # net prefill saved by the fitted rule on its calibration requests
    guard: str | None = None  # why the savings guard switched the certificate off (threshold "-inf"), if it did

    @property
    def score_split(self) -> int:
        """The split of the transfer the score is computed on (the screen's, when there is one)."""
        return self.split if self.screen_split is None else self.screen_split

    @property
    def identity(self) -> str:
        """sha256 (16 hex) of the certificate's content: what audit records name it by, so audits of one
        certificate never count against another of the same pair."""
        # fields added later are left out while unset, so a certificate keeps the identity its audits name it by
        later = {k for k in ("calibration_saving", "guard") if getattr(self, k) is None}
        return _checksum(self.model_dump(exclude=later))[:16]

    @property
    def lam(self) -> float:
        return float(self.threshold)

    def accepts(self, score: float) -> bool:
        """The certified decision: serve the transfer iff ``score <= lambda`` (ties accepted). NaN is refused."""
        return bool(score <= self.lam) if not math.isnan(score) else False

    def check_for(self, pair_fingerprints: dict[str, str], mapper_fingerprint: str | None = None,
                  method: str | None = None) -> None:
        """Raise :class:`CertificateError` unless this certificate belongs to that pair, mapper and method."""
        mismatch = first_identity_mismatch(self.pair_fingerprints, pair_fingerprints,
                                           f"certificate for {self.sender}->{self.receiver}")
        if mismatch is not None:
            k, v = mismatch
            raise CertificateError(f"certificate for {self.sender}->{self.receiver} has {k}="
                                   f"{self.pair_fingerprints.get(k)!r}; this pair has {v!r}")
        if mapper_fingerprint is not None and mapper_fingerprint != self.mapper_fingerprint:
            raise CertificateError(f"certificate was calibrated with mapper {self.mapper_fingerprint}, but the "
                                   f"mapper in use is {mapper_fingerprint}; run `cachecert certify` again")
        if method is not None and method != self.method:
            raise CertificateError(f"certificate covers method {self.method}, not {method}")
        from cachecert_agents.cert.scores import definition_is_current, score_definition
        from cachecert_agents.eval.transfer_eval import parse_method

        scored = parse_method(self.screen_method or self.method)  # the transfer the score is computed on
        if not definition_is_current(self.score_definition, self.score, repaired=bool(scored.recompute)):
            raise CertificateError(f"certificate was fitted on score {self.score_definition!r}; this library computes "
                                   f"{score_definition(self.score)!r}; run `cachecert certify` again")

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write atomically with a content checksum; refuses to replace an existing file unless ``overwrite``."""
        path = Path(path)
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True (CLI: --force) to replace it")
        body = self.model_dump()
        return write_atomic(path, json.dumps(dict(body, checksum=_checksum(body)), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Certificate":
        """Read and verify a certificate; any problem is a :class:`CertificateError` naming the file."""
        path = Path(path)
        try:
            payload = json.loads(path.read_text())
        except FileNotFoundError:
            raise CertificateError(f"no certificate at {path}") from None
        except OSError as exc:  # a directory, no permission, ...
            raise CertificateError(f"cannot read the certificate {path}: {exc}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise CertificateError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise CertificateError(f"{path}: not a {FORMAT} file")
        checksum = payload.pop("checksum", None)
        if checksum != _checksum(payload):
            raise CertificateError(f"{path}: checksum mismatch (corrupt or edited); run `cachecert certify` again")
        try:
            return cls.model_validate(payload)
        except ValidationError as exc:
            raise CertificateError(f"{path}: invalid certificate: {exc}") from None


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def build_certificate(ids: list[str], scores: np.ndarray, unsafe: np.ndarray, *, alpha: float,
                      delta: float | None, sender: str, receiver: str, pair_fingerprints: dict[str, str],
                      mapper_fingerprint: str, workload: str, method: str, split: int, score: str,
                      score_definition: str, screen_method: str | None = None,
                      screen_split: int | None = None, agreement: str | None = None,
                      gain_accepted: np.ndarray | None = None, gain_rejected: np.ndarray | None = None,
                      guard: bool = True) -> Certificate:
    """Fit the threshold on labelled requests (CRC when ``delta`` is None, else LTT) and wrap it. For a two-stage
    certificate, ``scores`` are the screen transfer's and ``unsafe`` the served (``method``) transfer's labels.
    With the requests' gains (prefill fraction saved when served / when refused,
    :meth:`~cachecert_agents.eval.cert_eval.LabelledRequests.gains`) the certificate records its calibration
    saving, and with ``guard`` a rule that does not pay is switched off (threshold ``-inf``, the reason in
    ``guard``; :func:`~cachecert_agents.cert.conformal.guard_threshold`, which keeps the guarantee).
    Raises :class:`~cachecert_agents.cert.conformal.InfeasibleRiskError` when no threshold is certifiable."""
    scores, unsafe = np.asarray(scores, float), np.asarray(unsafe, float)
    fit: dict[str, Any] = fit_threshold(scores, unsafe, alpha, delta)
    lam = fit["lambda"]
    saving, reason = None, None
    if gain_accepted is not None:
        refused = np.zeros_like(scores) if gain_rejected is None else gain_rejected
        saving = calibration_gain(scores, lam, gain_accepted, refused)
        if guard and guard_threshold(scores, lam, gain_accepted, refused) != lam:
            reason = (f"savings guard: the certified rule (lambda={lam:.4g}, accepting {fit['accept_rate']:.0%} of "
                      f"calibration transfers) saves {saving:.3f} of prefill on its calibration requests, not more "
                      f"than 0, so no transfer is served")
            lam = float("-inf")
            fit = dict(fit, accept_rate=0.0, empirical_risk_at_lambda=0.0)
    return Certificate(
        sender=sender, receiver=receiver, pair_fingerprints=pair_fingerprints,
        mapper_fingerprint=mapper_fingerprint, workload=workload, method=method, split=split, score=score,
        score_definition=score_definition, control=fit["method"], alpha=alpha, delta=delta, n=fit["n"],
        threshold=("inf" if lam > 0 else "-inf") if math.isinf(lam) else float(lam),
        accept_rate_calibration=fit["accept_rate"], empirical_risk_calibration=fit["empirical_risk_at_lambda"],
        unsafe_rate_calibration=float(unsafe.mean()),
        calibration_fingerprint=calibration_fingerprint(ids, scores, unsafe),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        library_version=__version__, screen_method=screen_method, screen_split=screen_split, agreement=agreement,
        calibration_saving=saving, guard=reason)
