"""An emulated slow cluster on one machine: Linux network namespaces joined by rate-limited links,
and Horovod or ``torch.distributed`` jobs (Gloo) run across them.

    with EmulatedCluster(workers=2, rate="1gbit") as cluster:
        link = measure_link(cluster)                       # bandwidth and latency of a link
        outputs = run_horovod(cluster, [sys.executable, "-m", "benchmarks.emulated.synthetic", ...])
        outputs = run_torch_distributed(cluster, [sys.executable, "-m", "benchmarks.emulated.synthetic_ddp", ...])

Topology: a *switch* namespace holding a bridge, and one namespace per *host* joined to the
bridge by a veth pair. Both ends of every veth are shaped with ``tc qdisc ... tbf``: the host
end limits what the host sends, the switch end what it receives, as a full-duplex NIC of that
speed on a non-blocking switch would. Host ``h`` has address ``<subnet>.<h+1>`` on ``eth0``; the
switch's bridge has ``<subnet>.254`` and runs Horovod's rendezvous server. By default every
worker is a host of its own; with ``workers_per_host=L`` the workers ``h*L .. h*L+L-1`` share
host ``h``'s namespace (Horovod's ``local_rank`` ``0..L-1``, ``cross_rank`` ``h``), so their
traffic to each other stays inside it, unshaped (the kernel routes a namespace's own addresses
over its loopback), and all of them share the host's shaped link to the others: a node's
fast links inside and one NIC out::

    with EmulatedCluster(workers=4, rate="1gbit", workers_per_host=2) as cluster:  # 2 hosts x 2

Horovod 0.28.1 binds the Gloo context of its global process set to the address the machine's
hostname resolves to (it ignores ``HOROVOD_GLOO_IFACE`` there), as on a real cluster where a
host's name resolves to its NIC. So each host namespace gets its own ``hosts`` file, which
``ip netns exec`` mounts over ``/etc/hosts`` inside that namespace only (``/etc/netns/<ns>/hosts``),
mapping the hostname to the host's address.

Everything is created inside namespaces this module makes (named ``<prefix>-<pid>-...``), so no
address or interface ever appears in the machine's own namespace. Leaving the ``with`` block
removes them, after killing whatever still runs inside, also on errors and on SIGTERM / SIGINT;
namespaces left by a run that was killed outright (SIGKILL) are removed by the next run, which
recognises them by their prefix and dead pid. Needs root (``ip netns``).

``python -m benchmarks.emulated.netem rendezvous|probe-server|probe-client`` are the helper processes the
functions below start inside the namespaces.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: Name prefix of every namespace this module creates.
PREFIX = "hsnet"
#: Interface name of a worker's link, inside its namespace (``HOROVOD_GLOO_IFACE``).
IFACE = "eth0"
#: Where ``ip netns exec`` finds per-namespace files to mount over ``/etc``.
NETNS_ETC = Path("/etc/netns")
#: Port of the link probe, inside the namespaces.
PROBE_PORT = 5201
#: Port of a ``torch.distributed`` job's store, on worker 0's address (``MASTER_PORT``).
TORCH_MASTER_PORT = 29500
REPO = Path(__file__).resolve().parents[2]

_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as ``1gbit``, ``10gbit`` or ``500mbit``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate.strip().lower())
    if not match:
        raise ValueError(f"rate must look like 1gbit, 10gbit or 100mbit, got {rate!r}")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def tbf_arguments(rate: str) -> List[str]:
    """``tc qdisc add ... tbf`` arguments for ``rate``: a bucket of 1 ms of traffic (at least
    16 KiB; a smaller one cannot hold a full-size segment) and 50 ms of queue."""
    burst = max(int(rate_bits(rate) / 8 / 1000), 16 * 1024)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def _run(argv: Sequence[str]) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def list_namespaces() -> List[str]:
    """Names of the network namespaces that exist now."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_namespace(name: str) -> None:
    """Kill every process still inside namespace ``name``, then delete it (its links go with it)
    and its ``/etc/netns/<name>`` files."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    etc = NETNS_ETC / name
    if etc.is_dir():
        shutil.rmtree(etc)
        if NETNS_ETC.is_dir() and not any(NETNS_ETC.iterdir()):
            NETNS_ETC.rmdir()


def remove_stale_namespaces(prefix: str = PREFIX) -> List[str]:
    """Delete namespaces ``<prefix>-<pid>-*`` whose creating process is gone; returns their names."""
    stale = [name for name in list_namespaces()
             if (m := re.fullmatch(rf"{re.escape(prefix)}-(\d+)-\w+", name)) and not _pid_alive(int(m.group(1)))]
    for name in stale:
        delete_namespace(name)
    return stale


class EmulatedCluster:
    """``workers`` workers on ``workers / workers_per_host`` hosts, one network namespace per
    host on a bridge, every host's link shaped to ``rate`` both ways.

    Args:
        workers: number of workers (1..253 hosts of ``workers_per_host``).
        rate: link speed as tc writes it (``1gbit``, ``10gbit``, ``100mbit``), or None for
            unshaped links.
        subnet: first three octets of the /24 used inside the namespaces.
        prefix: namespace name prefix.
        workers_per_host: workers sharing one host's namespace (``workers`` must be a multiple).

    Attributes: ``hosts``, and per host its namespace (``namespaces``) and address (``addresses``).
    """

    def __init__(self, workers: int, rate: Optional[str] = "1gbit", subnet: str = "10.213.0",
                 prefix: str = PREFIX, workers_per_host: int = 1) -> None:
        if workers_per_host < 1 or workers % workers_per_host:
            raise ValueError(f"workers ({workers}) must be a multiple of workers_per_host ({workers_per_host})")
        hosts = workers // workers_per_host
        if not 1 <= hosts <= 253:
            raise ValueError(f"hosts (workers / workers_per_host) must be in 1..253, got {hosts}")
        if rate is not None:
            rate_bits(rate)
        self.workers = workers
        self.workers_per_host = workers_per_host
        self.hosts = hosts
        self.rate = rate
        tag = f"{prefix}-{os.getpid()}"
        self.prefix = prefix
        self.switch = f"{tag}-sw"
        self.namespaces = [f"{tag}-w{h}" for h in range(hosts)]
        self.addresses = [f"{subnet}.{h + 1}" for h in range(hosts)]
        self.switch_address = f"{subnet}.254"
        self._created: List[str] = []
        self._previous_handlers: Dict[int, Any] = {}

    # -- lifetime -----------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        self._trap_signals()
        try:
            remove_stale_namespaces(self.prefix)
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove every namespace this cluster created (idempotent)."""
        while self._created:
            delete_namespace(self._created.pop())
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _trap_signals(self) -> None:
        """Turn SIGTERM / SIGINT into exceptions so ``__exit__`` cleans up (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def interrupt(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[signum] = signal.signal(signum, interrupt)

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _create(self) -> None:
        self._add_namespace(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "addr", "add", f"{self.switch_address}/24", "dev", "br0"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, (name, address) in enumerate(zip(self.namespaces, self.addresses)):
            port = f"p{i}"
            self._add_namespace(name)
            # Both ends are created directly inside the namespaces: never in the host's.
            _run(["ip", "-n", name, "link", "add", IFACE, "type", "veth", "peer", "name", port,
                  "netns", self.switch])
            _run(["ip", "-n", name, "addr", "add", f"{address}/24", "dev", IFACE])
            _run(["ip", "-n", name, "link", "set", IFACE, "up"])
            etc = NETNS_ETC / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", self.switch, "link", "set", port, "up"])
            if self.rate is not None:
                _run(["tc", "-n", name, "qdisc", "add", "dev", IFACE, "root", *tbf_arguments(self.rate)])
                _run(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", *tbf_arguments(self.rate)])

    # -- running things inside ----------------------------------------------------------------------
    def host_of(self, worker: int) -> int:
        """The host of worker (rank) ``worker``: ranks are numbered host by host."""
        return worker // self.workers_per_host

    def exec_argv(self, worker: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside worker ``worker``'s namespace (its host's)."""
        return self.host_argv(self.host_of(worker), argv)

    def host_argv(self, host: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def switch_argv(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside the switch namespace."""
        return ["ip", "netns", "exec", self.switch, *argv]


def _python_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2", **(extra or {})}


def _module_argv(*args: str) -> List[str]:
    return [sys.executable, "-m", "benchmarks.emulated.netem", *args]


# -- link measurement --------------------------------------------------------------------------------
@dataclass
class LinkMeasurement:
    """One link measured between host 0 and host 1: bandwidth of a bulk TCP transfer and half
    the round trip of a 1-byte ping-pong (the alpha and 1/beta of the alpha-beta model)."""

    rate: Optional[str]
    bits_per_second: float
    latency_seconds: float
    bytes_transferred: int

    def as_dict(self) -> Dict[str, Any]:
        return {"rate": self.rate, "bits_per_second": self.bits_per_second,
                "latency_seconds": self.latency_seconds, "bytes_transferred": self.bytes_transferred}


def measure_link(cluster: EmulatedCluster, seconds: float = 1.0, timeout: float = 60.0) -> LinkMeasurement:
    """Measure the link from host 0 to host 1 (about ``seconds`` of bulk transfer)."""
    if cluster.hosts < 2:
        raise ValueError("measure_link needs at least two hosts")
    nominal = rate_bits(cluster.rate) if cluster.rate else 10e9
    total = int(nominal / 8 * seconds)
    server = subprocess.Popen(cluster.host_argv(1, _module_argv("probe-server")), env=_python_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        server.stdout.readline()  # "ready"
        client = subprocess.run(cluster.host_argv(0, _module_argv("probe-client", cluster.addresses[1], str(total))),
                                env=_python_env(), capture_output=True, text=True, timeout=timeout)
        if client.returncode != 0:
            raise RuntimeError(f"link probe failed: {client.stderr.strip()}")
        figures = json.loads(client.stdout)
    finally:
        server.kill()
        server.wait()
    return LinkMeasurement(cluster.rate, figures["bits_per_second"], figures["latency_seconds"], total)


def _probe_server() -> None:
    listener = socket.create_server(("0.0.0.0", PROBE_PORT), reuse_port=True)
    print("ready", flush=True)
    connection, _ = listener.accept()
    with connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while (byte := connection.recv(1)) != b"B":  # ping-pong phase until the bulk marker
            connection.sendall(byte)
        while connection.recv(1 << 20):
            pass
        connection.sendall(b"k")


def _probe_client(address: str, total: int, pings: int = 200) -> None:
    with socket.create_connection((address, PROBE_PORT), timeout=30) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        for _ in range(pings):
            connection.sendall(b"p")
            connection.recv(1)
        latency = (time.perf_counter() - start) / pings / 2
        connection.sendall(b"B")
        chunk = bytes(1 << 20)
        start = time.perf_counter()
        for offset in range(0, total, len(chunk)):
            connection.sendall(chunk[:min(len(chunk), total - offset)])
        connection.shutdown(socket.SHUT_WR)
        connection.recv(1)
        elapsed = time.perf_counter() - start
    print(json.dumps({"bits_per_second": 8 * total / elapsed, "latency_seconds": latency}))


# -- jobs over the cluster -------------------------------------------------------------------------------
def _serve_rendezvous(hosts: int, slots: int) -> None:
    """Start Horovod's rendezvous server for ``slots`` slots on each host ``w0 .. w<hosts-1>`` (ranks
    numbered host by host); print the port and each slot's environment as JSON, then serve until
    stdin closes."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    plan = get_host_assignments(parse_hosts(",".join(f"w{h}:{slots}" for h in range(hosts))), hosts * slots)
    server = RendezvousServer()
    port = server.start()
    server.init(plan)
    print(json.dumps({"port": port, "slots": [create_slot_env_vars(slot) for slot in plan]}), flush=True)
    sys.stdin.read()
    server.stop()


def inner_argv(argv: Sequence[str], driver_options: Sequence[str] = ("--emulate", "--workers")) -> List[str]:
    """The arguments of an emulated run's workers: the driver's ``argv`` without its
    ``driver_options`` (each with its value, as two words or ``--option=value``)."""
    inner: List[str] = []
    value_next = False
    for arg in argv:
        if value_next:
            value_next = False
        elif arg in driver_options:
            value_next = True
        elif not arg.startswith(tuple(f"{option}=" for option in driver_options)):
            inner.append(arg)
    return inner


@dataclass
class JobOutput:
    """What the workers of one job printed; ``stdout[0]`` is rank 0's."""

    stdout: List[str]
    stderr: List[str]


def run_horovod(cluster: EmulatedCluster, argv: Sequence[str], timeout: float = 1800.0,
                on_line: Optional[Callable[[str], None]] = None, extra_env: Optional[Dict[str, str]] = None
                ) -> JobOutput:
    """Run ``argv`` as a Horovod job over Gloo with ``cluster.workers_per_host`` workers per host
    namespace, as ``horovodrun --gloo -H w0:L,w1:L,...`` would (rendezvous server in the switch
    namespace, Gloo bound to each host's shaped ``eth0``; each namespace is a Horovod host).
    ``on_line`` sees rank 0's stdout lines as they come. Raises with every worker's output when
    one fails or ``timeout`` passes; all workers are stopped then."""
    helper = _module_argv("rendezvous", str(cluster.hosts), str(cluster.workers_per_host))
    rendezvous = subprocess.Popen(cluster.switch_argv(helper), env=_python_env(), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    try:
        assert rendezvous.stdout is not None
        plan = json.loads(rendezvous.stdout.readline())
        common = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.switch_address,
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": str(plan["port"]), "HOROVOD_CONTROLLER": "gloo",
                  "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": IFACE,
                  "HOROVOD_GLOO_TIMEOUT_SECONDS": "120", **(extra_env or {})}
        envs = [{**common, **{k: str(v) for k, v in slot.items()}} for slot in plan["slots"]]
        return _run_job(cluster, argv, envs, timeout, on_line)
    finally:
        rendezvous.kill()
        rendezvous.wait()


def run_torch_distributed(cluster: EmulatedCluster, argv: Sequence[str], timeout: float = 1800.0,
                          on_line: Optional[Callable[[str], None]] = None,
                          extra_env: Optional[Dict[str, str]] = None) -> JobOutput:
    """Run ``argv`` as a ``torch.distributed`` job with ``L = cluster.workers_per_host`` processes
    per host namespace, as ``torchrun --nnodes N --nproc-per-node L`` on each host would: the
    environment of ``init_process_group(init_method="env://")`` (``MASTER_ADDR`` = host 0's
    address on its shaped link, where rank 0 serves the store on :data:`TORCH_MASTER_PORT`;
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE=L``) and Gloo bound to the
    shaped ``eth0`` (``GLOO_SOCKET_IFNAME``). ``on_line``, errors and stopping as :func:`run_horovod`."""
    local = cluster.workers_per_host
    common = {"MASTER_ADDR": cluster.addresses[0], "MASTER_PORT": str(TORCH_MASTER_PORT),
              "WORLD_SIZE": str(cluster.workers), "LOCAL_WORLD_SIZE": str(local),
              "GLOO_SOCKET_IFNAME": IFACE, **(extra_env or {})}
    envs = [{**common, "RANK": str(i), "LOCAL_RANK": str(i % local)} for i in range(cluster.workers)]
    return _run_job(cluster, argv, envs, timeout, on_line)


def _run_job(cluster: EmulatedCluster, argv: Sequence[str], envs: List[Dict[str, str]], timeout: float,
             on_line: Optional[Callable[[str], None]]) -> JobOutput:
    """Start ``argv`` in every worker's namespace, worker ``i`` with ``envs[i]`` added to the Python
    environment, and wait for them all (:func:`_follow`): rank 0's stdout is piped to
    ``on_line``, every other output goes to a log file. Raises with every worker's exit code and
    the tails of its output when one fails or ``timeout`` passes; no worker outlives the call."""
    workers: List[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="hsnet-job-") as tmp:
        try:
            logs = [(Path(tmp, f"{i}.out"), Path(tmp, f"{i}.err")) for i in range(cluster.workers)]
            for i, env in enumerate(envs):
                out = subprocess.PIPE if i == 0 else logs[i][0].open("w")
                workers.append(subprocess.Popen(cluster.exec_argv(i, argv), env=_python_env(env), stdout=out,
                                                stderr=logs[i][1].open("w"), text=True))
            rank0, timed_out = _follow(workers, timeout, on_line)
            codes = [w.returncode for w in workers]
            stdout = ["\n".join(rank0)] + [logs[i][0].read_text() for i in range(1, cluster.workers)]
            stderr = [logs[i][1].read_text() for i in range(cluster.workers)]
            if timed_out or any(codes):
                tails = "\n".join(f"--- worker {i} (exit {c}) ---\n{stdout[i][-3000:]}\n{stderr[i][-3000:]}"
                                  for i, c in enumerate(codes))
                what = f"ran past {timeout:.0f} s" if timed_out else "failed"
                raise RuntimeError(f"{' '.join(argv)} {what} across the emulated cluster:\n{tails}")
            return JobOutput(stdout, stderr)
        finally:
            for process in workers:
                if process.poll() is None:
                    process.kill()
                process.wait()


def _follow(workers: List[subprocess.Popen], timeout: float,
            on_line: Optional[Callable[[str], None]]) -> Tuple[List[str], bool]:
    """Read rank 0's stdout to its end and wait for every worker; kill them all when one fails
    or ``timeout`` passes (a worker left alone would wait on its peers until Gloo times out).
    Returns rank 0's lines and whether the timeout struck."""
    deadline = time.monotonic() + timeout
    timed_out = threading.Event()

    def watchdog() -> None:
        while any(w.poll() is None for w in workers):
            late = time.monotonic() > deadline
            if late or any(w.poll() not in (None, 0) for w in workers):
                if late:
                    timed_out.set()
                for w in workers:
                    if w.poll() is None:
                        w.kill()
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    lines = []
    assert workers[0].stdout is not None
    for line in workers[0].stdout:
        lines.append(line.rstrip("\n"))
        if on_line is not None:
            on_line(lines[-1])
    for w in workers:
        w.wait()
    thread.join()
    return lines, timed_out.is_set()


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="helper processes of benchmarks.emulated.netem (run inside "
                                                 "namespaces)")
    sub = parser.add_subparsers(dest="command", required=True)
    rendezvous = sub.add_parser("rendezvous")
    rendezvous.add_argument("hosts", type=int)
    rendezvous.add_argument("slots", type=int, help="workers per host")
    sub.add_parser("probe-server")
    client = sub.add_parser("probe-client")
    client.add_argument("address")
    client.add_argument("bytes", type=int)
    args = parser.parse_args(argv)
    if args.command == "rendezvous":
        _serve_rendezvous(args.hosts, args.slots)
    elif args.command == "probe-server":
        _probe_server()
    else:
        _probe_client(args.address, args.bytes)


if __name__ == "__main__":
    main()
