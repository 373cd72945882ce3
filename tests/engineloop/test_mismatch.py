"""engineloop.mismatch helpers that need no engine run."""

from engineprofiles.store import get_profile


def test_engine_kv_split_follows_the_capture_and_the_kernel_build():
    from engineloop.mismatch import engine_kv_split
    from engineprofiles.regions.attention import KVSplit

    att = dict(split_kv=True, torch_threads=4)
    avx512, avx2 = (get_profile(n) for n in ("vllm-0.32.0-cpu-inductor-bfloat16-insitu",
                                              "vllm-0.32.0-cpu-inductor-bfloat16-insitu-avx2"))
    assert engine_kv_split(dict(name="vllm", attention=att), avx512) == KVSplit(threads=4, merge="fma")
    assert engine_kv_split(dict(name="vllm", attention=att), avx2) == KVSplit(threads=4, merge="mul_add")
    for eng in (dict(name="vllm", attention=dict(att, split_kv=False)), dict(name="vllm", attention=dict(att, torch_threads=1)),
                dict(name="sglang", attention=att), dict(name="vllm"), dict(name="vllm", attention=dict(split_kv=True))):
        assert engine_kv_split(eng, avx512) is None, eng
