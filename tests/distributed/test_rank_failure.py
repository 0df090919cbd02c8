"""One rank dies: the others stop within seconds naming it, and the run resumes exactly.

Rank 1 SIGKILLs itself as step 4 starts sampling (no message, no cleanup: what the OOM killer or a
lost machine does). Rank 0 must not hang in the step's collective: its watcher sees rank 1's
process gone and stops it with one line naming rank 1 and the newest complete checkpoint
(checkpoint-2); `--resume` under the same launch then reaches the weights of a run that was never
interrupted, bit for bit. The run uses `length_aware` with the online predictor, so each rank's
sampler state and the assignment's cost predictor go through the checkpoint too.
"""

from __future__ import annotations

import json
import time

import pytest

from launching import final_weights, launch, max_difference, settings, train_argv


@pytest.mark.slow
def test_killed_rank_stops_the_others_and_the_run_resumes(tiny_model_dir, tmp_path):
    common = {"training.max_steps": 4, "checkpointing.save_every": 2,  # each rank's sampler has
              "sampling.policy": "length_aware", "sampling.predictor": "online"}  # a predictor
    straight = settings(tiny_model_dir, tmp_path / "straight", **common)
    killed = settings(tiny_model_dir, tmp_path / "killed", **common)
    result = launch(tmp_path / "b", [(train_argv(killed), tmp_path / "rec-b")],
                    kill="1:sampling@4")
    finished = time.time()
    killed_at = float(next((tmp_path / "b").glob("*.killed")).read_text())
    assert result.returncode != 0
    assert finished - killed_at < 60, finished - killed_at
    assert "rank 1 failed" in result.output, result.output[-3000:]
    assert "newest complete checkpoint is" in result.output and "checkpoint-2" in result.output
    assert not (tmp_path / "killed" / "checkpoint-4").exists()

    # one launch: the resumed run, then the uninterrupted reference (saves a launch's imports)
    result = launch(tmp_path / "c", [(train_argv(killed, "--resume"), tmp_path / "rec-c"),
                                     (train_argv(straight), tmp_path / "rec-a")])
    assert result.returncode == 0, result.output[-3000:]
    assert max_difference(final_weights(tmp_path / "killed", 4),
                          final_weights(tmp_path / "straight", 4)) == 0.0
    state = {run: json.loads((tmp_path / run / "checkpoint-4" / "training_state.json").read_text())
             for run in ("killed", "straight")}
    for key in ("ranks", "rank_costs", "predictor", "data", "counters"):  # each rank's own state
        assert state["killed"][key] == state["straight"][key], key
    assert len(state["killed"]["ranks"]) == 2 and state["killed"]["rank_costs"] is not None


@pytest.mark.slow
def test_an_exception_on_one_rank_stops_the_others_naming_it(tiny_model_dir, tmp_path):
    """Rank 1's reward function raises at step 2: rank 1 reports it in one line, rank 0 stops with
    one line naming rank 1 and its error (exit 3) instead of waiting in a collective. (Rank 1 may
    still be exiting when torchrun, seeing rank 0 gone, sends it SIGTERM.)"""
    from launching import HERE

    values = settings(tiny_model_dir, tmp_path / "run", **{
        "rewards.functions": f"{HERE / 'recording_reward.py'}:fails_on_rank_1"})
    start = time.time()
    result = launch(tmp_path / "a", [(train_argv(values), tmp_path / "rec")])
    assert result.returncode != 0 and time.time() - start < 90
    lines = [line for line in result.output.splitlines() if "infsamp train: error" in line]
    assert any(line.startswith("infsamp train: error: rank 1: step 2: reward function") and
               "a reward server that went away" in line for line in lines), result.output[-3000:]
    assert any("rank 1 failed (RewardError:" in line and "rank 0 stopped too" in line
               and "checkpoint-1" in line for line in lines), lines
    # rank 0 exits with PEER_FAILED_EXIT (3), unless torchrun, seeing rank 1 gone first, ends it
    # with SIGTERM after it printed the line above (seen under load)
    assert "exitcode  : 3" in result.output or "exitcode  : -15" in result.output
