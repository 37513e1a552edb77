"""The ``delft`` command: parses arguments, calls the library, renders. No torch at import time."""

from __future__ import annotations

import functools
import inspect
import os
import signal
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from delft import signals
from delft.errors import UserError, VerificationError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fine-tune language models to get numbers right (Digit Entropy Loss, QLoRA).")
recipe_app = typer.Typer(no_args_is_help=True, help="Validate recipes and plan their memory.")
app.add_typer(recipe_app, name="recipe")

console = Console(soft_wrap=True)  # long log lines wrap in the terminal, not mid-word in logs
err_console = Console(stderr=True)
DEBUG = os.environ.get("DELFT_DEBUG") == "1"

SET_HELP = "Override a recipe key, e.g. --set train.max_steps=50 (repeatable)."
# compare's and study's --nproc: each run trained by `delft train --nproc N`, evaluated once in the command's process
ARMS_NPROC = typer.Option(None, "--nproc", min=1, help="Train each run on N processes (one per GPU) with delft train "
                          "--nproc N; needed for train.distributed: fsdp arms. The runs are evaluated once, in this "
                          "process.")


def _allow_seen_option():
    return typer.Option(False, "--allow-seen", help="Score an eval set even when more than half of it is a run's "
                        "training data (counted by prompt; refused otherwise). The unseen problems are scored beside.")


# How answers are decoded, on eval, compare and study alike: shorthands for --set eval.KEY=VALUE.
def _fewshot_option():
    return typer.Option(None, "--fewshot", min=0, max=8, help="lm-evaluation-harness's GSM8K prompt with N exemplars "
                        "(0 = zero-shot): --set eval.fewshot=N.")


def _samples_option():
    return typer.Option(None, "--samples", min=1, help="K sampled answers per problem, scored by majority vote with "
                        "pass@1 and pass@K (default 1: greedy): --set eval.samples=K.")


def _temperature_option():
    return typer.Option(None, "--temperature", help="Sampling temperature with --samples (default 0.7).")


def _top_p_option():
    return typer.Option(None, "--top-p", help="Nucleus sampling with --samples (default 1: off).")


def decoding_overrides(fewshot, samples, temperature, top_p) -> list[str]:
    """The decoding options as --set overrides of the recipe's eval section."""
    given = {"fewshot": fewshot, "samples": samples, "temperature": temperature, "top_p": top_p}
    return [f"eval.{k}={v}" for k, v in given.items() if v is not None]


# The options compare and study both end with: --allow-seen and the decoding shorthands (name, type, option).
SCORING_OPTIONS = (("allow_seen", bool, _allow_seen_option), ("fewshot", Optional[int], _fewshot_option),
                   ("samples", Optional[int], _samples_option), ("temperature", Optional[float], _temperature_option),
                   ("top_p", Optional[float], _top_p_option))


def scoring_options(fn):
    """``fn`` with SCORING_OPTIONS after its own options; it is called with ``allow_seen`` and ``set_`` led by the
    decoding options' overrides (so the command's own --set comes after them and wins)."""
    own = [p for p in inspect.signature(fn).parameters.values() if p.name != "allow_seen"]

    @functools.wraps(fn)
    def wrapper(*, allow_seen, fewshot, samples, temperature, top_p, set_, **kwargs):
        decoding = decoding_overrides(fewshot, samples, temperature, top_p)
        return fn(allow_seen=allow_seen, set_=[*decoding, *set_], **kwargs)

    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option(), annotation=kind)
             for name, kind, option in SCORING_OPTIONS]
    wrapper.__signature__ = inspect.Signature([*own, *extra])
    wrapper.__annotations__ = {**fn.__annotations__, **{name: kind for name, kind, _ in SCORING_OPTIONS}}
    return wrapper


def quiet_libraries() -> None:
    """delft prints what matters itself; library progress bars and advisories drown it (--debug keeps them)."""
    if DEBUG:
        return
    import logging
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")  # tqdm >= 4.66 reads TQDM_* overrides
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(peft|transformers|torch)\..*")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "kernels-community" advisory on CPU
    logging.getLogger("liger_kernel").setLevel(logging.ERROR)  # optional backends (CuTe DSL, Ascend) it lacks


