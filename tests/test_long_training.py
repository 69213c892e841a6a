"""Long-sequence training: PoSE position ids, PoSE through the model and the recipe (exact resume), the memory
options (tiled MLP) against the plain step, and their config errors."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, WINDOW, override_cases, stdlib_text, tiny_model, tokens

import hfpatch
from hfpatch.position.registry import SCHEMES
from hfpatch.train import memory
from hfpatch.train.cli import run
from hfpatch.train.loop import CausalLMLoss
from hfpatch.train.pose import batch_position_ids, position_ids

# ------------------------------------------------------------------------------------------------ PoSE position ids

@pytest.mark.parametrize("seq_len,target,chunks", [(64, 256, 2), (100, 1000, 3), (16, 17, 2), (50, 4096, 5)])
def test_pose_position_ids_are_increasing_chunks_within_the_target(seq_len, target, chunks):
    for sample in range(300):
        pos = position_ids(seq_len, target, chunks, seed=3, sample=sample)
        assert pos.shape == (seq_len,) and pos.dtype == torch.int64
        steps = pos.diff()
        assert pos[0] == 0 and (steps >= 1).all() and pos[-1] <= target - 1
        assert (steps > 1).sum() <= chunks - 1  # consecutive inside each chunk, a skip only between chunks


def test_pose_position_ids_are_a_pure_function_of_seed_and_sample():
    a = batch_position_ids(128, 1024, 2, seed=7, first_sample=40, batch=4)
    assert torch.equal(a, batch_position_ids(128, 1024, 2, seed=7, first_sample=40, batch=4))
    assert torch.equal(a[2], position_ids(128, 1024, 2, seed=7, sample=42))  # row b is sample first + b
    assert not torch.equal(a, batch_position_ids(128, 1024, 2, seed=8, first_sample=40, batch=4))
    assert len({tuple(position_ids(128, 1024, 2, seed=7, sample=s).tolist()) for s in range(50)}) == 50


def test_pose_skips_follow_the_paper_and_cover_the_target_distances():
    """Two chunks: u_0 = 0, u_1 uniform on {0, ..., target - seq_len}; the cut uniform on 1..seq_len-1. Over many
    sequences the largest relative distance reaches the target window's."""
    seq_len, target = 64, 1024
    skips, cuts, longest = [], [], []
    for s in range(4000):
        pos = position_ids(seq_len, target, 2, seed=0, sample=s)
        jump = (pos.diff() > 1).nonzero()
        cut = int(jump[0]) + 1 if len(jump) else None
        skips.append(int(pos[-1]) - (seq_len - 1))
        cuts.append(cut)
        longest.append(int(pos[-1] - pos[0]))
    room = target - seq_len
    mean = sum(skips) / len(skips)
    assert abs(mean - room / 2) < 0.03 * room  # uniform on 0..room: mean room/2 (std of the mean ~ 0.005 room)
    assert min(skips) >= 0 and max(skips) <= room and max(skips) > 0.99 * room
    assert max(longest) == target - 1 or max(longest) > 0.99 * (target - 1)
    seen = [c for c in cuts if c is not None]
    assert min(seen) >= 1 and max(seen) <= seq_len - 1


# --------------------------------------------------------------------------------------- PoSE through the model

def _reference_loss(model, ids, positions, mask):
    """CE of the plain transformers forward with explicit position ids and an explicit 4D float mask."""
    logits = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _causal(n):
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def test_pose_chunks_attend_to_each_other():
    """transformers reads position ids that jump as packed documents and masks attention between them unless a
    mask is given; PoSE's chunks are one document: the recipe's loss equals the full causal computation."""
    model = tiny_model("llama").train()
    ids = tokens(48, batch=2)
    pos = batch_position_ids(48, 4 * WINDOW, 3, seed=1, first_sample=0, batch=2)
    ours = CausalLMLoss(model)(ids, pos)[0]
    full = _reference_loss(model, ids, pos, _causal(48))
    assert abs(ours.item() - full.item()) <= 1e-6 * abs(full.item())
    # what transformers does with the positions alone: block-diagonal attention, another loss
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    blocks = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert abs(blocks.item() - full.item()) > 1e-4


