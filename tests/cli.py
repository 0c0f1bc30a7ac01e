"""``run`` and ``Popen`` as in :mod:`subprocess`; ``python script.py ...`` from a warm interpreter.

A recipe run through a fresh interpreter spends ~5 s importing torch, transformers, datasets and
Hydra before it reads its first argument; the suite runs ~300. A *zygote* (one per test session,
which its xdist workers share, and import-time environment) imports those once and forks a child
per command. The child takes the command's arguments, folder, environment, streams and session,
runs the script as ``__main__`` (``runpy.run_path``, as ``python script.py`` does), then its
atexit handlers, and exits with the script's status: the caller sees its pid, signals and status as
a subprocess's. Variables read only after start-up (``LATE_ENVIRONMENT``) may differ from the
zygote's; any other difference gets its own zygote, so import-time reads (``HF_HOME``,
``OMP_NUM_THREADS``) stay true. torchrun (``python -m torch.distributed.run``) runs warm only in
an environment from :func:`warm_torchrun_environment`, where its workers start warm as well (through
its ``PYTHON_EXEC``); anything else (``python -X ...``, ``python -c``) runs as a real subprocess.
The zygote only imports, never runs torch work: a fork cannot inherit an OpenMP pool's locks, nor a
store thread's resolver lock.
"""

import contextlib
import fcntl
import hashlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from components.runtime.malloc import malloc_environment
from tests.stacks import descendants, python_stacks

REPO = Path(__file__).resolve().parents[1]
# Read when code runs, not at import, so they may differ from the zygote's (pytest sets
# PYTEST_CURRENT_TEST anew for every test).
LATE_ENVIRONMENT = ("SHARDTUNE_", "WANDB_", "MLFLOW_", "COUNT_", "TMPDIR", "NETRC", "PYTEST_")
# What a recipe's checks import before its first step (the rest is imported by the child itself).
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "transformers",
    "datasets",
    "hydra",
    "matplotlib.pyplot",
    "recipes.finetune",
    "recipes.checks",
    "recipes.prepare",
    "components.models.build",
    "components.models.load",
    "components.planning.dry_run",
    "components.runtime.launch",
    "components.runtime.world",
    "components.runtime.cli",
    "components.runtime.ranks",
    # the tiny families' classes, which the checks' meta model imports in nearly every run
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.mixtral.modeling_mixtral",
)  # and what the recipe's functions import (components/runtime/preload.py), after these
MAX_ZYGOTES = 8  # each holds ~0.5 GiB; the suite has about seven import-time environments
_ZYGOTES: dict[tuple, "_Zygote"] = {}
_ZYGOTES_LOCK = threading.Lock()


def _is_warm_command(command, env: dict[str, str] | None) -> bool:
    """``python script.py ...``; or ``python -m torch.distributed.run ...`` (torchrun's agent) in
    an environment made by :func:`warm_torchrun_environment`."""
    arguments = [str(part) for part in command] if not isinstance(command, str) else []
    if len(arguments) < 2 or arguments[0] != sys.executable:
        return False
    torchrun = arguments[1:3] == ["-m", "torch.distributed.run"]
    return arguments[1].endswith(".py") or (torchrun and "SHARDTUNE_TEST_ZYGOTE" in (env or {}))


def _early_environment(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(LATE_ENVIRONMENT)))


def _send(sock: socket.socket, payload) -> None:
    data = pickle.dumps(payload)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _receive(sock: socket.socket):
    header = _read_exactly(sock, 4)
    return pickle.loads(_read_exactly(sock, struct.unpack("!I", header)[0]))


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the zygote closed the connection")
        data += chunk
    return data


