"""A study file (``recipes/study/*.study.yaml``) as delft reads it: its typed schema (``StudyConfig``: recipes,
seeds, eval sets, the decision rule and the power plan), its ``--set`` overrides (``split_overrides``,
``load_study``) and each eval set as the data section it reads (``eval_data``). Torch-free: ``delft recipe check``
checks a study file with it, and ``delft study`` (delft.experiments.study) runs one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from delft.data.fields import check_data_path
from delft.data.sources import LOCAL_LOADERS
from delft.errors import UserError
from delft.evaluation.problems import disjoint_from_training
from delft.experiments.seed_level import MARGIN
from delft.recipe.files import merge_keys, parse_overrides, read_yaml
from delft.recipe.schema import DataConfig, ReasoningGymConfig, Recipe, SyntheticConfig, describe_error
from delft.recipe.section import Section

HUB_SPLIT = "test"  # the split a hub eval set reads unless its `split` says otherwise
EXACT_TEST_SEEDS = 6  # below this the exact tests' smallest p, 2 / 2^seeds, is 0.0625 or more


class EvalSet(Section):
    source: str = Field("synthetic", description="'synthetic' (the recipes' held-out generator, changed by "
                                                 "`synthetic`), 'reasoning_gym' (changed by `reasoning_gym`), a "
                                                 "data file (a relative file is looked up in --data-dir) or a hub "
                                                 "dataset id.")
    format: Optional[Literal["prompt_completion", "alpaca", "chat", "gsm8k", "svamp"]] = Field(
        None, description="How a file's or hub dataset's rows map to question and answer (required with either).")
    split: Optional[str] = Field(None, min_length=1, description=f"Split of a hub dataset (default: '{HUB_SPLIT}', "
                                 "the split a dataset is usually evaluated on; the recipes' data.split is their "
                                 "training split). Files and synthetic sets have none.")
    limit: int = Field(..., gt=0, description="Evaluate the first N problems.")
    mode: Literal["greedy", "teacher_forced"] = Field(
        "greedy", description="Generate answers and score them, or score the gold completion token by token.")
    max_new_tokens: int = Field(32, gt=0, description="Generation budget per answer (greedy sets).")
    synthetic: dict[str, Any] = Field(default_factory=dict, description="Changes to the held-out generator: "
                                      "seed, min_digits, max_digits, ops, ... (synthetic sets only).")
    reasoning_gym: dict[str, Any] = Field(default_factory=dict, description="A reasoning-gym set (source "
                                          "reasoning_gym): task, options, n, seed, as data.reasoning_gym.")


class Arm(Section):
    recipe: str = Field(..., min_length=1, description="A recipe file relative to the study file.")
    control: bool = Field(False, description="A positive control: a loss expected to move the metric, which shows "
                          "whether the design can see a digit-loss effect at all (the summary says if it moved).")
    calibrator: bool = Field(False, description="A calibrator: a loss with a known cost, expected below the "
                             "reference. It is tested alone at p < 0.05 (outside Holm's family); where it does not "
                             "come out below, the design is insensitive and no other arm is read there (the summary "
                             "says so first).")

    @model_validator(mode="after")
    def _one_role(self):
        if self.control and self.calibrator:
            raise ValueError("an arm is a control (expected up) or a calibrator (expected down), not both")
        return self


class PowerPlan(Section):
    seed_spread: Optional[float] = Field(None, ge=0, description="Points: how much a recipe's difference from the "
                                         "reference varies from seed to seed beyond the noise of the set's problems "
                                         "(the standard deviation of the effect over seeds). `delft study --plan` "
                                         "adds the problems' own noise (at worst, for right/wrong answers).")
    pilot: Optional[str] = Field(None, min_length=1, description="Or: an earlier study's study.json (or its out "
                                 "folder), relative to this file, whose seeds give the spread per set and recipe "
                                 "(the upper end of its 95 % interval: a few seeds' spread is a rough estimate). It "
                                 "must have run every arm the study plans for.")
    problem_variance: Optional[float] = Field(None, ge=0, le=1, description="With seed_spread: the per-problem "
                                              "variance of a paired right/wrong difference (default 0.5, the "
                                              "worst case); state where the figure comes from.")


class StudyConfig(Section):
    description: str = Field("", description="What the study asks and, written before it runs, what would confirm "
                             "it, what would refute it, and what a control that does not move means (shown at the "
                             "top of summary.md).")
    recipes: list[Union[str, Arm]] = Field(..., min_length=2, description="Recipe files relative to this file (or "
                                           "{recipe: FILE, control: true}); they may differ only in their loss, "
                                           "data.numbers (and grpo) sections.")
    seeds: list[int] = Field([0, 1, 2], min_length=1, description="Training seeds: every recipe trains once per seed.")
    out: str = Field(..., min_length=1, description="Results directory (relative to the current directory).")
    evals: dict[str, EvalSet] = Field(..., min_length=1, description="Eval sets by name (a name is a file stem).")
    curve: list[int] = Field(default_factory=list, description="Training steps at which every run is evaluated too "
                             "(it keeps snapshots there): exact match along training and the area under that curve "
                             "on every greedy set; the finished run is the last point.")
    margin: float = Field(MARGIN, ge=0, description="The smallest exact-match difference that matters, in points "
                          f"(default {MARGIN:g}; the verdicts say whether the file stated it). An arm is better or "
                          "worse when the t test over seeds, Holm-adjusted, gives p < 0.05; equivalent when the t "
                          "interval over seeds lies inside +-margin and a control moved up on that set; not readable "
                          "on a floor or when no control moved; otherwise inconclusive.")
    decide: Literal["t", "two_way", "sign_flip", "wilcoxon"] = Field(
        "t", description="The test that decides: t (the paired t test over seeds), two_way (the seed x problem "
        "random-effects interval: where every seed sees the same problems and they carry the spread, as in LoRA "
        "fine-tuning), sign_flip or wilcoxon (exact, distribution-free: from scratch with 8 or more seeds). Other "
        "than t, equivalence is TOST at +-margin.")
    learns_at: Optional[float] = Field(None, gt=0, le=1, description="A held-out exact-match share (e.g. 0.5) at "
                                       "which a run counts as having learned the task: the study reports each run's "
                                       "first step there and the seeds that get there, against the reference, from "
                                       "the runs' train.accuracy_steps measurements (delft.experiments.transitions).")

    plan: PowerPlan = Field(default_factory=PowerPlan, description="The between-seed spread `delft study --plan` "
                            "computes the detectable differences from (stated or piloted), written before the runs.")

    def recipe_files(self) -> list[str]:
        return [r if isinstance(r, str) else r.recipe for r in self.recipes]

    def controls(self) -> list[str]:
        """The names (file stems) of the positive-control recipes."""
        return [Path(r.recipe).stem for r in self.recipes if isinstance(r, Arm) and r.control]

    def calibrators(self) -> list[str]:
        """The names (file stems) of the calibrator recipes (a known cost, expected below the reference)."""
        return [Path(r.recipe).stem for r in self.recipes if isinstance(r, Arm) and r.calibrator]

    @model_validator(mode="after")
    def _exact_tests_need_seeds(self):
        if self.decide in ("sign_flip", "wilcoxon") and len(self.seeds) < EXACT_TEST_SEEDS:
            raise ValueError(f"decide: {self.decide} with {len(self.seeds)} seeds cannot reach p < 0.05 (its smallest "
                             f"p is 2 / 2^seeds); give {EXACT_TEST_SEEDS} or more seeds, or decide: t")
        return self

    @field_validator("curve")
    @classmethod
    def _curve_steps(cls, steps: list[int]) -> list[int]:
        if any(s <= 0 for s in steps) or len(set(steps)) != len(steps):
            raise ValueError("curve steps are training steps, 1 or more, each once")
        return sorted(steps)

    @field_validator("seeds")
    @classmethod
    def _each_seed_once(cls, seeds: list[int]) -> list[int]:
        twice = [s for i, s in enumerate(seeds) if s in seeds[:i]]
        if twice:
            raise ValueError(f"seed {twice[0]} is given twice: it would count one run as two seeds; give each "
                             "training seed once")
        return seeds


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """--set items for the study file's own keys (seeds, margin, evals.NAME.limit, plan.seed_spread: a key whose
    first part is a study file key) and for its recipes (model, data, train, loss, eval, ...): the two name
    different keys, so each --set reaches the one it names."""
    own = [o for o in overrides if o.partition("=")[0].strip().split(".")[0] in StudyConfig.model_fields]
    return own, [o for o in overrides if o not in own]


def load_study(path: Path, overrides: Sequence[str] = ()) -> StudyConfig:
    """The study file, with ``overrides`` (--set items of its own keys, split_overrides) applied."""
    data = read_yaml(Path(path))
    if overrides:
        _no_new_sets(data, overrides, path)
        data = merge_keys(data, parse_overrides(list(overrides)))
    try:
        study = StudyConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(describe_error(err, StudyConfig) for err in e.errors())
        raise UserError(f"invalid study file: {problems}", f"{path}{' (with --set overrides)' if overrides else ''}",
                        "A study file has recipes, seeds, out and evals (see recipes/study/).") from None
    bad = [name for name in study.evals if not name.replace("_", "").replace("-", "").isalnum()]
    if bad:
        raise UserError(f"eval set names {bad} are not plain words", str(path),
                        "Name sets with letters, digits, '_' and '-' (they name the plot files).")
    return study


def _no_new_sets(data: dict, overrides: Sequence[str], path: Path) -> None:
    """``--set evals.NAME.KEY=...`` changes a set the file has; a NAME it lacks (a typo, or another study's set)
    would add a set of that one key, and is refused."""
    sets = data.get("evals") if isinstance(data.get("evals"), dict) else {}
    for item in overrides:
        parts = item.partition("=")[0].strip().split(".")
        if parts[0] == "evals" and len(parts) > 2 and parts[1] not in sets:
            raise UserError(f"--set {item} names the eval set {parts[1]!r}, which {path} does not have (its sets: "
                            f"{', '.join(sets) or 'none'})", "--set",
                            "Name one of its sets; a new set goes in the study file, with its source and limit.")


def data_file(source: str, data_dir: Optional[Path], where: str) -> str:
    """A file source as given, or looked up in --data-dir when relative; missing files are refused now. A
    hub dataset id (no file suffix, no such path) is left to the data loader."""
    path = Path(source).expanduser()
    in_dir = data_dir is not None and (data_dir / path).exists()
    if path.suffix.lower() not in LOCAL_LOADERS and not path.exists() and not in_dir:
        return source
    if not path.is_absolute() and data_dir is not None:
        path = data_dir / path
    check_data_path(path, str(path), where.removesuffix(".source"),
                    "Pass --data-dir DIR, the folder that holds the study's data files (GSM8K's train.jsonl/test.jsonl "
                    "as gsm8k_train.jsonl/gsm8k_test.jsonl, SVAMP's svamp.json).")
    return str(path)


def eval_data(name: str, spec: EvalSet, cfg: Recipe, data_dir: Optional[Path]) -> DataConfig:
    """One eval set as a DataConfig, rendered like the recipes' training data (template, system prompt)."""
    where = f"evals.{name}"
    fields = cfg.eval_data().model_dump()
    fields.update(limit=spec.limit, val_size=0)
    if spec.source == "synthetic":
        if spec.format not in (None, "synthetic"):
            raise UserError(f"a synthetic set has no format (got {spec.format!r})", where, "Drop format.")
        _no_split(spec, "a synthetic set", where)
        try:
            fields["synthetic"] = SyntheticConfig.model_validate({**fields["synthetic"], **spec.synthetic})
        except ValidationError as e:
            problems = "; ".join(describe_error(err, SyntheticConfig) for err in e.errors())
            raise UserError(f"invalid synthetic changes: {problems}", f"{where}.synthetic",
                            "Use the keys of data.synthetic (seed, min_digits, max_digits, ops, ...).") from None
        fields["format"] = "synthetic"
    elif spec.source == "reasoning_gym":
        fields.update(format="reasoning_gym", reasoning_gym=_reasoning_gym_set(spec, fields, where))
    else:
        if spec.synthetic:
            raise UserError("synthetic changes given for a file source", f"{where}.synthetic", "Drop them.")
        if spec.format is None:
            raise UserError(f"a file source needs a format ({spec.source})", f"{where}.format",
                            "e.g. format: gsm8k (or svamp, prompt_completion, ...).")
        fields.update(source=data_file(spec.source, data_dir, f"{where}.source"), format=spec.format)
        fields["synthetic"] = SyntheticConfig()
        if Path(fields["source"]).is_file():  # data_file refused missing files: anything else is a hub id
            _no_split(spec, f"a data file ({fields['source']})", where)
        else:
            fields["split"] = spec.split or HUB_SPLIT
    return disjoint_from_training(DataConfig.model_validate(fields), cfg.data)


def _reasoning_gym_set(spec: EvalSet, fields: dict, where: str) -> ReasoningGymConfig:
    """A reasoning-gym eval set's generator: the recipes' own (when they train on one) changed by the set's keys."""
    if spec.format not in (None, "reasoning_gym") or spec.synthetic:
        raise UserError("a reasoning_gym set has no format and no synthetic changes", where, "Drop them.")
    _no_split(spec, "a reasoning_gym set", where)
    base = fields["reasoning_gym"] if fields["format"] == "reasoning_gym" else {}
    try:
        return ReasoningGymConfig.model_validate({**base, **spec.reasoning_gym})
    except ValidationError as e:
        problems = "; ".join(describe_error(err, ReasoningGymConfig) for err in e.errors())
        raise UserError(f"invalid reasoning_gym set: {problems}", f"{where}.reasoning_gym",
                        "Use the keys of data.reasoning_gym (task, options, n, seed).") from None


def _no_split(spec: EvalSet, what: str, where: str) -> None:
    if spec.split is not None:
        raise UserError(f"{what} has no split (got split: {spec.split}); split names the part of a hub dataset to "
                        "evaluate", f"{where}.split", "Drop split, or give a hub dataset id as source.")
