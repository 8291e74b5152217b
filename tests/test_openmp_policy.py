"""llmhal chooses a short OpenMP spin before torch loads, unless the user chose a wait policy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmhal.utils import openmp

PROBE = (
    "import os, sys\n"
    "{pre}\n"
    "import llmhal\n"
    "from llmhal.utils.openmp import openmp_wait_policy\n"
    "print(os.environ.get('GOMP_SPINCOUNT', '-'), openmp_wait_policy())\n"
)


def _run(pre: str = "", **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in openmp._USER_CHOICES}
    clean.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(pre=pre)],
        env=clean,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.strip()


def test_import_llmhal_sets_a_short_spin_when_nothing_chose():
    assert _run() == f"{openmp.DEFAULT_SPINCOUNT} short-spin"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "- active"),
        ({"OMP_WAIT_POLICY": "passive"}, "- passive"),
        ({"GOMP_SPINCOUNT": "10M"}, "10M spin"),
        ({"GOMP_SPINCOUNT": "infinite"}, "infinite spin"),
        ({"GOMP_SPINCOUNT": "50k"}, "50k short-spin"),
        ({"KMP_BLOCKTIME": "0"}, "- spin"),
    ],
)
def test_a_user_choice_is_kept(env, expected):
    assert _run(**env) == expected


def test_nothing_is_set_once_torch_is_loaded():
    # the OpenMP runtime has read its environment already: setting the variable would be a lie
    assert _run(pre="import torch") == "- spin"


@pytest.mark.parametrize(
    ("env", "quick"),
    [({"OMP_WAIT_POLICY": "PASSIVE"}, True), ({"GOMP_SPINCOUNT": "2000"}, True), ({}, False)],
)
def test_kernels_keep_small_work_on_one_thread_where_threads_park(monkeypatch, env, quick):
    for name in openmp._USER_CHOICES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert openmp.threads_park_quickly() is quick
