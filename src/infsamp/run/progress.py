"""Progress for people: a run bar with the ETA, a bar per phase of a step, a line per logged step.

    run:  23%|███▍          | 21/90 [01:05<03:34,  3.11s/step]
    sampling 12/16 samples [00:01, 4,210 tok/s, slots 8/8]     <- then scoring, then update

Bars are drawn only on an interactive terminal (tqdm's `disable=None`: off when the output is a
pipe, a file or CI); the summary lines (`step 21/90: reward=... | eta 3:34`) are printed in every
case, so logs stay readable. `logging.progress_bar: false` turns the bars off everywhere.

Deliberately simple: the ETA is the mean time of this session's steps times the steps left
(evaluations and checkpoints included in the mean); the sampling bar refreshes at most every 0.2 s.
"""

from __future__ import annotations

import time
from typing import Any, TextIO

from tqdm.auto import tqdm

from infsamp.sampling.types import SamplerStats

SUMMARY_KEYS = ("reward", "accuracy", "reward_std", "frac_reward_zero_std",
                "completions/mean_length", "loss", "kl", "clip_ratio/region_mean",
                "sampling/decode_steps", "step_time")
PHASE_FORMAT = "{desc} {n_fmt}/{total_fmt} {unit} [{elapsed}{postfix}]"
REFRESH_S = 0.2


def format_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class RunProgress:
    """The run bar, the phase bar and the summary lines of one training run."""

    def __init__(self, max_steps: int, start_step: int, enabled: bool = True,
                 file: TextIO | None = None):
        disable = None if enabled else True  # None: tqdm draws only when `file` is a terminal
        self.max_steps, self.start_step = max_steps, start_step
        self.started = time.perf_counter()
        self.run_bar = tqdm(total=max_steps, initial=start_step, desc="run", unit="step",
                            disable=disable, dynamic_ncols=True, position=0, file=file)
        self.phase_bar = tqdm(total=1, desc="starting", disable=disable, dynamic_ncols=True,
                              position=1, leave=False, file=file, bar_format=PHASE_FORMAT)
        self._last_refresh = 0.0

    @property
    def bars_shown(self) -> bool:
        return not self.run_bar.disable

    def phase(self, name: str, total: int, unit: str) -> None:
        """Start a phase (sampling, scoring, update) counting `total` units."""
        self.phase_bar.unit = unit
        self.phase_bar.set_description_str(name, refresh=False)
        self.phase_bar.set_postfix_str("", refresh=False)
        self.phase_bar.reset(total=max(total, 1))

    def advance(self, num: int = 1) -> None:
        self.phase_bar.update(num)
        if self.bars_shown and self.phase_bar.n >= self.phase_bar.total:
            self.phase_bar.refresh()  # a phase's end is always drawn (update() waits 0.1 s)

    def sampling(self, stats: SamplerStats, finished: int, running: int) -> None:
        """The sampler's per-decode-step callback: samples done, tokens/s, slots in use (a wide
        policy's probes may run more samples than g)."""
        now = time.perf_counter()
        if not self.bars_shown or (now - self._last_refresh < REFRESH_S
                                   and finished < stats.num_samples):
            return
        self._last_refresh = now
        self.phase_bar.n = finished
        slots = (f"slots {running}/{stats.micro_group}" if running <= stats.micro_group
                 else f"{running} running (g={stats.micro_group})")
        self.phase_bar.set_postfix_str(f"{stats.tokens_per_second:,.0f} tok/s, {slots}",
                                       refresh=True)

    def end_step(self, step: int) -> None:
        self.run_bar.update(step - self.run_bar.n)
        if self.bars_shown:
            self.run_bar.refresh()

    def summary(self, step: int, metrics: dict[str, Any]) -> str:
        """`step 21/90: reward=0.41 ... | eta 3:34`"""
        shown = " ".join(f"{k}={format_value(metrics[k])}" for k in SUMMARY_KEYS if k in metrics)
        done, tail = step - self.start_step, ""
        if done > 0 and step < self.max_steps:
            eta = (time.perf_counter() - self.started) / done * (self.max_steps - step)
            tail = f" | eta {format_duration(eta)}"
        return f"step {step}/{self.max_steps}: {shown}{tail}"

    def write(self, line: str) -> None:
        """A line above the bars (or plainly, without them)."""
        self.run_bar.write(line)

    def close(self) -> None:
        self.phase_bar.close()
        self.run_bar.close()
