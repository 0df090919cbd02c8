"""Rewards: the built-in functions, loading by name, calling (sync, async, timeouts), checked sums.

    builtin.py       format and accuracy rewards (TRL's signature), completion text
    loading.py       a name -> a function (built-in, module:function, file.py:function, model
                     folder)
    calling.py       running the functions of a step: async ones concurrently, timeouts
    compute.py       `compute_rewards`: every function's values checked, weighted, summed
    reward_model.py  a sequence-classification model folder as a reward function
    workers.py       `rewards.timeout_s`: each function in a worker process, stopped past its time
    worker_process.py  what runs in those processes (the loader, one worker per request)
    process_tree.py  a stopped worker's whole process tree ended with it
"""
