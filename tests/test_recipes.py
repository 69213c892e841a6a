"""The recipes under accelerate: two CPU processes (gloo) per recipe on a tiny model, exact resume, gradient
checkpointing through patched blocks, LoRA, config errors before training, the accelerate configs we ship."""

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from conftest import REPO, override_cases, stdlib_text, tiny_model
from torch.nn.parallel import DistributedDataParallel

import hfpatch
from hfpatch.train import loop
from hfpatch.train.cli import run

TINY = ("model_config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "stdlib.txt"
    path.write_text(stdlib_text(300_000))
    return path


def common(text, out, steps=8):
    return [f"data.text_files=[{text}]", "seq_len=128", "batch_size=2", f"max_steps={steps}", "eval_every=4",
            "save_every=4", "lr=3e-3", "warmup_steps=2", f"output_dir={out}"]


def launch(recipe, args, processes=2):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "recipes" / "accelerate" / "multi_cpu.yaml"), "--num_processes", str(processes),
           "--main_process_port", str(29500 + os.getpid() % 1000), str(REPO / "recipes" / f"{recipe}.py"), *args]
    if processes == 1:
        cmd = [sys.executable, str(REPO / "recipes" / f"{recipe}.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def decreased(rows):
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    return last < first


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tiny_tokenizer_dir, text):
    """pretrain on 2 processes; its final model is the starting point of the other recipes."""
    out = tmp_path_factory.mktemp("pretrain")
    launch("pretrain",
           [TINY, f"tokenizer={tiny_tokenizer_dir}", *common(text, out), "patch={position: ntk, factor: 2}"])
    return out


def test_pretrain_two_processes(pretrained):
    rows = log(pretrained)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert decreased(rows) and rows[-1]["eval_loss"] is not None
    assert sorted(p.name for p in (pretrained / "checkpoints").iterdir()) == ["step_4", "step_8"]
    model = hfpatch.from_pretrained(pretrained / "final")
    assert hfpatch.describe(model)["applied"] == {"position": {"scheme": "ntk", "factor": 2.0}}
    assert rows[-1]["tokens"] == 8 * 2 * 2 * 128  # steps x processes x batch x seq_len


def test_context_extension_two_processes(pretrained, text, tmp_path):
    # the pretrained model has ntk x2 (window 256): yarn x4 on it replaces that (from its original 128) -> 512
    launch("context_extension", [f"model={pretrained / 'final'}", "patch={position: yarn, factor: 4}",
                                 *common(text, tmp_path), "seq_len=512", "batch_size=1"])
    rows = log(tmp_path)
    assert decreased(rows)
    model = hfpatch.from_pretrained(tmp_path / "final")
    assert hfpatch.describe(model)["applied"] == {"position": {"scheme": "yarn", "factor": 4.0}}
    assert model.config.max_position_embeddings == 512


def test_heal_with_distillation_two_processes(pretrained, text, tmp_path):
    # post-norm + LayerNorm changes the function a lot; pure distillation (alpha=1) pulls it back to the original
    launch("heal", [f"model={pretrained / 'final'}", "patch={norm: layernorm, placement: post}",
                    "distill.enabled=true", "distill.alpha=1.0", "loss_chunk=32", *common(text, tmp_path)])
    rows = log(tmp_path)
    assert all(r["kl"] > 0 for r in rows) and all(r["loss"] == r["kl"] for r in rows)
    assert decreased(rows)  # the KL to the unswapped model goes down
    model = hfpatch.from_pretrained(tmp_path / "final")
    info = hfpatch.describe(model)
    assert info["norm"]["kind"] == "layernorm" and info["norm"]["exact"] is False


def test_heal_with_lora(pretrained, text, tmp_path):
    launch("heal", [f"model={pretrained / 'final'}", "patch={placement: post}", "lora.enabled=true", "lora.r=4",
                    "lora.target_modules=[q_proj, v_proj]", *common(text, tmp_path, steps=4)], processes=1)
    model = hfpatch.from_pretrained(tmp_path / "final")  # adapters merged into the weights
    assert hfpatch.describe(model)["placement"] == "post"
    assert not any("lora" in n for n, _ in model.named_parameters())


def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(tiny_tokenizer_dir, text, tmp_path):
    base = [TINY, f"tokenizer={tiny_tokenizer_dir}", "patch={position: alibi}", "model_config.attention_dropout=0.1",
            *common(text, tmp_path / "x", steps=8)[:-1]]
    launch("pretrain", [*base, f"output_dir={tmp_path / 'whole'}"], processes=1)
    launch("pretrain", [*base, f"output_dir={tmp_path / 'parts'}", "stop_after=4"], processes=1)
    assert len(log(tmp_path / "parts")) == 4 and not (tmp_path / "parts" / "final").exists()
    launch("pretrain", [*base, f"output_dir={tmp_path / 'parts'}", "resume=true"], processes=1)
    whole, parts = log(tmp_path / "whole"), log(tmp_path / "parts")
    assert [r["step"] for r in parts] == list(range(1, 9))
    for a, b in zip(whole, parts):
        assert a["loss"] == b["loss"] and a.get("eval_loss") == b.get("eval_loss"), (a, b)
    x = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(hfpatch.from_pretrained(tmp_path / "whole" / "final")(x).logits,
                           hfpatch.from_pretrained(tmp_path / "parts" / "final")(x).logits)


def test_gradient_checkpointing_gives_the_same_training(tiny_tokenizer_dir, text, tmp_path):
    """Patched blocks (post-norm class swap, ALiBi attention) under activation checkpointing train identically."""
    base = [TINY, f"tokenizer={tiny_tokenizer_dir}", "patch={position: alibi, placement: post}",
            *common(text, tmp_path / "x", steps=3)[:-1]]
    launch("pretrain", [*base, f"output_dir={tmp_path / 'plain'}"], processes=1)
    launch("pretrain", [*base, f"output_dir={tmp_path / 'ckpt'}", "gradient_checkpointing=true"], processes=1)
    for a, b in zip(log(tmp_path / "plain"), log(tmp_path / "ckpt")):
        assert abs(a["loss"] - b["loss"]) <= 1e-5


# ------------------------------------------------------------------------------------------------- config errors

@pytest.fixture
def tiny_folder(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    path = tmp_path / "tiny"
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    hfpatch.save_pretrained(tiny_model("llama", vocab_size=len(tok)), path, tokenizer=tok)
    return path


# what each recipe refuses before training: an override (or a tuple of them), and what the one error line says
BAD_CONFIGS = {
    "heal": {
        "bogus=1": "unknown config key 'bogus'",
        "distill.temp=2": "unknown config key 'distill.temp'",
        "lr=fast": "lr must be float, got 'fast'",
        "max_steps=1.5": "max_steps must be int",
        "data.text_files=[/no/such/file.txt]": "data path not found: /no/such/file.txt",
        "precision=fp8": "precision must be no, bf16 or fp16",
        "seq_len=[1": "override 'seq_len=[1': not valid YAML: expected ',' or ']'",
        "lr=!!python/object/apply:os.system [exit 3]": "!!python/ tags are not accepted",
        "data.text_files=[1, 2]": "data.text_files must be a list of strings, got [1, 2]",
        ("lora.enabled=true", "lora.target_modules=[nope]"): "lora: Target modules {'nope'} not found",
        "log_with=[nonsense]": "log_with: unknown tracker 'nonsense'",
        "data.max_tokens=40": "the data holds 40 tokens: fewer than two sequences of seq_len=32",
        "tokenizer=smollm2": "the tokenizer has 49152 tokens, the model's embedding 384 rows",
        "calibrate=-1": "calibrate must be >= 0",
        ("patch={norm: dyt}", "calibrate=100000"): "calibrate=100000 is more than the",
        "calibrate=1": "nothing to calibrate (patch it with norm='batchnorm'",
    },
    "context_extension": {
        "seq_len=128": "seq_len=128 is above the 64 positions the model supports",
        "patch={position: yarn, factor: 0.5}": "patch: factor must be > 1",
        "patch={position: interpolate, factor: 2}": "stretches a learned absolute position",
    },
    "pretrain": {
        "tokenizer=x": "pretrain builds its model from model_config",
    },
}


@pytest.mark.parametrize("recipe,args,message", override_cases(BAD_CONFIGS))
def test_bad_configs_fail_before_training(tiny_folder, text, tmp_path, capsys, recipe, args, message):
    import importlib.util

    spec = importlib.util.spec_from_file_location(recipe, REPO / "recipes" / f"{recipe}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = [f"model={tiny_folder}", f"data.text_files=[{text}]", "seq_len=32", f"output_dir={tmp_path / 'o'}", *args]
    if recipe == "pretrain":
        argv = [TINY, *argv]
    assert run(recipe, mod.main, argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # (besides progress bars)
    assert len(errors) == 1 and message in errors[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text, message", [
    ("seq_len: [1\n", "not valid YAML: expected ',' or ']', but got '<stream end>' (line 2, column 1)"),
    ("lr: !!python/object/apply:os.system ['touch {ran}']\n", "!!python/ tags are not accepted (line 1, column 5)"),
    ("seq_len: 10\n\tlr: 1\n", "not valid YAML"),
])
def test_a_config_file_that_is_not_yaml_is_one_error(tmp_path, capsys, text, message):
    ran = tmp_path / "ran"
    path = tmp_path / "bad.yaml"
    path.write_text(text.format(ran=ran))
    assert run("heal", lambda cfg: pytest.fail("trained"), ["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"heal: error: {path}: ") and message in err
    assert not ran.exists()


def test_a_model_config_whose_sizes_do_not_fit_is_one_error(tiny_tokenizer_dir, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain", REPO / "recipes" / "pretrain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = [TINY, "model_config.hidden_size=65", f"tokenizer={tiny_tokenizer_dir}", f"output_dir={tmp_path / 'o'}"]
    assert run("pretrain", mod.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain: error: model_config: ") and "hidden size (65) is not a multiple" in err


def test_a_tracker_that_is_not_installed_is_an_error(capsys):
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    missing = [t for t in LoggerType.list() if t != "all" and LoggerType(t) not in get_available_trackers()]
    if not missing:
        pytest.skip("every tracker accelerate knows is installed")
    assert run("heal", lambda cfg: pytest.fail("trained"), ["model=smollm2", f"log_with={missing[0]}"]) == 2
    assert f"log_with: {missing[0]} is not installed" in capsys.readouterr().err


def test_a_second_run_into_the_same_output_dir_is_refused(tiny_folder, text, tmp_path, capsys):
    out = tmp_path / "o"
    (out / "checkpoints" / "step_4").mkdir(parents=True)
    (out / "log.jsonl").write_text('{"step": 1}\n')
    argv = [f"model={tiny_folder}", f"data.text_files=[{text}]", f"output_dir={out}"]
    assert run("heal", lambda cfg: pytest.fail("trained"), argv) == 2
    assert "already holds a run (log.jsonl, checkpoints/); resume=true continues it" in capsys.readouterr().err
    assert run("heal", lambda cfg: None, [*argv, "resume=true"]) == 0


def test_missing_config_file(capsys):
    assert run("heal", lambda cfg: None, ["--config", "/no/such.yaml"]) == 2
    assert "config file not found" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------- accelerate configs

def launched(name, monkeypatch):
    """What `accelerate launch --config_file recipes/accelerate/<name>.yaml` gives its processes: accelerate's own
    launch code runs (config parsing, validation, the environment it builds) and is stopped where it would start
    them. Returns (launcher, its arguments, the environment variables it adds)."""
    import accelerate.commands.launch as launch
    from accelerate.utils import launch as prepare

    got = {}
    for launcher, env_of in [("simple_launcher", lambda a: prepare.prepare_simple_launcher_cmd_env(a)[1]),
                             ("multi_gpu_launcher", prepare.prepare_multi_gpu_env),
                             ("deepspeed_launcher", lambda a: prepare.prepare_deepspeed_cmd_env(a)[1])]:
        monkeypatch.setattr(launch, launcher, lambda a, launcher=launcher, env_of=env_of: got.update(
            launcher=launcher, args=a, env=env_of(a)))
    config = REPO / "recipes" / "accelerate" / f"{name}.yaml"
    launch.launch_command(launch.launch_command_parser().parse_args(["--config_file", str(config), "recipe.py"]))
    added = {k: v for k, v in got["env"].items() if os.environ.get(k) != v}
    return got["launcher"], got["args"], added


@pytest.mark.parametrize("name, launcher, processes, precision", [
    ("cpu", "simple_launcher", 1, "no"),
    ("multi_cpu", "multi_gpu_launcher", 2, "no"),
    ("ddp", "multi_gpu_launcher", 8, "bf16"),
    ("fsdp", "multi_gpu_launcher", 8, "bf16"),
    ("deepspeed_zero3", "deepspeed_launcher", 8, "bf16"),
])
def test_accelerate_configs_load(name, launcher, processes, precision, monkeypatch):
    used, args, env = launched(name, monkeypatch)
    assert (used, args.num_processes, env["ACCELERATE_MIXED_PRECISION"]) == (launcher, processes, precision)
    if name == "cpu":
        assert env["ACCELERATE_USE_CPU"] == "True"
    if name == "deepspeed_zero3":
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    if name == "fsdp":
        # the plugin each process builds from that environment, and the blocks it shards on its own: every decoder
        # layer, also when a patch gave the layers another class (post-norm, the sinusoidal input of layer 0)
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

        for key, value in env.items():
            monkeypatch.setenv(key, value)
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.state_dict_type.name == "SHARDED_STATE_DICT"
        for spec in [{}, {"placement": "post"}, {"position": "sinusoidal", "placement": "post"}]:
            model = hfpatch.patch(tiny_model("llama"), **spec)
            policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
            assert [n for n, m in model.named_modules() if policy(m)] == ["model.layers.0", "model.layers.1"], spec


@pytest.mark.parametrize("chunk", [None, 7, 64])
def test_chunked_loss_equals_the_full_computation(chunk):
    """CE and KL scored in recomputed chunks equal the plain full-logit formulas, values and gradients."""
    import torch.nn.functional as F

    from hfpatch.train.losses import chunked_lm_loss, shift

    torch.manual_seed(0)
    head, teacher_head = torch.nn.Linear(16, 50), torch.nn.Linear(16, 50)
    ids = torch.randint(0, 50, (2, 30))
    h = torch.randn(2, 30, 16, requires_grad=True)
    ht = torch.randn(2, 30, 16)
    loss, ce, kl = chunked_lm_loss(h, shift(ids), head, chunk, ht, teacher_head, temperature=2.0, alpha=0.3)
    loss.backward()
    grad = h.grad.clone()
    h.grad = None
    logits, t_logits = head(h)[:, :-1], teacher_head(ht)[:, :-1]
    ce_ref = F.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1))
    p_t = F.softmax(t_logits / 2.0, -1)
    kl_ref = (p_t * (p_t.log() - F.log_softmax(logits / 2.0, -1))).sum(-1).mean() * 4.0
    ref = 0.7 * ce_ref + 0.3 * kl_ref
    ref.backward()
    assert torch.allclose(ce, ce_ref, atol=1e-5) and torch.allclose(kl, kl_ref, atol=1e-5)
    assert torch.allclose(grad, h.grad, atol=1e-6)


def test_trained_tokenizer_round_trips_text(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert len(tok) == 384 and tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    sample = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    ids = tok(sample)["input_ids"]
    assert tok.decode(ids) == sample  # byte-level: any text, exactly
    assert len(ids) < len(sample.encode())  # and the merges it learned shorten it


def test_train_tokenizer_rejects_a_vocabulary_without_room_for_bytes(tmp_path):
    proc = subprocess.run([sys.executable, "recipes/train_tokenizer.py", "--vocab-size", "100", "--out",
                           str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "at least 259" in proc.stderr


def test_finish_frees_the_ddp_reducer_before_the_process_group_is_destroyed(tmp_path):
    """loop.finish: when end_training destroys the process group, DDP's wrapper (whose reducer holds the group) is
    already gone, so the group's last reference is not dropped from the reducer's destructor with the GIL held (a
    two-process test run hung at exit that way). A one-process gloo group in this process, a real DDP module."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
        ddp(torch.randn(2, 4)).sum().backward()
        alive, seen = weakref.ref(ddp), {}

        class Acc:  # accelerate's own free_memory over the references an Accelerator keeps
            free_memory = Accelerator.free_memory

            def __init__(self, model):
                self._models, self._optimizers, self._schedulers, self._dataloaders = [model], [], [], []

            def end_training(self):
                seen.update(wrapper_alive=alive() is not None, group_up=dist.is_initialized())
                dist.destroy_process_group()

        finished = loop.Run.__new__(loop.Run)
        finished.accelerator, finished.loss_module, finished.optimizer = Acc(ddp), ddp, None
        finished.params = list(ddp.parameters())
        del ddp
        loop.finish(finished)
        assert seen == {"wrapper_alive": False, "group_up": True}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
