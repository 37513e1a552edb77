"""Whether a study's runs reproduce its pilot's runs of the same name (a study that shares some runs' settings with
the earlier study it plans from, as lora_powered's ce and del seeds 0-2 share formats_lora's).

From the two study.json files, and each run's delft_run.json where its directory is still there. Settings: the
recipe each study.json stores (its first recipe's, resolved), with the run's own loss (study.json keeps each arm's
loss section, not its whole recipe), leaving out what a run's training does not read: output.dir, the eval section,
and train.seed (the same by name). A key that differs is one of: added to delft since the pilot (absent there, at
its default here), unused (in a data section the recipes' source does not read), an ``auto`` that resolved to the
other side's value where that run trained, or a real difference. Final records: the training section's last logged
step (train loss, CE, term, gradient norm) and last validation (validation CE), each equal bit for bit (JSON keeps
every float exactly) or not, with the largest relative difference.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from delft.data.columns import FORMAT_FIELDS
from delft.errors import UserError
from delft.outputs import plain_table
from delft.recipe.files import read_yaml
from delft.recipe.keys import flat_keys
from delft.recipe.model_section import resolve_quantization
from delft.recipe.schema import GENERATED, Recipe
from delft.rundir import COMPLETED, read_info

REPRODUCTION_HEADING = "Reproduction of the pilot's runs"  # its section in summary.md, its block in tables.txt
RUN_NAME = re.compile(r"^(?P<recipe>.+)-seed(?P<seed>-?\d+)$")
NOT_TRAINING = ("output.dir", "train.seed")  # besides the eval section: keys a run's training does not read
FINAL = (("train", "step"), ("train", "loss"), ("train", "ce"), ("train", "term"), ("train", "grad_norm"),
         ("validation", "step"), ("validation", "val_ce"))
ABSENT = "(absent)"

# What a differing key is, tried in this order; only DIFFERS makes the settings differ.
ADDED, UNUSED, EQUIVALENT, DIFFERS = "added since", "unused", "equivalent where they trained", "differs"
# What a run's training record or its delft_run.json may store of where and how it trained.
STORED = ("device", "dtype", "quantization", "threads", "torch_version")
# The recipe keys whose 'auto' the device resolves, each with the stored fact that says what it became.
BY_DEVICE = {"model.device": "device", "model.dtype": "dtype", "quantization.mode": "quantization"}
# model.dtype auto on a device (models.loading.resolve_dtype): on CUDA bf16 or fp16, as the GPU supports, which
# no study.json records, so only the CPU's is known from the device alone.
AUTO_DTYPE = {"cpu": "float32"}
# What an auto resolves to in full precision; a half-precision run (fp16 rounds at 2^-11, bf16 at 2^-8) or an nf4
# one would not follow a float32 run's final losses closer than fp16 rounds, so agreement inside it says the auto
# side trained like the other.
FULL_PRECISION = {"model.dtype": "float32", "quantization.mode": "none"}
HALF_PRECISION = 2.0 ** -11


def study_pilot(study_file: Optional[str]) -> Optional[Path]:
    """The pilot a study file names (plan.pilot, relative to the file), or None: no file there, or no pilot."""
    path = Path(study_file) if study_file else None
    if path is None or not path.is_file():
        return None
    pilot = ((read_yaml(path) or {}).get("plan") or {}).get("pilot")
    return Path(os.path.normpath(path.parent / pilot)) if isinstance(pilot, str) else None


def pilot_reproduction(report: dict, pilot_path: Optional[Path]) -> Optional[dict]:
    """The comparison of ``report``'s runs with the pilot's of the same name; None without a pilot or without a
    shared run name; a record saying so when the pilot's study.json cannot be read."""
    if pilot_path is None:
        return None
    path = Path(pilot_path) / "study.json" if Path(pilot_path).is_dir() else Path(pilot_path)
    try:  # read here: power's reader would close an import circle (power imports seed_level, which imports this)
        pilot = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return {"pilot": str(path), "error": f"{type(e).__name__}: {e}", "runs": []}
    if not isinstance(pilot, dict):
        return {"pilot": str(path), "error": "not a study.json (no mapping at its top)", "runs": []}
    rows = reproduction_rows(pilot, report)
    return {"pilot": str(path), "runs": rows} if rows else None


