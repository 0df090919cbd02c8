"""The README's "your model, your data, your reward" example runs: its config and reward blocks,
one step on the tiny checkpoint."""
import json
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(name: str) -> str:
    match = re.search(rf"<!-- example: {name} -->\n```\w*\n(.*?)```", README.read_text(), re.S)
    assert match, f"README.md has no '<!-- example: {name} -->' block"
    return match.group(1)


def test_readme_example_trains_one_step(tmp_path, monkeypatch, tiny_model_dir):
    from infsamp.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text(_block("config"))
    (tmp_path / "my_reward.py").write_text(_block("reward"))
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["train", "my.yaml", "--model.name_or_path", str(tiny_model_dir),
                 "--model.attn_implementation", "eager", "--training.max_steps", "1",
                 "--training.prompts_per_step", "2", "--sampling.num_generations", "2",
                 "--sampling.max_new_tokens", "8", "--sampling.kv_budget", "4096",
                 "--eval.num_problems", "2", "--logging.progress_bar", "false",
                 "--logging.plot", "false"])
    assert code in (0, None)
    metrics = [json.loads(line) for line in (tmp_path / "runs/mine/metrics.jsonl").open()]
    assert "rewards/exact/mean" in metrics[-1]
