"""Evaluations never give a silently wrong table: a results file is continued only with the model it was computed
with (by content, not by path), haystacks too short for a cell and needle files of the wrong shape are refused
before any work, and lengths whose memory cannot fit are refused before anything is built. (Kills and damaged
results files: tests/test_eval_faults.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import tiny_model
from test_eval_perplexity import save_tiny, text_of, tiny_tokenizer

import hfpatch
from hfpatch.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("own_cache")


def cli(capsys, *argv):
    capsys.readouterr()
    code = cli_main(list(argv))
    return code, capsys.readouterr().err.strip()


@pytest.fixture
def ppl(tmp_path):
    """A tiny model saved at a path, a text file, and the ppl command on them (without --patches)."""
    model = save_tiny(tmp_path / "model")
    (tmp_path / "a.txt").write_text(text_of(200, 1), encoding="utf-8")
    argv = ["eval", "ppl", "--model", str(model), "--text-files", str(tmp_path / "a.txt"), "--lengths", "32",
            "--no-plot", "--out", str(tmp_path / "out")]
    return model, argv


def test_resume_with_other_weights_at_the_same_path_is_refused(ppl, capsys):
    """Model A scored, model B copied to A's path, the run resumed into the same --out: refused, naming the
    weights file, instead of a table whose rows come from two models."""
    model, argv = ppl
    assert cli(capsys, *argv, "--patches", "none")[0] == 0
    shutil.rmtree(model)
    hfpatch.save_pretrained(tiny_model("llama", seed=1), model, tokenizer=tiny_tokenizer())
    code, err = cli(capsys, *argv, "--patches", "none,ntk:2")
    assert code == 2 and "\n" not in err, err
    assert "model_files/model.safetensors" in err and "--overwrite" in err
    results = json.loads((model.parent / "out" / "results.json").read_text())
    assert [c["patch"] for c in results["cells"]] == ["none"]  # nothing of B was added


def test_resume_with_another_config_is_refused(ppl, capsys):
    model, argv = ppl
    assert cli(capsys, *argv, "--patches", "none")[0] == 0
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500.0  # same weights, other positions
    (model / "config.json").write_text(json.dumps(config))
    code, err = cli(capsys, *argv, "--patches", "none,ntk:2")
    assert code == 2 and "model_files/config.json" in err, err


def test_resume_with_the_same_model_copied_elsewhere_continues(ppl, capsys, tmp_path):
    """The identity is the content: the same files at another path (a copy, new mtimes) resume the run."""
    model, argv = ppl
    assert cli(capsys, *argv, "--patches", "none")[0] == 0
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    shutil.rmtree(model)
    copy.rename(model)
    code, err = cli(capsys, *argv, "--patches", "none,ntk:2")
    assert code == 0 and "resuming from" in err, err


CHAT = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")


def test_resume_after_the_chat_template_was_edited_is_refused(tmp_path, capsys):
    """transformers keeps the chat template in chat_template.jinja: a template edited between two runs of
    `ruler --chat-template` would put samples made with two templates in one cell. The same command is refused,
    naming the file, with the ways out."""
    model = save_tiny(tmp_path / "model")
    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    tok.save_pretrained(model)
    assert (model / "chat_template.jinja").read_text() == CHAT
    argv = ["eval", "ruler", "--model", str(model), "--tasks", "niah_single_1", "--lengths", "700", "--samples", "1",
            "--patches", "none", "--chat-template", "--no-plot", "--out", str(tmp_path / "out")]
    assert cli(capsys, *argv)[0] == 0
    before = (tmp_path / "out" / "results.json").read_text()
    (model / "chat_template.jinja").write_text(CHAT.replace("assistant:", "answer:"))
    code, err = cli(capsys, *argv)
    assert code == 2 and "\n" not in err, err
    assert "model_files/chat_template.jinja" in err and "--overwrite" in err and "another --out" in err, err
    assert (tmp_path / "out" / "results.json").read_text() == before  # nothing was added or rewritten


def test_the_model_identity_holds_every_file_the_tokenizer_reads(tmp_path):
    """model_fingerprint covers, by content, the files AutoTokenizer.from_pretrained reads from a folder (chat
    templates, versioned and legacy tokenizer files, vocabularies, SentencePiece models) and nothing else."""
    from hfpatch.models import model_fingerprint

    read = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
            "tokenizer.4.0.0.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
            "sentencepiece.bpe.model", "tekken.json", "bpe.codes", "source.spm", "emoji.json"]
    for name in read:
        (tmp_path / name).write_text(name)
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    for unread in ("README.md", "notes.txt", ".gitattributes", "training_args.json"):
        (tmp_path / unread).write_text(unread)
    fingerprint = model_fingerprint(str(tmp_path))
    assert sorted(fingerprint) == sorted([*read, "additional_chat_templates/tool_use.jinja"])
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0] }}")
    assert model_fingerprint(str(tmp_path)) != fingerprint  # by content


def test_the_tokenizer_file_names_cover_every_tokenizer_class_of_transformers():
    """Every vocabulary file name a tokenizer class of the installed transformers declares (VOCAB_FILES_NAMES,
    read from its source) is part of the model identity: a new one in a transformers release fails here."""
    import ast
    from pathlib import Path

    import transformers

    from hfpatch.models import is_model_file

    declared = set()
    for source in Path(transformers.__file__).parent.rglob("tokenization_*.py"):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                    and any(isinstance(t, ast.Name) and t.id == "VOCAB_FILES_NAMES" for t in node.targets)):
                declared |= {v.value for v in node.value.values if isinstance(v, ast.Constant)}
    assert len(declared) > 10, declared  # the scan found the classes
    assert sorted(n for n in declared if not is_model_file(n)) == []


def test_a_tokenizer_changed_in_place_is_not_served_stale_ids():
    """The tokenization cache is keyed by the tokenizer's full definition: a normalizer or a post-processor set on
    the same object (same vocabulary size) gives new ids, the ones an uncached tokenization gives."""
    from tokenizers import normalizers, processors

    from hfpatch.lm.text import Document, tokenize

    tok = tiny_tokenizer()
    doc = Document("d", "Hello World. ABC")
    first = tokenize(tok, doc).ids
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    lowered = tokenize(tok, doc).ids
    assert list(lowered) == list(tokenize(tok, doc, use_cache=False).ids) != list(first)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    framed = tokenize(tok, doc).ids
    assert list(framed) == list(tokenize(tok, doc, use_cache=False).ids) == [1, *lowered]


# ------------------------------------------------------------------------------------- haystacks and needle files


@pytest.fixture
def tiny(tmp_path):
    return save_tiny(tmp_path / "model")


@pytest.mark.parametrize("what", ["niah", "ruler"])
def test_an_empty_haystack_file_is_refused_before_loading(tiny, tmp_path, capsys, what):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    extra = ["--tasks", "niah_single_2"] if what == "ruler" else []
    code, err = cli(capsys, "eval", what, "--model", str(tiny), "--text-files", str(empty), "--lengths", "1k",
                    *extra, "--out", str(tmp_path / "o"))
    assert code == 2 and len(err.splitlines()) == 1 and "has no words" in err, err
    assert not (tmp_path / "o" / "results.json").exists()


def test_niah_refuses_a_haystack_shorter_than_the_cell(tiny, tmp_path, capsys):
    """A text of a few hundred words cannot fill a 2k-token haystack without repeating itself: refused (as eval
    ppl refuses documents shorter than the length), instead of a '2k' cell scored on a shorter prompt or a text
    read round and round."""
    short = tmp_path / "short.txt"
    short.write_text("The cat sat on the mat. " * 50)  # 300 words, about 1200 one-character tokens
    code, err = cli(capsys, "eval", "niah", "--model", str(tiny), "--text-files", str(short), "--lengths", "2k",
                    "--depths", "0.5", "--out", str(tmp_path / "o"))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "300 words" in err and "2k" in err, err
    assert not (tmp_path / "o" / "results.json").exists()


@pytest.mark.parametrize("change,message", [
    ({"answers": [42]}, "answers must be a list of non-empty strings"),
    ({"needles": ["ok", 7]}, "needles must be a list of non-empty strings"),
    ({"answers": [""]}, "answers must be a list of non-empty strings"),
])
def test_a_needle_file_of_the_wrong_shape_is_refused_before_loading(tiny, tmp_path, capsys, change, message):
    needles = {"needles": ["The code is 42."], "question": "What is the code?", "answer_prefix": "The code is",
               "answers": ["42"], **change}
    path = tmp_path / "needles.json"
    path.write_text(json.dumps(needles))
    code, err = cli(capsys, "eval", "niah", "--model", str(tiny), "--needles", str(path), "--lengths", "300",
                    "--depths", "0.5", "--out", str(tmp_path / "o"))
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "o" / "results.json").exists()


@pytest.mark.parametrize("what", ["passkey", "niah", "ruler"])
def test_a_length_whose_memory_cannot_fit_is_refused_before_any_prompt_is_built(tiny, tmp_path, capsys, what,
                                                                                 monkeypatch):
    """A billion tokens: refused from the config's sizes, before the tokenizer is asked for a prompt that long
    (at 100000k the tokenizer aborted the process after about 20 s)."""
    from hfpatch.evaluate import haystack
    from hfpatch.evaluate.evaluations import passkey

    def never(*a, **k):
        raise AssertionError("a prompt was built")

    monkeypatch.setattr(passkey, "build_prompt", never)
    monkeypatch.setattr(haystack, "fit", never)
    code, err = cli(capsys, "eval", what, "--model", str(tiny), "--lengths", "1000000k", "--out",
                    str(tmp_path / "o"))
    assert code == 2 and len(err.splitlines()) == 1 and "is free on the" in err, err
    assert not (tmp_path / "o").exists()


def test_a_hub_model_is_identified_by_its_cached_commit(tmp_path, monkeypatch):
    """A hub id names no content; the snapshot the cache holds (by commit) does."""
    import huggingface_hub.constants as constants

    from hfpatch.models import model_fingerprint

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_fingerprint("someone/tiny") == {"hub": "someone/tiny", "revision": commit}
    assert model_fingerprint("someone/other") == {"hub": "someone/other", "revision": None}