def reproduction_rows(pilot: dict, report: dict) -> list[dict]:
    """One row per run name both studies trained (in the study's order): settings and final records compared."""
    shared = [n for n in report.get("training") or {} if n in (pilot.get("training") or {}) and RUN_NAME.match(n)]
    rows = []
    for name in shared:
        records = (pilot["training"][name], report["training"][name])
        finals = final_differences(*records)
        largest = max(finals, key=lambda f: -1.0 if f["relative"] is None else f["relative"])
        agreement = None if any(f["relative"] is None for f in finals) else largest["relative"]
        sides = (run_settings(pilot, name), run_settings(report, name))
        facts = (stored_facts(records[0]), stored_facts(records[1]))
        differ = [classify(d, sides, facts, agreement) for d in setting_differences(*sides)]
        rows.append({"run": name, "settings_same": all(d["class"] != DIFFERS for d in differ),
                     "settings_differ": differ, "finals": finals, "bitwise": all(f["equal"] for f in finals),
                     "largest_relative": {"key": largest["key"], "value": largest["relative"]},
                     "stored": {"pilot": facts[0], "study": facts[1]}})
    return rows


def run_settings(report: dict, name: str) -> dict[str, Any]:
    """The settings of run ``name`` (recipe-seedN) as a study.json stores them, as dotted keys."""
    settings = report["settings"]
    recipe = dict(settings["recipe"])
    recipe["loss"] = (settings.get("losses") or {}).get(RUN_NAME.match(name)["recipe"], recipe.get("loss"))
    return {k: v for k, v in flat_keys(recipe).items() if k not in NOT_TRAINING and not k.startswith("eval.")}


def setting_differences(pilot: dict, study: dict) -> list[dict]:
    """Every key whose value differs (or that one side lacks), with both values."""
    return [{"key": k, "pilot": pilot.get(k, ABSENT), "study": study.get(k, ABSENT)}
            for k in sorted(set(pilot) | set(study)) if pilot.get(k, ABSENT) != study.get(k, ABSENT)]


def stored_facts(record: dict) -> dict:
    """What is stored of where and how a run trained: {"read": the records read, "facts": {fact: {"value", "in"}}}
    for each fact of STORED that its training record holds, or else its delft_run.json (read where the run
    directory is still there and holds this finished run)."""
    info = _run_info(record)
    read = ["study.json", *(["delft_run.json"] if info else [])]
    facts = {}
    for fact in STORED:
        for where, source in (("study.json", record), ("delft_run.json", info)):
            if source.get(fact) is not None:
                facts[fact] = {"value": source[fact], "in": where}
                break
    return {"read": read, "facts": facts}


def _run_info(record: dict) -> dict:
    """The run's delft_run.json when it is this record's finished run ({} otherwise: gone, another run since, or
    damaged, which leaves the comparison without it rather than stopping a report)."""
    run = record.get("run")
    if not isinstance(run, str) or not run:
        return {}
    try:
        info = read_info(Path(run))
    except UserError:
        return {}
    return info if info.get("status") == COMPLETED and info.get("step") == record.get("steps") else {}


def classify(diff: dict, settings: tuple[dict, dict], facts: tuple[dict, dict], agreement: Optional[float]) -> dict:
    """``diff`` with its class (ADDED, UNUSED, EQUIVALENT or DIFFERS) and why, from the two runs' settings, what
    is stored of where they trained, and how closely their final records agree (None: a record missing)."""
    key, pilot, study = diff["key"], diff["pilot"], diff["study"]
    if pilot == ABSENT and study == _defaults().get(key, ABSENT):
        return {**diff, "class": ADDED, "why": "not in the pilot's stored recipe, at its current default here"}
    unused = _unused(key, settings)
    if unused:
        return {**diff, "class": UNUSED, "why": unused}
    same, why = _auto_resolved(key, (pilot, study), settings, facts, agreement)
    return {**diff, "class": EQUIVALENT if same else DIFFERS, "why": why}


@lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    """Every recipe key at its current default."""
    return flat_keys(Recipe().to_dict())


def _unused(key: str, settings: tuple[dict, dict]) -> Optional[str]:
    """Why neither run reads ``key``, or None: a generator's section is read only when data.source names it (the
    schema pairs each generated source with its format); data.columns only by the formats that read a file."""
    parts = key.split(".")
    if parts[0] != "data" or len(parts) < 2:
        return None
    sources = sorted({str(s.get("data.source", _defaults()["data.source"])) for s in settings})
    formats = sorted({str(s.get("data.format", _defaults()["data.format"])) for s in settings})
    if parts[1] in GENERATED and parts[1] not in sources:
        return f"data.{parts[1]} is read only when data.source is {parts[1]} (here {' / '.join(sources)})"
    if parts[1] == "columns" and not set(formats) & set(FORMAT_FIELDS):
        return f"data.columns is read only by the formats that read a file's rows (here {' / '.join(formats)})"
    return None


