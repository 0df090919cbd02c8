"""Training state as data: JSON + tensors round trips exactly, and nothing else gets in."""

import json
import random

import numpy as np
import pytest
import torch

from infsamp.errors import first_non_finite
from infsamp.run.state_data import from_data, rng_state, set_rng_state, to_data
from infsamp.sampling.length_predictor import OnlinePredictor
from infsamp.sampling.types import Sample


def through_disk(value):
    """What a checkpoint does: JSON text for the tree, tensors kept as they are (safetensors)."""
    tree, tensors = to_data(value)
    return from_data(json.loads(json.dumps(tree)), tensors)


def test_optimizer_state_round_trips_with_int_keys_and_tuples():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = through_disk(optimizer.state_dict())
    assert state["param_groups"][0]["betas"] == (0.9, 0.99)
    assert set(state["state"]) == {0, 1}
    assert torch.equal(state["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(state)


def test_rng_states_round_trip():
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    saved = through_disk(rng_state())
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(saved)
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])


def test_objects_that_are_not_data_are_refused():
    with pytest.raises(TypeError, match="state/f: function is not data"):
        to_data({"f": lambda: 0})


def test_non_finite_tensor_is_named():
    assert first_non_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}) == "b"
    assert first_non_finite({"step": torch.tensor([3])}) is None


def test_online_predictor_state_round_trips_through_json():
    def spec(i, group, key):
        return Sample(i, group, i, 10 + group, 200, key, f"{group}+{group}=?")

    trained = OnlinePredictor()
    rng = random.Random(0)
    for _call in range(6):
        specs = [spec(i, g, f"p{g}") for g in range(3) for i in range(8)]
        for s in specs:
            trained.predict_remaining(s, [rng.randrange(40) for _ in range(4)])
        trained.update(specs, [rng.randint(5, 150) for _ in specs])
    restored = OnlinePredictor()
    restored.load_state_dict(json.loads(json.dumps(trained.state_dict())))
    probe = [spec(i, g, f"p{g}") for g in range(4) for i in range(3)]
    assert [trained.predict(s) for s in probe] == [restored.predict(s) for s in probe]
    prefix = [1, 2, 3, 1]
    assert [trained.predict_remaining(s, prefix) for s in probe] == \
        [restored.predict_remaining(s, prefix) for s in probe]
