"""--model PATH (issue 33 item 3): mismatch and localize on a checkpoint folder the tool did not build, and a clear
error for a folder that is not one. The engine's side is tests/engines/test_checkpoint_engine.py; here the engine is
the trainer itself (a planted capture), so the rows compare the trainer with its own as-is forward."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engineloop.checkpoint import fingerprint
from engineloop.cli import app
from engineloop.standin import capture_from_trainer

TRAINER = "transformers-5.19.0-cpu-eager-bfloat16"


def user_checkpoint(folder: Path, seed: int, head_dims=(16, 32, 48)) -> Path:
    """A Llama or Qwen3 checkpoint of random widths, FP32 weights (as a user's training run saves them), built from
    its own config (not the tool's tiny_model). ``head_dims``: those to draw from (vLLM's CPU attention takes 32, 64,
    80, 96, 112, 128, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rng = random.Random(seed)
    kind = rng.choice(["llama", "qwen3"])
    kv = rng.choice([1, 2])
    heads = kv * rng.choice([1, 2, 3])
    head_dim = rng.choice(list(head_dims))
    cfg = AutoConfig.for_model(kind, vocab_size=rng.randint(150, 400), hidden_size=heads * head_dim * rng.choice([1, 2]),
                               intermediate_size=rng.choice([96, 160, 224]), num_hidden_layers=rng.randint(1, 3),
                               num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                               max_position_embeddings=256, tie_word_embeddings=rng.random() < 0.5)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[0, 1])
def checkpoint(request, tmp_path_factory):
    """(the folder, a capture of it planted from the trainer's own as-is forward, with every module tensor)."""
    from engineloop.checkpoint import load_checkpoint

    folder = user_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", request.param)
    model = load_checkpoint(str(folder))
    cap = capture_from_trainer(model, None, prompts=2, modules=True, seed=request.param)
    cap.update(model_size={}, family=model.config.model_type, checkpoint=fingerprint(str(folder)))
    f = folder.parent / "cap.pt"
    torch.save(cap, f)
    return folder, f


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, " ".join(r.output.split())


def test_mismatch_and_localize_run_on_a_users_checkpoint(checkpoint, tmp_path):
    folder, cap = checkpoint
    code, said = run("mismatch", "vllm", "--model", folder, "--capture", cap, "--profile", TRAINER, "--json",
                     tmp_path / "m.json")
    assert code == 0, said
    d = json.loads((tmp_path / "m.json").read_text())
    assert d["model"]["checkpoint"] == str(folder.resolve())
    assert d["family"] == json.loads((folder / "config.json").read_text())["model_type"]
    assert "temperature 1.0" in d["engine_logprobs"] and "engine log-probs:" in said
    as_is = {r["trainer"]: r for r in d["prefill"]}["as-is"]
    assert as_is["exact_match"] == 1.0  # the planted engine is the as-is trainer on the same checkpoint
    code, said = run("localize", "vllm", "--model", folder, "--capture", cap, "--profile", TRAINER, "--trainer",
                     "as-is", "--json", tmp_path / "l.json")
    assert code == 0, said
    d = json.loads((tmp_path / "l.json").read_text())
    assert d["trainers"][0]["first_divergence"] is None


def test_a_checkpoints_capture_goes_with_that_checkpoint_only(checkpoint, tmp_path):
    folder, cap = checkpoint
    code, said = run("mismatch", "vllm", "--capture", cap, "--profile", TRAINER)
    assert code == 2 and "pass --model with that folder" in said, said
    other = user_checkpoint(tmp_path / "other", 7)
    code, said = run("mismatch", "vllm", "--model", other, "--capture", cap, "--profile", TRAINER)
    assert code == 2 and "another checkpoint" in said, said


def broken(tmp_path: Path, case: str) -> Path:
    good = user_checkpoint(tmp_path / "good", 3)
    if case == "missing":
        return tmp_path / "nowhere"
    if case == "a file":
        return good / "config.json"
    bad = tmp_path / case.replace(" ", "-")
    bad.mkdir()
    for p in good.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    if case == "no config":
        (bad / "config.json").unlink()
    elif case == "bad json":
        (bad / "config.json").write_text("{ not json")
    elif case == "gpt2":
        (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    elif case == "not a causal LM":
        (bad / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForSequenceClassification"])))
    elif case == "no weights":
        for p in bad.glob("*.safetensors"):
            p.unlink()
    elif case == "weights short":  # a config asking for one more layer than the weights hold
        (bad / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=cfg["num_hidden_layers"] + 1)))
    return bad


@pytest.mark.parametrize("case,words", [
    ("missing", "no such folder"), ("a file", "not a checkpoint folder"), ("no config", "no config.json"),
    ("bad json", "cannot be read as JSON"), ("gpt2", "'gpt2' is not a supported family"),
    ("not a causal LM", "not a causal LM"), ("no weights", "no weights"), ("weights short", "the weights lack")])
@pytest.mark.parametrize("command", ["mismatch", "localize"])
def test_a_folder_that_is_not_a_supported_checkpoint_is_refused_before_any_engine_runs(tmp_path, monkeypatch, case,
                                                                                       words, command):
    ran = []
    monkeypatch.setattr("engineloop.mismatch.run_capture", lambda *a, **k: ran.append(1))
    code, said = run(command, "vllm", "--model", broken(tmp_path, case), "--profile", TRAINER)
    assert code == 2 and words in said, said
    assert not ran


@pytest.mark.parametrize("args,words", [(["--layers", "3"], "apply to the tiny model only"),
                                        (["--rope-scaling", "llama3"], "apply to the tiny model only"),
                                        (["--family", "mistral"], "leave --family out"),
                                        (["--prompt-len", "240", "--max-tokens", "20"], "its context is 256 tokens"),
                                        (["--prompt-len", "120", "--batch-check"], "the batch check's longest")])
def test_the_tiny_models_options_and_runs_too_long_are_refused_with_a_checkpoint(tmp_path, monkeypatch, args, words):
    folder = user_checkpoint(tmp_path / "m", 0)
    if args[0] == "--family" and json.loads((folder / "config.json").read_text())["model_type"] == "mistral":
        args = ["--family", "qwen2"]
    ran = []
    monkeypatch.setattr("engineloop.mismatch.run_capture", lambda *a, **k: ran.append(1))
    code, said = run("mismatch", "vllm", "--model", folder, *args)
    assert code == 2 and words in said, said
    assert not ran


def test_the_in_situ_fit_refuses_a_checkpoints_capture(checkpoint):
    from engineloop.fit import in_situ_pairs
    from engineprofiles.errors import EngineProfilesError

    folder, cap = checkpoint
    family = json.loads((folder / "config.json").read_text())["model_type"]
    with pytest.raises(EngineProfilesError, match="the in-situ fit runs on the tool's tiny models"):
        in_situ_pairs("vllm", [family], [str(cap)], seed=0, prompts=2, mode="default", env=None, note=print,
                      rope_scaling=None)


@pytest.mark.parametrize("record", ["a string", {"path": 3}, ["x"]])
def test_a_capture_with_a_malformed_checkpoint_record_is_refused(checkpoint, tmp_path, record):
    folder, cap = checkpoint
    bad = tmp_path / "bad.pt"
    torch.save(dict(torch.load(cap, weights_only=False), checkpoint=record), bad)
    code, said = run("mismatch", "vllm", "--model", folder, "--capture", bad, "--profile", TRAINER)
    assert code == 2 and "is not a checkpoint record" in said, said
