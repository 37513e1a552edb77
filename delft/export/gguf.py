"""``delft export --gguf``: GGUF files for llama.cpp, Ollama and LM Studio, made and checked by llama.cpp itself.

The converter (``convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``, their ``conversion/`` package and
``gguf-py``) comes from the source distribution of llama-cpp-python on PyPI, pinned, extracted once into the
delft cache. It runs as a subprocess with its own gguf-py first on the path: the installed ``gguf`` package may
be another version than the one the converter was written against. f32/f16/bf16/q8_0 come straight from the
converter; the other types (q4_k_m, ...) go through llama.cpp's quantiser (llama-cpp-python, the ``[gguf]``
extra) from a 16-bit GGUF of the merged model's own dtype.

The check, per file: llama.cpp (llama-cpp-python) loads the GGUF and computes the logits at every position of
the export's check prompts; the merged model in transformers (fp32) computes the same, from the same token ids
(the Hugging Face tokenizer's, so tokenisation cannot hide or cause a difference). Reported: the normalised
squared error ``||llama - hf||^2 / ||hf||^2`` against ``TOLERANCE[type]`` and whether llama.cpp's own tokenizer
gives the same ids on those texts (together the verdict), the share of positions whose argmax agrees, and both
greedy answers to one chat prompt. A LoRA GGUF is checked as llama.cpp's base
GGUF + adapter against base + adapter in transformers. A failed check keeps every file, writes
GGUF_CHECK_FAILED.txt and exits 1, as the merge check does.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from delft import children
from delft.children import describe_exit
from delft.data.prompts import use_chat_template
from delft.data.templates import render_chat
from delft.errors import UserError, VerificationError
from delft.evaluation.metrics import DIGIT_ACCURACY, EXACT_MATCH
from delft.export.checks import check_out, check_run_dir
from delft.export.gguf_check import GgufFile, LlamaCrashed, check_files
from delft.export.gguf_probe import PROBE_PROBLEMS, probe_files
from delft.export.report import CHECK_PROMPTS, load_recipe_quietly
from delft.models.loading import load_tokenizer
from delft.models.sources import cache_dir, cache_error, resolve_model, usable_cache_dir
from delft.numbers.answers import PLAIN_STOP_STRINGS
from delft.numbers.formats import NumberForm
from delft.outputs import pct, staged, temporary_sibling, write_atomic
from delft.rundir import EXPORT_INFO, base_model, is_merged_model

LLAMA_CPP_VERSION = "0.3.36"  # the converter and the llama.cpp that checks its output come from this release


LLAMA_CPP_SDIST = f"llama-cpp-python=={LLAMA_CPP_VERSION}"


SDIST_ENV = "DELFT_LLAMA_CPP_SDIST"  # a local copy of the sdist, for machines without PyPI


VENDOR = "vendor/llama.cpp/"


CONVERTER_FILES = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")


CONVERTER_PACKAGES = ("conversion/", "gguf-py/gguf/")


INSTALL_HINT = 'pip install -e ".[gguf]"'


CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")


QUANTISER_TYPES = ("q6_k", "q5_k_m", "q5_k_s", "q5_1", "q5_0", "q4_k_m", "q4_k_s", "q4_1", "q4_0",
                   "q3_k_l", "q3_k_m", "q3_k_s", "q2_k")
# Bytes per weight of each type (llama.cpp's bits per weight / 8, rounded up; tensors kept in higher precision
# make small models larger), for the free-space check before the export.
GGUF_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 1.07, "q6_k": 0.83, "q5_k_m": 0.72, "q5_k_s": 0.7,
              "q5_1": 0.75, "q5_0": 0.69, "q4_k_m": 0.62, "q4_k_s": 0.6, "q4_1": 0.63, "q4_0": 0.57,
              "q3_k_l": 0.54, "q3_k_m": 0.5, "q3_k_s": 0.45, "q2_k": 0.42}


LORA_TYPE = "f16"  # the adapter and the base it is applied to


MARKER = "GGUF_CHECK_FAILED.txt"


MODELFILE = "Modelfile"
CARD_HEADING = "## GGUF (llama.cpp, Ollama, LM Studio)"  # the GGUF section of the export's model card


@dataclass
class GgufPlan:
    """What --gguf asked for, checked before the merge starts."""

    types: list
    lora: bool
    check: bool  # load every file in llama.cpp and compare (needs llama-cpp-python)
    converter: Path
    notes: list = field(default_factory=list)

    @property
    def bytes_per_param(self) -> float:
        """Disk the GGUF files take per model parameter, at their peak: each file, the 16-bit source a quantiser
        reads (while it runs), and with --gguf-lora the 16-bit base beside the adapter."""
        total = sum(GGUF_BYTES[t] for t in self.types)
        if any(t in QUANTISER_TYPES for t in self.types):
            total += 2
        return total + (2 if self.lora else 0)


def parse_types(types: list[str]) -> list[str]:
    """Lower-case, known, each once, in the order given."""
    known = CONVERTER_TYPES + QUANTISER_TYPES
    out = []
    for t in types:
        key = t.strip().lower().replace("-", "_")
        if key not in known:
            raise UserError(f"unknown GGUF type {t!r}", "--gguf", f"Use one of {', '.join(known)} (f16 or bf16 "
                            "keep the merged weights; q4_k_m is the usual small one).")
        if key not in out:
            out.append(key)
    return out


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def prepare_gguf(run_dir, out, types: list[str], lora: bool = False, check: Optional[bool] = None,
                 match_training: bool = False, force: bool = False, resume: bool = False) -> Optional[GgufPlan]:
    """Refuse what cannot be done before minutes of merging: types, flags, the converter, the base's
    architecture and tokenizer (a vocabulary-only conversion of the base). None when no GGUF was asked.
    ``resume``: ``out`` holds this run's verified merged export (its GGUF phase is redone, the merge kept)."""
    types = parse_types(types)
    if not types and not lora:
        if check:
            raise UserError("--gguf-check needs --gguf TYPE or --gguf-lora", "--gguf-check",
                            "Add --gguf f16 (or another type).")
        return None
    if lora and match_training:
        raise UserError("--gguf-lora writes the adapter for the original base weights, but --match-training merges "
                        "into their nf4 round-trip", "--gguf-lora", "Drop one of the two.")
    if lora and is_merged_model(Path(run_dir)):
        raise UserError(f"{run_dir} was fully fine-tuned: it has no adapter for --gguf-lora to write", "--gguf-lora",
                        "Drop --gguf-lora; --gguf f16 (or another type) writes the whole model.")
    have_llama = llama_cpp_available()
    quantised = [t for t in types if t in QUANTISER_TYPES]
    if quantised and not have_llama:
        raise UserError(f"{', '.join(quantised)} {'needs' if len(quantised) == 1 else 'need'} llama.cpp's quantiser, from llama-cpp-python, which is not "
                        "installed", "--gguf", f"{INSTALL_HINT} (builds llama.cpp, see docs/export.md), or use "
                        f"{', '.join(CONVERTER_TYPES)}.")
    if check and not have_llama:
        raise UserError("--gguf-check loads the files in llama.cpp, from llama-cpp-python, which is not installed",
                        "--gguf-check", f"{INSTALL_HINT} (builds llama.cpp, see docs/export.md), or drop --gguf-check.")
    check_run_dir(Path(run_dir))  # the export's own refusals before the converter's download
    if not resume:
        check_out(Path(out), force, {"run directory": Path(run_dir)})
    plan = GgufPlan(types=types, lora=lora, check=have_llama if check is None else check,
                    converter=ensure_converter())
    if not plan.check:
        plan.notes.append("The GGUF files were not loaded in llama.cpp (" + (
            "--no-gguf-check)." if check is False else
            f"llama-cpp-python is not installed: {INSTALL_HINT} enables the check)."))
    _try_the_base(plan, Path(run_dir))
    return plan


