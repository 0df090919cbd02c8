"""The vLLM engine: vLLM's paged KV cache and kernels under infsamp's scheduler, in-process.

One `vllm.LLMEngine` lives for the whole run (in the trainer's process:
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, no server). It starts from the trainer model's config with
dummy weights, then takes the trainer's weights (`load_weights`, after every optimizer step; LoRA
adapters merged out of place, so the trainer's weights never drift); the prefix cache is reset
after every update.

Sizing (the run's `RunSizes`, decided once by the planner): the KV pool is the KV budget rounded
down to whole blocks (`planner.sizes.vllm_pool`), `max_num_seqs` the run's largest g, a step's
tokens `planner.estimate.vllm_step_tokens`; prefix caching on; chunked prefill off (vLLM discards
a chunk's sample by rewinding the request's seeded generator, which CPU generators cannot do).

The loop is the slot engine's: `start` adds a request, `decode_step` is one `LLMEngine.step()`
(a new request's prefill yields its first token in the same step). A sample the scheduler parks is
preempted by vLLM's own routine (`Scheduler._preempt_request`) and held out of vLLM's waiting queue
until the scheduler resumes it. Each sample carries its own seed (`sample_seed`, keyed by
`DecodeOptions.stream_key`), so completions depend neither on the schedule nor on how many ranks
share the step; vLLM returns each sampled token's log-prob after temperature
(`logprobs_mode="processed_logprobs"`). docs/sampler.md ("The vLLM engine") gives the reasons.

Deliberately simple: one device, no tensor parallelism, eager mode on CPU; sleep mode (CUDA) frees
the pool and the weights during training (`sleep`), the weights being pushed again after; no hidden
states (vLLM's generate path has none: the `hidden` predictor falls back to its token-level part).
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence

import torch

from infsamp.config_algorithm import SamplingConfig
from infsamp.errors import SamplingError, first_line
from infsamp.models.device import model_kv_bytes_per_token
from infsamp.planner.estimate import vllm_step_tokens
from infsamp.planner.kv_budget import VLLM_BLOCK_SIZE
from infsamp.planner.sizes import RunSizes, vllm_pool
from infsamp.sampling.engines.base import DecodeOptions, SlotLogitsProcessor
from infsamp.sampling.engines.vllm_loading import (
    check_architecture,
    engine_config,
    engine_weights,
    import_vllm,
    memory_share,
    reload_weights,
    sleep_level,
)
from infsamp.sampling.types import Sample, SamplerStats

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
FINISH_REASONS = {"stop": "eos", "length": "length"}


_live: weakref.ref | None = None  # vLLM keeps its parallel state per process: one engine at a time


def sample_seed(seed: int, sample_id: int) -> int:
    """Each sample's own random stream (a vLLM per-request seed), whatever the schedule."""
    return (seed * 1_000_003 + sample_id * 0x9E3779B1) & 0x7FFFFFFF


