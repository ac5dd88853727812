"""engine/models package."""