def _rope_request(scheme):
    if scheme == "longrope":
        return dict(position=scheme, factor=4.0, short_factor=[1.0] * 8, long_factor=[4.0] * 8)
    if SCHEMES[scheme].factor == "none":  # rope, p-rope
        return dict(position=scheme)
    return dict(position=scheme, factor=4.0)


@pytest.mark.parametrize("scheme", sorted(s for s, record in SCHEMES.items() if record.rope))
def test_pose_reaches_every_rope_scheme(scheme):
    """The PoSE positions reach the (patched) rotary module, and the loss is the full causal computation at them."""
    model = tiny_model("llama").train()
    hfpatch.patch(model, **_rope_request(scheme))
    seen = []
    rotary = model.model.rotary_emb
    handle = rotary.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append((args[1:] or [kwargs["position_ids"]])[0].clone()), with_kwargs=True)
    ids = tokens(32, batch=2)
    pos = batch_position_ids(32, 4 * WINDOW, 2, seed=5, first_sample=3, batch=2)
    ours = CausalLMLoss(model)(ids, pos)[0]
    plain = CausalLMLoss(model)(ids)[0]
    handle.remove()
    assert torch.equal(seen[0], pos) and pos.max() >= 32
    ref = _reference_loss(model, ids, pos, _causal(32))
    assert abs(ours.item() - ref.item()) <= 1e-6 * abs(ref.item())
    assert abs(ours.item() - plain.item()) > 1e-6  # the positions changed the computation


# ----------------------------------------------------------------------------------------------- memory options

def _step(model, ids, chunk=None, positions=None):
    model.zero_grad(set_to_none=True)
    loss = CausalLMLoss(model, chunk=chunk)(ids, positions)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(a, b, tol=1e-5):
    (la, ga), (lb, gb) = a, b
    assert abs(la.item() - lb.item()) <= tol * abs(lb.item())
    assert ga.keys() == gb.keys()
    for name in gb:
        scale = gb[name].abs().max().item()
        assert (ga[name] - gb[name]).abs().max().item() <= tol * max(scale, 1e-12), name


def _training_model(family):
    """model.train() with dropout off: a tile draws its own dropout mask, so only dropout-free steps can be equal."""
    model = tiny_model(family).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "phi3", "gemma2", "olmo2"])
def test_tiled_mlp_equals_the_plain_step(family):
    """Loss and every gradient with the MLP run in tiles (tile not dividing the length, with and without block
    checkpointing, with a chunked loss) equal the plain step's to 1e-5 relative (fp32)."""
    ids = tokens(50, batch=2)
    plain = _step(_training_model(family), ids)
    for checkpointing in (False, True):
        model = _training_model(family)
        calls = []
        mlp = memory.feed_forward_modules(model)[0]
        inner = next(iter(mlp.children()))  # its first linear (gate_proj, c_fc, dense_h_to_4h, gate_up_proj)
        inner.register_forward_hook(lambda m, a, o, calls=calls: calls.append(a[0].shape[1]))
        edits = memory.apply(model, gradient_checkpointing=checkpointing, mlp_tile=16)
        _assert_same_step(_step(model, ids, chunk=20), plain)
        assert sorted(set(calls)) == [2, 16]  # forward and recomputation saw tiles only (50 = 3 x 16 + 2)
        edits.undo()
        assert type(mlp).__name__ != "TiledMLP" and "TiledMLP" not in type(mlp).__name__


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_fused_loss_equals_cross_entropy_with_its_gradients(softcap):
    """The fused loss (gradients made in the forward pass, chunk not dividing the rows, ignored labels, a bias,
    soft-capped logits) against the formula: F.cross_entropy of the (capped) logits, autograd's gradients."""
    from hfpatch.train.losses import fused_lm_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    h = torch.randn(2, 30, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 30))
    labels[0, 5:9] = -100
    loss = fused_lm_loss(h, labels, head, chunk=7, softcap=softcap)[0]
    (3.0 * loss).backward()  # an upstream gradient other than 1 reaches every gradient
    got = [h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    h.grad = head.weight.grad = head.bias.grad = None
    logits = head(h)
    logits = torch.tanh(logits / softcap) * softcap if softcap else logits
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    (3.0 * ref).backward()
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    for a, b in zip(got, [h.grad, head.weight.grad, head.bias.grad]):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_all_memory_options_together_equal_the_plain_step(family):
    """Checkpointed blocks, tiled MLP and the fused loss in small chunks: loss and gradients of the plain step
    (gemma2: soft-capped logits; llama and gpt2: the head tied to the embedding)."""
    ids = tokens(50, batch=2)
    plain = _step(_training_model(family), ids)
    model = _training_model(family)
    edits = memory.apply(model, gradient_checkpointing=True, mlp_tile=16)
    model.zero_grad(set_to_none=True)
    loss = CausalLMLoss(model, chunk=12, fused=True)(ids)[0]
    loss.backward()
    _assert_same_step((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}),
                      plain)
    edits.undo()


