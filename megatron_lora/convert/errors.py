"""The one error type conversion tools raise for bad inputs (it names the file, tensor or field)."""


class ConversionError(ValueError):
    """A checkpoint that cannot be converted or loaded as asked; the message says which file,
    tensor or config field is at fault."""
