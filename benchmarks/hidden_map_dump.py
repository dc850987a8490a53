"""Dump sender features and receiver residual streams over a workload's calibration contexts, for offline
comparison of residual-stream map designs (``benchmarks/hidden_map_features.py``).

Writes one safetensors file per context under ``--out`` (default: ``$CACHECERT_HOME/experiments/<pair>``):
``sender`` ``[num_sender_layers + 1, n, hidden_s]`` (float16, RMS-normalised, on the receiver's tokens) and
``hidden:s`` ``[n, hidden_r]`` (float32, raw residual stream entering receiver layer s). Resumable; a rerun with
more ``--splits`` adds the missing ``hidden:s`` to existing dumps (receiver forward only, stopped at the deepest
missing layer; the sender is not loaded when nothing else is missing).

    python benchmarks/hidden_map_dump.py --pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b --workload hotpotqa \
        --contexts 36 --splits 7,10,14,17
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from cachecert_agents.eval.workloads import get_workload
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.paths import cache_home
from cachecert_agents.transfer.features import alignment_for, sender_features


class _StopForward(Exception):
    pass


def _stop_forward(*_: object) -> None:
    raise _StopForward


def _layers(model: ModelHandle) -> torch.nn.ModuleList:
    return getattr(model.model, model.model.base_model_prefix, model.model).layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True)
    ap.add_argument("--workload", default="hotpotqa")
    ap.add_argument("--contexts", type=int, default=36)
    ap.add_argument("--splits", default="7,10,14,17")
    ap.add_argument("--out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    s_name, r_name = args.pair.split(":")
    splits = [int(s) for s in args.splits.split(",")]
    out = Path(args.out) if args.out else cache_home() / "experiments" / f"{s_name}__{r_name}__{args.workload}"
    out.mkdir(parents=True, exist_ok=True)
    cal = get_workload(args.workload).examples("calibration")[:args.contexts]
    paths = [out / f"{i:03d}.safetensors" for i in range(len(cal))]
    missing = {p: (_missing_splits(p, splits) if p.exists() else None) for p in paths}
    if all(m == [] for m in missing.values()):
        return
    receiver = ModelHandle.load(r_name)
    sender = ModelHandle.load(s_name) if any(m is None for m in missing.values()) else None
    for ex, path in tqdm(list(zip(cal, paths)), desc="dump", unit="ctx"):
        todo = missing[path]
        if todo == []:
            continue
        r_prompt = receiver.format_prompt(ex.context, ex.instruction)
        start, end = r_prompt.context_span
        t0 = time.perf_counter()
        hidden = _receiver_stream(receiver, r_prompt.input_ids[:end], start, end, splits if todo is None else todo)
        receiver_s = f"{time.perf_counter() - t0:.2f}"
        if todo is None:
            assert sender is not None
            s_prompt = sender.format_prompt(ex.context, ex.instruction)
            feats = sender_features(sender, s_prompt)
            feats = feats.on_receiver_tokens(alignment_for(r_prompt.context_offsets, s_prompt.context_offsets))
            tensors = {"sender": feats.hidden.half().contiguous()}
            meta = {"id": ex.id, "receiver_s": receiver_s}
        else:  # add layers to an existing dump: same context, same receiver tokens
            tensors = load_file(str(path))
            with safe_open(str(path), "pt") as f:
                meta = dict(f.metadata() or {})
            if meta.get("id") != ex.id:
                raise SystemExit(f"{path} holds context {meta.get('id')}, not {ex.id}: remove the folder and redo")
        tensors.update({f"hidden:{s}": hidden[s].clone() for s in (splits if todo is None else todo)})
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)


def _missing_splits(path: Path, splits: list[int]) -> list[int]:
    with safe_open(str(path), "pt") as f:
        have = set(f.keys())
    return [s for s in splits if f"hidden:{s}" not in have]


def _receiver_stream(receiver: ModelHandle, input_ids: torch.Tensor, start: int, end: int,
                     splits: list[int]) -> dict[int, torch.Tensor]:
    """The receiver's residual stream over tokens ``[start, end)`` entering each layer in ``splits``."""
    with torch.inference_mode(), receiver.capture_residual_stream(start, end) as hidden:
        # the layers above the deepest split are not needed: stop the forward there (hooks run in order)
        stop = _layers(receiver)[max(splits) - 1].register_forward_hook(_stop_forward)
        try:
            receiver.forward(input_ids, logits_to_keep=1)
        except _StopForward:
            pass
        finally:
            stop.remove()
    return hidden


if __name__ == "__main__":
    main()
