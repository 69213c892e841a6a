"""torch FSDP2 (`fully_shard`) on patched models, two CPU processes over gloo: every kind of patch shards, a training
step gives the loss one process gives on the whole batch (and the same weights after it), and the sharded model
saves through hfpatch.save_pretrained and reloads with its patches.

accelerate sends a CPU run to DDP whatever its FSDP plugin says, so this calls torch's FSDP2 directly, as
accelerate's FSDP2 path does (fully_shard on each block, then on the root).
"""

import copy
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_model, tokens

import hfpatch
from hfpatch.adapters import adapter_for, get_path
from hfpatch.train import memory
from hfpatch.train.loop import CausalLMLoss
from hfpatch.train.pose import batch_position_ids

# (family, patch, memory options, PoSE target): each kind of edit hfpatch makes to a model. The first case also
# runs the fused loss and fused AdamW on the sharded side.
CASES = [
    ("llama", dict(position="yarn", factor=4.0), dict(gradient_checkpointing=True, mlp_tile=16), 256),  # rotary rebuilt
    ("llama", dict(position="dynamic-yarn"), {}, None),  # rotary class swapped
    ("llama", dict(position="alibi"), dict(mlp_tile=16), None),  # attention function, position signal removed
    ("llama", dict(position="sinusoidal"), {}, None),  # first block's class swapped
    ("llama", dict(norm="layernorm", placement="post"), dict(gradient_checkpointing=True), None),  # modules, blocks
    ("gpt2", dict(norm="rmsnorm", position="interpolate", factor=2.0), {}, None),  # folded weights, bigger table
]
SEQ = 48


def _losses(loss_module, ids, positions):
    return loss_module(ids, positions)[0]


def _case(rank, world, index, out_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    family, request, options, target = CASES[index]
    reference = tiny_model(family, vocab_size=101).train()
    for m in reference.modules():  # equal steps need the same dropout masks: none
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    hfpatch.patch(reference, **request)
    sharded = copy.deepcopy(reference)
    ids = tokens(SEQ, batch=world, seed=index)
    positions = None if target is None else batch_position_ids(SEQ, target, 2, seed=index, first_sample=0,
                                                                batch=world)

    # one process, the whole batch: loss, AdamW step, loss after
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    loss = _losses(CausalLMLoss(reference), ids, positions)
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = _losses(CausalLMLoss(reference), ids, positions)

    # FSDP2 as accelerate applies it to the recipes' loss module: each block, then the root (the loss module); each
    # rank its own rows of the batch
    memory.apply(sharded, **options)
    root = CausalLMLoss(sharded, chunk=20, fused=index == 0)
    mesh = init_device_mesh("cpu", (world,))
    for block in get_path(sharded.base_model, adapter_for(sharded).layers):
        fully_shard(block, mesh=mesh)
    fully_shard(root, mesh=mesh)
    assert all(type(p).__name__ == "DTensor" for p in root.parameters())
    mine = slice(rank, rank + 1)
    pos_mine = None if positions is None else positions[mine]
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2, fused=index == 0)
    local = _losses(root, ids[mine], pos_mine)
    local.backward()  # FSDP2 averages the gradients over the ranks: the whole batch's mean gradient
    opt.step()
    with torch.no_grad():
        local_after = _losses(root, ids[mine], pos_mine)
    both = torch.stack([local.detach(), local_after])
    dist.all_reduce(both)
    both /= world

    full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}  # as loop.save_final does
    result = {"loss": loss.item(), "after": after.item(), "sharded_loss": both[0].item(),
              "sharded_after": both[1].item()}
    if rank == 0:
        path = os.path.join(out_dir, f"case{index}")
        hfpatch.save_pretrained(sharded, path, state_dict=state)
        reloaded = hfpatch.from_pretrained(path).eval()
        reference.eval()
        with torch.no_grad():
            kw = {} if positions is None else {"position_ids": positions, "attention_mask": torch.ones_like(ids)}
            result["reload_max_diff"] = (reloaded(ids, **kw).logits - reference(ids, **kw).logits).abs().max().item()
        result["applied"] = [hfpatch.describe(m)["applied"] for m in (reloaded, reference)]
    dist.barrier()
    return result


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = [_case(rank, world, i, out_dir) for i in range(len(CASES))]
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def test_patched_models_shard_train_and_reload_under_fsdp2(tmp_path):
    ctx = mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two FSDP2 processes did not finish in 240 s")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for case, r0, r1 in zip(CASES, *ranks):
        family, request = case[0], case[1]
        for r in (r0, r1):
            assert abs(r["sharded_loss"] - r["loss"]) <= 1e-5 * abs(r["loss"]), (family, request, r)
            assert abs(r["sharded_after"] - r["after"]) <= 1e-5 * abs(r["after"]), (family, request, r)
        assert r["after"] < r["loss"]  # the step trained
        assert r0["reload_max_diff"] <= 1e-5, (family, request, r0)
        reloaded, wanted = r0["applied"]
        assert reloaded == wanted and wanted, (family, request, reloaded)
