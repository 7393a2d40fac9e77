"""mt.pdeathsig: a child asks the kernel to kill it with its parent, and leaves at once where the
parent is gone already."""

import subprocess
import sys

import pytest
from conftest import REPO

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")


def child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


@linux_only
def test_a_child_is_set_to_die_of_sigkill_with_its_parent():
    done = child("import ctypes, os\n"
                 "from mt.pdeathsig import die_with\n"
                 "die_with(os.getppid())\n"
                 "got = ctypes.c_int()\n"
                 "ctypes.CDLL(None).prctl(2, ctypes.byref(got))  # PR_GET_PDEATHSIG\n"
                 "print(got.value)\n")
    assert done.returncode == 0 and done.stdout.split() == ["9"], done.stderr


@linux_only
def test_a_child_whose_parent_is_gone_already_exits_at_once():
    """The kernel signals no child whose parent died before it asked: a parent id other than
    the one its parent gave means that, and the child must not work on, an orphan."""
    done = child("import os\n"
                 "from mt.pdeathsig import die_with\n"
                 "die_with(os.getppid() + 1)\n"
                 "print('worked on')\n")
    assert done.returncode == 1 and "worked on" not in done.stdout, done.stderr
