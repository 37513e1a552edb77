"""delft: fine-tune language models to get numbers right."""

# The name pip installs (`pip install delft-digits`): PyPI's `delft` is another project that also imports as
# `delft`, so the two must not share an environment. The command and the import name stay `delft`.
DISTRIBUTION = "delft-digits"
__version__ = "0.1.0"


def _quiet_bitsandbytes_kernels_line() -> None:
    """transformers 5.25 requires the `kernels` package, and bitsandbytes >= 0.50, imported by transformers'
    Trainer and by peft, then asks the hub for a CPU nf4 kernel when it loads; the hub refuses to trust it, and
    bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community ..." in every process and uses
    its own CPU code, as it would without `kernels`. Nothing there is the user's to act on, so delft drops that one
    line (a filter on bitsandbytes' CPU backend logger, set before anything in delft imports bitsandbytes); every
    other line of that logger is kept."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community"))


_quiet_bitsandbytes_kernels_line()