def _try_the_base(plan: GgufPlan, run_dir: Path) -> None:
    """The converter on the base's vocabulary (and a dry run on the adapter): its refusals, in seconds."""
    base_dir = _local_base(run_dir)
    if base_dir is None:
        if plan.lora:
            raise UserError("--gguf-lora needs the base model on this machine (its GGUF is what the adapter "
                            "applies to)", "--gguf-lora", "Download the base model and train against that directory.")
        return
    with tempfile.TemporaryDirectory(prefix="delft-gguf-vocab-") as tmp:
        _run_converter(plan.converter, CONVERTER_FILES[0],
                       [str(base_dir), "--vocab-only", "--outfile", str(Path(tmp) / "vocab.gguf")], str(base_dir))
        if plan.lora:
            _run_converter(plan.converter, CONVERTER_FILES[1],
                           ["--base", str(base_dir), "--dry-run", "--outfile", str(Path(tmp) / "lora.gguf"),
                            str(run_dir)], f"the adapter in {run_dir}")


def _local_base(run_dir: Path) -> Optional[Path]:
    """The run's base model as a local directory (a fully fine-tuned run is its own), or None (not resolvable here:
    the export will say why)."""
    if is_merged_model(run_dir):
        return run_dir
    name = base_model(run_dir)
    if not name:
        return None
    try:
        ref = resolve_model(name)
    except UserError:
        return None
    return Path(ref.path) if ref.is_local else None