def _auto_resolved(key: str, values: tuple, settings: tuple[dict, dict], facts: tuple[dict, dict],
                   agreement: Optional[float]) -> tuple[bool, str]:
    """(whether an 'auto' on one side took the other side's value where that run trained, what says so); False
    with "" for a key the device does not resolve, or two values that are not one auto and one value."""
    if key not in BY_DEVICE or values.count("auto") != 1:
        return False, ""
    side = values.index("auto")
    runs = ("the pilot's run", "this study's run")
    other, whose = values[1 - side], runs[side]
    took, where = _resolution(key, settings[side], facts[side]["facts"], facts[side]["read"])
    if took is not None:
        return took == other, f"auto was {took} where {whose} trained ({where})"
    if FULL_PRECISION.get(key) == other and agreement is not None and agreement < HALF_PRECISION:
        return True, (f"{whose} has {where}, but its final records agree with {runs[1 - side]}'s closer than half "
                      f"precision rounds ({HALF_PRECISION:.1e} relative), which bf16, fp16 or nf4 weights would not: "
                      "auto trained in full precision there, as on the CPU")
    return False, f"what auto became for {whose} is not known: it has {where}"


def _resolution(key: str, settings: dict, facts: dict, read: list[str]) -> tuple[Optional[str], str]:
    """(what ``key``'s auto became for one run, where that is read from), or (None, what is missing from the
    records ``read``)."""
    fact = BY_DEVICE[key]
    if fact in facts:
        return str(facts[fact]["value"]), f"{fact} {facts[fact]['value']} in its {facts[fact]['in']}"
    device = facts.get("device", {}).get("value")
    where = f"device {device} in its {facts['device']['in']}" if device else ""
    if device is None and settings.get("model.device", "auto") != "auto":
        device, where = settings["model.device"], f"model.device {settings['model.device']} in its recipe"
    if device is None:
        return None, f"no device or resolved value in its {' or '.join(read)}"
    if key == "model.device":
        return str(device), where
    if key == "model.dtype":
        took = AUTO_DTYPE.get(str(device))
        return took, where if took else f"{where}, and no dtype (bf16 or fp16 there, as the GPU supports)"
    t = {k: settings.get(f"train.{k}", _defaults()[f"train.{k}"]) for k in ("finetuning", "distributed")}
    return resolve_quantization("auto", str(device), t["finetuning"], t["distributed"]), where


def _relative(a: Any, b: Any) -> Optional[float]:
    """|a - b| over the larger magnitude (0 when equal); None where either is not a number."""
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return None
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))


def final_differences(pilot_run: dict, run: dict) -> list[dict]:
    """Each final record (FINAL) of one run in the pilot and in the study: equal bit for bit, relative difference."""
    out = []
    for part, key in FINAL:
        a, b = (pilot_run.get(part) or {}).get(key), (run.get(part) or {}).get(key)
        out.append({"key": f"{part}.{key}", "pilot": a, "study": b, "equal": a is not None and a == b,
                    "relative": _relative(a, b)})
    return out


def _largest(r: dict) -> str:
    big = r["largest_relative"]
    if big["value"] is None:
        return "- (a record is missing)"
    return "0 (every record equal)" if big["value"] == 0 else f"{big['value']:.3g} ({big['key']})"


def _settings_cell(r: dict) -> str:
    real = [d["key"] for d in r["settings_differ"] if d["class"] == DIFFERS]
    return "settings differ: " + ", ".join(real) if real else "same settings"


