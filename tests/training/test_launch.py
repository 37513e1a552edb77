"""Stopping a sharded run together and keeping its rendezvous where the user said (delft.training.signals,
delft.training.run, delft.training.distributed, delft.training.launch and its agent): real 2-rank runs on the CPU
(gloo), a signal sent to one process, the listening sockets read from /proc."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import free_port, recipe_file, run_cli
from test_distributed import LOGGED, finished, start, wait_for


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread ended
            pass
    return out


def process_tree(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            todo += children(pid)
        except OSError:  # the process ended
            pass
    return pids


def rank_pids(root: int) -> dict[int, int]:
    """{rank: pid} of the workers under ``root`` (their RANK in /proc/PID/environ)."""
    out = {}
    for pid in process_tree(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        out.update({int(e[5:]): pid for e in env if e.startswith(b"RANK=")})
    return out


def listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state that one of ``pids`` holds: /proc/net/tcp and tcp6
    matched to the processes' descriptors by inode (no tool needed)."""
    sockets = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = b"".join(struct.pack("<I", int(hex_addr[i:i + 8], 16)) for i in range(0, len(hex_addr), 8))
            sockets[fields[9]] = (socket.inet_ntop(family, raw), int(hex_port, 16))
    out = []
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        out += [(*sockets[link[8:-1]], pid) for link in links if link.startswith("socket:[") and link[8:-1] in sockets]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


SHARDED = {"finetuning": "full", "distributed": "fsdp", "max_steps": 40, "save_steps": 4, "eval_steps": 100,
           "logging_steps": 1}


def two_ranks(recipe: Path, logs: Path) -> list[subprocess.Popen]:
    """The two ranks of a sharded run, started with the environment torchrun gives its workers, by the test
    itself: each rank's exit code and the moment it ends can be read."""
    port, procs = free_port(), []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DELFT_DIST_TIMEOUT": "300", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        with open(logs / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "delft", "train", str(recipe)], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs


def ended(procs: list[subprocess.Popen], timeout: float) -> list[float]:
    """When each process ended (time.monotonic()), waiting at most ``timeout`` seconds for all."""
    end, at = time.monotonic() + timeout, [None] * len(procs)
    while None in at:
        if time.monotonic() > end:
            left = [p for p in procs if p.poll() is None]
            for p in left:  # not left to the rest of the suite
                p.kill()
            raise AssertionError(f"still running after {timeout} s: {[p.pid for p in left]}")
        for i, p in enumerate(procs):
            if at[i] is None and p.poll() is not None:
                at[i] = time.monotonic()
        time.sleep(0.05)
    return at


@pytest.mark.slow
def test_a_sigterm_to_one_rank_stops_both_at_one_step_and_the_resumed_log_equals_the_uninterrupted(tmp_path,
                                                                                                  tiny_model_dir):
    from delft.rundir import checkpoints, read_info

    cut = recipe_file(tmp_path, tiny_model_dir, name="cut", train=SHARDED)
    ranks = two_ranks(cut, tmp_path)
    wait_for(lambda: len(checkpoints(tmp_path / "cut")) > 0, ranks[0], "a checkpoint")
    ranks[1].send_signal(signal.SIGTERM)  # rank 1 alone: rank 0 learns of it only from rank 1
    at = ended(ranks, timeout=200)  # a deadlock would last DELFT_DIST_TIMEOUT (300 s)
    out = (tmp_path / "rank0.log").read_text()
    assert [p.returncode for p in ranks] == [143, 143], out[-3000:]
    assert abs(at[0] - at[1]) < 20, at
    stopped = int(out.split("Saved ")[1].split("(step ")[1].split("/")[0])
    last = checkpoints(tmp_path / "cut")[-1]
    assert last.name == f"step-{stopped:06d}" and "Stopped (SIGTERM)" in out
    assert {"__0_0.distcp", "__1_0.distcp", "sharded.json"} <= {f.name for f in last.iterdir()}  # both ranks' shards
    assert read_info(tmp_path / "cut")["status"] == "interrupted" and read_info(tmp_path / "cut")["step"] == stopped
    assert [r["step"] for r in metrics(tmp_path / "cut")] == list(range(1, stopped + 1))  # the stop step's row too
    resumed = finished(start([sys.executable, "-m", "delft", "train", str(cut), "--nproc", "2"]))
    assert "Resuming" in resumed
    straight = recipe_file(tmp_path, tiny_model_dir, name="straight", train=SHARDED)
    finished(start([sys.executable, "-m", "delft", "train", str(straight), "--nproc", "2"]))
    rows, ref = metrics(tmp_path / "cut"), metrics(tmp_path / "straight")
    assert [r["step"] for r in rows] == [r["step"] for r in ref] and stopped < SHARDED["max_steps"]
    for r, q in zip(rows, ref):
        assert {k: r.get(k) for k in LOGGED} == {k: q.get(k) for k in LOGGED}, r["step"]


@pytest.mark.slow
def test_a_sigint_to_the_nproc_launcher_alone_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_dir):
    """Ctrl-C sent to `delft train --nproc 2` only (not to its process group): the ranks save one step and stop,
    the launcher exits 130 with the command the user ran, and torchrun's traceback of the signal is not shown."""
    from delft.rundir import checkpoints, read_info

    recipe = recipe_file(tmp_path, tiny_model_dir, name="cut", train=SHARDED)
    proc = start([sys.executable, "-m", "delft", "train", str(recipe), "--nproc", "2"])
    wait_for(lambda: len(checkpoints(tmp_path / "cut")) > 0, proc, "a checkpoint")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 130, out[-3000:]
    assert "Interrupted. Saved" in out and f"Resume with: delft train {recipe} --nproc 2" in " ".join(out.split())
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    last = checkpoints(tmp_path / "cut")[-1]
    assert {"__0_0.distcp", "__1_0.distcp", "sharded.json"} <= {f.name for f in last.iterdir()}
    assert read_info(tmp_path / "cut")["status"] == "interrupted"
    assert int(last.name.split("-")[1]) < SHARDED["max_steps"]


