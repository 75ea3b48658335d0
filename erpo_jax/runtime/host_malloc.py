"""Keep freed host memory for reuse instead of returning it to the OS (glibc).

XLA's CPU backend allocates each program's temporary memory afresh on every
call, as one block (48 MiB for the tiny RL update, 32 rows x 64 tokens). With
glibc's defaults a block that large is a fresh `mmap`, returned with `munmap`
when freed, so every call first-touches its temporaries page by page. Measured
on that update: 12,326 page faults per call, a third of its time, showing up
in a profile as slow broadcasts and copies into new buffers. This is the
CPU-side cousin of the advice to run TPU hosts with tcmalloc.

`configure()` (called when `erpo_jax` is imported) sets, through `mallopt`:

- M_MMAP_MAX = 0: a large block is not served by its own mmap but from its
  thread's heap, so freeing it keeps the pages for the next call. (glibc caps
  the mmap *threshold* at 32 MiB, which is why raising it is not enough.)
  The limit: a thread's heap holds at most 64 MiB, and glibc still mmaps a
  larger block requested from a thread other than the main one. Putting every
  thread on the main heap (M_ARENA_MAX = 1) would lift that, but the lock
  contention cost more than the faults (tiny update 25 -> 31 ms).
- M_TRIM_THRESHOLD = 2 GiB: freed memory at the top of the heap is kept.
- M_TOP_PAD = 64 MiB: the heap grows in steps of at least that much.

What it cannot keep: a block over the trim threshold (2 GiB, the largest
value `mallopt` takes) is returned when freed even on the main heap, and a
worker thread's block over 64 MiB is always its own mmap. Both are faulted in
afresh on every call: the small peer config's update in one piece, 6.9 GiB of
temporaries, took 1.8 M faults per call. Running it in micro-batches
(`optim.micro_batches`) shrinks the temporaries; `large_temporaries_note`
says so when a compiled update's are over the threshold.

Measured on the tiny RL iteration: no page faults in the update, which went
from 35 to 25 ms. The cost is memory kept rather than returned: each XLA worker
thread's heap keeps what it last held (at most 64 MiB each, as above), so the
resident size of that run grew from 800 to 860 MiB. It works whenever it is
called, before or after JAX's first computation. It does nothing outside
glibc, and `ERPO_JAX_HOST_MALLOC=default` in the environment turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
SETTINGS = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, (1 << 31) - 1), (_M_TOP_PAD, 64 << 20))
ENV = "ERPO_JAX_HOST_MALLOC"

_applied: bool | None = None


def configure() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "").strip().lower() in ("default", "off", "0"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):   # musl and other libcs have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = all(mallopt(option, value) for option, value in SETTINGS)
    return _applied


TRIM_LIMIT = (1 << 31) - 1   # M_TRIM_THRESHOLD above; blocks larger are returned on free


def large_temporaries_note(name: str, temp_bytes: int, micro_batches: int) -> str | None:
    """A line for the log when a CPU program's temporaries are over what glibc
    keeps between calls (see the module docstring), or None."""
    if not applied() or temp_bytes <= TRIM_LIMIT:
        return None
    need = -(-temp_bytes * micro_batches // TRIM_LIMIT)
    return (f"the {name} needs {temp_bytes / 2**30:.1f} GiB of temporaries per call, more than "
            f"the allocator keeps between calls (2 GiB), so every call faults them in afresh; "
            f"optim.micro_batches={need} or more (it is {micro_batches}) would keep them")


def applied() -> bool:
    """Whether `configure()` put the settings in effect in this process."""
    return bool(_applied)
