"""SentencePiece trained in a spawned child process (mt.spmtrain): the model of training here,
byte for byte; its failures in one line; a hang-free child after torch's OpenMP work; and a child
that dies with its parent."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import sentencepiece as spm
from conftest import REPO
from test_tokenizer import SRC, TGT

from mt import spmtrain
from mt.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TokenizerConfig
from mt.tokenizer import train_tokenizer

posix_only = pytest.mark.skipif(not spmtrain.SPAWN, reason="SentencePiece trains in-process there")

# Any Unicode, a line end inside a sentence and a user symbol: what the stream must carry whole
SENTENCES = SRC + TGT + ["zwei\nZeilen", "日本語の文です。", "emoji 🙂 and € and \u00a0nbsp",
                         "<BT> tagged house"]
OPTIONS = dict(vocab_size=150, hard_vocab_limit=False, input_sentence_size=0, num_threads=2,
               minloglevel=2, pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
               max_sentence_length=4192, user_defined_symbols=["\u2581<BT>"])

# A sitecustomize that makes SentencePiece's training slow and deaf to stop signals, as its C++
# is, in every process that imports it (the child too, which no monkeypatch here reaches); the
# training process writes its id to $MT_TEST_SLOW_SPM as it starts.
SLOW_SPM = textwrap.dedent("""\
    import os
    if os.environ.get("MT_TEST_SLOW_SPM"):
        import signal, time
        import sentencepiece as spm

        def _slow(*args, **kwargs):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM,
                                                      signal.SIGHUP})
            with open(os.environ["MT_TEST_SLOW_SPM"] + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.environ["MT_TEST_SLOW_SPM"] + ".tmp", os.environ["MT_TEST_SLOW_SPM"])
            time.sleep(60)

        spm.SentencePieceTrainer.train = _slow
    """)


def slow_spm_env(tmp_path: Path, env: dict[str, str]) -> tuple[dict[str, str], Path]:
    """``env`` with the slow SentencePiece planted (SLOW_SPM), and the file its id goes to."""
    hook = tmp_path / "slow_spm"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SLOW_SPM)
    marker = tmp_path / "training.pid"
    path = os.pathsep.join(p for p in (str(hook), str(REPO), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "MT_TEST_SLOW_SPM": str(marker)}, marker


def kill_left(proc: subprocess.Popen, child: int) -> None:
    """Kills what a failed test left running: mt-train's process group and the training child."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if child and alive(child):
        os.kill(child, signal.SIGKILL)


def wait_for(marker: Path, proc: subprocess.Popen, seconds: float = 60) -> int:
    """The id in ``marker`` once the slow training has started."""
    deadline = time.monotonic() + seconds
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()[1][-3000:]
    return int(marker.read_text())


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@posix_only
@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_the_child_trains_the_model_of_training_here_byte_for_byte(model_type, monkeypatch,
                                                                  tmp_path):
    """The same options, seed and sentences (any Unicode, a '\\n' inside one) reach the child:
    its model is the one this process trains, and the seed seeds SentencePiece there."""
    options = {**OPTIONS, "model_type": model_type}
    here = spmtrain.train_here(3, SENTENCES, options)

    def not_here(*args, **kwargs):
        raise AssertionError("SentencePiece trained in this process")

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", not_here)
    assert spmtrain.train_model(3, SENTENCES, **options) == here
    seeded = tmp_path / "seed"  # (no model here differs by seed: SentencePiece is told it)
    monkeypatch.setattr(spmtrain, "_CHILD", (
        "import sys; sys.path.insert(0, sys.argv[1]); import mt.spmtrain as m; "
        f"m.spm.set_random_generator_seed = lambda seed: open({str(seeded)!r}, 'w')"
        ".write(str(seed)); "
        "m.child_main(int(sys.argv[2]))"))
    assert spmtrain.train_model(12345, SENTENCES, **options) == here
    assert seeded.read_text() == "12345"


@posix_only
def test_the_child_imports_no_torch(tmp_path, monkeypatch):
    """The child is a fresh interpreter that loads SentencePiece, not torch (seconds, and
    hundreds of MB, per tokenizer trained)."""
    seen = tmp_path / "modules"
    monkeypatch.setattr(spmtrain, "_CHILD", spmtrain._CHILD + (
        f"; open({str(seen)!r}, 'w').write(' '.join(sorted(sys.modules)))"))
    spmtrain.train_model(0, SRC, **OPTIONS)
    modules = seen.read_text().split()
    assert "sentencepiece" in modules and "torch" not in modules


