"""Integrations of fairscale_c with training frameworks (each imports its framework on import)."""
