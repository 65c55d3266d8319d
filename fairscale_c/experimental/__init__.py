"""fairscale_c.experimental — mirrors the parts of fairscale.experimental that fairscale_c provides
(docs/experimental.md)."""
