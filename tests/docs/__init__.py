"""The project as documented: README and docs/api.md run or are current, and the layering of
docs/architecture.md holds."""
