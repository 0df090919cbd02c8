"""Every registry holds exactly the names the config accepts for it (`infsamp.choices`)."""

import pytest

from infsamp import choices


def registry(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("names, module, table", [
    (choices.LOSS_TYPES, "infsamp.algorithm.losses", "LOSS_TYPES"),
    (choices.REWARD_SCALERS, "infsamp.algorithm.advantages", "REWARD_SCALERS"),
    (choices.OPTIMIZERS, "infsamp.algorithm.optim", "OPTIMIZERS"),
    (choices.OPTIMIZERS, "infsamp.planner.estimate", "OPTIMIZERS"),
    (choices.PRECISIONS, "infsamp.planner.precisions", "PRECISIONS"),
    (choices.POLICIES, "infsamp.sampling.policies", "POLICIES"),
    (choices.PREDICTORS, "infsamp.sampling.predictors", "PREDICTORS"),
    (choices.ENGINES, "infsamp.sampling.engines.base", "ENGINES"),
    (choices.STRATEGIES, "infsamp.distributed.strategies", "STRATEGIES"),
    (choices.TRACKERS, "infsamp.run.trackers", "TRACKERS"),
    (choices.ANSWER_EXTRACTIONS, "infsamp.tasks.answers", "ANSWER_EXTRACTORS"),
])
def test_every_registry_holds_exactly_its_names(names, module, table):
    assert set(registry(module, table)) == set(names)


def test_wide_policies_are_the_ones_that_probe():
    """`choices.WIDE_POLICIES` (read by the planner and the simulator) names exactly the
    policies whose samples start as probes (`probe_tokens` > 0, the scheduler's)."""
    from infsamp.sampling.policies import POLICIES, make_policy
    from infsamp.sampling.types import make_samples

    samples = make_samples([4], 2, 8)
    probing = {name for name in POLICIES if make_policy(name, samples, 1, None).probe_tokens > 0}
    assert probing == set(choices.WIDE_POLICIES)


def test_training_predictors_are_predictors():
    assert set(choices.TRAINING_PREDICTORS) <= set(choices.PREDICTORS)


def test_schedules_are_transformers_schedules():
    from transformers import SchedulerType

    assert set(choices.LR_SCHEDULERS) <= {s.value for s in SchedulerType}


def test_config_imports_no_registry_code():
    import subprocess
    import sys

    code = ("import sys, infsamp.config_io; bad = [m for m in sys.modules if m.startswith("
            "('torch', 'transformers', 'infsamp.algorithm', 'infsamp.run', 'infsamp.models'))]; "
            "print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)
