"""One run per directory: the lock `<run_dir>/run.lock` held by the process
that trains (or fine-tunes) into it.

The file names its holder (host, pid, start time, command). A second `erpo
train` or `erpo sft` on the same directory is refused with a sentence naming
that holder, before it writes anything there.

- A local directory: the lock is `flock` on the file, which the kernel drops
  when the holder exits however it exits (SIGKILL, a crash, the OOM killer),
  so a rerun after a kill resumes without anyone deleting anything. The file
  itself stays behind (unlinking it would let two processes hold two inodes).
  On NFS `flock` is as good as the server's lock support.
- gs:// (an object store has no locks nor an atomic create-if-absent): the
  holder writes the lock object and renews it every `LEASE_S / 4` seconds
  from a background thread; a lock renewed less than `LEASE_S` ago by another
  process is refused, an older one is stale and taken over, and so is one of
  this host whose process is gone. The limit: two starts within the same few
  seconds can both see no lock and both start; a killed holder on another host
  keeps its directory locked for up to `LEASE_S` (a preempted TPU VM's rerun
  waits that long, or deletes the object).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

from erpo_jax.runtime import rundir

LOCK_FILE = "run.lock"
LEASE_S = 600.0   # gs:// only: a lock not renewed for this long is stale


def _holder(command: str) -> dict:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "renewed": now}


def describe(holder: dict | None) -> str:
    if not holder:
        return "another process (which has not written its name yet)"
    return (f"{holder.get('command', 'a run')} on host {holder.get('host', '?')}, pid "
            f"{holder.get('pid', '?')}, started {holder.get('started', '?')}")


def _refuse(run_dir, holder: dict | None, extra: str = ""):
    from erpo_jax.runtime.errors import ConfigError
    raise ConfigError(f"config field train.out_dir: {run_dir} is in use by {describe(holder)} "
                      f"({run_dir}/{LOCK_FILE}); one run per directory: wait for it to end, stop "
                      f"it, or use another train.out_dir{extra}.")


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie (killed, not yet reaped) holds nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class RunLock:
    """`RunLock(run_dir, 'erpo train')` takes the lock or raises ConfigError
    naming its holder; `close()` releases it (also safe twice)."""

    def __init__(self, run_dir, command: str):
        self.run_dir, self.command = rundir.path(run_dir), command
        self.path = self.run_dir / LOCK_FILE
        self.holder = _holder(command)
        self._fd = None
        self._stop = threading.Event()
        self._renewer = None
        if rundir.is_remote(self.run_dir):
            self._acquire_remote()
        else:
            self._acquire_local()

    # ------------------------------------------------------------------ local

    def _acquire_local(self) -> None:
        import fcntl
        fd = os.open(os.fspath(self.path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0).decode() or "null")
            except ValueError:
                holder = None
            os.close(fd)
            _refuse(self.run_dir, holder)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.holder).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    # ------------------------------------------------------------------ gs://

    def _read_remote(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _acquire_remote(self) -> None:
        old = self._read_remote()
        if old and not self._stale(old):
            _refuse(self.run_dir, old, f" (a lock on gs:// is stale {LEASE_S:.0f} s after its "
                    "holder stops renewing it; delete it if that run is gone)")
        rundir.write_atomic(self.path, json.dumps(self.holder))
        self._renewer = threading.Thread(target=self._renew, daemon=True)
        self._renewer.start()

    @staticmethod
    def _stale(holder: dict) -> bool:
        if holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid")):
            return True
        renewed = holder.get("renewed")
        return not isinstance(renewed, (int, float)) or time.time() - renewed > LEASE_S

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_S / 4):
            self.holder["renewed"] = time.time()
            try:
                rundir.write_atomic(self.path, json.dumps(self.holder))
            except OSError:
                pass   # the next renewal tries again; the lease has slack for it

    # ------------------------------------------------------------------ release

    def close(self) -> None:
        if self._fd is not None:
            import fcntl
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self._renewer is not None:
            self._stop.set()
            self._renewer.join()
            self._renewer = None
            cur = self._read_remote()
            if cur and (cur.get("host"), cur.get("pid"), cur.get("started")) == (
                    self.holder["host"], self.holder["pid"], self.holder["started"]):
                try:
                    self.path.unlink()
                except OSError:
                    pass

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
