"""The launcher of ``delft train --nproc N`` (and ``--nnodes``): the launch options checked (``Nodes``,
``check_nproc``), node 0's rendezvous socket bound where the user said, torchrun's agent (delft.training.agent)
started with this command's argv less the launch options (``relaunch``, ``strip_nproc``), and the workers' errors
and stops reported once, by this process (``report_error``, ``report_stop``: the CLI calls them in a worker).

Torch-free at import, as the CLI imports it before a recipe is trained; the process group and the collectives the
workers then use are delft.training.distributed's.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from delft import signals
from delft.children import on_parent_death
from delft.errors import UserError, VerificationError
from delft.models.loading import resolve_device
from delft.training.distributed import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, launched, rank

ERROR_FILE_ENV = "DELFT_ERROR_FILE"  # where --nproc's workers leave a user error for the parent to print once
LAUNCH_REPORT = "launch"  # the launcher's own report beside the ranks' (ERROR_FILE_ENV.launch)
LAUNCH_COMMAND_ENV = "DELFT_LAUNCH_COMMAND"  # the command the user ran, for the workers' resume hint
STORE_FD_ENV = "DELFT_STORE_FD"  # node 0's rendezvous socket, bound by delft train, served by the launcher
START_TIMEOUT_ENV = "DELFT_START_TIMEOUT"  # seconds the nodes wait for each other at start
DEFAULT_START_TIMEOUT_S = 600
RENDEZVOUS_BACKEND = "delft-static"  # delft.training.agent's rendezvous
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
        """delft.training.agent's rendezvous for this machine: node 0's store at ``addr:port``."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return [f"--nnodes={self.count}", f"--rdzv-backend={RENDEZVOUS_BACKEND}", f"--rdzv-endpoint={host}:{port}",
                f"--rdzv-conf=rank={self.rank or 0}"]


def relaunch(nproc: int, argv: list[str], nodes: Nodes = Nodes(), command: str = "") -> None:
    """Run torchrun's agent (delft.training.agent) starting ``nproc`` copies of ``delft <argv>`` on this machine
    (argv without the launch options; ``nodes``: this machine's part of a multi-node run), then exit with its status.
    ``command`` is what the user ran, which the workers name when a stop leaves the run to be resumed.

    A user error in the workers (or a rendezvous that fails) is printed once, by this process, with exit 2, instead
    of once per rank plus torchrun's traceback: they write it to ERROR_FILE_ENV and stay silent; a stop (Ctrl-C,
    SIGTERM) ends this process with the workers' 130 or 143. The launcher runs in its own process group, so a
    Ctrl-C in the terminal reaches it once, from here; it dies with this process (SIGTERM: the workers save)."""
    if launched():
        raise UserError("--nproc was given to a process that a launcher already started", "--nproc",
                        "Drop --nproc when using torchrun or accelerate launch.")
    listener = nodes.listen()
    port = listener.getsockname()[1] if listener is not None else (nodes.master_port or DEFAULT_MASTER_PORT)
    timeout = int(float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))  # the workers' own bound for a save
    cmd = [sys.executable, "-m", "delft.training.agent", *nodes.torchrun_args(port), f"--nproc-per-node={nproc}",
           f"--shutdown-timeout={timeout}", "-m", "delft", *argv]
    with tempfile.TemporaryDirectory(prefix="delft-nproc-") as tmp:
        # a compare or study that launched this training passes its own command: the one that resumes it
        env = {**os.environ, ERROR_FILE_ENV: str(Path(tmp) / "error"),
               LAUNCH_COMMAND_ENV: os.environ.get(LAUNCH_COMMAND_ENV) or command,
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
    os.setpgid(0, 0)
    on_parent_death(signal.SIGTERM)


def _end(tmp: Path, returncode: int, stderr: str, forwarded: Optional[int]) -> None:
    """Exit as the launch ended: the first report (the launcher's, then rank 0's ...) once; a stop with its
    signal's code, without torchrun's traceback of the signal; anything else with torchrun's own words."""
    launch = tmp / f"error.{LAUNCH_REPORT}"
    ranks = sorted((f for f in tmp.glob("error.*") if f.suffix[1:].isdigit()), key=lambda f: int(f.suffix[1:]))
    reports = ([launch] if launch.is_file() else []) + ranks
    if reports:
        _raise_reported(reports[0], stderr)
    if returncode != 0 and forwarded is not None:
        raise SystemExit(signals.exit_code(forwarded))
    if returncode != 0:
        sys.stderr.write(stderr)
    sys.exit(returncode)


def _raise_reported(report: Path, stderr: str) -> None:
    error = json.loads(report.read_text())
    if error.get("output"):  # a rank that failed without a report: what it printed is all there is
        sys.stderr.write(stderr)
    if error["exit_code"] == 2:
        raise UserError(error["message"])
    if error["exit_code"] == 1:
        raise VerificationError(error["message"])
    if error["message"]:
        print(f"error: {error['message']}", file=sys.stderr)
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