def ensure_converter() -> Path:
    """llama.cpp's converter scripts from the pinned llama-cpp-python sdist, extracted once into the cache."""
    target = cache_dir() / f"llama.cpp-{LLAMA_CPP_VERSION}"
    if _converter_complete(target):
        return target
    usable_cache_dir(target)  # a read-only cache is refused by name before the download
    with tempfile.TemporaryDirectory(prefix="delft-llama-cpp-") as tmp:
        sdist = Path(os.environ.get(SDIST_ENV) or _download_sdist(Path(tmp)))
        try:
            with staged(target, shared=_converter_complete) as staging:  # another delft may extract it too
                _extract_converter(sdist, staging)
        except OSError as e:
            raise cache_error(target.parent, e) from None
    return target


def _converter_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in CONVERTER_FILES) and all(
        (path / p / "__init__.py").is_file() for p in CONVERTER_PACKAGES)


def sdist_download_command(dest: Path) -> list[str]:
    """pip fetching llama-cpp-python's source distribution alone: --no-binary names only that package, so the build
    requirements pip installs to read its metadata come as wheels (`--no-binary :all:` built every one of them, and
    theirs, from source: minutes with nothing shown)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
            LLAMA_CPP_SDIST, "-d", str(dest)]


def _download_sdist(dest: Path) -> Path:
    """The sdist in ``dest``, pip's own progress shown on the terminal (the first --gguf export fetches it once)."""
    Console(stderr=True).print(f"[bold]gguf[/] fetching llama.cpp's converter once ({LLAMA_CPP_SDIST}, source "
                               "distribution, into delft's cache) with pip:", highlight=False)
    proc = subprocess.run(sdist_download_command(dest))
    found = sorted(dest.glob("*.tar.gz"))
    if proc.returncode != 0 or not found:
        raise UserError(f"could not download llama.cpp's converter ({LLAMA_CPP_SDIST}, source distribution) from "
                        f"PyPI (pip exited with {proc.returncode}; its messages are above)", "--gguf",
                        f"Run `pip download --no-deps --no-binary llama-cpp-python {LLAMA_CPP_SDIST}` where PyPI is "
                        f"reachable and set {SDIST_ENV} to the .tar.gz.")
    return found[0]


