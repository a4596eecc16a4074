"""What a user sees: `lopd --help` in pipeline order, library noise only with --debug, and
progress as plain lines (count, rate, ETA) when stderr is a log."""

import re
import threading

import pytest

from lopd_cli.progress import LogProgress, fmt_duration, status_line


def test_help_lists_commands_in_pipeline_panels(lopd):
    r = lopd("--help")
    assert r.code == 0
    text = r.out
    panels = [text.index(p) for p in ("Project", "Experience", "Training", "Results")]
    assert panels == sorted(panels), text
    order = ["init", "models", "recipe", "demo", "rollout", "bank", "coldstart", "train", "eval", "export", "report"]
    rows = [line.split()[1] for line in text.splitlines() if line.startswith("│ ") and len(line.split()) > 1]
    names = [w for w in rows if w in order]
    assert names == order, names


@pytest.fixture
def project(lopd, tmp_path):
    assert lopd("init", "p", "--no-base-policy", cwd=tmp_path).code == 0
    return tmp_path / "p"


def test_library_progress_bars_show_only_with_debug(lopd, project):
    args = ("rollout", "--recipe", "toolcall", "-n", "2", "--set", "rollout.max_new_tokens=4", "--json")
    quiet = lopd(*args, cwd=project)
    assert quiet.code == 0, quiet
    assert "Loading weights" not in quiet.err and "Warning" not in quiet.err, quiet.err
    loud = lopd(*args, "--debug", cwd=project)
    assert loud.code == 0, loud
    assert "Loading weights" in loud.err, loud.err
    again = lopd(*args, cwd=project)  # --debug does not stick in the process
    assert "Loading weights" not in again.err, again.err


def test_a_library_warning_is_hidden_unless_debug(lopd, project, tmp_path):
    """A FutureWarning raised by code under lopd (here a plugin) is noise unless --debug."""
    (tmp_path / "noisy_env.py").write_text(
        "import warnings\n"
        "class NoisyEnv:\n"
        "    def tasks(self, split):\n"
        "        warnings.warn('`past_key_values` is deprecated', FutureWarning)\n"
        "        return [{'id': 'a', 'instruction': 'hi'}]\n"
        "    def reset(self, task):\n        return [{'role': 'user', 'content': 'hi'}]\n"
        "    def step(self, call):\n        return ''\n"
        "    def reward(self, transcript):\n        return 0.0\n")
    recipe = tmp_path / "noisy.yaml"
    recipe.write_text("model: {backbone: tiny}\nenv: {class: noisy_env.py:NoisyEnv}\nrollout: {max_new_tokens: 2}\n")
    quiet = lopd("rollout", "--recipe", str(recipe), "-n", "1", "--json", cwd=project)
    assert quiet.code == 0 and "past_key_values" not in quiet.err, quiet
    loud = lopd("rollout", "--recipe", str(recipe), "-n", "1", "--json", "--debug", cwd=project)
    assert loud.code == 0 and "FutureWarning: `past_key_values` is deprecated" in loud.err, loud


def test_status_line_has_count_rate_and_eta():
    assert status_line("rollouts", 24, 64, 12.0) == "rollouts 24/64 (38%) 2/s ETA 20s 12s elapsed"
    assert status_line("eval base", 2, None, 30.0, "test") == "eval base 2 done 15s each 30s elapsed  test"
    assert status_line("cold start", 0, 40, 5.0) == "cold start 0/40 (0%) 5s elapsed"
    assert fmt_duration(3725) == "1h02m" and fmt_duration(61) == "1m01s"


def test_rate_after_a_resume_counts_only_this_process_steps(capsys):
    # 65 of 96 steps were done before the resume: 1 step in 10 s here is 0.1/s, 30 steps left: 5m00s
    assert status_line("grpo steps", 66, 96, 10.0, since=65) == "grpo steps 66/96 (69%) 0.1/s ETA 5m00s 10s elapsed"
    # a resumed task's printed lines: one step after the reset, in ~0.3 s, leaves ~9 s for the
    # other 30 (without the reset the 66 steps look done in 0.3 s and the ETA reads 0s)
    gate = threading.Event()
    with LogProgress(every=0.05) as bar:
        tid = bar.add_task("grpo steps", total=96, info="")
        bar.reset(tid, completed=65)
        gate.wait(0.3)
        bar.update(tid, completed=66)
        gate.wait(0.3)
        bar.update(tid, completed=96)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("grpo steps 66/96")]
    etas = [re.search(r"ETA (\d+)s", ln) for ln in lines]
    assert lines and all(m and int(m.group(1)) >= 5 for m in etas), lines


def test_log_progress_prints_lines_while_a_task_runs(capsys):
    gate = threading.Event()
    with LogProgress(every=0.05) as bar:
        tid = bar.add_task("steps", total=4, info="")
        bar.advance(tid, 1)
        gate.wait(0.5)  # the reporter thread prints every 0.05 s meanwhile
        bar.update(tid, completed=4, info="loss 0.1")
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("steps 1/4 (25%)") and "ETA" in line for line in lines), lines
    assert lines[-1].startswith("steps 4/4 (100%)") and " done in " in lines[-1] and lines[-1].endswith("  loss 0.1")
