"""``delft export``: a run's adapter merged into a standalone model and verified (delft.export.merge), then, when
asked, GGUF files for llama.cpp checked there (delft.export.gguf).

The order is the command's own: what a killed export left goes first; the GGUF request is refused, if it must be,
before minutes of merging; and an ``--out`` that already holds this run's verified merge (no ``--force``) redoes only
the GGUF phase, so a failed or interrupted conversion never costs the merge again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console

from delft.export.checks import remove_export_leftovers
from delft.export.gguf import export_gguf, prepare_gguf
from delft.export.merge import verified_export, write_merged_model
from delft.export.report import ExportResult
from delft.outputs import said_removed


def run_export(run: Path, out: Path, dtype: str = "bfloat16", match_training: bool = False,
               tolerance: Optional[float] = None, device: str = "cpu", force: bool = False,
               gguf: Sequence[str] = (), gguf_lora: bool = False, gguf_check: Optional[bool] = None,
               trust_remote_code: bool = False, console: Optional[Console] = None) -> ExportResult:
    """Merge and verify ``run`` into ``out``, then write and check the GGUF files ``gguf`` / ``gguf_lora`` ask for.
    Returns the merged export (an earlier verified one when only its GGUF phase ran again)."""
    console = console or Console()
    gone = remove_export_leftovers(out)  # what an export killed with SIGKILL left beside (or in) --out
    if gone:
        console.print(f"[yellow]{said_removed(gone)}[/]", highlight=False)
    resumed = None if force or not (gguf or gguf_lora) else verified_export(run, out, dtype)
    plan = prepare_gguf(run, out, list(gguf), gguf_lora, gguf_check, match_training, force,
                        resume=resumed is not None)
    if plan is not None and resumed is not None:
        console.print(f"[bold]resuming[/] {out} holds this run's verified merged model: only the GGUF phase runs "
                      "again", highlight=False)
        export_gguf(plan, resumed, console, resume=True)
        return resumed
    result = write_merged_model(run_dir=run, out=out, dtype=dtype, match_training=match_training, tolerance=tolerance,
                                device=device, force=force, console=console,
                                gguf_bytes_per_param=plan.bytes_per_param if plan is not None else 0.0,
                                trust_remote_code=trust_remote_code)
    if plan is not None:
        export_gguf(plan, result, console)
    return result