def friendly(fn):
    """User mistakes -> one red paragraph and exit 2; failed verifications -> exit 1. --debug re-raises."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        quiet_libraries()
        with signals.stop_on_signals():  # SIGTERM too: a message and exit 143, never a silent kill mid-write
            return _reported(fn, *args, **kwargs)

    return wrapper


def _reported(fn, *args, **kwargs):
    """``fn`` under ``friendly``'s rules (inside ``signals.stop_on_signals``, which records the signal)."""
    try:
        result = fn(*args, **kwargs)
        signals.check()  # a signal whose exception a finalizer swallowed still ends the command
        return result
    except (UserError, VerificationError) as e:
        if DEBUG:
            raise
        label = "error" if isinstance(e, UserError) else "verification failed"
        from delft.training.launch import report_error

        if not report_error(str(e), e.exit_code):  # a --nproc worker leaves it to the parent, printed once
            # escaped: a message's own brackets (pip install -e ".[gguf]") are text, not rich markup
            from delft.recipe.shipped import cite_shipped_docs

            err_console.print(f"[bold red]{label}:[/] {escape(cite_shipped_docs(str(e)))}", highlight=False,
                              soft_wrap=True)
        raise typer.Exit(e.exit_code)
    except KeyboardInterrupt:
        if DEBUG:
            raise
        how = signals.received()
        err_console.print(f"[yellow]{signals.describe(how)}[/] (nothing was left half-written)")
        raise typer.Exit(signals.exit_code(how))
    except Exception:
        how = signals.received()
        if how is None or DEBUG:
            raise
        # the stop surfaced as another exception: raised inside an import (a half-imported module then fails as
        # a RecursionError) or turned into its own error by a library's except clause
        err_console.print(f"[yellow]{signals.describe(how)}[/] (nothing was left half-written)")
        raise typer.Exit(signals.exit_code(how))


def _print_version(value: bool) -> None:
    """The distribution (``pip install delft-digits``) and its version; a warning when PyPI's unrelated ``delft``
    package shares the environment, since both import as ``delft``."""
    if value:
        from importlib import metadata

        from delft import DISTRIBUTION, __version__
        from delft.models.loading import bitsandbytes_line

        console.print(f"{DISTRIBUTION} {__version__} (the delft command)", highlight=False)
        console.print(bitsandbytes_line(), highlight=False)
        try:
            other = metadata.version("delft")
        except metadata.PackageNotFoundError:
            other = None
        if other is not None:
            err_console.print(f"[yellow]warning:[/] a package named 'delft' ({other}: PyPI's unrelated project, or this "
                              "one from before its rename) is installed here too, and both import as delft. Remove it: "
                              "pip uninstall delft", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print delft's version and exit.")):
    pass


@app.command()
@friendly
def train(
    recipe: Path = typer.Argument(..., help="Recipe YAML file, or a built-in recipe's name (quickstart; delft recipe "
                                  "list)."),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
    resume: Optional[bool] = typer.Option(
        None, "--resume/--no-resume", help="Continue from the run's last checkpoint (default: automatic if one exists)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing run directory."),
    nproc: Optional[int] = typer.Option(None, "--nproc", min=1, help="Processes on this machine (one per GPU), via "
                                        "torchrun (default 1; train.distributed fsdp needs it, or torchrun)."),
    oversubscribe: bool = typer.Option(False, "--oversubscribe",
                                       help="Allow more --nproc processes than GPUs (or CPU cores without GPUs)."),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="Machines in the run; start the same command on each "
                               "(docs/distributed.md#several-machines)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", min=0, help="This machine's number, 0 to --nnodes "
                                            "- 1 (0 writes the run directory; several nodes only)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Node 0's address, which every node can "
                                              "reach and node 0 listens on (several nodes only; default 127.0.0.1)."),
    master_port: Optional[int] = typer.Option(None, "--master-port", min=1, max=65535,
                                              help="A free port on node 0 (several nodes only; default 29500)."),
):
    """Fine-tune with QLoRA and a digit-aware loss; writes an adapter to the recipe's output.dir."""
    from delft.recipe.files import load_recipe
    from delft.training.launch import Nodes

    nodes = Nodes(nnodes, node_rank, master_addr, master_port)
    nodes.check()
    cfg = load_recipe(recipe, set_)  # a mistake in the recipe is refused before the training modules load torch
    from delft.training.command import train_command

    train_command(cfg, resume, force, nproc, oversubscribe, console, nodes)