class _Zygote:
    """One warm interpreter (``python -m tests.cli``) listening on a Unix socket. It ends when this
    process closes its stdin (the test session ended) or, shared by a session's pytest-xdist
    workers (:func:`_zygote_for`), when the session's controller process ends."""

    def __init__(self, env: dict[str, str], address: str | None = None, die_with: int = 0):
        self.folder = None if address else tempfile.mkdtemp(prefix="shardtune-zygote-")
        self.address = address or os.path.join(self.folder, "socket")
        self.shared = bool(die_with)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.cli", self.address, str(die_with)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,  # its end ends an own zygote (die_with 0; see _serve)
            stdout=subprocess.DEVNULL,
        )
        self.pid = self.process.pid

    @classmethod
    def at(cls, address: str, pid: int | None = None) -> "_Zygote":
        """A running zygote's client side, by its socket's address (no process of ours), and its
        process id where known (so that a client need not wait for a zygote that ended)."""
        zygote = cls.__new__(cls)
        zygote.address = address
        zygote.process = None
        zygote.pid = pid
        zygote.shared = True
        return zygote

    def ended(self) -> bool:
        if self.process is not None:
            return self.process.poll() is not None
        return self.pid is not None and not os.path.exists(f"/proc/{self.pid}")

    def connect(self) -> socket.socket:
        deadline = time.monotonic() + 120
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.address)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if self.ended() or time.monotonic() > deadline:
                    raise RuntimeError("the test zygote did not start") from None
                time.sleep(0.05)

    def close(self) -> None:
        """End a zygote of this process's own (a shared one ends with the session)."""
        if not self.shared:
            self.process.stdin.close()
            self.process.wait(timeout=30)


def _zygote_for(env: dict[str, str]) -> _Zygote:
    """The zygote for ``env``'s import-time environment; the least recently used one makes room.
    Locked: tests start commands from threads, and two zygotes for one key would import twice."""
    key = _early_environment(env)
    with _ZYGOTES_LOCK:
        if key not in _ZYGOTES:
            if len(_ZYGOTES) >= MAX_ZYGOTES:
                _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
            _ZYGOTES[key] = _session_zygote(key)
        _ZYGOTES[key] = _ZYGOTES.pop(key)  # the most recently used last
        return _ZYGOTES[key]


def _session_zygote(key: tuple) -> _Zygote:
    """A zygote of this process's own; under pytest-xdist, the one this session's workers share
    for ``key`` (the first worker to ask starts it, under a file lock; the others connect to its
    socket): one ~9 CPU-s start per environment instead of one per worker."""
    env = dict(key)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run or "PYTEST_XDIST_WORKER" not in os.environ:
        return _Zygote(env)
    folder = Path(tempfile.gettempdir()) / f"shardtune-zygotes-{run}"
    folder.mkdir(exist_ok=True)
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    address, started = str(folder / f"{name}.socket"), folder / f"{name}.pid"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if started.exists():
            return _Zygote.at(address, int(started.read_text()))
        zygote = _Zygote(env, address, die_with=os.getppid())  # the xdist controller
        started.write_text(str(zygote.pid))
        return zygote


def _descriptor(stream, inherited: int, opened: list) -> int:
    """The file descriptor the child gets for one standard stream, as ``subprocess`` reads it."""
    if stream is None:
        return inherited  # the caller's own stream, as a subprocess inherits it
    if stream == subprocess.DEVNULL:
        opened.append(open(os.devnull, "r+b"))  # noqa: SIM115 - closed once sent
        return opened[-1].fileno()
    if stream == subprocess.PIPE:
        raise ValueError("tests.cli has no pipes: give a file")
    return stream if isinstance(stream, int) else stream.fileno()