@posix_only
def test_train_tokenizer_trains_in_a_child_process(monkeypatch):
    """mt-train's tokenizer is trained in the child, which a stop signal can end (the old code
    trained here, in C++ that no handler interrupts)."""
    expected = train_tokenizer(SRC, TGT, TokenizerConfig(vocab_size=120), seed=0)

    def not_here(*args, **kwargs):
        raise AssertionError("SentencePiece trained in this process")

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", not_here)
    tok = train_tokenizer(SRC, TGT, TokenizerConfig(vocab_size=120), seed=0)
    assert tok.fingerprint == expected.fingerprint


@posix_only
def test_sentencepieces_error_comes_back_as_in_process(monkeypatch):
    """A vocabulary too small for the text's characters: SentencePiece's RuntimeError crosses
    from the child, so the one line naming data.tokenizer.vocab_size still appears."""
    monkeypatch.setattr(spm.SentencePieceTrainer, "train", None)  # (not trained here)
    chars = [" ".join(chr(c) * 3 for c in range(0x4E00 + i, 0x4E00 + i + 10))
             for i in range(0, 300, 10)]
    with pytest.raises(ValueError, match=r"^data.tokenizer.vocab_size=100: the text needs at "
                       r"least \d+ pieces; raise it or lower data.tokenizer.character_coverage"):
        train_tokenizer(chars, chars, TokenizerConfig(vocab_size=100), seed=0)


@posix_only
def test_a_training_process_killed_is_said_in_one_line(monkeypatch):
    """The out-of-memory killer ends the training process (SentencePiece's biggest user of
    memory), not mt-train: what to lower is said instead."""
    exchange = spmtrain._exchange

    def killed(child, *args):
        child.kill()
        child.wait()
        return exchange(child, *args)

    monkeypatch.setattr(spmtrain, "_exchange", killed)
    with pytest.raises(ValueError, match=r"^the SentencePiece training process was killed by "
                       r"SIGKILL: out of memory\? lower data.tokenizer.input_sentence_size$"):
        train_tokenizer(SRC, TGT, TokenizerConfig(vocab_size=120), seed=0)


@posix_only
@pytest.mark.parametrize("code, said", [
    ("import sys; sys.exit(3)", r"exited with status 3 without a model \(its error, if any, is "
                                r"above\)$"),
    ("import sys; sys.path.insert(0, sys.argv[1]); import mt.spmtrain as m; "
     "m._sentences = lambda *a: 1 / 0; m.child_main(int(sys.argv[2]))",
     r"failed: ZeroDivisionError: division by zero$"),
    ("import sys; sys.stdout.write('not a pickle')", r"answered what is not a model \("),
])
def test_any_other_failure_of_the_child_is_one_line(code, said, monkeypatch):
    monkeypatch.setattr(spmtrain, "_CHILD", code)
    with pytest.raises(spmtrain.TrainingProcessFailed,
                       match=r"^the SentencePiece training process " + said):
        spmtrain.train_model(0, SRC, **OPTIONS)


