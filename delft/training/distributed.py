"""Data-parallel training over several processes (torchrun, accelerate launch, ``delft train --nproc N``).

Each rank holds its own copy of the model on its own device. An optimizer batch is ``batch_size x grad_accum x
world_size`` examples: rank r takes micro-batches ``r*grad_accum .. (r+1)*grad_accum - 1`` of every optimizer step's
share of the one shuffled stream, so the ranks' examples are disjoint and together the same as one process with
``grad_accum x world_size`` micro-batches. The label and digit counts are summed over all ranks before the first
backward and the LoRA gradients are summed after the last one, so the gradient is that of one process on the whole
optimizer batch (no DDP wrapper: only the adapter has gradients, and one all-reduce of them is exact and simple).

Randomness: with several processes, each optimizer step re-seeds torch's generators (CPU and CUDA) from
(train.seed, rank, step), so dropout is well defined per rank and a resume needs no saved generator state.
Only rank 0 writes files and shows the display; the others are silent unless they fail.
The launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is all this reads;
DELFT_DIST_TIMEOUT (seconds, default 1800) bounds every collective, so a lost rank never hangs the others.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from delft import signals
from delft.children import on_parent_death
from delft.errors import UserError, VerificationError
from delft.models.loading import resolve_device

TIMEOUT_ENV = "DELFT_DIST_TIMEOUT"


DEFAULT_TIMEOUT_S = 1800  # rank 0 validates alone while the others wait: must outlast a validation pass


def launched() -> bool:
    """Started by a launcher (torchrun / accelerate set WORLD_SIZE), even with a single process."""
    return "WORLD_SIZE" in os.environ


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """The one process that writes files and shows the display."""
    return rank() == 0


def start(device_pref: str) -> None:
    """Join the process group (nccl on CUDA, gloo on CPU) and pin this rank's GPU; nothing for one process."""
    if not launched():
        return
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    _die_with_the_launcher()
    device = resolve_device(device_pref)
    if device == "cuda":
        torch.cuda.set_device(local_rank())  # "cuda" (and nf4's device_map) now mean this rank's GPU
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    dist.init_process_group(backend(device), timeout=timeout)
    import atexit

    atexit.register(stop)
    _interrupt_once()


BACKEND_ENV = "DELFT_DIST_BACKEND"  # nccl or gloo; unset: nccl on CUDA, gloo on the CPU


def backend(device: str) -> str:
    """The process group's backend: DELFT_DIST_BACKEND when set (refused where it cannot run), else nccl on CUDA
    and gloo on the CPU."""
    import torch.distributed as dist

    asked = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not asked:
        return "nccl" if device == "cuda" else "gloo"
    if asked not in ("nccl", "gloo"):
        raise UserError(f"{BACKEND_ENV}={asked!r} names no backend delft uses", BACKEND_ENV,
                        "Set it to nccl (GPUs) or gloo (CPU, or GPUs without NCCL), or unset it.")
    if asked == "nccl" and (device != "cuda" or not dist.is_nccl_available()):
        why = "this run trains on the CPU" if device != "cuda" else "this torch was built without NCCL"
        raise UserError(f"{BACKEND_ENV}=nccl asks for NVIDIA's collectives, and {why}", BACKEND_ENV,
                        "Unset it (gloo is used on the CPU), or run on CUDA GPUs with a torch built with NCCL.")
    return asked


def _die_with_the_launcher() -> None:
    """On Linux, have the kernel kill this worker when its parent (the launcher's agent) dies, even by SIGKILL,
    so a killed launcher never leaves workers training on. The last checkpoint is intact (written whole)."""
    import signal

    if not on_parent_death(signal.SIGKILL):
        return
    if os.getppid() == 1:  # the launcher died before the request took effect
        os._exit(1)


