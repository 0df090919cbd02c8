"""benchmarks/step_width.py on the tiny model: one line per width, each a positive time."""

import re


def test_one_line_per_width(load_benchmark, tiny_model_dir, capsys):
    step_width = load_benchmark("step_width")
    assert step_width.main(["--model", str(tiny_model_dir), "--rows", "1,3", "--context", "4",
                            "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [re.match(r"rows +(\d+):", line).group(1) for line in lines] == ["1", "3"]
    assert all(float(re.search(r"([\d.]+) ms", line).group(1)) > 0 for line in lines)
    assert "(1.00x the first)" in lines[0]
