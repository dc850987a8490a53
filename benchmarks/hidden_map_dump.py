"""Dump sender features and receiver residual streams over a workload's calibration contexts, for offline
comparison of residual-stream map designs (``benchmarks/hidden_map_features.py``).

Writes one safetensors file per context under ``--out`` (default: ``$CACHECERT_HOME/experiments/<pair>``):
``sender`` ``[num_sender_layers + 1, n, hidden_s]`` (float16, RMS-normalised, on the receiver's tokens) and
``hidden:s`` ``[n, hidden_r]`` (float32, raw residual stream entering receiver layer s). Resumable.

    python benchmarks/hidden_map_dump.py --pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b --workload hotpotqa \
        --contexts 36 --splits 7,10,14,17
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
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
    sender, receiver = ModelHandle.load(s_name), ModelHandle.load(r_name)
    cal = get_workload(args.workload).examples("calibration")[:args.contexts]
    for i, ex in enumerate(tqdm(cal, desc="dump", unit="ctx")):
        path = out / f"{i:03d}.safetensors"
        if path.exists():
            continue
        s_prompt = sender.format_prompt(ex.context, ex.instruction)
        r_prompt = receiver.format_prompt(ex.context, ex.instruction)
        feats = sender_features(sender, s_prompt)
        feats = feats.on_receiver_tokens(alignment_for(r_prompt.context_offsets, s_prompt.context_offsets))
        start, end = r_prompt.context_span
        t0 = time.perf_counter()
        with torch.inference_mode(), receiver.capture_residual_stream(start, end) as hidden:
            # the layers above the deepest split are not needed: stop the forward there (hooks run in order)
            stop = _layers(receiver)[max(splits) - 1].register_forward_hook(_stop_forward)
            try:
                receiver.forward(r_prompt.input_ids[:end], logits_to_keep=1)
            except _StopForward:
                pass
            finally:
                stop.remove()
        tensors = {"sender": feats.hidden.half().contiguous()}
        tensors.update({f"hidden:{s}": hidden[s].clone() for s in splits})
        save_file(tensors, str(path), metadata={"id": ex.id, "receiver_s": f"{time.perf_counter() - t0:.2f}"})


if __name__ == "__main__":
    main()