@app.command("eval")
@friendly
def eval_(
    targets: Optional[List[str]] = typer.Argument(
        None, help="[RECIPE.yaml] then run directories, merged models or .gguf files (run in llama.cpp)."),
    model: Optional[str] = typer.Option(None, "--model", help="Base model (overrides the recipe's model.name)."),
    data: Optional[str] = typer.Option(None, "--data", help="Eval data source (file, hub id or 'synthetic')."),
    format: Optional[str] = typer.Option(None, "--format", help="Format of --data (gsm8k, svamp, alpaca, ...)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Evaluate at most N problems."),
    no_base: bool = typer.Option(False, "--no-base", help="Skip the base model column."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every metric and prediction here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of per-place digit accuracy."),
    teacher: bool = typer.Option(False, "--teacher-forced", help="Also score the gold completions token by token: "
                                 "digit accuracy and CE per place, CE / perplexity of the other tokens."),
    fewshot: Optional[int] = _fewshot_option(),
    samples: Optional[int] = _samples_option(),
    temperature: Optional[float] = _temperature_option(),
    top_p: Optional[float] = _top_p_option(),
    backend: Optional[str] = typer.Option(
        None, "--backend", help="What runs a .gguf --model: transformers (dequantised, the default) or llama.cpp "
        "(the file as people run it). GGUF files given as runs always run in llama.cpp."),
    allow_seen: bool = _allow_seen_option(),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
):
    """Numeric accuracy of the base model, adapters, merged models and GGUF files, side by side."""
    from delft.evaluation.command import run_eval

    recipe, runs = _split_recipe(targets or [])
    chosen = [f"eval.backend={backend}"] if backend is not None else []
    run_eval(recipe_path=recipe, runs=runs, model=model, data=data, data_format=format, limit=limit,
             include_base=not no_base, json_out=json_out, plot=plot, console=console, teacher_forced=teacher,
             allow_seen=allow_seen,
             overrides=[*decoding_overrides(fewshot, samples, temperature, top_p), *chosen, *set_])


@app.command("inspect")
@friendly
def inspect_(
    targets: List[str] = typer.Argument(..., metavar="[RECIPE.yaml] [RUN_DIR...] PROMPT",
                                        help="An optional recipe, the run directories to set side by side (with "
                                        "--compare), then the prompt."),
    model: Optional[str] = typer.Option(None, "--model", help="Base model (overrides the recipe's model.name)."),
    adapter: Optional[str] = typer.Option(None, "--adapter", help="A run directory (adapter) or merged model."),
    target: Optional[str] = typer.Option(None, "--target", help="Teacher-force this answer instead of generating."),
    compare: bool = typer.Option(False, "--compare", help="A flag: the arguments between the recipe and the prompt "
                                 "are run directories, compared side by side (delft inspect --compare runs/ce runs/del "
                                 "\"What is 17 * 23?\"; base names the base model)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Generation budget for the greedy answer."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every number shown here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a heatmap PNG (positions x digits)."),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
):
    """Per-digit probability tables for one prompt: where the model is sure, where it hesitates."""
    from delft.inspection.command import run_inspect

    *rest, prompt = targets
    recipe, runs = _split_recipe(rest)
    if runs and not compare:
        raise UserError(f"unexpected arguments {runs}", fix="Use --adapter RUN, or --compare RUN_A RUN_B \"prompt\".")
    if compare and not runs:
        raise UserError("--compare needs run directories before the prompt", fix='e.g. --compare runs/ce runs/del "What is 17 * 23?"')
    if compare and adapter:  # one would be dropped or the two silently combined: neither is what was asked
        raise UserError(f"--adapter {adapter} and --compare do not go together: --adapter inspects one run, "
                        "--compare sets the runs named before the prompt side by side", "delft inspect",
                        f"Use --adapter {adapter} \"prompt\" for that run alone, or --compare {adapter} "
                        f"{' '.join(runs)} \"prompt\" to compare them (name base among them for the base model).")
    adapters = runs if compare else ([adapter] if adapter else [])
    run_inspect(recipe_path=recipe, prompt=prompt, model=model, adapters=adapters, target=target,
                max_new_tokens=max_new_tokens, json_out=json_out, plot=plot, overrides=set_, console=console)


@app.command()
@friendly
def export(
    run: Path = typer.Argument(..., help="Run directory written by delft train."),
    out: Path = typer.Option(..., "--out", help="Directory for the merged model (must not exist unless --force)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32."),
    match_training: bool = typer.Option(
        False, "--match-training", help="Merge into nf4 round-tripped weights (what a QLoRA adapter was trained on)."),
    tolerance: Optional[float] = typer.Option(None, "--tolerance", help="Max |logit difference| allowed in the check."),
    device: str = typer.Option("cpu", "--device", help="Where to merge: cpu or cuda."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out."),
    gguf: List[str] = typer.Option(
        [], "--gguf", help="Also write DIR/<name>-TYPE.gguf for llama.cpp, Ollama, LM Studio: f16, bf16, q8_0, "
                           "q4_k_m, ... (repeatable)."),
    gguf_lora: bool = typer.Option(False, "--gguf-lora", help="Also write the adapter alone as a GGUF LoRA "
                                                              "(with its base as GGUF) for llama-cli --lora."),
    gguf_check: Optional[bool] = typer.Option(
        None, "--gguf-check/--no-gguf-check",
        help="Load the GGUF files in llama.cpp and compare logits (default: when llama-cpp-python is installed)."),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code",
        help="Run Python code shipped with the base model or run (auto_map). Never read from the run's files."),
):
    """Merge an adapter into a standalone model and verify the merge (optionally GGUF, checked in llama.cpp)."""
    from delft.export.command import run_export

    run_export(run, out, dtype=dtype, match_training=match_training, tolerance=tolerance, device=device, force=force,
               gguf=gguf, gguf_lora=gguf_lora, gguf_check=gguf_check, trust_remote_code=trust_remote_code,
               console=console)


@app.command()
@friendly
@scoring_options
def compare(
    recipes: List[Path] = typer.Argument(
        ..., help="Recipes that differ only in their loss or data.numbers (recipes/compare/*.yaml)."),
    seeds: List[int] = typer.Option([0], "--seed", help="Training seed(s) (repeatable)."),
    out: Path = typer.Option(Path("results/compare"), "--out", help="Where the table, JSON and plot go."),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
    transfer: Optional[str] = typer.Option(
        None, "--transfer", help="A second eval set (a file such as SVAMP's svamp.json), to see whether training "
        "transfers; none unless given."),
    transfer_format: str = typer.Option("svamp", "--transfer-format", help="Format of --transfer (svamp, gsm8k, ...)."),
    transfer_limit: int = typer.Option(100, "--transfer-limit", help="Evaluate the first N problems of --transfer."),
    transfer_max_new_tokens: int = typer.Option(
        32, "--transfer-max-new-tokens", help="Generation budget on --transfer (word problems: some text first)."),
    no_transfer: bool = typer.Option(
        False, "--no-transfer", help="Only the synthetic held-out set, even with --transfer."),
    force: bool = typer.Option(False, "--force", help="Replace earlier results in --out (as a set)."),
    plan: bool = typer.Option(False, "--plan", help="Train nothing: check the recipes as a comparison and print "
                              "every run (finished, resumed or to train), the steps left and the sets to score."),
    nproc: Optional[int] = ARMS_NPROC,
    allow_seen: bool = False,
):
    """Train what is missing, then evaluate the base model and every adapter side by side."""
    from delft.experiments.compare import plan_compare, run_compare

    if plan:
        plan_compare(recipes, seeds, set_, console, transfer, transfer_format, transfer_limit, no_transfer)
        return
    run_compare(recipe_paths=recipes, seeds=seeds, out=out, overrides=set_, console=console, transfer=transfer,
                transfer_format=transfer_format, transfer_limit=transfer_limit,
                transfer_max_new_tokens=transfer_max_new_tokens, no_transfer=no_transfer, force=force,
                allow_seen=allow_seen, nproc=nproc)


@app.command()
@friendly
@scoring_options
def study(
    study_file: Path = typer.Argument(..., help="A study file (recipes/study/*.study.yaml): recipes, seeds, eval sets."),
    data_dir: Optional[Path] = typer.Option(
        None, "--data-dir", help="Folder holding the study's data files: its relative data paths are looked up here."),
    set_: List[str] = typer.Option([], "--set", help="Override a key of the study file (--set seeds=[0,1], --set "
                                   "evals.held_out.limit=100) or of its recipes (--set train.max_steps=50); "
                                   "repeatable."),
    train_only: bool = typer.Option(False, "--train-only", help="Train (or resume) the missing runs, then stop."),
    force: bool = typer.Option(False, "--force", help="Replace earlier results in the study's out (as a set)."),
    plan: bool = typer.Option(False, "--plan", help="Train nothing: print, for each comparison, the smallest "
                              "difference its seeds and problems can detect (80 % power), from the study file's "
                              "plan.seed_spread or plan.pilot, and warn where it exceeds the margin."),
    nproc: Optional[int] = ARMS_NPROC,
    allow_seen: bool = False,
    report: bool = typer.Option(False, "--report", help="Train and evaluate nothing: write the analysis in the "
                                "study's out/study.json, its summary.md and tables.txt again from that study.json "
                                "with this delft's analysis (the evaluation tables in tables.txt are kept)."),
):
    """Run a whole loss study: train what is missing, evaluate every set, write results with paired intervals."""
    from delft.experiments.study import plan_study, report_again, run_study

    if report:
        given = [flag for flag, on in (("--plan", plan), ("--train-only", train_only), ("--force", force),
                                       ("--nproc", nproc is not None), ("--data-dir", data_dir is not None),
                                       ("--allow-seen", allow_seen)) if on]
        if given:
            raise UserError(f"--report trains and evaluates nothing, so {', '.join(given)} has nothing to act on",
                            "delft study --report", "Drop " + ", ".join(given) + ", or run without --report.")
        report_again(study_file, overrides=set_, console=console)
        return
    if plan:
        plan_study(study_file, data_dir=data_dir, overrides=set_, console=console)
        return
    run_study(study_file, data_dir=data_dir, overrides=set_, console=console, train_only=train_only, force=force,
              allow_seen=allow_seen, nproc=nproc)


@recipe_app.command("check")
@friendly
def recipe_check(
    recipe: Path = typer.Argument(..., help="Recipe YAML file, or a built-in recipe's name (quickstart)."),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
    plan: bool = typer.Option(False, "--plan", help="Estimate peak GPU memory and say whether it fits."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="GPU memory to plan for, e.g. 8GiB."),
    shape: Optional[str] = typer.Option(None, "--shape", help="With --plan: plan a shipped model shape (qwen2.5-7b, "
                                        "llama-3.1-8b, mistral-7b-v0.3, phi-3-mini, ...) instead of model.name's "
                                        "config.json; an unknown name lists them all."),
    world_size: int = typer.Option(1, "--world-size", min=1, help="Plan each GPU of a run on N processes."),
    distributed: Optional[str] = typer.Option(None, "--distributed", help="Plan the run as ddp or fsdp (the same as "
                                              "--set train.distributed=...; default: the recipe's)."),
    show_examples: int = typer.Option(0, "--show-examples", min=0, help="Print the first N training examples as "
                                      "the trainer tokenizes them: masked and trained spans, the digits the loss "
                                      "scores and their places."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Look relative data paths up here, as delft "
                                            "study --data-dir does (a study's recipes and eval sets)."),
):
    """Validate a recipe (or a study file and its recipes) and print it with every default resolved."""
    from rich.syntax import Syntax

    from delft.recipe.files import dump_recipe, load_recipe
    from delft.recipe.shipped import resolve_recipe
    from delft.recipe.studies import is_study_file
    from delft.planning.memory import parse_memory

    if gpu_memory is not None:
        parse_memory(gpu_memory)  # a bad budget is refused before the plan is worked out and printed
    if shape is not None and not plan:
        raise UserError(f"--shape {shape} sizes the memory plan, and no --plan was asked for", "--shape",
                        f"Add --plan: delft recipe check {recipe} --plan --shape {shape}.")
    if is_study_file(resolve_recipe(recipe)):
        _check_study(resolve_recipe(recipe), data_dir, set_)
        return
    cfg = load_recipe(recipe, [*set_, *([f"train.distributed={distributed}"] if distributed else [])])
    try:
        _check_recipe(cfg, resolve_recipe(recipe), data_dir)
    except UserError as e:
        if not plan:
            raise
        # --plan often sizes a run for another machine (its GPU, its packages): say it, and plan anyway
        console.print(f"[yellow]note:[/] train would refuse this recipe on this machine: {escape(str(e))}",
                      highlight=False, soft_wrap=True)
    console.print(f"[green]ok[/] {recipe}: valid recipe")
    console.print(Syntax(dump_recipe(cfg), "yaml", theme="ansi_dark", background_color="default"))
    if plan:
        from delft.planning.command import run_plan

        run_plan(cfg, gpu_memory=gpu_memory, console=console, world_size=world_size, shape=shape)
    if show_examples:
        from delft.training.preview import show_examples as show

        show(cfg, show_examples, console)


def _check_recipe(cfg, path: Path, data_dir: Optional[Path]) -> None:
    """train's own checks before loading ("valid" means train gets past them here), a relative data file looked up
    in ``data_dir`` first; a study's recipe whose data file is not here passes with a note (the study finds it in
    its --data-dir)."""
    from delft.recipe.studies import studies_training
    from delft.training.precheck import check_before_loading, local_data_file

    source = Path(cfg.data.source).expanduser()
    relative_file = local_data_file(cfg.data.source, cfg.data.format) and not source.is_absolute()
    if relative_file and data_dir is not None:
        if not (data_dir / source).exists() and not source.exists():
            raise UserError(f"data file {source} is neither in --data-dir {data_dir} nor here", "data.source",
                            "Pass --data-dir the folder that holds it, or fix data.source.")
        if (data_dir / source).exists():
            cfg.data.source = str(data_dir / source)
    try:
        check_before_loading(cfg)
    except UserError as e:
        studies = studies_training(path) if relative_file and not Path(cfg.data.source).exists() else []
        if e.where != "data.source" or data_dir is not None or not studies:
            raise
        console.print(f"[yellow]note:[/] data file {source} is not here, so its rows were not checked: {path} is "
                      f"trained by {studies[0]}, which looks it up in delft study --data-dir DIR (delft recipe check "
                      f"{path} --data-dir DIR checks it too)", highlight=False, soft_wrap=True)


def _check_study(path: Path, data_dir: Optional[Path], overrides: List[str]) -> None:
    """A study file, its recipes (each as recipe check checks one, compared as delft study compares them) and its
    eval sets; data files that are not here are named, and pass only where no --data-dir was given."""
    from delft.experiments.contenders import resolve_contenders
    from delft.experiments.study_file import eval_data, load_study, split_overrides

    own, overrides = split_overrides(overrides)  # --set seeds=... reaches the study file, train.* its recipes
    study = load_study(path, own)
    contenders = resolve_contenders([path.parent / r for r in study.recipe_files()], overrides, console,
                                    "delft study", f"{path}: recipes")
    for c in contenders:
        _check_recipe(c.recipe, c.path, data_dir)
    for name, spec in study.evals.items():
        try:
            eval_data(name, spec, contenders[0].recipe, data_dir)
        except UserError as e:
            if data_dir is not None or "does not exist" not in e.what:
                raise
            console.print(f"[yellow]note:[/] eval set {name}: {escape(e.what)}; the study looks it up in delft study "
                          f"--data-dir DIR", highlight=False, soft_wrap=True)
    runs = len(contenders) * len(study.seeds)
    console.print(f"[green]ok[/] {path}: valid study file: {len(contenders)} recipes x {len(study.seeds)} seeds = "
                  f"{runs} runs, eval sets {', '.join(study.evals)}, results in {study.out}", highlight=False)


@recipe_app.command("new")
@friendly
def recipe_new(
    name: str = typer.Argument(..., help="A built-in recipe (quickstart; delft recipe list names them all)."),
    out: Path = typer.Argument(..., help="The file to write (never overwritten)."),
):
    """Write a built-in recipe, with its comments, to a file of your own to edit."""
    from delft.recipe.starter import write_new_recipe

    written = write_new_recipe(name, out)
    console.print(f"[green]wrote[/] {written} (from the built-in recipe {name}). Next: delft recipe check {written}, "
                  f"then delft train {written}", highlight=False)


@recipe_app.command("list")
@friendly
def recipe_list():
    """The recipes that come with delft: run one by name (delft train quickstart) or copy it (delft recipe new)."""
    from delft.recipe.shipped import recipes_dir
    from delft.recipe.starter import builtin_recipes

    for name, said in builtin_recipes():
        console.print(f"{name:<42} {said}", highlight=False)
    console.print(f"\n(files in {recipes_dir()})", highlight=False)


@app.command("docs")
@friendly
def docs(page: Optional[str] = typer.Argument(None, help="A page (gpu, recipes, refusals, ...); none: list them.")):
    """Print one of the docs pages that come with delft (Markdown), or list them and where they are."""
    from delft.recipe.shipped import doc_page, docs_dir

    if page is None:
        for path in sorted(docs_dir().glob("*.md")):
            console.print(path.stem, highlight=False)
        console.print(f"\n(files in {docs_dir()}; delft docs PAGE prints one)", highlight=False)
        return
    sys.stdout.write(doc_page(page).read_text(encoding="utf-8"))


@recipe_app.command("keys")
@friendly
def recipe_keys():
    """Print every recipe key with its type, default and description (Markdown; docs/recipe_keys.md)."""
    from delft.recipe.keys import reference_markdown

    sys.stdout.write(reference_markdown())


def _split_recipe(targets: list[str]) -> tuple[Optional[Path], list[str]]:
    """The first argument is a recipe when it is a .yaml/.yml file; the rest are runs."""
    if targets and targets[0].lower().endswith((".yaml", ".yml")):
        return Path(targets[0]), list(targets[1:])
    return None, list(targets)


def main() -> None:
    """Entry point: ``--debug`` may stand anywhere on the command line."""
    global DEBUG
    if "--debug" in sys.argv[1:]:
        sys.argv.remove("--debug")
        DEBUG = True
    try:
        app()
    except SystemExit as e:  # the command ended on its own terms (a handled Ctrl-C or SIGTERM included): its exit code
        signals.forget_handled_interrupt()
        if e.code in (signals.exit_code(signal.SIGINT), signals.exit_code(signal.SIGTERM)):
            from delft.training.launch import report_stop

            report_stop(e.code)  # a --nproc worker: its launcher ends the same way, without torchrun's traceback
        raise


if __name__ == "__main__":
    main()
