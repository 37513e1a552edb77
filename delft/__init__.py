"""delft: fine-tune language models to get numbers right."""

__version__ = "0.1.0"