def _interrupt_once() -> None:
    """Ctrl-C reaches a worker twice (from the terminal, then forwarded by torchrun): the first raises
    KeyboardInterrupt, so rank 0 saves a checkpoint; a repeat must not cut that save short."""
    import signal

    def handler(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def stop() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def describe() -> str:
    """' on N processes ' for the training line; '' for one process."""
    return f"on {world_size()} processes " if world_size() > 1 else ""


def rank_console(console):
    """The console itself on rank 0; a silent one elsewhere (errors still reach stderr through the CLI)."""
    if is_main():
        return console
    from rich.console import Console

    return Console(quiet=True)


def micro_indices(step: int, grad_accum: int) -> list[int]:
    """This rank's micro-batch indices (into the endless stream) for optimizer step ``step``."""
    first = (step * world_size() + rank()) * grad_accum
    return list(range(first, first + grad_accum))


def seed_step(seed: int, step: int) -> None:
    """Re-seed torch's generators for this rank and step (several processes only; see the module docstring)."""
    if not launched():
        return
    import torch

    # also seeds every CUDA device; modulo torch's 64-bit range, which train.seed up to 2**32 - 1 would pass
    torch.manual_seed(((seed * 1_000_003 + rank()) * 1_000_003 + step) % 2**64)


def _collective(what: str, fn, *args):
    """Run a collective; a peer that died or stopped answering becomes one paragraph naming this rank."""
    try:
        return fn(*args)
    except RuntimeError as e:  # gloo / nccl report a lost peer or a timeout as RuntimeError subclasses
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"rank {rank()} of {world_size()} lost the other ranks during {what} ({first[:200]}): "
                        "another rank died or stopped; the launcher's summary names it", "the launch",
                        "Fix what stopped that rank, then run the same command again: it resumes from the last "
                        "checkpoint, which is intact.") from None


def all_reduce_counts(counts):
    """The optimizer batch's label and digit counts summed over all ranks (delft.losses.loss.Counts)."""
    if world_size() == 1:
        return counts
    import torch
    import torch.distributed as dist

    t = torch.tensor([counts.labels, counts.digits], dtype=torch.int64, device=_device())
    _collective("the count all-reduce", dist.all_reduce, t)
    return type(counts)(int(t[0]), int(t[1]))


def all_reduce_floats(values: list[float]) -> list[float]:
    """Floats summed over all ranks, in float64 (logged loss sums, token counts)."""
    if world_size() == 1:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_device())
    _collective("the statistics all-reduce", dist.all_reduce, t)
    return t.tolist()


