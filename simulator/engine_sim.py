"""A pdserve engine without a model: the real scheduler and block manager, steps priced by a profile.

Lifecycle: ``sim_engine(cfg, profile, num_blocks)`` builds an ``engine.LLMEngine`` through
``LLMEngine.with_runner`` around a ``SimRunner``. Callers use the engine's own request API
(``add_request``, ``reserve``, ``add_prefilled_request``, ``abort_request``, ``release``) and
call ``step()``: the engine schedules with its own ``Scheduler`` (continuous batching, chunked
prefill, preemption, prefix cache) and hands the ``SchedulerOutput`` to the runner, which
samples a fixed token for every row that samples (``ModelRunner``'s rule: decodes at the end
of their sequence, last prefill chunks) and prices the step with the profile's step model
(``simulator.costs.step_features``) plus the serving path's cost of each token it streams
(``Profile.router_per_step_s`` + ``router_per_token_s`` x tokens: token gaps minus the engine's own steps,
work on the same cores and GIL the engine loop needs, so it lengthens the step rather than delaying
the token after it). ``runner.last_seconds`` is the step's duration, which the
simulator puts on its virtual clock.
"""
from __future__ import annotations

from typing import Callable, Optional

from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import RunnerOutput
from engine.scheduler import SchedulerOutput
from simulator.costs import Profile, StepFeatures, step_features

SIM_TOKEN = 3
"""The token every simulated row samples (requests run with ignore_eos and a forced length)."""


class SimRunner:
    """Stands in for ``engine.model_runner.ModelRunner``: tokens without a model, durations from the profile."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.last_seconds = 0.0
        """Duration of the last executed step."""
        self.last_features = StepFeatures()
        self.busy_seconds = 0.0
        """Sum of every step's duration (the worker's utilisation numerator)."""

    def execute(self, sched: SchedulerOutput, layer_hook: Optional[Callable[[int], None]] = None) -> RunnerOutput:
        f = step_features(sched)  # before the engine advances the sequences
        self.last_features = f
        # a worker's step also pays the serving path's work: per step that streams and per token streamed (the
        # profile's router_per_step_s / router_per_token_s: token gaps of 1 and 8 streams minus the engine's steps)
        self.last_seconds = self.profile.step_seconds(f)
        self.busy_seconds += self.last_seconds
        seqs = []
        for seq in sched.decodes:
            if seq.num_computed + 1 == seq.num_tokens:
                seqs.append(seq)
        for seq, n in sched.prefills:
            if seq.num_computed + n == seq.num_tokens:
                seqs.append(seq)
        if sched.verifies:
            raise ValueError("the simulator does not model speculative decoding")
        return RunnerOutput(seqs, [SIM_TOKEN] * len(seqs), [None] * len(seqs))


def sim_model_config(profile: Profile) -> ModelConfig:
    """A model config with the profile's context length (the simulator needs nothing else of the model)."""
    return ModelConfig(vocab_size=max(SIM_TOKEN + 1, 1 << 16), max_position_embeddings=profile.max_model_len,
                       num_hidden_layers=profile.num_layers)


def sim_engine(cfg: EngineConfig, profile: Profile, num_blocks: int) -> tuple[LLMEngine, SimRunner]:
    """An engine with ``cfg``'s scheduling settings over ``num_blocks`` KV blocks, priced by ``profile``."""
    if cfg.block_size != profile.block_size:
        raise ValueError(f"block_size {cfg.block_size} differs from the profile's {profile.block_size}")
    runner = SimRunner(profile)
    eng = LLMEngine.with_runner(cfg, sim_model_config(profile), runner, num_blocks)  # type: ignore[arg-type]
    return eng, runner
