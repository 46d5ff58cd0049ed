"""Deployment policies: the pydantic schema, YAML loading with clear errors, examples."""
