"""SIGTERM, SIGINT and SIGHUP: the step ends, a checkpoint is saved and named, exit 128 + signal."""

from __future__ import annotations

import errno
import io
import os
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from fault_runs import run_args
from test_kill_resume import assert_same_run


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_saves_names_the_checkpoint_and_resumes_exactly(runner, reference, tiny_model_dir,
                                                              tmp_path, number):
    out = tmp_path / "run"
    # save_every 0: with no periodic checkpoint, only the signal's save can keep the work
    child = runner.start(run_args(tiny_model_dir, out, "--checkpointing.save_every", "0"),
                         kill_at="wait@3")
    child.wait_for("waiting for a signal")
    child.signal(number)
    assert child.wait() == 128 + number, child.output
    name = signal.Signals(number).name
    assert f"stopped by {name} after step 3: saved checkpoint-3" in child.output
    assert "Traceback" not in child.output
    assert (out / "checkpoint-3" / "manifest.json").is_file()
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 0 and "resuming from" in output, output
    assert_same_run(out, reference("continuous"))


def test_second_signal_stops_at_once_without_saving(runner, reference, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    child = runner.start(run_args(tiny_model_dir, out), kill_at="wait2@3")
    child.wait_for("waiting for a signal")
    child.signal(signal.SIGTERM)
    child.wait_for("SIGTERM received")  # two signals sent at once would arrive as one
    child.signal(signal.SIGTERM)
    assert child.wait() == 128 + signal.SIGTERM, child.output
    assert "SIGTERM again: stopped at once" in child.output and "Traceback" not in child.output
    assert not (out / "checkpoint-3").exists()
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 0 and "resuming from" in output and "(step 2)" in output, output
    assert_same_run(out, reference("continuous"))


def test_signal_without_save_on_signal_says_so(runner, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    child = runner.start(run_args(tiny_model_dir, out, "--checkpointing.save_on_signal", "false"),
                         kill_at="wait@3")
    child.wait_for("waiting for a signal")
    child.signal(signal.SIGTERM)
    assert child.wait() == 128 + signal.SIGTERM
    assert ("nothing saved (checkpointing.save_on_signal false; newest checkpoint: "
            "checkpoint-2)") in child.output
    assert not (out / "checkpoint-3").exists()


def test_a_closed_terminal_saves(runner, tiny_model_dir, tmp_path):
    """The run's terminal goes away (a closed window, a dropped ssh session): SIGHUP, and every
    later write to the terminal fails. The run still saves, and exits 129."""
    master, slave = os.openpty()
    terminal = Path(os.ttyname(slave))  # kept open here until the hang-up (reads need one)
    out = tmp_path / "run"
    child = runner.start(run_args(tiny_model_dir, out, "--checkpointing.save_every", "0"),
                         kill_at="tty:wait@3", log=terminal)
    # a loaded machine can take minutes to reach step 3; hanging up earlier (during start-up,
    # before the run handles signals) is another case: this test once exited 1 that way
    seen, deadline = b"", time.monotonic() + 300
    while b"waiting for a signal" not in seen and time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            seen += os.read(master, 1 << 16)
    assert b"waiting for a signal" in seen, seen.decode(errors="replace")
    os.close(master)  # hang up: the kernel sends SIGHUP to the run's session
    os.close(slave)
    code = child.wait()
    exception = Path(f"/tmp/infsamp-child-{child.process.pid}.exc")  # fault_harness writes it
    assert code == 128 + signal.SIGHUP, (seen.decode(errors="replace"),
                                         exception.read_text() if exception.exists() else "")
    assert (out / "checkpoint-3" / "manifest.json").is_file()


class ClosedTerminal(io.StringIO):
    def write(self, text):
        raise OSError(errno.EIO, "Input/output error")


def test_console_writes_cannot_end_a_run(monkeypatch):
    """Inside StopSignals a write to a terminal that went away (EIO) is dropped, not raised (a
    hang-up in the middle of a printed line once ended a run before it could save); the streams
    are the run's own again afterwards."""
    from infsamp.run.signals import StopSignals

    closed = ClosedTerminal()
    monkeypatch.setattr(sys, "stdout", closed)
    with StopSignals():
        print("step 3/6: reward=1.3", flush=True)
    assert sys.stdout is closed
    with pytest.raises(OSError):
        print("outside a run's loop, errors are the caller's")
