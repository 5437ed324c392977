"""The version of this copy of `am_model_io`: the one place it is written (hatchling reads it into the wheel's
metadata, see `[tool.hatch.version]` in pyproject.toml), so a vendored copy reports its own version without any
installed metadata."""

__version__ = "0.1.0"
