"""The shell scripts' command lines against the current CLIs, in seconds: mt-train, translate and
mt-eval are replaced by stand-ins that record their arguments (and write what the script reads
next), and each recorded command is then checked as the real one would check it: mt-train's
overrides compose and pass the config checks, translate's and mt-eval's flags parse."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, cli_env, compose

STAND_IN = """#!{python}
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["CALLS"], "a") as log:
    log.write(json.dumps([{name!r}, *args]) + "\\n")
if {name!r} == "mt-train":
    run = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
    for sub in ("checkpoints", "tokenizer", ".hydra"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    (run / "checkpoints" / "best.pt").write_text("")
    (run / "tokenizer" / "tokenizer.json").write_text("{{}}")
    (run / ".hydra" / "config.yaml").write_text(
        "data: {{src_lang: en, tgt_lang: de}}\\ntrainer: {{beam_size: 5, lenpen: 0.6, "
        "device: cpu}}\\n")
elif {name!r} == "translate":
    lines = Path(args[args.index("-i") + 1]).read_text().splitlines()
    Path(args[args.index("-o") + 1]).write_text("".join("x\\n" for _ in lines))
"""


def run_script(script: str, args: list[str], tmp_path: Path, **env: str) -> list[list[str]]:
    """Runs scripts/SCRIPT with the stand-ins first on PATH; returns the commands it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("mt-train", "translate", "mt-eval"):
        path = bin_dir / name
        path.write_text(STAND_IN.format(python=PYTHON, name=name))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.jsonl"
    environ = cli_env(tmp_path)
    environ.update(env, CALLS=str(calls),
                   PATH=f"{bin_dir}{os.pathsep}{Path(PYTHON).parent}{os.pathsep}"
                        f"{environ['PATH']}")
    result = subprocess.run(["bash", str(REPO / "scripts" / script), *args], cwd=tmp_path,
                            env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in calls.read_text().splitlines()]


def check_commands(calls: list[list[str]]) -> None:
    """Each recorded command is one the real command accepts."""
    from mt.evaluate_args import build_parser as eval_parser
    from mt.translate import build_parser as translate_parser

    for name, *args in calls:
        said = shlex.join([name, *args])
        if name == "mt-train":  # composed and checked as mt-train does; hydra.* is Hydra's
            compose([a for a in args if not a.startswith("hydra.")])
        else:
            parser = translate_parser() if name == "translate" else eval_parser()
            try:
                parser.parse_args(args)
            except SystemExit:
                pytest.fail(f"{said}: refused by {name}'s parser")


@pytest.fixture()
def multi30k_like(tmp_path) -> Path:
    """The files the scripts read from Multi30k, a few lines each."""
    data = tmp_path / "m30k"
    data.mkdir()
    for split, n in (("train", 10), ("valid", 3), ("test2016", 3)):
        for lang in ("en", "de"):
            (data / f"{split}.{lang}").write_text("".join(f"{lang} {i}\n" for i in range(n)))
    return data


def test_simulate_back_translation_runs_current_commands(tmp_path, multi30k_like):
    """Its commands are the current CLIs', and it back-translates in bfloat16 only where the CPU
    has bfloat16 instructions: it asked for bfloat16 everywhere, several times slower than
    float32 on an AVX2 CPU, where translate itself warns against it."""
    from mt.optim import cpu_has_fast_bf16

    calls = run_script("simulate_back_translation.sh", [str(tmp_path / "bt")], tmp_path,
                       DATA=str(multi30k_like), STEPS="7")
    assert [c[0] for c in calls] == ["mt-train", "translate", "mt-eval", "mt-train", "mt-train",
                                     "mt-train", "mt-eval", "mt-eval", "mt-eval"]
    check_commands(calls)
    back = calls[1]
    assert back[back.index("--dtype") + 1] == ("bfloat16" if cpu_has_fast_bf16() else "float32")
    assert (tmp_path / "bt" / "data" / "bt.de").read_text() == "de 5\nde 6\nde 7\nde 8\nde 9\n"
    tagged = calls[5]
    assert "data.tagged=[bt]" in tagged and "trainer.max_steps=7" in tagged


def test_reproduce_multi30k_runs_current_commands(tmp_path):
    """Two seeds: two runs (the second on the first's tokenizer), then mt-eval of each run's
    best.pt and of the ensemble, on the valid and the test split."""
    calls = run_script("reproduce_multi30k.sh", ["multi30k_en_fr_cpu", str(tmp_path / "r"),
                                                 "trainer.max_steps=5"], tmp_path, SEEDS="1 2")
    assert [c[0] for c in calls] == ["mt-train"] * 2 + ["mt-eval"] * 6
    check_commands(calls)
    assert f"data.tokenizer.path={tmp_path}/r/seed1/tokenizer" in calls[1]
    ensemble = calls[4]
    assert ensemble[ensemble.index("-m") + 1] == (f"{tmp_path}/r/seed1/checkpoints/best.pt,"
                                                  f"{tmp_path}/r/seed2/checkpoints/best.pt")