@pytest.mark.slow
def test_a_rank_that_dies_first_is_named_not_hidden_by_the_rank_torchrun_stopped(tmp_path, tiny_model_dir):
    """Rank 0 killed (as the kernel kills a process for memory) mid-run under `delft train --nproc 2`: torchrun
    stops rank 1, which saves and reports a stop; the launcher names rank 0's death and exits as a shell reports
    SIGKILL (137), instead of showing only rank 1's stop (143) and hiding the failure that caused it."""
    from delft.rundir import checkpoints

    train = {"max_steps": 60, "save_steps": 2, "eval_steps": 100, "logging_steps": 1}
    recipe = recipe_file(tmp_path, tiny_model_dir, name="killed", train=train)
    proc = start([sys.executable, "-m", "delft", "train", str(recipe), "--nproc", "2"])
    wait_for(lambda: len(checkpoints(tmp_path / "killed")) > 0, proc, "a checkpoint")
    os.kill(rank_pids(proc.pid)[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 137, out[-3000:]
    assert "rank 0 failed first (killed by SIGKILL" in " ".join(out.split()), out[-3000:]
    assert "run the same command again to resume" in out and checkpoints(tmp_path / "killed")


@pytest.mark.slow
def test_a_single_node_run_listens_on_loopback_only(tmp_path, tiny_model_dir):
    """`delft train --nproc 2`: the rendezvous store (and gloo) of every process of the run listen on loopback,
    never on every interface (0.0.0.0, ::) as torchrun's own store does."""
    recipe = recipe_file(tmp_path, tiny_model_dir, name="run", train={"max_steps": 400, "eval_steps": 1000,
                                                                      "save_steps": 1000})
    proc = start([sys.executable, "-m", "delft", "train", str(recipe), "--nproc", "2"])
    wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").is_file(), proc, "a first step")
    ranks, sockets = rank_pids(proc.pid), listening(process_tree(proc.pid))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=200)
    assert set(ranks) == {0, 1}, ranks
    assert any(pid not in ranks.values() for _, _, pid in sockets), sockets  # the launcher's store was seen
    assert all(addr in ("127.0.0.1", "::1") for addr, _, _ in sockets), sockets
    assert proc.returncode == 143 and "Stopped (SIGTERM)" in out, out[-3000:]


def test_launch_options_of_several_machines_are_refused_on_one(tmp_path, tiny_model_dir):
    recipe = recipe_file(tmp_path, tiny_model_dir)
    for options in (["--node-rank", "5", "--master-addr", "10.0.0.9"], ["--nnodes", "1", "--master-port", "29501"]):
        r = run_cli("train", str(recipe), "--nproc", "2", *options)
        text = " ".join(r.output.split())
        assert r.exit_code == 2 and "place this machine among several, and --nnodes is 1" in text, r.output
        assert "Traceback" not in r.output and not (tmp_path / "run").exists()


def test_node_0_with_its_port_taken_is_one_paragraph(tmp_path, tiny_model_dir):
    recipe = recipe_file(tmp_path, tiny_model_dir)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = run_cli("train", str(recipe), "--nproc", "1", "--nnodes", "2", "--node-rank", "0", "--master-addr",
                    "127.0.0.1", "--master-port", str(port))
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and f"node 0 cannot listen at 127.0.0.1:{port}" in text and "holds that port" in text
    assert "Traceback" not in r.output and not (tmp_path / "run").exists()


def silent_listener():
    """A socket that takes connections and never answers (what a TCPStore client would wait on forever)."""
    return socket.create_server(("127.0.0.1", 0))


def wrong_server():
    """A program that answers, but not as a rendezvous store."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed
                return
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    return server


@pytest.mark.slow
@pytest.mark.parametrize("node,peer,needle", [
    (1, silent_listener, "node 1 found no rendezvous at 127.0.0.1:{port} within 3 s"),
    (1, wrong_server, "node 1 reached 127.0.0.1:{port}, and what answers there is no delft rendezvous"),
    (0, None, "node 0 waited 3 s at 127.0.0.1:{port} and not all 2 nodes joined"),
], ids=["silent", "not-a-store", "alone"])
def test_a_rendezvous_that_never_forms_ends_in_one_paragraph_naming_what_it_waited_for(tmp_path, tiny_model_dir,
                                                                                       node, peer, needle):
    recipe = recipe_file(tmp_path, tiny_model_dir)
    server = peer() if peer is not None else None
    port = server.getsockname()[1] if server is not None else free_port()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "delft", "train", str(recipe), "--nproc", "1", "--nnodes", "2",
                                 "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)],
                                env={**os.environ, "OMP_NUM_THREADS": "1", "DELFT_START_TIMEOUT": "3"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=120)
    finally:
        if server is not None:
            server.close()
    text = " ".join(out.split())
    assert proc.returncode == 2 and needle.format(port=port) in text, out[-3000:]
    assert "waiting for" in text and "DELFT_START_TIMEOUT" in text  # the wait was said, not silent
    assert text.count("error:") == 1 and "Traceback" not in out, out[-3000:]
