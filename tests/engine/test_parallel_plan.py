"""Step plans and sampled steps survive their wire form unchanged."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.kv.transfer import TransferError
from shoal.engine.parallel.plan import (
    NewRequest,
    PrefixLoad,
    SampledStep,
    StepPlan,
    decode_plan,
    decode_sampled,
    decode_tensors,
    encode_plan,
    encode_sampled,
    encode_tensors,
)
from shoal.engine.sampler import SampledLogprobs
from shoal.engine.sampling import SamplingParams
from shoal.engine.scheduler_output import ScheduledChunk
from shoal.tracing.steps import RequestTrace


def test_a_step_plan_round_trips():
    mask = torch.zeros(49152, dtype=torch.bool)
    mask[[1, 7, 49151]] = True
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=("\n",),
                            logit_bias={12: -1.5}, logprobs=True, top_logprobs=2)
    plan = StepPlan(kind="step",
                    chunks=(ScheduledChunk("a", (5,), 9, (0, 3), True),
                            ScheduledChunk("b", (1, 2, 3), 0, (7,), False)),
                    added=(NewRequest("a", (4, 4, 2), params),), removed=("old",),
                    allowed={"a": mask})
    back = decode_plan(encode_plan(plan))
    assert back.chunks == plan.chunks and back.added == plan.added
    assert back.removed == ("old",) and back.num_tokens == 4
    assert torch.equal(back.allowed["a"], mask)
    assert decode_plan(encode_plan(StepPlan(kind="keepalive"))).kind == "keepalive"


def test_new_requests_traces_travel_in_the_plan():
    traced = {"a": RequestTrace("a" * 32, "b" * 16), "b": RequestTrace("c" * 32)}
    back = decode_plan(encode_plan(StepPlan(kind="step", traced=traced)))
    assert back.traced == traced
    assert decode_plan(encode_plan(StepPlan(kind="keepalive"))).traced == {}


def test_a_sampled_step_round_trips():
    step = SampledStep(token_ids=(3, 9),
                       logprobs=(None, SampledLogprobs(9, -0.25, [(9, -0.25), (4, -1.5)])))
    assert decode_sampled(encode_sampled(step)) == step


def test_a_prefix_write_plan_and_a_rank_s_share_round_trip():
    order = PrefixLoad(b"p" * 16, (b"a" * 16, b"b" * 16), ((1, 40),))
    plan = decode_plan(encode_plan(StepPlan(kind="prefix_write", prefix_load=order)))
    assert plan.kind == "prefix_write" and plan.prefix_load == order
    share = (torch.randn(6, 32, 64).bfloat16(), torch.randint(-128, 127, (6, 32, 68),
                                                              dtype=torch.int8))
    back = decode_tensors(encode_tensors(share))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(share, back))


# not msgpack; a list of numbers; a list holding an empty map
@pytest.mark.parametrize("data", [b"\xc1", b"\x92\x01\x02", b"\x91\x80"])
def test_a_malformed_share_is_a_transfer_error(data):
    with pytest.raises(TransferError, match="malformed"):
        decode_tensors(data)