def _extract_converter(sdist: Path, dest: Path) -> None:
    """Only the converter's files, each written to a path computed here (no member decides where it lands)."""
    try:
        tar = tarfile.open(sdist, "r:gz")
    except (OSError, tarfile.TarError) as e:
        raise UserError(f"{sdist} is not a readable .tar.gz ({e})", SDIST_ENV,
                        f"Point it at the source distribution of {LLAMA_CPP_SDIST}.") from None
    with tar:
        for member in tar:
            _, _, rest = member.name.partition("/")
            rel = rest[len(VENDOR):] if rest.startswith(VENDOR) else None
            if not member.isfile() or rel is None or ".." in Path(rel).parts:
                continue
            if rel in CONVERTER_FILES or rel.startswith(CONVERTER_PACKAGES):
                path = dest / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(path, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    if not _converter_complete(dest):
        shutil.rmtree(dest, ignore_errors=True)
        raise UserError(f"{sdist} does not contain llama.cpp's converter ({', '.join(CONVERTER_FILES)}, "
                        f"{', '.join(CONVERTER_PACKAGES)})", SDIST_ENV, f"Use the sdist of {LLAMA_CPP_SDIST}.")


def _run_converter(converter: Path, script: str, args: list[str], what: str, owned=()) -> None:
    """One converter run; its known refusals become UserErrors that say what could not be converted. ``owned``:
    the file it writes, removed should delft die meanwhile (delft.children)."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = str(converter / "gguf-py")  # its own gguf-py, not the installed gguf package
    env["TQDM_DISABLE"] = "1"
    proc = children.run([sys.executable, str(converter / script), *args], owned, capture_output=True, text=True,
                        env=env)
    if proc.returncode == 0:
        return
    log = (proc.stderr or "") + (proc.stdout or "")
    if m := re.search(r"Model (\S+) is not supported", log):
        raise UserError(f"llama.cpp's converter ({LLAMA_CPP_SDIST}) does not support the architecture {m[1]} of "
                        f"{what}", "--gguf", "Export without --gguf; the merged safetensors model still works.")
    if "pre-tokenizer was not recognized" in log:
        raise UserError(f"llama.cpp's converter ({LLAMA_CPP_SDIST}) does not recognise the tokenizer of {what} "
                        "(its pre-tokenizer is not one llama.cpp knows)", "--gguf",
                        "Export without --gguf; GGUF needs a tokenizer llama.cpp implements.")
    if m := re.search(r"No module named '([\w.]+)'", log):
        raise UserError(f"llama.cpp's converter needs the Python package {m[1]!r}, which is not installed",
                        "--gguf", f"pip install {m[1].split('.')[0]} (or {INSTALL_HINT}).")
    tail = " | ".join(line.strip() for line in log.strip().splitlines()[-4:])
    raise UserError(f"llama.cpp's converter failed on {what}: {tail}", "--gguf",
                    "Export without --gguf; the merged safetensors model still works.")


@contextmanager
def _new_file(dest: Path):
    """A temporary sibling to write ``dest`` into, renamed onto it when complete; never over an existing file."""
    with staged(dest) as tmp:
        yield tmp
        if dest.exists():
            raise UserError(f"{dest} already exists", "--out", "Choose another --out (or remove the file).")


def convert(converter: Path, model_dir: Path, gguf_type: str, dest: Path) -> None:
    with _new_file(dest) as tmp:
        _run_converter(converter, CONVERTER_FILES[0],
                       [str(model_dir), "--outtype", gguf_type, "--outfile", str(tmp)], str(model_dir), owned=(tmp,))


def convert_lora(converter: Path, run_dir: Path, base_dir: Path, dest: Path) -> None:
    with _new_file(dest) as tmp:
        args = ["--base", str(base_dir), "--outtype", LORA_TYPE, "--outfile", str(tmp), str(run_dir)]
        _run_converter(converter, CONVERTER_FILES[1], args, f"the adapter in {run_dir}", owned=(tmp,))


def quantize(src: Path, dest: Path, gguf_type: str) -> None:
    """llama.cpp's quantiser, in a subprocess: it logs hundreds of lines to the C stderr."""
    with _new_file(dest) as tmp:
        here = str(Path(__file__).resolve().parents[2])  # the checkout holding this delft, whatever else is installed
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
        proc = children.run([sys.executable, "-m", "delft.export.gguf", "quantize", str(src), str(tmp), gguf_type],
                            (tmp, src), capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not tmp.is_file():
            tail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])
            raise UserError(f"llama.cpp's quantiser failed to make {gguf_type} from {src.name}: {tail}", "--gguf",
                            "Use f16 or q8_0, which the converter writes itself.")


