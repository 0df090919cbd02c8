"""Reward functions for the timeout tests: module-level, so they pickle by reference into the
worker processes of `rewards.timeout_s` (and import nothing heavy, so a worker starts fast)."""

import asyncio
import os
import time


async def slow_async(prompts, completions, **kw):
    await asyncio.sleep(60)
    return [1.0] * len(completions)


async def blocks_its_loop(prompts, completions, **kw):
    time.sleep(3600)  # noqa: ASYNC251 - blocks the event loop: only killing can stop it
    return [1.0] * len(completions)


def busy_loop(prompts, completions, **kw):
    while True:
        pass


async def stubborn(prompts, completions, **kw):
    while True:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            continue  # swallows every cancellation


def pid_reward(prompts, completions, **kw):
    """The worker's process id as the reward: shows which process scored."""
    return [float(os.getpid())] * len(completions)


def counts_calls(prompts, completions, **kw):
    """State kept in the worker across calls: 1, 2, 3, ..."""
    counts_calls.calls = getattr(counts_calls, "calls", 0) + 1
    return [float(counts_calls.calls)] * len(completions)


def slow_on_x(prompts, completions, **kw):
    """Overruns on a step whose first completion is 'x', answers at once otherwise."""
    if completions[0] == "x":
        time.sleep(60)
    return [2.0] * len(completions)


def exits_hard(prompts, completions, **kw):
    os._exit(7)
