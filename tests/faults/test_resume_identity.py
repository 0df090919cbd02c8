"""A resume continues the same run, or says why not, before it changes anything.

The checkpoint records what defines the run (`run/identity.py`): a resume that changes a setting
or the data rows is one line naming each change and the way out, and leaves the folder as it
was (the logs are not rewound). What does not change results may change: every policy and
predictor resumes into every other, with another micro group, KV budget, engine and logging.
"""

from __future__ import annotations

import itertools
import json
import shutil

from infsamp.sampling.policies import uses_predictor

from fault_harness import rows
from fault_runs import HARNESS, POLICIES, run_args
from test_checkpoint_files import rehash
from test_run_folder import last_line, snapshot


def stopped_at_4(reference, tmp_path):
    """A copy of the reference run as if it had stopped after step 6's row but before its
    checkpoint: checkpoint-4 is the newest, rows 5 and 6 would be rewound by a resume."""
    out = tmp_path / "run"
    shutil.copytree(reference("continuous"), out)
    shutil.rmtree(out / "checkpoint-6")
    return out


REFUSED = [
    (["--sampling.num_generations", "8", "--training.seed", "1"],
     [("checkpoint-4 was trained with sampling.num_generations 4 (this run: 8), training.seed 0 "
       "(this run: 1); a resume continues the same run: resume with its settings, or start a new "
       "run from ")]),
    (["--training.loss_type", "grpo", "--training.beta", "0.04",
      "--rewards.functions", "format", "--sampling.temperature", "1.0"],
     ["training.loss_type dapo (this run: grpo)", "training.beta 0.0 (this run: 0.04)",
      f"rewards.functions format,{HARNESS}:length_reward (this run: format)",
      "rewards.weights 1.0,1.0 (this run: 1.0)", "sampling.temperature 0.7 (this run: 1.0)"]),
    (["--data.seed", "7"],  # the embedded task generated with another seed: other rows
     [("checkpoint-4 was trained on other training rows (40 then, 40 now) and evaluation rows "
       "(4 then, 4 now): data.seed 1234 (this run: 7); a resume continues the same run on the "
       "same rows")]),
    (["--eval.num_problems", "2"],
     [("checkpoint-4 was trained on other evaluation rows (4 then, 2 now): eval.num_problems 4 "
       "(this run: 2)")]),
]


def test_a_resume_that_changes_the_run_is_one_line(runner, reference, tiny_model_dir, tmp_path):
    out = stopped_at_4(reference, tmp_path)
    before = snapshot(out)
    for extra, expected in REFUSED:
        code, output = runner.run(run_args(tiny_model_dir, out, *extra, "--resume"))
        assert code == 2 and "Traceback" not in output, output
        for text in expected:
            assert text in last_line(output), (text, last_line(output))
        assert snapshot(out) == before  # nothing rewound, renamed or written
    # the way out the line names: a new run from the checkpoint's model folder
    code, output = runner.run(run_args(
        tiny_model_dir, tmp_path / "new", "--model.name_or_path", str(out / "checkpoint-4/model"),
        "--sampling.num_generations", "8", "--training.max_steps", "1",
        "--eval.num_problems", "0"))
    assert code == 0, output


def test_a_checkpoint_from_before_the_records(runner, reference, tiny_model_dir, tmp_path):
    """Written before checkpoints recorded the settings and the data: refused in one line where
    what it does record differs; else it resumes (into another policy too) after one line."""
    out = stopped_at_4(reference, tmp_path)
    state = json.loads((out / "checkpoint-4/training_state.json").read_text())
    for key in ("settings", "data", "config"):
        del state["run"][key]
    (out / "checkpoint-4/training_state.json").write_text(json.dumps(state))
    rehash(out / "checkpoint-4", "training_state.json")
    code, output = runner.run(run_args(tiny_model_dir, out, "--training.learning_rate", "0.5",
                                       "--resume"))
    assert code == 2
    assert "checkpoint-4 was trained with training.learning_rate 0.01 (this run: 0.5)" in \
        last_line(output)
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume",
                                       *POLICIES["length_aware-online"]))
    assert code == 0 and "Traceback" not in output, output
    assert "checkpoint-4 was written by an older infsamp: it does not record" in output


def test_a_config_yaml_edited_by_hand_is_named(runner, reference, tiny_model_dir, tmp_path):
    """A resume does not read the run's config.yaml: an edit there is named (the resume is
    refused, so the edit is not overwritten), and resuming with the file itself uses it."""
    out = stopped_at_4(reference, tmp_path)
    config = out / "config.yaml"
    written = config.read_text()
    config.write_text(written + "training: [\n")
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 2 and f"{config} was edited by hand and cannot be read" in last_line(output)
    config.write_text(written.replace("log_every: 1", "log_every: 2"))
    before = snapshot(out)
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 2 and "Traceback" not in output
    assert (f"{config} was edited by hand (logging.log_every 2 in the file, 1 in this run); a "
            f"resume does not read it and would overwrite it: resume with `infsamp train "
            f"{config} --resume` to use it") in last_line(output)
    assert snapshot(out) == before
    code, output = runner.run(["train", str(config), "--resume"])
    assert code == 0 and "resuming from" in output, output
    assert "log_every: 2" in config.read_text()


