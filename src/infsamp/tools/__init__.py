"""Tools and environments for multi-turn episodes (TRL's `tools` and `environment_factory`).

`loading.py` reads the references and the JSON schemas, `environments.py` the environment class,
`running.py` runs calls isolated (worker processes, a timeout, answers checked), `episodes.py`
is the sampler's `TurnHandler`: it reads a turn's calls, runs them and renders the answers
through the chat template (`tasks/tool_format.py`). The room sits above `sampling` and `rewards`
(it uses both) and below `distributed`.
"""