def test_tiled_mlp_with_pose_positions_equals_the_plain_step():
    ids = tokens(64, batch=1)
    pos = batch_position_ids(64, 4 * WINDOW, 2, seed=0, first_sample=0, batch=1)
    model = tiny_model("llama").train()
    hfpatch.patch(model, position="yarn", factor=4.0)
    plain = _step(model, ids, positions=pos)
    edits = memory.apply(model, gradient_checkpointing=True, mlp_tile=24)
    _assert_same_step(_step(model, ids, chunk=16, positions=pos), plain)
    edits.undo()


def test_tiled_mlp_is_refused_where_the_block_has_no_mlp_module():
    with pytest.raises(ValueError, match="opt blocks hold their feed-forward linears directly"):
        memory.apply(tiny_model("opt"), mlp_tile=8)
    with pytest.raises(ValueError, match="mlp_tile must be a number of positions > 0"):
        memory.apply(tiny_model("llama"), mlp_tile=0)


# ---------------------------------------------------------------------------------------------- the recipe, PoSE

@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "stdlib.txt"
    path.write_text(stdlib_text(120_000))
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny") / "model"
    model = tiny_model("llama", vocab_size=384)
    hfpatch.save_pretrained(model, path, tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    return path


def _context_extension():
    import importlib.util

    spec = importlib.util.spec_from_file_location("context_extension", REPO / "recipes" / "context_extension.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def test_pose_run_resumes_exactly(tiny_folder, text, tmp_path):
    """PoSE + YaRN x4 + tiled MLP + checkpointing: an interrupted and resumed run equals the uninterrupted one, and
    PoSE changed the training (another loss curve than the same run without it)."""
    main = _context_extension().main
    base = [f"model={tiny_folder}", f"data.text_files=[{text}]", "patch={position: yarn, factor: 4}", "seq_len=64",
            "batch_size=2", "max_steps=4", "eval_every=2", "save_every=2", "lr=3e-3", "warmup_steps=1",
            "pose.target_len=256", "mlp_tile=24", "gradient_checkpointing=true", "loss_chunk=32"]
    assert run("context_extension", main, [*base, f"output_dir={tmp_path / 'whole'}"]) == 0
    assert run("context_extension", main, [*base, f"output_dir={tmp_path / 'parts'}", "stop_after=2"]) == 0
    assert run("context_extension", main, [*base, f"output_dir={tmp_path / 'parts'}", "resume=true"]) == 0
    whole, parts = _log(tmp_path / "whole"), _log(tmp_path / "parts")
    assert [r["step"] for r in parts] == [1, 2, 3, 4]
    for a, b in zip(whole, parts):
        assert a["loss"] == b["loss"] and a.get("eval_loss") == b.get("eval_loss"), (a, b)
    assert run("context_extension", main, [*base, f"output_dir={tmp_path / 'plain'}", "pose.target_len=null"]) == 0
    assert _log(tmp_path / "plain")[-1]["loss"] != whole[-1]["loss"]
    model = hfpatch.from_pretrained(tmp_path / "whole" / "final")
    assert "TiledMLP" not in type(model.model.layers[0].mlp).__name__


@pytest.mark.parametrize("args,message", [
    (["pose.target_len=32"], "pose.target_len=32 must be an integer greater than seq_len=64"),
    (["pose.target_len=64"], "pose.target_len=64 must be an integer greater than seq_len=64"),
    (["pose.target_len=256", "pose.chunks=1"], "pose.chunks must be between 2 and seq_len=64, got 1"),
    (["pose.target_len=1024", "patch={position: yarn, factor: 4}"], "pose.target_len=1024 is above the 256 positions"),
    (["pose.target_len=256", "patch={position: alibi}"], "pose needs a RoPE model"),
    (["pose.target_len=256", "patch={position: nope}"], "pose needs a RoPE model"),
    (["mlp_tile=0"], "mlp_tile must be > 0, got 0"),
    (["mlp_tile=-4"], "mlp_tile must be > 0, got -4"),
    (["fused_loss=maybe"], "fused_loss must be bool"),
    (["pose.target=256"], "unknown config key 'pose.target'"),
])
def test_bad_long_training_configs_fail_before_training(tiny_folder, text, tmp_path, capsys, args, message):
    argv = [f"model={tiny_folder}", f"data.text_files=[{text}]", "seq_len=64", f"output_dir={tmp_path / 'o'}", *args]
    assert run("context_extension", _context_extension().main, argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "o").exists()


def test_fused_loss_with_distillation_is_refused():
    from hfpatch.train.config import ConfigError, load

    with pytest.raises(ConfigError, match="fused_loss computes the plain cross-entropy only"):
        load("heal", None, ["model=x", "distill.enabled=true", "fused_loss=true"])


def test_mlp_tile_on_a_model_without_an_mlp_module_fails_before_training(tmp_path, text, tiny_tokenizer_dir, capsys):
    from transformers import AutoTokenizer

    path = tmp_path / "opt"
    hfpatch.save_pretrained(tiny_model("opt", vocab_size=384), path,
                            tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    argv = [f"model={path}", f"data.text_files=[{text}]", "seq_len=32", "mlp_tile=8", f"output_dir={tmp_path / 'o'}"]
    assert run("context_extension", _context_extension().main, argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "opt blocks hold their feed-forward linears directly" in errors[0]
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------ sequences split over processes (CP / SP)

def _launch_env(name):
    """The environment `accelerate launch --config_file recipes/accelerate/<name>.yaml` gives the recipe, computed by
    accelerate's own launcher code (nothing is started: no GPU here)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(REPO / "recipes" / "accelerate" / f"{name}.yaml"),
                                               "recipes/context_extension.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join([*defaults.deepspeed_config, "mixed_precision"])
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name,sizes", [("fsdp2_cp", (4, 1)), ("deepspeed_sp", (1, 4))])
def test_sequence_parallel_configs_reach_the_recipe(name, sizes, monkeypatch):
    from accelerate.utils import ParallelismConfig

    from hfpatch.train import parallel

    env = _launch_env(name)
    for key in [k for k in os.environ if k.startswith("PARALLELISM_CONFIG_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if "PARALLELISM" in key:
            monkeypatch.setenv(key, value)
    pc = ParallelismConfig()  # accelerate's own validation of what the processes will read
    assert (pc.cp_size, pc.sp_size) == sizes and parallel.requested() == sizes
    if name == "fsdp2_cp":
        assert env["FSDP_VERSION"] == "2" and pc.dp_shard_size == 2 and pc.cp_handler.cp_comm_strategy == "alltoall"
    else:
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and pc.sp_backend == "deepspeed"
        assert pc.sp_handler.sp_attn_implementation == "sdpa"


# what each way of splitting sequences over processes refuses: an override (or a tuple of them), and the error
SPLIT_REFUSALS = {
    "cp": {
        "patch={position: alibi}": "position='alibi' cannot train under context parallelism (cp_size=2)",
        "patch={position: dynamic}": "position='dynamic' cannot train under context parallelism",
        "seq_len=62": "seq_len=62 must be a multiple of 4 under context parallelism",
    },
    "sp": {
        "patch={position: alibi}": "position='alibi' cannot train under Ulysses sequence parallelism (sp_",
        "patch={position: dynamic-yarn}": "position='dynamic-yarn' cannot train under Ulysses",
        ("patch={position: yarn, factor: 4}", "pose.target_len=256"): "pose cannot train under Ulysses",
        "seq_len=63": "seq_len=63 must be a multiple of 2 under Ulysses",
    },
}


@pytest.mark.parametrize("split,args,message", override_cases(SPLIT_REFUSALS))
def test_what_cannot_train_with_split_sequences_is_refused(split, args, message, tiny_folder, text, tmp_path, capsys,
                                                           monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2" if split == "cp" else "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2" if split == "sp" else "1")
    argv = [f"model={tiny_folder}", f"data.text_files=[{text}]", "seq_len=64", f"output_dir={tmp_path / 'o'}", *args]
    assert run("context_extension", _context_extension().main, argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("split,request_", [("cp", dict(position="yarn", factor=4.0)), ("cp", dict(position="nope")),
                                             ("sp", dict(position="linear", factor=2.0)),
                                             ("sp", dict(placement="post"))])
def test_static_schemes_pass_the_split_sequence_checks(split, request_, monkeypatch):
    from hfpatch.train import setup
    from hfpatch.train.config import load

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2" if split == "cp" else "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2" if split == "sp" else "1")
    extra = ["pose.target_len=256"] if split == "cp" and request_.get("position") == "yarn" else []
    cfg = dataclasses.replace(load("context_extension", None, ["model=x", "seq_len=64", *extra]), patch=request_)
    setup.apply_patch(tiny_model("llama"), cfg)  # no ConfigError


def test_ulysses_pieces_add_up_to_the_whole_batch():
    """A sequence split in contiguous shards (labels shifted before the split, positions passed, each shard's loss
    scaled): averaged over the shards, as the gradient reduction averages, loss and gradients are the whole batch's.
    A model without blocks, so that a shard needs nothing from the others and one process can check it."""
    import types

    from hfpatch.train import parallel
    from hfpatch.train.loop import Run

    model = tiny_model("llama", num_hidden_layers=0).train()
    ids = tokens(48, batch=2)
    whole = _step(model, ids)
    size = 3
    loss_sum, grads = 0.0, None
    for rank in range(size):
        run = types.SimpleNamespace(layout=parallel.Layout(0, 1, "sp", size, rank))
        model.zero_grad(set_to_none=True)
        with Run.pieces(run, ids, None) as pieces:
            shard_ids, positions, labels, _ = pieces
            assert shard_ids.shape == (2, 16) and torch.equal(positions[0], torch.arange(16 * rank, 16 * rank + 16))
            assert torch.equal(labels[:, :-1], shard_ids[:, 1:]) and (rank == size - 1) == bool((labels == -100).any())
            loss = CausalLMLoss(model)(*pieces)[0] / size
        loss.backward()
        loss_sum += loss.item()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        grads = g if grads is None else {n: grads[n] + g[n] for n in g}
    _assert_same_step((torch.tensor(loss_sum), grads), whole)


def test_fsdp_wraps_every_block_of_the_loss_module_patched_or_not():
    """accelerate's FSDP2 wraps the blocks named by the trained module's _no_split_modules: the loss module names
    its model's block classes, patched subclasses included."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    model = tiny_model("llama")
    hfpatch.patch(model, placement="post")
    loss_module = CausalLMLoss(model)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    policy = fsdp2_prepare_auto_wrap_policy(plugin, loss_module)
    wrapped = [name for name, m in loss_module.named_modules() if policy(m)]
    assert wrapped == [f"model.model.layers.{i}" for i in range(len(model.model.layers))]
    assert loss_module.config is model.config
