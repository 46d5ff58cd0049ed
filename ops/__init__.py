"""Operator tools: the `fedsilo` CLI, simulations, reports and plots."""