def all_reduce_grads(params) -> None:
    """Sum the trainable gradients over all ranks, as one flat buffer (the loss is already globally normalised)."""
    if world_size() == 1:
        return
    import torch
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    _collective("the gradient all-reduce", dist.all_reduce, flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()


def barrier(what: str) -> None:
    if world_size() == 1:
        return
    import torch.distributed as dist

    _collective(what, dist.barrier)


def _device():
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"


def global_sums(sums, tokens: int):
    """(this step's delft.losses.loss.Sums added over all ranks, tokens over all ranks): what the log and tok/s
    report. The whole object goes in one all-reduce (``Sums.as_floats``), so no field is dropped."""
    if world_size() == 1:
        return sums, tokens
    *values, tok = all_reduce_floats([*sums.as_floats(), float(tokens)])
    return type(sums).from_floats(values), int(tok)


def check_resume(saved_info: dict, saved_recipe, recipe, diff: list[str], console) -> list[str]:
    """The recipe differences left after allowing a new world size with the same global batch.

    The global batch is ``batch_size x grad_accum x world_size``; a resume may trade grad_accum for processes
    as long as that product and batch_size stay. Then the step sequence and the examples are the same, but
    not which rank runs which micro-batch, so dropout masks differ from an uninterrupted run (said).
    """
    if "train.distributed" in diff:
        raise UserError(f"the run was trained with train.distributed {saved_recipe.train.distributed} and this "
                        f"recipe says {recipe.train.distributed}; its checkpoints hold "
                        f"{'shards' if saved_recipe.train.distributed == 'fsdp' else 'whole weights'}, which the "
                        "other way cannot resume", "train.distributed",
                        f"Resume it with train.distributed: {saved_recipe.train.distributed} (its recipe.yaml), or "
                        "start a new run from its final model or adapter once it has finished.")
    was, now = int(saved_info.get("world_size", 1)), world_size()
    if was == now:
        return diff
    st, t = saved_recipe.train, recipe.train
    rest = [d for d in diff if d != "train.grad_accum"]
    if st.batch_size == t.batch_size and st.grad_accum * was == t.grad_accum * now:
        console.print(f"[yellow]Resuming with {now} process(es) instead of {was}[/]: the same global batch "
                      f"({t.batch_size} x {t.grad_accum} x {now}) and the same examples per step; dropout masks "
                      "differ from an uninterrupted run.")
        return rest
    need = st.grad_accum * was / now
    fix = (f"Run it with {was} process(es) again" + (f", or with {now} and --set train.grad_accum={int(need)}"
                                                      if need == int(need) and need >= 1 else "") + ".")
    raise UserError(f"the run was trained with {was} process(es) and a global batch of {st.batch_size} x "
                    f"{st.grad_accum} x {was}; {now} process(es) with train.grad_accum={t.grad_accum} would change "
                    "it", "output.dir", fix)


ERROR_FILE_ENV = "DELFT_ERROR_FILE"  # where --nproc's workers leave a user error for the parent to print once
LAUNCH_REPORT = "launch"  # the launcher's own report beside the ranks' (ERROR_FILE_ENV.launch)
LAUNCH_COMMAND_ENV = "DELFT_LAUNCH_COMMAND"  # the command the user ran, for the workers' resume hint
STORE_FD_ENV = "DELFT_STORE_FD"  # node 0's rendezvous socket, bound by delft train, served by the launcher
START_TIMEOUT_ENV = "DELFT_START_TIMEOUT"  # seconds the nodes wait for each other at start
DEFAULT_START_TIMEOUT_S = 600
RENDEZVOUS_BACKEND = "delft-static"  # delft.training.launch's rendezvous
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Nodes:
    """Where this machine sits among several (``delft train --nnodes N --node-rank R --master-addr A --master-port
    P``): a static rendezvous at A:P, which node R = 0 serves. None: not given (one machine takes none of them)."""

    count: int = 1
    rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    def check(self) -> None:
        """Refuse what only several machines use on a run of one (it would train alone, ignoring them), and a node
        rank outside the nodes."""
        given = [f"--{o} {v}" for o, v in (("node-rank", self.rank), ("master-addr", self.master_addr),
                                           ("master-port", self.master_port)) if v is not None]
        if self.count == 1 and given:
            raise UserError(f"{' '.join(given)} place this machine among several, and --nnodes is 1: this machine "
                            "would train alone, its rendezvous on loopback", "--nnodes",
                            "Drop them to train on this machine alone, or give --nnodes N (the number of machines) "
                            "with them on every machine.")
        if not 0 <= (self.rank or 0) < self.count:
            raise UserError(f"--node-rank {self.rank} is not one of the {self.count} nodes (0 to {self.count - 1})",
                            "--node-rank", "Give each machine its own --node-rank from 0 to --nnodes - 1.")

    @property
    def addr(self) -> str:
        return self.master_addr or "127.0.0.1"

    def listen(self):
        """Node 0's rendezvous socket (None on the other nodes), bound where the user said: loopback and a free port
        for one machine, --master-addr and --master-port for several (never every interface, as torch's own)."""
        import errno
        import socket

        if self.rank:
            return None
        port = self.master_port or (DEFAULT_MASTER_PORT if self.count > 1 else 0)
        where = f"{self.addr}:{port}"
        try:
            family, _, _, _, address = socket.getaddrinfo(self.addr, port, type=socket.SOCK_STREAM)[0]
            return socket.create_server(address, family=family, backlog=128)
        except socket.gaierror as e:
            raise UserError(f"{self.addr} names no address this machine can look up ({e.strerror})",
                            "--master-addr", "Give node 0's IP address or a host name every node resolves.") from None
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"node 0 cannot listen at {where} for the rendezvous: another program (or another "
                                "run) holds that port", "--master-port",
                                "Give every node another --master-port that is free on node 0, or stop what holds "
                                "it.") from None
            why = ("it is not an address of this machine" if e.errno == errno.EADDRNOTAVAIL else e.strerror)
            raise UserError(f"node 0 cannot listen at {where} for the rendezvous: {why}", "--master-addr",
                            "Give node 0's own address on the network the nodes share (node 0 listens there), and "
                            "every other machine its own --node-rank (1 to --nnodes - 1).") from None

    def torchrun_args(self, port: int) -> list[str]:
        """delft.training.launch's rendezvous for this machine: node 0's store at ``addr:port``."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return [f"--nnodes={self.count}", f"--rdzv-backend={RENDEZVOUS_BACKEND}", f"--rdzv-endpoint={host}:{port}",
                f"--rdzv-conf=rank={self.rank or 0}"]


def relaunch(nproc: int, argv: list[str], nodes: Nodes = Nodes(), command: str = "") -> None:
    """Run torchrun's agent (delft.training.launch) starting ``nproc`` copies of ``delft <argv>`` on this machine
    (argv without the launch options; ``nodes``: this machine's part of a multi-node run), then exit with its status.
    ``command`` is what the user ran, which the workers name when a stop leaves the run to be resumed.

    A user error in the workers (or a rendezvous that fails) is printed once, by this process, with exit 2, instead
    of once per rank plus torchrun's traceback: they write it to ERROR_FILE_ENV and stay silent; a stop (Ctrl-C,
    SIGTERM) ends this process with the workers' 130 or 143. The launcher runs in its own process group, so a
    Ctrl-C in the terminal reaches it once, from here; it dies with this process (SIGTERM: the workers save)."""
    import subprocess
    import tempfile

    if launched():
        raise UserError("--nproc was given to a process that a launcher already started", "--nproc",
                        "Drop --nproc when using torchrun or accelerate launch.")
    listener = nodes.listen()
    port = listener.getsockname()[1] if listener is not None else (nodes.master_port or DEFAULT_MASTER_PORT)
    timeout = int(float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))  # the workers' own bound for a save
    cmd = [sys.executable, "-m", "delft.training.launch", *nodes.torchrun_args(port), f"--nproc-per-node={nproc}",
           f"--shutdown-timeout={timeout}", "-m", "delft", *argv]
    with tempfile.TemporaryDirectory(prefix="delft-nproc-") as tmp:
        env = {**os.environ, ERROR_FILE_ENV: str(Path(tmp) / "error"), LAUNCH_COMMAND_ENV: command,
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if nodes.count == 1 and sys.platform.startswith("linux"):  # gloo's sockets on loopback too
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        fds = () if listener is None else (listener.fileno(),)
        if fds:
            env[STORE_FD_ENV] = str(fds[0])
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, pass_fds=fds,
                                preexec_fn=_launcher_start)
        if listener is not None:
            listener.close()  # the launcher holds it now
        stderr, forwarded = _wait(proc)
        _end(Path(tmp), proc.returncode, stderr, forwarded)


def _launcher_start() -> None:
    """In the launcher's process before it runs: its own process group (a terminal's Ctrl-C reaches this process
    alone, which passes it on once) and SIGTERM when this process dies (its workers then save and stop)."""
    import signal

    os.setpgid(0, 0)
    on_parent_death(signal.SIGTERM)


def _end(tmp: Path, returncode: int, stderr: str, forwarded: Optional[int]) -> None:
    """Exit as the launch ended: the first report (the launcher's, then rank 0's ...) once; a stop with its
    signal's code, without torchrun's traceback of the signal; anything else with torchrun's own words."""
    launch = tmp / f"error.{LAUNCH_REPORT}"
    ranks = sorted((f for f in tmp.glob("error.*") if f.suffix[1:].isdigit()), key=lambda f: int(f.suffix[1:]))
    reports = ([launch] if launch.is_file() else []) + ranks
    if reports:
        _raise_reported(reports[0])
    if returncode != 0 and forwarded is not None:
        raise SystemExit(signals.exit_code(forwarded))
    if returncode != 0:
        sys.stderr.write(stderr)
    sys.exit(returncode)


