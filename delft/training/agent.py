"""The agent process of ``delft train --nproc N`` (``python -m delft.training.agent TORCHRUN-ARGS``): torchrun's
own agent (``torch.distributed.run.main``, which starts and watches the workers) with one change, the rendezvous.

torchrun's rendezvous stores (``--standalone``'s, and the static one of ``--master-addr``) are TCPStores whose
server listens on every interface, whatever address it is given, and the agent unpickles the rendezvous state it
reads from its store; anyone who reaches the port joins an unauthenticated key-value store. Here node 0's store
serves the socket ``delft train`` bound where the user said (``launch.Nodes.listen``: loopback for one
machine, ``--master-addr`` for several) and handed over as ``STORE_FD_ENV``: TCPStore's ``master_listen_fd``.
The other nodes connect to it as clients. Joining has a deadline (``START_TIMEOUT_ENV``) that names what it waits
for: a store client whose peer accepts and never answers waits forever in torch's own handshake.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import main as torchrun

from delft.children import describe_exit
from delft.errors import UserError
from delft.training.launch import (
    DEFAULT_START_TIMEOUT_S,
    ERROR_FILE_ENV,
    LAUNCH_REPORT,
    RENDEZVOUS_BACKEND,
    START_TIMEOUT_ENV,
    STORE_FD_ENV,
)


class Rendezvous(RendezvousHandler):
    """torchrun's static rendezvous (node R of N, node 0's store at the endpoint), with node 0's store on the socket
    it was handed and a deadline for joining."""

    def __init__(self, addr: str, port: int, node: int, nodes: int, run_id: str):
        self.addr, self.port, self.node, self.nodes, self.run_id = addr, port, node, nodes, run_id
        self.store = None

    def get_backend(self) -> str:
        return RENDEZVOUS_BACKEND

    @property
    def use_agent_store(self) -> bool:  # the workers join this store as clients: none of them listens
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self.store is None:
            self.store = self._join()
        return RendezvousInfo(PrefixStore(self.run_id, self.store), self.node, self.nodes,
                              RendezvousStoreInfo(self.addr, self.port))

    def _join(self) -> TCPStore:
        """Node 0's store on its handed socket (waiting for the other nodes to connect), or a client of it."""
        timeout = float(os.environ.get(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S))
        where = f"{self.addr}:{self.port}"
        fd = os.environ.get(STORE_FD_ENV) if self.node == 0 else None
        if self.nodes > 1:  # a wait that may take minutes is said, not silent
            what = (f"the other {self.nodes - 1} node(s) to join at {where}" if self.node == 0
                    else f"node 0's rendezvous at {where}")
            print(f"node {self.node}: waiting for {what} (up to {timeout:.0f} s, {START_TIMEOUT_ENV})", flush=True)
        made: dict = {}

        def make():
            try:
                made["store"] = TCPStore(self.addr, self.port, self.nodes, self.node == 0, timedelta(seconds=timeout),
                                         multi_tenant=True, master_listen_fd=int(fd) if fd else None)
            except Exception as e:  # torch's DistNetworkError, DistStoreError, TimeoutError: said as one paragraph
                made["error"] = e

        joining = threading.Thread(target=make, daemon=True)  # a handshake that never ends is left behind
        joining.start()
        joining.join(timeout + 5)
        if "store" in made:
            return made["store"]
        fail(self._failure(where, timeout, made.get("error")))

    def _failure(self, where: str, timeout: float, error) -> UserError:
        first = str(error).strip().splitlines()[0][:200].rstrip(".") if error is not None and str(error).strip() else ""
        if self.node == 0:
            return UserError(f"node 0 waited {timeout:.0f} s at {where} and not all {self.nodes} nodes joined"
                             + (f" ({first})" if first else ""), "--nnodes",
                             f"Start the same command on every machine, each with its own --node-rank (0 to "
                             f"{self.nodes - 1}), --master-addr and --master-port within {START_TIMEOUT_ENV} seconds "
                             "of each other, and let them reach this address (a firewall may drop the port).")
        if "Ping failed" in first:
            return UserError(f"node {self.node} reached {where}, and what answers there is no delft rendezvous "
                             "(another program listens on that port)", "--master-addr",
                             "Give every node node 0's address and the --master-port that node 0's delft train uses.")
        return UserError(f"node {self.node} found no rendezvous at {where} within {timeout:.0f} s"
                         + (f" ({first})" if first else ""), "--master-addr",
                         f"Start node 0 (--node-rank 0) within {START_TIMEOUT_ENV} seconds, give every node node 0's "
                         "address on a network this machine reaches and the same --master-port, and let the port "
                         "through any firewall between them.")

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def fail(error: UserError) -> None:
    """End the launcher with ``error``: left for ``delft train`` (which prints it once, exit 2) or printed here."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        Path(f"{path}.{LAUNCH_REPORT}").write_text(json.dumps({"message": str(error), "exit_code": error.exit_code}))
    else:
        print(f"error: {error}", file=sys.stderr)
    sys.stdout.flush()
    os._exit(error.exit_code)  # a join that never ends holds a thread that exit would wait for


def create(params: RendezvousParameters) -> Rendezvous:
    addr, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    return Rendezvous(addr, port, int(params.config["rank"]), params.max_nodes, params.run_id)


def report_first_failure(failures: dict) -> None:
    """When the rank that failed first left no report of its own (it crashed with a traceback, or was killed), say
    so in the launcher's report: torchrun then stopped the other ranks (SIGTERM), and a stopped rank's own report
    (saved, exit 143) would otherwise be all ``delft train`` shows, hiding the failure that caused it."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or not failures:
        return
    rank, first = min(failures.items(), key=lambda item: item[1].timestamp)
    if Path(f"{path}.{rank}").is_file():  # it said what happened: its report is the one printed
        return
    code = 128 - first.exitcode if first.exitcode < 0 else first.exitcode  # a signal's death as a shell says it
    others = sorted(r for r in failures if r != rank)
    stopped = f"; torchrun then stopped rank(s) {', '.join(map(str, others))}" if others else ""
    message = (f"rank {rank} failed first ({describe_exit(first.exitcode)}) without a message delft could print (its "
               f"output is above){stopped}. The last checkpoint is intact: run the same command again to resume.")
    Path(f"{path}.{LAUNCH_REPORT}").write_text(json.dumps({"message": message, "exit_code": code, "output": True}))


def main(argv: list[str]) -> None:
    rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, create)
    try:
        torchrun(argv)
    except ChildFailedError as e:
        report_first_failure(e.failures)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
