"""Three GRPO steps in TRL (run in TRL's own environment, scripts/framework_env.sh trl VERSION) with the
project's one-liner (a class patch before the trainer loads its models) and log_mismatch.

    python trl_worker.py OUT_DIR

The "engine" is a rollout_func sampling with an unpatched copy of the checkpoint, token by token with a KV
cache, returning each sampled token's log-prob (as an engine returns them); its weights are the policy's,
synced before each generation batch. Writes OUT_DIR/result.json:
the log history, whether the policy and the reference model were patched, and per generation batch the
metrics log_mismatch recorded beside the same metrics computed here from the trainer's log-probs by a plain
forward (an independent computation of what TRL's old_per_token_logps are), and the refusal of a trainer
that samples with the model it trains."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import emulator  # noqa: E402
from engineloop.integrations.trl import TRLIntegrationError, log_mismatch  # noqa: E402
from engineprofiles.metrics import rollout_corr  # noqa: E402
from engineprofiles.models import tiny_model  # noqa: E402

OUT = Path(sys.argv[1])
CKPT = OUT / "checkpoint"
VOCAB = 256
PAD, EOS, UNK = 1, 2, 0
MAX_NEW = 8


def save_checkpoint() -> PreTrainedTokenizerFast:
    model = tiny_model("qwen2", seed=0)  # BF16 weights, 2 layers
    model.config.pad_token_id, model.config.eos_token_id = PAD, EOS
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    model.save_pretrained(CKPT)
    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token=f"t{UNK}"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=f"t{UNK}", pad_token=f"t{PAD}",
                                  eos_token=f"t{EOS}")
    tok.save_pretrained(CKPT)
    return tok


def main() -> None:
    tok = save_checkpoint()
    engine = AutoModelForCausalLM.from_pretrained(CKPT).eval()  # loaded before the patch: the engine as-is
    gen = torch.Generator().manual_seed(0)

    def rollout(prompts, trainer):
        engine.load_state_dict(trainer.model.state_dict())  # the weight sync of an engine in the loop
        prompt_ids, completion_ids, logprobs = [], [], []
        for text in prompts:
            ids = tok(text)["input_ids"]
            out, lps, past = [], [], None
            x = torch.tensor([ids])
            with torch.no_grad():
                for _ in range(MAX_NEW):
                    o = engine(x, past_key_values=past, use_cache=True)
                    past = o.past_key_values
                    lp = torch.log_softmax(o.logits[0, -1].float(), -1)
                    t = int(torch.multinomial(lp.exp(), 1, generator=gen))
                    out.append(t), lps.append(float(lp[t]))
                    x = torch.tensor([[t]])
            prompt_ids.append(ids), completion_ids.append(out), logprobs.append(lps)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    def reward(completions, **kwargs):  # the number of even tokens: a reward with spread
        return [float(sum(int(w[1:]) % 2 == 0 for w in c.split())) for c in completions]

    rng = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (5,), generator=rng)) for _ in range(8)]
    data = Dataset.from_dict({"prompt": prompts})
    args = GRPOConfig(output_dir=str(OUT / "run"), max_steps=3, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=MAX_NEW, beta=0.04, learning_rate=1e-3, logging_steps=1,
                      report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)

    patch = emulator.patch_family("qwen2", "vllm")  # the one-liner: before the trainer loads its models
    trainer = GRPOTrainer(model=str(CKPT), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok, rollout_func=rollout)
    patched = {"policy": emulator.handle_of(trainer.model) is not None,
               "reference": trainer.ref_model is not None and emulator.handle_of(trainer.ref_model) is not None}
    callback = log_mismatch(trainer)
    batches = []
    measure = callback.measure

    def checked_measure(output):
        got = measure(output)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
        attn = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
        keep = output["completion_ids"].size(1)
        with torch.no_grad():
            logits = trainer.model(input_ids=ids, attention_mask=attn).logits[:, -keep - 1:-1].float()
        train = torch.log_softmax(logits / args.temperature, -1).gather(-1, output["completion_ids"][..., None])[..., 0]
        want = rollout_corr(output["sampling_per_token_logps"].float(), train, output["completion_mask"].bool())
        batches.append({"logged": got, "recomputed": want})
        return got

    callback.measure = checked_measure
    trainer.train()

    plain = GRPOTrainer(model=str(CKPT), reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    try:
        log_mismatch(plain)
        refusal = None
    except TRLIntegrationError as e:
        refusal = str(e)
    patch.remove()
    result = {"log_history": trainer.state.log_history, "patched": patched, "batches": batches,
              "refusal": refusal, "global_step": trainer.state.global_step,
              "emulated": list(emulator.handle_of(trainer.model).emulated) if emulator.handle_of(trainer.model) else None}
    (OUT / "result.json").write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