def _raise_reported(report: Path) -> None:
    import json

    error = json.loads(report.read_text())
    if error["exit_code"] == 2:
        raise UserError(error["message"])
    if error["exit_code"] == 1:
        raise VerificationError(error["message"])
    raise SystemExit(error["exit_code"])


def _wait(proc) -> tuple[str, Optional[int]]:
    """(torchrun's stderr once it has exited, the signal passed on to it or None). The first Ctrl-C or SIGTERM this
    process gets goes on to the launcher, which passes it to the workers; they save and stop. Repeats only wait."""
    forwarded: Optional[int] = None
    while True:
        try:
            return proc.communicate()[1] or "", forwarded
        except KeyboardInterrupt:
            if forwarded is None and signals.received() is not None:
                forwarded = signals.received()
                proc.send_signal(forwarded)


def report_stop(exit_code: int) -> None:
    """In a --nproc worker stopped by a signal (exit 130 or 143): tell the parent, which exits the same way."""
    report_error("", exit_code)


def report_error(message: str, exit_code: int) -> bool:
    """In a --nproc worker: leave the error for the parent, which prints one (rank 0's first); True when handled."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or not launched():
        return False
    import json

    Path(f"{path}.{rank()}").write_text(json.dumps({"message": message, "exit_code": exit_code}))
    return True


def check_nproc(nproc: int, device_pref: str, oversubscribe: bool = False) -> None:
    """Refuse more processes than GPUs (or than CPU cores where training runs on the CPU), unless asked for:
    extra processes share a device, which is no data parallelism and can exhaust memory."""
    import torch

    on_gpu = resolve_device(device_pref) == "cuda"
    devices = torch.cuda.device_count() if on_gpu else (os.cpu_count() or 1)
    if nproc > devices and not oversubscribe:
        what = f"{devices} GPU(s)" if on_gpu else f"{devices} CPU core(s) and no GPU to train on"
        raise UserError(f"--nproc {nproc} asks for more processes than this machine has devices ({what})", "--nproc",
                        f"Use --nproc {devices} or fewer, or add --oversubscribe to start {nproc} anyway.")


LAUNCH_OPTIONS = ("--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port")  # torchrun's, not a worker's


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without the launch options (``--nproc N`` / ``--nproc=N``, ``--nnodes``, ...)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in LAUNCH_OPTIONS:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in LAUNCH_OPTIONS)):
            out.append(a)
    return out