def _quantize_in_process(src: str, dest: str, gguf_type: str) -> int:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}")
    params.nthread = os.cpu_count() or 1
    return int(llama_cpp.llama_model_quantize(src.encode(), dest.encode(), params))


def write_gguf_files(plan: GgufPlan, out: Path, run_dir: Path, base: str, merged_dtype: str,
                     console: Console) -> list[GgufFile]:
    """Every GGUF file the plan asks for, next to the merged model in ``out``."""
    files = []
    name = out.name
    made = {}
    for t in sorted(plan.types, key=lambda t: t not in CONVERTER_TYPES):  # a 16-bit file first: quantiser input
        dest = out / f"{name}-{t}.gguf"
        if t in CONVERTER_TYPES:
            convert(plan.converter, out, t, dest)
            files.append(GgufFile(dest.name, t, "merged", made_by="convert_hf_to_gguf.py"))
        else:
            source = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[merged_dtype]
            src = made.get(source) or temporary_sibling(out / f"{name}-{source}.gguf.src")
            try:
                if source not in made:
                    convert(plan.converter, out, source, src)
                quantize(src, dest, t)
            finally:
                if source not in made:
                    src.unlink(missing_ok=True)
            files.append(GgufFile(dest.name, t, "merged", made_by=f"llama.cpp quantiser from {source}"))
        made[t] = dest
        console.print(f"  gguf {dest.name} ({files[-1].made_by})", highlight=False)
    if plan.lora:
        base_dir = _local_base(run_dir)
        base_dest, lora_dest = out / f"{name}-base-{LORA_TYPE}.gguf", out / f"{name}-lora-{LORA_TYPE}.gguf"
        convert(plan.converter, base_dir, LORA_TYPE, base_dest)
        convert_lora(plan.converter, run_dir, base_dir, lora_dest)
        files += [GgufFile(base_dest.name, LORA_TYPE, "base", made_by=f"convert_hf_to_gguf.py from {base}"),
                  GgufFile(lora_dest.name, LORA_TYPE, "lora", made_by="convert_lora_to_gguf.py")]
        console.print(f"  gguf {lora_dest.name} (adapter) + {base_dest.name} (its base)", highlight=False)
    for f in files:
        f.size_bytes = (out / f.file).stat().st_size
    return files


def ollama_modelfile(tokenizer, model_file: str, adapter_file: Optional[str] = None,
                     recipe=None) -> tuple[str, list[str]]:
    """An Ollama Modelfile that prompts as the run trained (``recipe``: its data.template and data.system_prompt;
    the tokenizer's defaults without one) and decodes as delft evaluated it: greedy, eval.max_new_tokens tokens.
    A chat TEMPLATE is written only when the chat template is ChatML (checked by rendering it)."""
    lines = [f"FROM ./{model_file}"] + ([f"ADAPTER ./{adapter_file}"] if adapter_file else [])
    if recipe is not None:
        lines += number_form_comment(recipe.data.numbers)
        lines += ["PARAMETER temperature 0", f"PARAMETER num_predict {recipe.eval.max_new_tokens}"]
        if not use_chat_template(tokenizer, recipe.data):
            return _plain_modelfile(lines, recipe.data.prompt_separator()), []
    notes = []
    system = _chatml_default_system(tokenizer)
    if system is None:
        notes.append("The chat template is not ChatML; the Modelfile has no TEMPLATE (Ollama falls back to the "
                     "template stored in the GGUF or to plain prompts): write one for this model's format.")
        return "\n".join(lines) + "\n", notes
    lines += ['TEMPLATE """{{- range $i, $_ := .Messages }}<|im_start|>{{ .Role }}',
              "{{ .Content }}<|im_end|>",
              '{{ if and (eq (len (slice $.Messages $i)) 1) (ne .Role "assistant") }}<|im_start|>assistant',
              '{{ end }}{{ end }}"""']
    if recipe is not None and recipe.data.system_prompt:
        system = recipe.data.system_prompt  # the run trained with its own system prompt
    if system:
        lines.append(f'SYSTEM """{system}"""')
    stops = ["<|im_end|>", "<|im_start|>"]
    if tokenizer.eos_token and tokenizer.eos_token not in stops:
        stops.append(tokenizer.eos_token)
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n", notes