class WarmProcess:
    """A command run by a zygote's child: the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, command, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None,
                 start_new_session=False, zygote: str | None = None):  # fmt: skip
        env = dict(os.environ if env is None else env)
        env = malloc_environment(env) or env  # as the recipe would exec itself (no second start)
        self.args = command
        self.returncode: int | None = None
        self._sock = (_Zygote.at(zygote) if zygote else _zygote_for(env)).connect()
        request = {
            "argv": [str(part) for part in command[1:]],
            "cwd": str(cwd or os.getcwd()),
            "env": env,
            "new_session": start_new_session,
            "watch": os.getpid() if zygote else None,  # the forwarding process (see forward)
        }
        opened = []
        fds = [_descriptor(s, fd, opened) for fd, s in enumerate((stdin, stdout, stderr))]
        data = pickle.dumps(request)
        socket.send_fds(self._sock, [struct.pack("!I", len(data)) + data], fds)
        for file in opened:
            file.close()
        self.pid = _receive(self._sock)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._sock], [], [], 0)[0]:
            self.returncode = _receive(self._sock)
            self._sock.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.poll()
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def Popen(command, **kwargs):  # noqa: N802 - subprocess's name
    """``subprocess.Popen``, warm for ``python script.py ...`` (see the module docstring)."""
    if _is_warm_command(command, kwargs.get("env")):
        return WarmProcess(command, **kwargs)
    return subprocess.Popen(command, **kwargs)


class PipedProcess:
    """``Popen(command, **kwargs)`` with stdout and stderr pipes, as under ``| tee`` or in a Slurm
    step, each copied into its file of ``paths`` (stdout's, stderr's) by a thread, byte for byte:
    ``wait`` returns once the process has ended and every process holding a pipe has closed it,
    its last bytes in the file. Anything else is the process's (``pid``, ``poll``, ...)."""

    COPIED_WITHIN_S = 60  # after the process ends: its children (ranks) die with it

    def __init__(self, command, paths: tuple[Path, Path], **kwargs):
        pipes = [os.pipe() for _ in paths]
        self._copies = [
            threading.Thread(target=_copy, args=(read, path), daemon=True, name=f"copy {path}")
            for (read, _), path in zip(pipes, paths, strict=True)
        ]
        try:
            self.process = Popen(command, stdout=pipes[0][1], stderr=pipes[1][1], **kwargs)
        finally:
            for _, write in pipes:
                os.close(write)
        for copy in self._copies:
            copy.start()

    def wait(self, timeout: float | None = None) -> int:
        returncode = self.process.wait(timeout)
        for copy in self._copies:
            copy.join(self.COPIED_WITHIN_S)
            assert not copy.is_alive(), f"a process outlived {self.process.pid} holding its pipe"
        return returncode

    def __getattr__(self, name: str):
        return getattr(self.process, name)


def _copy(read: int, path: Path) -> None:
    with open(read, "rb", buffering=0) as pipe, open(path, "wb") as copy:
        while chunk := pipe.read(1 << 16):
            copy.write(chunk)
            copy.flush()


def run(command, *, input=None, capture_output=False, text=False, timeout=None, **kwargs):  # noqa: A002
    """``subprocess.run``, warm for ``python script.py ...``: the same result and exceptions."""
    if not _is_warm_command(command, kwargs.get("env")):
        return subprocess.run(
            command, input=input, capture_output=capture_output, text=text, timeout=timeout,
            **kwargs,
        )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="shardtune-cli-") as folder:
        paths = {name: Path(folder) / name for name in ("stdin", "stdout", "stderr")}
        paths["stdin"].write_bytes((input.encode() if text else input) if input else b"")
        with open(paths["stdin"], "rb") as stdin, open(paths["stdout"], "wb") as stdout:
            with open(paths["stderr"], "wb") as stderr:
                streams = {"stdin": stdin}
                if capture_output:
                    streams |= {"stdout": stdout, "stderr": stderr}
                process = WarmProcess(command, **streams, **kwargs)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            print(python_stacks(descendants(process.pid)), file=sys.stderr)  # in the report
            process.kill()
            process.wait()
            raise
        out, err = (paths["stdout"].read_bytes(), paths["stderr"].read_bytes())
    if text:
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
    if not capture_output:
        out = err = None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def warm_torchrun_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a real ``torchrun`` whose workers start warm: torchrun runs each worker as
    ``$PYTHON_EXEC -u script ...`` (its documented override), and ``tests/warm_python`` hands that
    command to the zygote of ``env`` (:func:`forward`), so a rank skips ~5 s of imports while
    torchrun's agent, rendezvous, restarts and signals stay the real ones."""
    env = malloc_environment(env) or env  # the recipe's malloc settings: no exec in the worker
    zygote = _zygote_for(env)
    return env | {
        "PYTHON_EXEC": str(REPO / "tests" / "warm_python"),
        "SHARDTUNE_TEST_PYTHON": sys.executable,
        "SHARDTUNE_TEST_ZYGOTE": zygote.address,
    }


