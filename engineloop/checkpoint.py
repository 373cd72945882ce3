"""A user's own checkpoint in the engine-in-the-loop tools: ``probe-engine mismatch/localize ENGINE --model PATH``.

The folder is a Hugging Face checkpoint (``config.json`` and the weights) of a supported family's causal LM.
The engine loads it where it is (BF16, as it runs the tiny models); the trainer loads it with
``AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.bfloat16)``. Both round the weights to BF16 the
same way (to nearest even) where the checkpoint holds FP32. The prompts are random token ids of the
checkpoint's vocabulary, as for the tiny models (``--prompts``, ``--prompt-len``, ``--seed``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engineprofiles.errors import EngineProfilesError
from engineprofiles.families import FAMILIES

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")

# What the engine returns as each token's log-prob in the loop's runs (engineloop.capture): sampled at
# temperature 1.0 with no top-k, top-p or penalties, so that the raw log-probs (of the model's logits) and the
# processed ones (after the sampler's transformations) are the same numbers.
LOGPROB_SEMANTICS = ("the engine's log-prob of each sampled token at temperature 1.0, no top-k/top-p/penalties "
                     "(raw and processed log-probs agree there); re-scored tokens: its prompt log-probs")


class CheckpointError(EngineProfilesError):
    """``--model PATH`` is not a checkpoint folder of a supported family."""


def _config(path: str) -> dict[str, Any]:
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"--model {path}: no such folder")
    if not folder.is_dir():
        raise CheckpointError(f"--model {path}: a file, not a checkpoint folder (config.json and the weights)")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"--model {path}: no config.json; not a Hugging Face checkpoint folder")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"--model {path}: config.json cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"--model {path}: config.json holds no JSON object")
    return data


def checkpoint_family(path: str) -> str:
    """The family of the checkpoint at ``path`` (its config's ``model_type``); CheckpointError for a folder
    that is not a causal-LM checkpoint of a supported family with its weights."""
    data = _config(path)
    kind = data.get("model_type")
    if kind not in FAMILIES:
        raise CheckpointError(f"--model {path}: model_type {kind!r} is not a supported family; supported: "
                              f"{', '.join(FAMILIES)}")
    archs = data.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs if isinstance(archs, list) else [archs]
    if archs and not any(str(a).endswith("ForCausalLM") for a in archs):
        raise CheckpointError(f"--model {path}: its architectures are {', '.join(map(str, archs))}, not a causal LM "
                              "(...ForCausalLM): the engine samples from a language-model head")
    if not weight_files(path):
        raise CheckpointError(f"--model {path}: no weights ({' or '.join(WEIGHT_PATTERNS)}) beside config.json")
    return kind


def weight_files(path: str) -> list[Path]:
    folder = Path(path)
    return sorted({p for pat in WEIGHT_PATTERNS for p in folder.glob(pat) if p.is_file()})


def fingerprint(path: str) -> dict[str, Any]:
    """What a capture records of the checkpoint it ran: the folder, its config's sha256 and its weight
    files' names and sizes (hashing the weights would cost a pass over them)."""
    return dict(path=str(Path(path).resolve()),
                config_sha256=hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest(),
                weights=[[p.name, p.stat().st_size] for p in weight_files(path)])


def same_checkpoint(recorded: dict[str, Any], path: str) -> bool:
    got = fingerprint(path)
    return (recorded.get("config_sha256"), recorded.get("weights")) == (got["config_sha256"], got["weights"])


def resolve_family(family: str | None, model_path: str | None) -> str:
    """The family a run uses: the checkpoint's with ``--model`` (a different ``--family`` is refused), else
    ``family`` or qwen2 (the tiny model's default)."""
    if model_path is None:
        return family or "qwen2"
    kind = checkpoint_family(model_path)
    if family is not None and family != kind:
        raise CheckpointError(f"--family {family}, but the checkpoint {model_path} is a {kind} model: leave --family "
                              "out with --model")
    return kind


def check_context(path: str, *, prompt_len: int, prompts: int, max_tokens: int, batch_check: bool) -> None:
    """CheckpointError where the run's longest sequence does not fit the checkpoint's context (its
    ``max_position_embeddings``, at most the engine runs' 512 tokens)."""
    from .capture import context_length, longest_sequence

    limit, need = context_length(path), longest_sequence(prompt_len, prompts, max_tokens, batch_check)
    if need > limit:
        what = "the batch check's longest sequence" if batch_check else "the longest prompt and its completion"
        raise CheckpointError(f"--model {path}: its context is {limit} tokens (max_position_embeddings, at most 512 "
                              f"here), and {what} would take {need}: lower --prompt-len or --max-tokens")


def load_checkpoint(path: str) -> Any:
    """The checkpoint as the trainer's model: BF16, eval mode. CheckpointError when transformers cannot load it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    checkpoint_family(path)
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 (transformers raises many kinds: each is a checkpoint it cannot load)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"--model {path}: transformers cannot load it ({type(e).__name__}: {first})") from None
    finally:
        if was:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would initialise them at random: the engine and the trainer would run other weights
        raise CheckpointError(f"--model {path}: the weights lack {len(missing)} of the model's tensors "
                              f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    return model.eval()