@posix_only
def test_training_after_torchs_openmp_work_finishes(tmp_path):
    """The fork this replaced hung CI: a child forked after torch had run OpenMP work (its pool
    alive) waited forever in GOMP_parallel for threads the fork did not copy. A spawned child
    starts afresh: here torch runs CPU ops on four threads first, then a tokenizer trains."""
    script = textwrap.dedent("""\
        import torch
        torch.set_num_threads(4)
        x = torch.randn(512, 512)
        for _ in range(3):
            (x @ x).exp_().sum().item()
            torch.nn.functional.softmax(torch.randn(64, 4096), -1).sum().item()
        from mt.config import TokenizerConfig
        from mt.tokenizer import train_tokenizer
        lines = [" ".join(f"w{(i * j) % 97}" for j in range(12)) for i in range(800)]
        tok = train_tokenizer(lines, lines, TokenizerConfig(vocab_size=120), seed=0)
        print("trained", tok.src_vocab_size)
        """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as err:
        raise AssertionError("tokenizer training after torch's OpenMP work hung") from err
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_training_process_dies_with_a_parent_killed_outright(tmp_path):
    """SIGKILL (the OOM killer, a scheduler past its grace period) reaches mt-train, which no
    handler sees: the training child must not train on, an orphan, for minutes."""
    env, marker = slow_spm_env(tmp_path, dict(os.environ))
    script = ("from mt.spmtrain import train_model\n"
              f"train_model(0, ['a b c', 'd e f'], **{OPTIONS!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, text=True)
    child = 0
    try:
        child = wait_for(marker, proc)
        assert child != proc.pid  # trained in the child
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the training process outlived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


@posix_only
def test_a_stop_signal_during_the_spawn_kills_the_training_process(monkeypatch):
    """Ctrl-C or a SIGTERM in the instant of the spawn waits (blocked) until the child is known,
    then its handler runs as they are unblocked: that child must be killed and reaped too, not
    left training on (for minutes on a large corpus) beside a caller that goes on. A thread
    that does not block the signal (OpenMP's pool, gloo's) takes it while this one blocks it:
    Python ran the handler here at once, inside Popen, before the child was known."""
    real, made = subprocess.Popen, []
    done = threading.Event()
    other = threading.Thread(target=done.wait, args=(30,))
    other.start()

    def popen(*args, **kwargs):
        made.append(real(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGINT)  # held: its handler runs as the block ends
        time.sleep(0.1)  # (time for the other thread to take it)
        return made[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        with pytest.raises(KeyboardInterrupt):
            spmtrain.train_model(0, SRC, **OPTIONS)
        assert made and made[0].returncode == -signal.SIGKILL  # killed and reaped
        assert made[0].stdin.closed and made[0].stdout.closed
    finally:
        done.set()
        other.join()
        if made and made[0].poll() is None:
            made[0].kill()
            made[0].wait()


@posix_only
@pytest.mark.parametrize("sig", [pytest.param("SIGTERM", marks=pytest.mark.slow), "SIGINT"])
def test_a_stop_signal_while_the_tokenizer_trains_ends_mt_train_at_once(
        tmp_path, corpus_dir, tokenizer_dir, sig):
    """SentencePiece trains in C++ (minutes on a large corpus), where no Python handler runs:
    a SIGTERM took effect only when it returned, past a scheduler's grace period (then SIGKILL),
    and Ctrl-C looked ignored. Here SentencePiece's train is a 60 s wait deaf to stop signals
    (SLOW_SPM); mt-train must still end within seconds, as it does for that signal, kill the
    training process, leave no tokenizer, and the same command then trains one. (SIGHUP takes
    SIGTERM's path: mt.train's STOP_SIGNALS.)"""
    from conftest import PYTHON, cli_env, tiny_train_args

    env, marker = slow_spm_env(tmp_path, cli_env(tmp_path))
    run_dir = tmp_path / "run"
    args = [*tiny_train_args(corpus_dir, tokenizer_dir), "data.tokenizer.path=null",
            "data.tokenizer.vocab_size=200", "trainer.max_steps=1", f"hydra.run.dir={run_dir}"]
    script = ("import signal, sys\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal\n"
              "sys.argv[0] = 'mt-train'\nfrom mt.train import main\nmain()\n")
    proc = subprocess.Popen([PYTHON, "-c", script, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    child = 0
    try:
        child = wait_for(marker, proc)
        assert child != proc.pid  # trained in a child, not in mt-train
        time.sleep(0.3)
        sent = time.monotonic()
        # Ctrl-C reaches the terminal's whole group; `kill` (or a hangup) mt-train alone
        os.kill(-proc.pid if sig == "SIGINT" else proc.pid, getattr(signal, sig))
        try:
            said = proc.communicate(timeout=20)[1]
        except subprocess.TimeoutExpired as err:
            raise AssertionError(f"mt-train still ran 20 s after the {sig}") from err
        took = time.monotonic() - sent
    finally:
        kill_left(proc, child)
    assert proc.returncode == 128 + getattr(signal, sig), said[-3000:]
    how = "interrupted" if sig == "SIGINT" else f"terminated ({sig})"
    assert f"{how} before the first checkpoint; nothing to resume" in said, said[-3000:]
    assert "Traceback" not in said and "SentencePiece" not in said, said[-3000:]
    assert took < 10, f"mt-train ended {took:.1f} s after the {sig}"  # (2-5 s: its exit)
    assert not alive(child), "the training process outlived mt-train"
    assert not (run_dir / "tokenizer" / "tokenizer.json").exists()
    if sig != "SIGTERM":  # (the rerun once is enough)
        return
    again = subprocess.run([PYTHON, "-m", "mt.train", *args], env=cli_env(tmp_path),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trained SentencePiece unigram" in again.stderr, again.stderr[-3000:]


@posix_only
@pytest.mark.slow
def test_a_sigterm_to_torchrun_while_rank_0_trains_the_tokenizer_ends_every_rank(
        tmp_path, corpus_dir, tokenizer_dir):
    """Under torchrun rank 0 trains the tokenizer while the others wait for it at a barrier
    (mt.corpus). A scheduler's SIGTERM to the launcher, which passes it on to every rank, ends
    rank 0 at once (its training process killed) and the others with it: the run is over within
    seconds, not after the training (minutes), nor after torchrun's own SIGKILL."""
    from conftest import PYTHON, cli_env, tiny_train_args

    env, marker = slow_spm_env(tmp_path, cli_env(tmp_path))
    run_dir = tmp_path / "run"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           "data.tokenizer.path=null", "data.tokenizer.vocab_size=200", "trainer.max_steps=1",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    child = 0
    try:
        child = wait_for(marker, proc, seconds=120)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGTERM)
        try:
            said = proc.communicate(timeout=25)[1]
        except subprocess.TimeoutExpired as err:
            raise AssertionError("the run still went on 25 s after torchrun's SIGTERM") from err
    finally:
        kill_left(proc, child)
    assert proc.returncode != 0
    assert "terminated (SIGTERM) before the first checkpoint; nothing to resume" in said, \
        said[-3000:]
    # no rank's traceback (torchrun's own, for the signal it got, is torchrun's)
    assert "by peer" not in said and f"{REPO / 'mt'}{os.sep}" not in said, said[-3000:]
    assert not alive(child), "the training process outlived the run"
    assert not (run_dir / "tokenizer" / "tokenizer.json").exists()


@posix_only
def test_training_works_with_a_thousand_files_open():
    """A long-lived caller may hold over a thousand descriptors (memory-mapped Arrow files):
    the child's pipe then has a number past select.select's limit (1024), which refused it."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("a limit of open files below 1200")
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert spmtrain.train_model(0, SRC, **OPTIONS) == spmtrain.train_here(0, SRC, OPTIONS)
    finally:
        for fd in held:
            os.close(fd)


@posix_only
def test_a_stdlib_name_in_the_working_directory_breaks_no_child(tmp_path, monkeypatch):
    """The child imports with this process's sys.path: "python -c" put the working directory
    first, and a random.py there (not on mt-train's path) failed the child's imports."""
    (tmp_path / "random.py").write_text("raise ImportError('the random.py of the cwd')\n")
    monkeypatch.chdir(tmp_path)
    assert spmtrain.train_model(0, SRC, **OPTIONS) == spmtrain.train_here(0, SRC, OPTIONS)



def test_a_frozen_application_trains_in_process(monkeypatch):
    """A frozen mt (PyInstaller) has the application as sys.executable: "-c" would start it
    again, not an interpreter."""
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(spmtrain.subprocess, "Popen", lambda *a, **k: 1 / 0)
    assert spmtrain.train_model(0, SRC, **OPTIONS) == spmtrain.train_here(0, SRC, OPTIONS)


@posix_only
def test_an_isolated_parent_has_an_isolated_child(tmp_path):
    """Under "python -I" mt ignores PYTHONPATH; the child, spawned without the flag, took it
    (here a sitecustomize that breaks SentencePiece; elsewhere another SentencePiece)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sentencepiece as spm\n"
        "spm.SentencePieceTrainer.train = lambda *a, **k: 1 / 0\n")
    code = textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from mt import spmtrain
        from test_spmtrain import OPTIONS, SRC
        print(spmtrain.train_model(0, SRC, **OPTIONS) == spmtrain.train_here(0, SRC, OPTIONS))
        """)
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(hook)})
    assert done.stdout.strip() == "True", done.stderr[-2000:]
