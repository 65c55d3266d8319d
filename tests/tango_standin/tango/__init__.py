"""Stand-in for AI2 Tango (see ../README.md)."""