def reproduction_table(rep: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per shared run, the settings' verdict, final records bitwise equal?, the largest difference."""
    header = ["run", "settings", "final records bitwise equal", "largest relative difference"]
    return header, [[r["run"], _settings_cell(r), "yes" if r["bitwise"] else "no", _largest(r)] for r in rep["runs"]]


def _shown(value: Any) -> str:
    return "absent" if value == ABSENT else repr(value)


def _explained(rep: dict, classes: tuple[str, ...]) -> list[str]:
    """The differing settings of these classes, those with the same class and reason together: 'key (pilot value
    -> study value) and ..., class: why', naming the runs where that is not every shared run."""
    runs: dict[tuple[str, str, str], list[str]] = {}
    for r in rep["runs"]:
        for d in r["settings_differ"]:
            if d["class"] in classes:
                text = f"{d['key']} ({_shown(d['pilot'])} -> {_shown(d['study'])})"
                runs.setdefault((text, d["class"], d["why"]), []).append(r["run"])
    grouped: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
    for (text, kind, why), names in runs.items():
        grouped.setdefault((kind, why, tuple(names)), []).append(text)
    every = tuple(r["run"] for r in rep["runs"])
    return [" and ".join(texts) + ("" if kind == DIFFERS else f", {kind}") + (f": {why}" if why else "")
            + ("" if names == every else f" (in {', '.join(names)})") for (kind, why, names), texts in grouped.items()]


def _settings_verdict(rep: dict) -> str:
    real, explained = _explained(rep, (DIFFERS,)), _explained(rep, (EQUIVALENT, UNUSED, ADDED))
    if real:
        return ("**Settings differ**: " + "; ".join(real) + "." +
                (" The other differences do not change training: " + "; ".join(explained) + "." if explained else ""))
    if not explained:
        return "**Same settings**: the stored recipes are equal for every shared run."
    return ("**Same settings** for every shared run: the stored recipes differ only where training does not: "
            + "; ".join(explained) + ".")


def _records_verdict(rep: dict) -> list[str]:
    runs = rep["runs"]
    bitwise = [r for r in runs if r["bitwise"]]
    if len(bitwise) == len(runs):
        return ["**Final records bit for bit equal** in every shared run."]
    line = f"**Final records** bit for bit equal in {len(bitwise)} of {len(runs)} runs"
    measured = [r for r in runs if r["largest_relative"]["value"] is not None]
    if measured:
        big = max(measured, key=lambda r: r["largest_relative"]["value"])
        line += (f"; the largest relative difference {big['largest_relative']['value']:.3g} ({big['run']}, "
                 f"{big['largest_relative']['key']})")
    differ = [r for r in runs if not r["bitwise"]]
    return [line + "."] + ([_not_bitwise(differ)] if all(r["settings_same"] for r in differ) else [])


def _not_bitwise(rows: list[dict]) -> str:
    """Why runs of the same settings differ in the last bits, with the thread counts and torch versions where
    their records store them."""
    shown = []
    for r in rows:
        stored = {**r["stored"]["pilot"]["facts"], **r["stored"]["study"]["facts"]}
        facts = [f"{fact} {_fact(r, 'pilot', fact)} -> {_fact(r, 'study', fact)}"
                 for fact in ("threads", "torch_version") if fact in stored]
        shown += [f"{r['run']}: {', '.join(facts)}"] if facts else []
    return ("Not bit for bit with the same settings: float32 sums added in another order round differently, and the "
            "order follows torch's thread count (delft sets it from the machine's load when a run starts), the CPU's "
            "vector instructions and the torch version. " + ("Stored: " + "; ".join(shown) + "." if shown else
            "Neither run's record (study.json, delft_run.json) stores its thread count or torch version."))


def _fact(r: dict, side: str, fact: str) -> str:
    facts = r["stored"][side]["facts"]
    return str(facts[fact]["value"]) if fact in facts else "not stored"


def _intro(rep: dict) -> list[str]:
    if rep.get("error"):
        return [f"The pilot's study.json could not be read ({rep['error']}): its runs are not compared."]
    return [f"The pilot ({rep['pilot']}) trained {len(rep['runs'])} of this study's runs under the same names. "
            "Settings: the recipe each study.json stores with the run's own loss (output.dir, the eval section and "
            "train.seed left out); a key that differs only where training does not (an auto that became the other "
            "side's value where the run trained, a data section the source does not read, a key added to delft "
            "since) leaves them the same. Final records: train loss, CE, term and gradient norm at the last logged "
            "step, validation CE at the last validation, and both steps.",
            _settings_verdict(rep), *_records_verdict(rep)]


def reproduction_lines(rep: Optional[dict]) -> list[str]:
    """The summary's section on :func:`pilot_reproduction`."""
    if not rep:
        return []
    lines = [f"## {REPRODUCTION_HEADING}", "", *(x for line in _intro(rep) for x in (line, ""))]
    if rep["runs"]:
        header, rows = reproduction_table(rep)
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows] + [""]
    return lines


def reproduction_renderables(rep: Optional[dict]) -> list:
    """:func:`pilot_reproduction` for the terminal and tables.txt, after a heading line of its own."""
    if not rep:
        return []
    out: list = [f"{REPRODUCTION_HEADING}: {rep['pilot']}", *(line.replace("**", "") for line in _intro(rep))]
    if rep["runs"]:
        out.append(plain_table(*reproduction_table(rep)))
    return out + [""]