def number_form_comment(numbers) -> list[str]:
    """Modelfile comment lines for a run trained on numbers written otherwise (data.numbers): what it answers in,
    and how to write prompts and read its answers (docs/number_formats.md#prompting-an-exported-model)."""
    form = NumberForm.of(numbers)
    if not form.active:
        return []
    asked = "write the numbers of your prompts the same way" if form.writes_prompts else "prompt with plain numbers"
    read = (f"from delft.numbers.formats import read_numbers, read_last_number; "
            f"{form.reader.__name__}(answer, {numbers.order!r}, {numbers.count_prefix})")
    return [f"# This model writes numbers as {form.describe('{n:...} count prefixes')} (data.numbers scope "
            f"{numbers.scope}): {asked}, and read",
            f"# its answers back with: {read}"]


def _plain_modelfile(lines: list[str], separator: str) -> str:
    """The run trained on plain prompts (delft.data.prompts.render_prompt: the prompt, then data.separator) with
    delft's plain stop strings. The template writes the separator after every prompt (one typed into Ollama does
    not end in a space or newline); text that would end the triple quotes or open an action goes in as a Go
    string (JSON's escapes are Go's)."""
    if any(c in separator for c in '"{}'):
        separator = "{{ " + json.dumps(separator, ensure_ascii=False) + " }}"
    lines = lines + [f'TEMPLATE """{{{{ .Prompt }}}}{separator}"""']
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in PLAIN_STOP_STRINGS]
    return "\n".join(lines) + "\n"