def policy_circuit() -> list[str]:
    """The policies in an order that passes every ordered pair once: an Euler circuit of the
    complete directed graph on the policies (Hierholzer's walk)."""
    names = list(POLICIES)
    unused = {a: [b for b in reversed(names) if b != a] for a in names}
    stack, circuit = [names[0]], []
    while stack:
        if unused[stack[-1]]:
            stack.append(unused[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1]


def test_every_policy_and_predictor_resumes_into_every_other(runner, tiny_model_dir, tmp_path):
    """n(n-1)+1 runs of one step each (n policies and predictors): every (from, to) pair once,
    with the micro group, KV budget, engine and logging changing too."""
    out, circuit = tmp_path / "run", policy_circuit()
    num_pairs = len(POLICIES) * (len(POLICIES) - 1)
    assert len(circuit) == num_pairs + 1 and len(set(itertools.pairwise(circuit))) == num_pairs
    for step, policy in enumerate(circuit, start=1):
        free = ["--sampling.micro_group", str(4 >> step % 2), "--sampling.kv_budget",
                str(4096 >> step % 2), "--sampling.engine", ("slots", "auto")[step % 2],
                "--logging.log_every", str(1 + step % 2), "--checkpointing.keep_last", "1"]
        code, output = runner.run(run_args(
            tiny_model_dir, out, *POLICIES[policy], *free, "--training.max_steps", str(step),
            "--checkpointing.save_every", "1", "--eval.num_problems", "0",
            "--sampling.max_new_tokens", "4",  # short steps: the resumes are what is tested
            *(["--resume"] if step > 1 else [])))
        assert code == 0 and "Traceback" not in output, (circuit[step - 2:step], output)
        state = json.loads((out / f"checkpoint-{step}/training_state.json").read_text())
        name = policy.split("-")[0]
        assert state["counters"]["policy"] == name, (policy, state["counters"])
        assert state["counters"]["micro_group"] == 4 >> step % 2
        assert (state["predictor"] is None) == (not uses_predictor(name)), policy
    assert [row["step"] for row in rows(out / "metrics.jsonl")] == list(range(1, len(circuit) + 1))


DYNAMIC = ["--sampling.dynamic", "true", "--sampling.max_num_generations", "8",
           "--training.max_steps", "2", "--checkpointing.save_every", "1",
           "--eval.num_problems", "0", "--sampling.max_new_tokens", "4"]


def test_a_resume_that_switches_dynamic_sampling_is_one_line(runner, reference, tiny_model_dir,
                                                             tmp_path):
    """Dynamic sampling draws replacements from the prompt stream and trains on other groups: a
    resume that turns it on or off, or changes its cap, chunk, replacement limit or budget, is
    refused in one line; the same settings resume (a cap given as its default too)."""
    out = stopped_at_4(reference, tmp_path)
    before = snapshot(out)
    code, output = runner.run(run_args(tiny_model_dir, out, "--sampling.dynamic", "true",
                                       "--resume"))
    assert code == 2 and "Traceback" not in output, output
    assert ("checkpoint-4 was trained with sampling.dynamic False (this run: True); a resume "
            "continues the same run") in last_line(output)
    assert snapshot(out) == before
    dynamic = tmp_path / "dynamic"
    code, output = runner.run(run_args(tiny_model_dir, dynamic, *DYNAMIC))  # 2 steps
    assert code == 0, output
    shutil.rmtree(dynamic / "checkpoint-2")
    before = snapshot(dynamic)
    for extra, expected in (
            (["--sampling.dynamic", "false"], "sampling.dynamic True (this run: False)"),
            (["--sampling.max_num_generations", "12"],
             "sampling.max_num_generations 8 (this run: 12)"),
            (["--sampling.dynamic_chunk", "2"], "sampling.dynamic_chunk 4 (this run: 2)"),
            (["--sampling.max_replaced_prompts", "0"],
             "sampling.max_replaced_prompts 2 (this run: 0)"),
            (["--training.completions_per_step", "12"],
             "training.completions_per_step 0 (this run: 12)")):
        code, output = runner.run(run_args(tiny_model_dir, dynamic, *DYNAMIC, *extra,
                                           "--resume"))
        assert code == 2 and "Traceback" not in output, output
        assert f"checkpoint-1 was trained with {expected}; a resume" in last_line(output)
        assert snapshot(dynamic) == before
    code, output = runner.run(run_args(tiny_model_dir, dynamic, *DYNAMIC,
                                       "--sampling.dynamic_chunk", "4", "--resume"))
    assert code == 0 and "resuming from" in output, output
