"""Whether a study's runs reproduce its pilot's runs of the same name (a study that shares some runs' settings with
the earlier study it plans from, as lora_powered's ce and del seeds 0-2 share formats_lora's).

From the two study.json files alone. Settings: the recipe each stores (its first recipe's, resolved), with the
run's own loss (study.json keeps each arm's loss section, not its whole recipe), leaving out what a run's training
does not read: output.dir, the eval section, and train.seed (the same by name). Final records: the training
section's last logged step (train loss, CE, term, gradient norm) and last validation (validation CE), each equal
bit for bit (JSON keeps every float exactly) or not, with the largest relative difference.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from rich.table import Table

from delft.recipe.files import read_yaml
from delft.recipe.keys import flat_keys

REPRODUCTION_HEADING = "Reproduction of the pilot's runs"  # its section in summary.md, its block in tables.txt
RUN_NAME = re.compile(r"^(?P<recipe>.+)-seed(?P<seed>-?\d+)$")
NOT_TRAINING = ("output.dir", "train.seed")  # besides the eval section: keys a run's training does not read
FINAL = (("train", "step"), ("train", "loss"), ("train", "ce"), ("train", "term"), ("train", "grad_norm"),
         ("validation", "step"), ("validation", "val_ce"))
ABSENT = "(absent)"


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
        differ = setting_differences(run_settings(pilot, name), run_settings(report, name))
        finals = final_differences(pilot["training"][name], report["training"][name])
        largest = max(finals, key=lambda f: -1.0 if f["relative"] is None else f["relative"])
        rows.append({"run": name, "settings_same": not differ, "settings_differ": differ, "finals": finals,
                     "bitwise": all(f["equal"] for f in finals),
                     "largest_relative": {"key": largest["key"], "value": largest["relative"]}})
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
    return "yes" if r["settings_same"] else "no: " + ", ".join(d["key"] for d in r["settings_differ"])


def reproduction_table(rep: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per shared run, same settings?, final records bitwise equal?, the largest difference."""
    header = ["run", "same settings", "final records bitwise equal", "largest relative difference"]
    return header, [[r["run"], _settings_cell(r), "yes" if r["bitwise"] else "no", _largest(r)] for r in rep["runs"]]


def _differing(rep: dict) -> list[str]:
    """Each differing setting once: 'key (pilot value -> study value)'."""
    seen = dict.fromkeys(f"{d['key']} ({d['pilot']!r} -> {d['study']!r})" for r in rep["runs"]
                         for d in r["settings_differ"])
    return list(seen)


def _intro(rep: dict) -> list[str]:
    if rep.get("error"):
        return [f"The pilot's study.json could not be read ({rep['error']}): its runs are not compared."]
    same = all(r["settings_same"] for r in rep["runs"])
    return [f"The pilot ({rep['pilot']}) trained {len(rep['runs'])} of this study's runs under the same names. "
            "Settings: the recipe each study.json stores with the run's own loss (output.dir, the eval section and "
            "train.seed left out). Final records: train loss, CE, term and gradient norm at the last logged step, "
            "validation CE at the last validation, and both steps.",
            "The settings are the same for every shared run." if same else
            "**The settings differ** (pilot -> this study): " + "; ".join(_differing(rep)) + "."]


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
        header, rows = reproduction_table(rep)
        table = Table()
        for column in header:
            table.add_column(column)
        for r in rows:
            table.add_row(*r)
        out.append(table)
    return out + [""]
