"""Child processes that die with their parent: Linux's ``PR_SET_PDEATHSIG``.

A parent killed outright (SIGKILL from the OOM killer, a scheduler past its grace period) runs no
handler that could end its children: the search workers (``mt.workers``, forked) searched on and
the SentencePiece trainer (``mt.spmtrain``, spawned) trained on, orphans, for minutes. The kernel
sends them SIGKILL instead once the child has asked for it with ``die_with``.

Torch-free on purpose: the SentencePiece child imports this in a fresh interpreter whose start-up
time counts (``tests/test_spmtrain.py`` checks that it loads no torch).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl() -> Callable | None:
    """libc's prctl, or None where there is none (not Linux, no C library to look it up in)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once, as the parent imports this module, not in each child just after its fork: a
# forked child of a threaded process (torch's) must not take the dynamic loader's locks.
_PRCTL = _libc_prctl()


def die_with(parent: int) -> None:
    """Run first thing in a child process: the kernel kills it (SIGKILL) when its parent dies.

    Args:
        parent: the parent's process id, as the parent read it (``os.getpid()``) before it
            started the child. A parent that died before the call cannot signal the child any
            more; it shows as a parent id that changed, and the child exits at once (status 1).

    Elsewhere than on Linux nothing is asked of the kernel: the child ends with its work.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