def _chatml(messages: list[dict], generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def _chatml_default_system(tokenizer) -> Optional[str]:
    """The default system prompt ('' for none) when the tokenizer's template renders exactly ChatML, else None."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    probe = [{"role": "system", "content": "S1"}, {"role": "user", "content": "U1"},
             {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    try:
        with_system = render_chat(tokenizer, probe, add_generation_prompt=True)  # within bounds: the run's file
        without = render_chat(tokenizer, probe[1:2], add_generation_prompt=True)
    except Exception:
        return None
    if with_system != _chatml(probe, True):
        return None
    if without == _chatml(probe[1:2], True):
        return ""
    m = re.fullmatch(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n", without[:-len(_chatml(probe[1:2], True))],
                     re.S) if without.endswith(_chatml(probe[1:2], True)) else None
    return m[1] if m and '"""' not in m[1] else None


def export_gguf(plan: GgufPlan, result, console: Optional[Console] = None, resume: bool = False) -> list[GgufFile]:
    """After a verified merged export (``result``: delft.export.merge.ExportResult): GGUF files, Modelfile, check,
    and their figures added to delft_export.json and the model card. VerificationError (exit 1) when a check
    fails; the files stay, marked with GGUF_CHECK_FAILED.txt. ``resume``: an earlier GGUF phase of this export
    failed or was cut short: its GGUF outputs are removed and the phase is redone; the merged model is kept."""
    console = console or Console()
    out, run_dir = Path(result.out), Path(result.run_dir)
    if resume:
        _remove_gguf_phase(out)
    console.print(f"[bold]gguf[/] {', '.join(plan.types + (['lora'] if plan.lora else []))} with llama.cpp's "
                  f"converter ({LLAMA_CPP_SDIST})", highlight=False)
    files = write_gguf_files(plan, out, run_dir, result.base_model, result.dtype, console)
    notes = list(plan.notes)
    merged = [f for f in files if f.kind == "merged"]
    lora = next((f.file for f in files if f.kind == "lora"), None)
    if merged or lora:
        first = merged[0].file if merged else next(f.file for f in files if f.kind == "base")
        recipe = load_recipe_quietly(run_dir)  # None for adapters delft did not train: the tokenizer's defaults
        text, more = ollama_modelfile(load_tokenizer(str(out)), first, None if merged else lora, recipe)
        notes += more
        dest = out / MODELFILE
        if dest.exists():
            raise UserError(f"{dest} already exists", "--out", "Choose another --out (or remove the file).")
        write_atomic(dest, text)
    if plan.check:
        try:
            check_files(files, out, run_dir, result.base_model, console)
            probe_files(files, out, run_dir, console)
        except LlamaCrashed as crash:
            _record(out, files, notes, plan.check)
            raise _crashed(crash, files, out) from None
        except UserError:  # llama.cpp died answering the probe: what was measured is kept
            _record(out, files, notes, plan.check)
            raise
        notes += [f"llama.cpp tokenises {', '.join(map(repr, f.number_tokens['differ']))} differently from the "
                  f"training tokenizer in {f.file} (see ggml-org/llama.cpp#6914)"
                  for f in files if f.number_tokens and not f.number_tokens["match"]]
    _record(out, files, notes, plan.check)
    console.print(gguf_table(files))
    failed = [f for f in files if f.passed is False]
    if failed:
        write_atomic(out / MARKER, _failure_text(failed))
        names = ", ".join(f.file for f in failed)
        raise VerificationError(f"llama.cpp's output from {names} differs from the model in transformers (logits "
                                f"beyond the tolerance, or tokenisation). The files are kept and marked with "
                                f"{out / MARKER}; do not ship them. Try f16, or see delft_export.json.")
    for n in notes:
        console.print(f"  [yellow]note[/] {n}", highlight=False)
    console.print(f"[bold green]done[/] GGUF in {out}" + (f" (ollama create NAME -f {out / MODELFILE})"
                                                        if (out / MODELFILE).exists() else ""), highlight=False)
    return files


def _crashed(crash: LlamaCrashed, files: list[GgufFile], out: Path) -> UserError:
    verified = [f.file for f in files if f.passed is not None]
    rest = [f.file for f in files if f.passed is None]
    return UserError(
        f"llama.cpp died while checking {crash.file} ({describe_exit(crash.returncode)}"
        + (f": {crash.tail}" if crash.tail else "") + f"). Everything written is kept in {out}: the verified merged "
        f"model and the GGUF files ({', '.join(verified) or 'none'} checked; {', '.join(rest)} not checked)",
        "--gguf-check", f'Rebuild llama-cpp-python for this CPU (CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install '
        f"--force-reinstall --no-cache-dir {LLAMA_CPP_SDIST}), then run the same delft export command again: it keeps "
        "the merge and redoes only the GGUF phase. Or pass --no-gguf-check.")


def _remove_gguf_phase(out: Path) -> None:
    """What an earlier GGUF phase of this export wrote, so it can be redone: the .gguf files, the Modelfile, the
    failure marker, its half-written temporaries and its section of the model card."""
    for path in [*out.glob(f"{glob.escape(out.name)}-*.gguf"), *out.glob(f".{glob.escape(out.name)}-*.tmp-*"),
                 out / MODELFILE, out / MARKER]:
        path.unlink(missing_ok=True)
    card = out / "README.md"
    if card.is_file():
        write_atomic(card, card.read_text().split(f"\n{CARD_HEADING}")[0].rstrip() + "\n")


def _record(out: Path, files: list[GgufFile], notes: list[str], checked: bool) -> None:
    """The figures into delft_export.json and a GGUF section into the model card, each rewritten whole."""
    info_path = out / EXPORT_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    info["gguf"] = {"converter": LLAMA_CPP_SDIST, "checked_in_llama_cpp": checked, "prompts": list(CHECK_PROMPTS),
                    "metric": "||llama.cpp - transformers||^2 / ||transformers||^2 over every position's logits",
                    "files": [asdict(f) for f in files], "notes": notes}
    write_atomic(info_path, json.dumps(info, indent=2))
    card = out / "README.md"
    if card.is_file():
        write_atomic(card, card.read_text() + "\n" + _card_section(files, notes, checked, out.name))


def _card_section(files: list[GgufFile], notes: list[str], checked: bool, name: str) -> str:
    lines = [CARD_HEADING, "",
             f"Converted by llama.cpp's own converter ({LLAMA_CPP_SDIST})" + (
                 "; each file loaded in llama.cpp and its logits compared with this model in transformers (fp32) "
                 "on the check prompts." if checked else "; not loaded in llama.cpp (check skipped)."), "",
             "| file | type | size | made by | normalised sq. error (tolerance) | argmax agrees | check |",
             "|---|---|---|---|---|---|---|"]
    for f in files:
        err = f"{f.nse:.2g} ({f.tolerance:g})" if f.nse is not None else "-"
        agree = f"{f.argmax_agreement:.0%} of {f.positions}" if f.argmax_agreement is not None else "-"
        verdict = {True: "passed", False: "**FAILED**", None: "not run"}[f.passed]
        size = f"{f.size_bytes / 1e6:.1f} MB"
        lines.append(f"| {f.file} | {f.type} | {size} | {f.made_by} | {err} | {agree} | {verdict} |")
    lines += _probe_section(files)
    greedy = next((f for f in files if f.greedy or f.greedy_reference), None)
    if greedy:
        lines += ["", f"Greedy answer ({greedy.file}): {greedy.greedy!r}; transformers: {greedy.greedy_reference!r}."]
    lora = next((f.file for f in files if f.kind == "lora"), None)
    lines += ["", "```", f"ollama create {name} -f Modelfile"]
    if lora:
        lines.append(f"llama-cli -m {name}-base-{LORA_TYPE}.gguf --lora {lora}")
    lines += ["```", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _probe_section(files: list[GgufFile]) -> list[str]:
    """The card's table of what quantisation did to the numbers (delft.export.gguf_probe)."""
    probed = [f for f in files if f.probe]
    if not probed:
        return []
    lines = ["", f"What quantisation did to the numbers: greedy answers to {probed[0].probe['n']} problems of the "
             "run's held-out set in llama.cpp, beside this model in transformers.", "",
             "| file | exact match (merged) | digit accuracy (merged) | same answer as merged | numbers tokenised |",
             "|---|---|---|---|---|"]
    for f in probed:
        p, t = f.probe, f.number_tokens or {}
        split = "as in training" if t.get("match") else f"differently: {', '.join(map(repr, t.get('differ', [])))}"
        lines.append(f"| {f.file} | {pct(p[EXACT_MATCH.key])} ({pct(p['reference_exact_match'])}) | "
                     f"{pct(p[DIGIT_ACCURACY.key])} ({pct(p['reference_digit_accuracy'])}) | "
                     f"{pct(p['same_answers'])} | {split} |")
    return lines


def _failure_text(failed: list[GgufFile]) -> str:
    rows = "\n".join(f"{f.file}: normalised squared error {f.nse:.3g} (tolerance {f.tolerance:g}), llama.cpp's "
                     f"tokenizer {'agrees with' if f.tokens_match else 'differs from'} the model's" for f in failed)
    return f"The llama.cpp check of these GGUF files FAILED:\n{rows}\nDo not ship them. See delft_export.json.\n"


def gguf_table(files: list[GgufFile]) -> Table:
    table = Table(title="delft export --gguf", title_justify="left")
    for col in ("file", "size", "sq. error (tol.)", "argmax", f"exact / same answer ({PROBE_PROBLEMS})", "check"):
        table.add_column(col)
    for f in files:
        table.add_row(f.file, f"{f.size_bytes / 1e6:.1f} MB",
                      f"{f.nse:.2g} ({f.tolerance:g})" if f.nse is not None else "-",
                      f"{f.argmax_agreement:.0%}" if f.argmax_agreement is not None else "-",
                      f"{pct(f.probe[EXACT_MATCH.key], '%')} / {pct(f.probe['same_answers'], '%')}" if f.probe else "-",
                      {True: "[green]passed[/]", False: "[bold red]FAILED[/]", None: "not run"}[f.passed])
    return table


if __name__ == "__main__":  # python -m delft.export.gguf quantize SRC DEST TYPE (run by quantize())
    if len(sys.argv) == 5 and sys.argv[1] == "quantize":
        sys.exit(_quantize_in_process(*sys.argv[2:]))
    sys.exit("usage: python -m delft.export.gguf quantize SRC DEST TYPE")
