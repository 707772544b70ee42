"""Reward latency: the time a code sandbox takes to verify a batch of responses.

The profile models `reward_time_s` of rllm_deepcoder batches (64 responses, ~9,400 tokens mean).
A call's delay is that draw scaled to the caller's batch:

    delay = draw * (batch_size / reference batch_size) * (mean length / reference mean) ** e

Linear in batch size: a sandbox pool of fixed width verifies twice the responses in about twice
the time. The length exponent `e` is `reward_length_exponent` (default 0): across the recorded
batches reward time does not grow with response length (its correlation with response_sum is
negative), so by default lengths do not scale the delay.
"""

from __future__ import annotations

import math
import sys

from toolenv_core.latency.profile import Profile

from ..base import ToolEmulator
from ..settings import EmulatorSettings


class RewardEmulator(ToolEmulator):
    name = "reward"

    def __init__(self, settings: EmulatorSettings, profile: Profile) -> None:
        super().__init__(settings, profile, seed_index=2)

    def scale(self, batch_size: int, mean_length: float | None) -> float:
        ref_batch = self.profile.reference.get("batch_size", 64.0)
        factor = batch_size / ref_batch
        ref_mean = self.profile.reference.get("response_mean")
        e = self.settings.reward_length_exponent
        if e and mean_length is not None and ref_mean:
            try:
                factor *= (max(mean_length, 1.0) / ref_mean) ** e
            except OverflowError:  # float ** float raises past the range (it was a 500)
                factor = math.inf
        # finite, so the reply stays JSON (`Infinity` is not); the delay is capped at max_delay_s
        return factor if factor <= sys.float_info.max else sys.float_info.max
