"""Names the command line checks before it loads torch or an engine.

`probe-engine vllm` validates its arguments, then hands over to the engine's environment; loading
torch first would cost ~2 s there for nothing. The regions and rounding modules hold the real
definitions; tests/engineprofiles/test_cli.py checks that these names agree with them.
"""

REGION_NAMES = ("rope", "swiglu", "add_rmsnorm", "rmsnorm")
ACT_DTYPE_NAMES = ("bfloat16", "float16")
