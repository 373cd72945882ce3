"""FSDP2 (fully_shard) on CPU over gloo with a patched tiny model; run by test_patching.py.

    python -m tests.emulator.fsdp_worker FAMILY PROFILE OUT.pt [compile]

Spawns 2 processes; each runs forward + backward on the same batch of a patched tiny model that
is sharded with fully_shard (once patched before sharding, once sharded before patching), with
``compile``: through torch.compile of the sharded patched model; rank 0 saves the loss, logits and
full gradients of both to OUT.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def batch(model):
    from engineprofiles.models import tiny_inputs

    return tiny_inputs(model, tokens=24, batch=2, seed=3)


def exit_without_destructors() -> None:
    """End a worker whose work is done and saved. torch 2.13 sometimes aborts a gloo worker in a C++
    destructor at interpreter exit, after the process group is destroyed and the Python code has
    returned ("terminate called without an active exception", no Python frame on the stack; about
    one run in thirty here): leave without running the destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(rank: int, family: str, profile: str, out: str, port: int, compiled: bool = False) -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)  # a crash in a worker says where
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from emulator import apply_profile
        from engineprofiles.models import tiny_model

        mesh = init_device_mesh("cpu", (WORLD,))
        results = {}
        for order in ("patch-then-shard", "shard-then-patch"):
            model = tiny_model(family, seed=1)
            model.train()
            handle = apply_profile(model, profile) if order == "patch-then-shard" else None
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            if handle is None:
                handle = apply_profile(model, profile)
            ids = batch(model)
            run = torch.compile(model) if compiled else model
            o = run(ids, labels=ids)
            o.loss.backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            results[order] = dict(loss=o.loss.detach().clone(), logits=o.logits.detach().clone(), grads=grads,
                                  emulated=handle.emulated)
            handle.remove()
            torch._dynamo.reset()
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
    exit_without_destructors()


def main() -> None:
    family, profile, out = sys.argv[1:4]
    compiled = sys.argv[4:5] == ["compile"]
    port = 29500 + os.getpid() % 1000
    mp.spawn(_run, args=(family, profile, out, port, compiled), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