def forward(argv: list[str]) -> None:
    """Be ``python [-u] script args...`` (argv) for the process that started us (torchrun): the
    zygote runs it; signals are passed on, and this process ends as the command ended (by the same
    signal, or with its status). If this process is killed, the command is too (see ``watch``)."""
    unbuffered = argv[:1] == ["-u"]
    env = dict(os.environ) | ({"PYTHONUNBUFFERED": "1"} if unbuffered else {})
    command = [sys.executable, *argv[unbuffered:]]
    process = WarmProcess(
        command, env=env, stdin=0, stdout=1, stderr=2, zygote=env["SHARDTUNE_TEST_ZYGOTE"]
    )
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, lambda number, _frame: process.send_signal(number))
    code = process.wait()
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _die_with(pid: int) -> None:
    """SIGKILL this process once process ``pid`` has ended (a thread waiting on its pidfd)."""
    pidfd = os.pidfd_open(pid)

    def wait() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, daemon=True, name="die-with-forwarder").start()


# --- the zygote's side -------------------------------------------------------------------------


def _become_the_command(request: dict, fds: list[int]) -> None:
    """In the forked child: take the command's place and run its script; never returns."""
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("watch"):
        _die_with(request["watch"])
    if os.environ.get("PYTHONUNBUFFERED"):  # as `python -u` makes them
        sys.stdout.reconfigure(line_buffering=False, write_through=True)
        sys.stderr.reconfigure(line_buffering=False, write_through=True)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    argv = list(request["argv"])
    if argv[0] == "-m":  # as `python -m module` sets them
        sys.argv, sys.path[0] = argv[1:], os.getcwd()
        os._exit(_run_script(argv[1], module=True))
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` sets it
    os._exit(_run_script(argv[0]))


def _run_script(script: str, module: bool = False) -> int:
    import atexit
    import runpy
    import threading
    import traceback

    code = 0
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():  # as the interpreter does at exit
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code < 0:  # an uncaught KeyboardInterrupt ends a Python process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _preload_recipes() -> None:
    """What the recipes' launches import before they fork: their functions' imports and the parts
    each names (its composition, schema, checks, preparation and rank story)."""
    import importlib

    from components.runtime.cli import named
    from components.runtime.preload import preload
    from recipes.distill import DISTILL
    from recipes.dpo import DPO
    from recipes.finetune import FINETUNE

    for name in PRELOAD:
        importlib.import_module(name)
    preload(REPO / "recipes" / "finetune.py")
    for recipe in (FINETUNE, DPO, DISTILL):
        for part in (recipe.compose, recipe.schema, recipe.check, recipe.prepare, recipe.rank_main):
            named(part)
        # Hydra's first composition builds its override parser and config repository (pure
        # Python, no threads): once here instead of in every child.
        named(recipe.compose)([])


def _serve(address: str, die_with: int) -> None:
    """Fork a child per request on ``address`` until stdin closes or process ``die_with`` (when
    not 0) ends."""
    ended = os.pidfd_open(die_with) if die_with else sys.stdin.fileno()
    _preload_recipes()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(16)
    waiting: dict[int, socket.socket] = {}
    while True:
        readable = select.select([server, ended], [], [], 0.02)[0]
        if ended in readable and (die_with or not os.read(ended, 1)):
            if die_with:  # the session's files (_session_zygote)
                for suffix in (".socket", ".pid", ".lock"):
                    Path(address).with_suffix(suffix).unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # the last zygote of the session
                    Path(address).parent.rmdir()
            return  # the test session ended
        if server in readable:
            conn, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 8)
            size = struct.unpack("!I", message[:4])[0]
            message += _read_exactly(conn, 4 + size - len(message))
            request = pickle.loads(message[4:])
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _become_the_command(request, fds)
            for fd in fds:
                os.close(fd)
            _send(conn, pid)
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in waiting:
                conn = waiting.pop(pid)
                _send(conn, os.waitstatus_to_exitcode(status))
                conn.close()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
