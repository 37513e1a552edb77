"""delft: fine-tune language models to get numbers right."""

# The name pip installs (`pip install delft-digits`): PyPI's `delft` is another project that also imports as
# `delft`, so the two must not share an environment. The command and the import name stay `delft`.
DISTRIBUTION = "delft-digits"
__version__ = "0.1.0"
