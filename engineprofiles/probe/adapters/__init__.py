"""Engine adapters. Each imports its engine lazily, so this package imports anywhere."""

ENGINES = ("vllm", "sglang", "transformers")
