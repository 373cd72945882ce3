"""The RL demonstration's pieces that need no engine (the engine run is tests/engines/test_rl_demo_engine.py)."""

import pytest
import torch

from engineloop.rl import completion_logprobs, plot, ratio_spread, run_demo, toy_reward
from engineprofiles.errors import EngineProfilesError
from engineprofiles.models import tiny_model


def test_completion_logprobs_are_the_teacher_forced_log_probs_of_the_completion():
    model = tiny_model("qwen2", seed=0).eval()
    ids = torch.randint(1, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp = completion_logprobs(model, ids, 6)
        logits = model(input_ids=ids).logits.float()
    assert lp.shape == (3, 4)
    want = torch.log_softmax(logits[1, 7], -1)[ids[1, 8]]
    assert lp[1, 2] == want


def test_toy_reward_and_ratio_spread_by_hand():
    assert toy_reward(torch.tensor([[0, 31, 32, 100]]), 256).tolist() == [0.5]  # ids below 256 // 8 = 32
    same = torch.tensor([-1.0, -2.0])
    assert ratio_spread(same, same) == {"is_ratio_std": 0.0, "is_ratio_max_dev": 0.0}
    s = ratio_spread(torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.5]))
    assert s["is_ratio_max_dev"] == pytest.approx(float(torch.tensor(0.5, dtype=torch.float64).exp() - 1))


def test_bad_arguments_fail_before_any_engine_starts():
    with pytest.raises(EngineProfilesError, match="train-with"):
        run_demo(train_with="fp64")
    with pytest.raises(EngineProfilesError, match="positive"):
        run_demo(steps=0)


def test_plot_writes_a_png_and_shows_zero_mismatch(tmp_path):
    setups = {n: {"k3_kl": v, "is_ratio_std": v, "exact_match": 1.0 if v == 0 else 0.0}
              for n, v in (("as-is", 1e-5), ("profile", 1e-6), ("exact", 0.0))}
    result = dict(engine=dict(name="vllm", version="0.32.0", mode="default"), family="qwen2", train_with="exact",
                  cpu_capability="AVX512", steps=[dict(step=i, reward=0.1 * i, setups=setups) for i in range(3)])
    f = tmp_path / "p.png"
    plot(result, str(f))
    assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
