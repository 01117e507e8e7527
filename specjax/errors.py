"""Exceptions raised for bad input. Scripts print them as one line and exit 1."""


class SpecjaxError(ValueError):
  """Base class: bad input that the user can fix (never a bug in specjax)."""


class ConfigError(SpecjaxError):
  """A model configuration, preset name or flag value is invalid."""


class CacheOverflowError(SpecjaxError):
  """A write would run past the KV cache capacity."""


class CheckpointError(SpecjaxError):
  """A checkpoint is missing, incomplete or does not match its config."""


class TokenizerError(SpecjaxError):
  """A tokenizer is missing, unreadable, or does not match the model."""


class OutputError(SpecjaxError):
  """An output path (--json_out, --workdir, ...) cannot be written; found before the work."""
