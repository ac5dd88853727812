"""daemon/commands package."""