class VLLMEngine:
    name = "vllm"
    copies_weights = True  # its own weights, pushed after every optimizer step
    keeps_parked_kv = False  # a parked request's blocks go back to the pool (prefix-cached)
    hands_hidden_states = False  # vLLM's generate path hands out no hidden states
    shares_prefix = False  # the sampler never asks it to hold a prefix once

    def __init__(self, model, cfg: SamplingConfig, sizes: RunSizes):
        global _live
        vllm = import_vllm()
        from vllm.inputs import tokens_input

        self._tokens_input = tokens_input  # prompts as token ids (no renderer: no tokenizer)
        config = engine_config(model)
        check_architecture(vllm, config)
        param = next(model.parameters())
        self.device = param.device
        self._check_device()
        self.kv_block_size = VLLM_BLOCK_SIZE.get(self.device.type, 16)
        self.max_context = min(sizes.max_prompt_tokens + sizes.max_new_tokens,
                               int(getattr(config, "max_position_embeddings", 1 << 30)))
        self.max_micro_group = max(1, sizes.max_micro_group)
        self.kv_bytes_per_token = model_kv_bytes_per_token(model)
        num_blocks, self.kv_capacity_tokens = vllm_pool(sizes, self.kv_block_size, cfg.kv_budget)
        self.sleep_level = sleep_level(cfg, self.device)
        other = _live() if _live is not None else None
        if other is not None and other.engine is not None:
            raise SamplingError("sampling.engine vllm: another vLLM engine is running in this "
                                "process (vLLM keeps one per process); close() it first")
        self._config_dir = tempfile.mkdtemp(prefix="infsamp-vllm-")
        self._remove_config = weakref.finalize(self, shutil.rmtree, self._config_dir,
                                               ignore_errors=True)
        config.save_pretrained(self._config_dir)
        self.engine = self._start(param.dtype, num_blocks)
        _live = weakref.ref(self)
        core = self.engine.engine_core.engine_core
        self._scheduler = core.scheduler
        self._block_pool = self._scheduler.kv_cache_manager.block_pool
        self._runner = self.engine.model_executor.driver_worker.model_runner
        self._calls = 0
        self._sleeping: set[str] = set()  # vLLM memory tags freed by sleep mode
        self.load_weights(model)
        self._probe()

    # ---- start-up
    def _check_device(self) -> None:
        from vllm.platforms import current_platform

        built_for = current_platform.device_type
        if built_for != self.device.type:
            raise SamplingError(f"sampling.engine vllm: the installed vLLM runs on {built_for}, "
                                f"the model is on {self.device.type}; install the matching build "
                                "('infsamp[gpu]' for CUDA, 'infsamp[cpu-vllm]' for CPU) or use "
                                "--sampling.engine slots")

    def _start(self, dtype: torch.dtype, num_blocks: int):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(
            model=self._config_dir, load_format="dummy", skip_tokenizer_init=True,
            trust_remote_code=False,  # it reads only the config written above, with our weights
            generation_config="vllm", dtype=DTYPE_NAMES.get(dtype, "auto"), seed=0,
            max_model_len=self.max_context, block_size=self.kv_block_size,
            kv_cache_memory_bytes=num_blocks * self.kv_block_size * self.kv_bytes_per_token,
            enable_prefix_caching=True, max_num_seqs=self.max_micro_group,
            max_num_batched_tokens=vllm_step_tokens(self.max_micro_group, self.max_context),
            enable_chunked_prefill=False,  # a request that does not fit waits a step, whole
            enforce_eager=self.device.type == "cpu", logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.sleep_level > 0, disable_log_stats=True,
            gpu_memory_utilization=memory_share(self.device))
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker disables it process-wide
        try:
            engine = LLMEngine.from_engine_args(args)
        except Exception as err:
            self._remove_config()
            raise SamplingError(f"sampling.engine vllm: vLLM failed to start "
                                f"({first_line(err, 300)}); check "
                                "the model and sampling.kv_budget, or use --sampling.engine "
                                "slots") from None
        finally:
            torch.set_num_threads = set_num_threads
        return engine

    def _probe(self) -> None:
        """One token through the engine now, so that a kernel vLLM lacks for this model (e.g. an
        unsupported head size on CPU) fails here, before any training step."""
        from vllm import SamplingParams

        try:
            self.engine.add_request("probe", self._tokens_input([0, 0]),
                                    SamplingParams(max_tokens=1))
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except Exception as err:
            self.close()
            first = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
            raise SamplingError(f"sampling.engine vllm: vLLM cannot run this model ({first}); use "
                                "--sampling.engine slots") from None

    # ---- Engine protocol
    def begin_call(self, prompts: Sequence[Sequence[int]], samples: Sequence[Sample],
                   num_slots: int, options: DecodeOptions, stats: SamplerStats,
                   processor: SlotLogitsProcessor | None = None,
                   pool_tokens: int | None = None, shared_prefix: int = 0) -> None:
        """`num_slots` <= max_num_seqs (the sampler caps it); `pool_tokens` is not used: vLLM's
        pool is fixed at start, and the budget the scheduler keeps is within it.
        `shared_prefix` is always 0 (`shares_prefix` False: its prefix cache shares blocks)."""
        if processor is not None:
            raise SamplingError("the vllm engine takes no logits processor; use --sampling.engine "
                                "slots")
        if "weights" in self._sleeping and self.sleep_level == 2:
            raise RuntimeError("vllm engine: sleep mode discarded the weights; load_weights first")
        self._wake("weights")
        self._wake("kv_cache")
        self._calls += 1
        self.engine.reset_prefix_cache()  # each call computes its own prompts, as slots does
        self.prompts, self.options, self.stats = prompts, options, stats
        self.running: dict[str, Sample] = {}  # our request id -> sample
        self.internal_ids: dict[str, str] = {}  # ours -> vLLM's (it appends a random suffix)
        self.preemptions: dict[str, int] = {}
        self.parked: dict[int, tuple[str, object]] = {}  # sample id -> (our id, vLLM's Request)
        self._prompt_tokens: dict[str, int] = {}  # our id -> tokens of its request's prompt
        stats.kv_block_size = self.kv_block_size

    def start(self, slot: int, sample: Sample) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if sample.sample_id in self.parked:
            self._resume(sample)
            return
        done = sample.num_tokens  # > 0: its turn ended in a tool call; the episode so far
        request_id = f"{self._calls}-{sample.sample_id}" + (f"-{done}" if done else "")
        options, length = self.options, sample.max_new_tokens - done
        targets = options.target_lengths
        seed = sample_seed(options.seed, options.stream_key(sample.sample_id))
        params = SamplingParams(
            temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
            seed=sample_seed(seed, done) if done else seed,
            max_tokens=targets[sample.sample_id] - done if targets else length,
            min_tokens=targets[sample.sample_id] - done if targets else 0,
            stop_token_ids=list(options.eos_token_ids), logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.DELTA)
        if not done:
            sample.logprobs = []
        self._prompt_tokens[request_id] = len(self.prompts[sample.group_id]) + done
        prompt = self._tokens_input([*self.prompts[sample.group_id], *sample.token_ids])
        self.internal_ids[request_id] = self.engine.add_request(request_id, prompt, params)
        self.running[request_id] = sample

    def decode_step(self, active: dict[int, Sample]) -> list[Sample]:
        self._park_missing(active)
        start = time.perf_counter()
        outputs = self.engine.step()
        self.stats.model_time_s += time.perf_counter() - start
        finished, advanced = [], set()
        for output in outputs:
            sample = self.running.get(output.request_id)
            if sample is None:  # a request of an aborted call
                continue
            if output.outputs[0].token_ids:
                advanced.add(output.request_id)
            self._record(sample, output)
            if output.finished:
                del self.running[output.request_id]
                finished.append(sample)
        if len(advanced) < len(self.running) + len(finished):
            self._count_preemptions(advanced)
        self._track_peak()
        return finished

    def cancel(self, samples: Sequence[Sample]) -> None:
        pass  # a sample is a request only once started; prompts live in the prefix cache

    def end_call(self) -> None:
        self.running = {}

    def reset(self) -> None:
        """Abort a half-done call and forget cached prompts."""
        if self.engine is None:
            return
        parked = [request_id for request_id, _ in getattr(self, "parked", {}).values()]
        for _, request in getattr(self, "parked", {}).values():  # back in line, to be aborted
            self._scheduler.waiting.add_request(request)
        if getattr(self, "running", None) or parked:
            self.engine.abort_request([*getattr(self, "running", {}), *parked])
        self.running, self.parked = {}, {}
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.engine_core.shutdown()
            self.engine = self._runner = self._scheduler = self._block_pool = None
            gc.collect()
        self._remove_config()

    # ---- weights and memory
    def load_weights(self, model) -> None:
        """Push the trainer model's weights in place (LoRA merged out of place), then drop the
        cached prompts (their KV belongs to the old weights)."""
        self._wake("weights")
        reload_weights(self._runner, engine_weights(model))
        self.engine.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the KV pool (and the weights) for the training phase: CUDA sleep mode, level
        `sampling.vllm_sleep`. They come back at the next `load_weights` and `begin_call`."""
        if self.sleep_level and not self._sleeping:
            self.engine.reset_prefix_cache()
            self.engine.sleep(level=self.sleep_level)
            self._sleeping = {"weights", "kv_cache"}

    def _wake(self, tag: str) -> None:
        if tag in self._sleeping:
            self.engine.wake_up([tag])
            self._sleeping.discard(tag)

    # ---- parking (the scheduler's decisions, through vLLM's own preemption)
    def _park_missing(self, active: dict[int, Sample]) -> None:
        """Requests whose samples the scheduler parked leave vLLM's running set: preempted by
        vLLM's own routine (blocks back to the pool, prefix-cached; the request keeps its
        tokens and its random generator) and held out of its waiting queue until resumed."""
        wanted = {sample.sample_id for sample in active.values()}
        for request_id, sample in list(self.running.items()):
            if sample.sample_id in wanted:
                continue
            request = self._scheduler.requests[self.internal_ids[request_id]]
            self._scheduler.running.remove(request)
            self._scheduler._preempt_request(request, time.monotonic())
            self._scheduler.waiting.remove_request(request)
            self.preemptions[request_id] = request.num_preemptions  # not vLLM's own
            self.parked[sample.sample_id] = (request_id, request)
            del self.running[request_id]

    def _resume(self, sample: Sample) -> None:
        """Back into vLLM's waiting queue: the next step recomputes its KV (what the prefix
        cache still holds is reused) and samples its next token."""
        request_id, request = self.parked.pop(sample.sample_id)
        self._scheduler.waiting.prepend_request(request)
        self.running[request_id] = sample

    # ---- internals
    def _record(self, sample: Sample, output) -> None:
        completion = output.outputs[0]
        prompt_tokens = self._prompt_tokens.pop(output.request_id, None)  # its first output only
        if prompt_tokens is not None and output.num_cached_tokens is not None:
            self.stats.prefill_tokens += prompt_tokens - output.num_cached_tokens
        sample.token_ids.extend(completion.token_ids)
        if completion.logprobs:
            pairs = zip(completion.logprobs, completion.token_ids)
            sample.logprobs.extend(entry[token].logprob for entry, token in pairs)
        if output.finished:
            reason = FINISH_REASONS.get(completion.finish_reason, "length")
            turn_ends = self.options.turn_ends
            if reason == "eos" and turn_ends is not None and turn_ends(sample):
                reason = "tool_call"  # the request is done; the episode resumes as a new one
            sample.finish_reason = reason

    def _count_preemptions(self, advanced: set[str]) -> None:
        """Samples that got no token this step: count the ones vLLM preempted (to recompute)."""
        for request_id, sample in self.running.items():
            request = self._scheduler.requests.get(self.internal_ids[request_id])
            if request_id in advanced or request is None:
                continue
            new = request.num_preemptions - self.preemptions.get(request_id, 0)
            if new > 0:
                self.preemptions[request_id] = request.num_preemptions
                self.stats.num_preemptions += new
                self.stats.recomputed_tokens += sample.num_tokens

    def _track_peak(self) -> None:
        used = self._block_pool.num_gpu_blocks - 1 - self._block_pool.get_num_free_blocks()
        if used > self.stats.peak_kv_blocks:
            self.stats.peak_kv_blocks = used
            self.stats.peak_kv_tokens = used * self.kv_block_size
            self.stats.peak_kv_bytes = self.stats.peak_kv_tokens * self.kv_bytes_per_token

