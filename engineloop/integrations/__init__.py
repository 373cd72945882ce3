"""Integrations with the RL frameworks users train with (TRL; see docs/frameworks.md)."""
