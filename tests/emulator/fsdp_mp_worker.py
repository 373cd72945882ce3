"""FSDP2 mixed precision on CPU over gloo with a patched tiny model; run by test_mixed_precision.py.

    python -m tests.emulator.fsdp_mp_worker FAMILY PROFILE OUT.pt WORLD

FP32 master weights (the model built in float32), sharded with ``fully_shard`` and
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` as verl does, with
``cast_forward_inputs`` True (FSDP2's default: each layer's floating inputs, the FP32 residual
stream and the rotary embedding's FP32 cos/sin among them, are cast to bfloat16) and False, the
profile applied before and after sharding. WORLD processes (1 or 2) run forward + backward on the
same batch; rank 0 saves the loss, logits, hidden states and full FP32 gradients of each setup to
OUT.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.emulator.fsdp_worker import exit_without_destructors

SETUPS = [(cast, order) for cast in (True, False) for order in ("shard-then-patch", "patch-then-shard")]


def batch(model):
    from engineprofiles.models import tiny_inputs

    return tiny_inputs(model, tokens=20, batch=2, seed=3)


def _run(rank: int, world: int, family: str, profile: str, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from emulator import apply_profile
        from engineprofiles.models import tiny_model

        mesh = init_device_mesh("cpu", (world,))
        results = {}
        for cast, order in SETUPS:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                          cast_forward_inputs=cast)
            model = tiny_model(family, seed=1, dtype="float32")
            model.train()
            handle = apply_profile(model, profile) if order == "patch-then-shard" else None
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            if handle is None:
                handle = apply_profile(model, profile)
            ids = batch(model)
            o = model(ids, labels=ids, output_hidden_states=True)
            o.loss.backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            results[(cast, order)] = dict(
                loss=o.loss.detach().clone(), logits=o.logits.detach().clone(),
                hidden=[h.detach().clone() for h in o.hidden_states[1:]], grads=grads, emulated=handle.emulated,
                param_dtypes={str(p.dtype) for p in model.parameters()})
            handle.remove()
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
    exit_without_destructors()


def main() -> None:
    family, profile, out, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    port = 29500 + os.getpid() % 1000
    mp.spawn(_run, args=(world, family, profile, out, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
